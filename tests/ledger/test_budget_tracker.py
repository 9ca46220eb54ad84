"""Budgets v2 (otel_llm/ops/budgets.py) and the budget tracker (otel_llm/ops/budget_tracker.py): periods,
money and prepaid budgets across a month boundary (time passed in), progress superseded by the bill,
engine records, the spool and ClickHouse (chDB) feeds, the HTTP server."""

import calendar
import datetime as dt
import json
import threading
import urllib.request

import pytest

from otel_llm import semconv
from otel_llm.billing import ledger
from otel_llm.billing.prices import Price
from otel_llm.billing.promql import ReportError
from otel_llm.ops import budget_server, budgets
from otel_llm.ops.budget_tracker import PREPAID_RETRY_S, BudgetTracker, LedgerFeed, SpoolFeed


def ts(text: str) -> float:
    return calendar.timegm(dt.datetime.fromisoformat(text).timetuple())


NOV_30_LATE = ts("2026-11-30T23:59:00")
DEC_1_EARLY = ts("2026-12-01T00:01:00")
PRICES = {"m": Price(input=2.0, cached_input=1.0, output=10.0)}  # per million tokens


def record(tenant, t, input_=0, cached=0, output=0, key=None, kind=None, scene=None, model="m", **extra):
    fields = {
        semconv.USAGE_ID: key or f"i/{tenant}/{t}/{input_}/{output}",
        semconv.USAGE_TIME: int(t * 1e9),
        semconv.TENANT_ID: tenant,
        semconv.GEN_AI_REQUEST_MODEL: model,
        semconv.GEN_AI_USAGE_INPUT_TOKENS: input_,
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: cached,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: output,
        semconv.USAGE_SCHEMA_VERSION: semconv.USAGE_SCHEMA,
        **extra,
    }
    if kind:
        fields[semconv.USAGE_KIND] = kind
    if scene:
        fields[semconv.TENANT_SCENE] = scene
    return fields


def write(directory, records, name="usage-x-1.jsonl"):
    directory.mkdir(exist_ok=True)
    with open(directory / name, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def load(tmp_path, entries):
    path = tmp_path / "budgets.json"
    path.write_text(json.dumps({"budgets": entries}))
    return budgets.load(path)


def tracker(tmp_path, entries, now, prices=None):
    clock = [now]
    t = BudgetTracker(load(tmp_path, entries), prices, "USD", SpoolFeed(str(tmp_path / "spool")), lambda: clock[0])
    return t, clock


def used(t, tenant, now=None):
    return {(f["period"], f["unit"]): f["used"] for f in t.figures(tenant, now=now)}


# --- the budget file --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry,message",
    [
        ({"tenant": "a", "tokens": 5, "cost": 1}, "either tokens or cost"),
        ({"tenant": "a"}, "either tokens or cost"),
        ({"tenant": "a", "tokens": 1.5}, "whole number"),
        ({"tenant": "a", "cost": 0}, "number > 0"),
        ({"tenant": "a", "tokens": 5, "period": "week"}, "period must be one of"),
        ({"tenant": "a", "cost": 5, "period": "prepaid"}, "since"),
        ({"tenant": "a", "cost": 5, "period": "prepaid", "since": "yesterday"}, "ISO 8601"),
        ({"tenant": "a", "cost": 5, "since": "2026-12-01"}, "for prepaid budgets"),
        ({"tenant": "a\tb", "tokens": 5}, "no request would match it"),
        ({"tenant": " a", "tokens": 5}, "no request would match it"),
        ({"tenant": "a", "scene": "x" * 300, "tokens": 5}, "no request would match it"),
        ({"tenant": "a", "cost": 5, "token_types": ["output"]}, "prices every token type"),
    ],
)
def test_bad_budgets_are_clear_errors(tmp_path, entry, message):
    with pytest.raises(ReportError, match=message):
        load(tmp_path, [entry])


def test_one_budget_per_tenant_scene_period_and_unit(tmp_path):
    both = load(
        tmp_path,
        [
            {"tenant": "a", "tokens": 5},
            {"tenant": "a", "cost": 5},
            {"tenant": "a", "tokens": 5, "period": "month"},
            {"tenant": "a", "tokens_per_day": 9},
        ][:3],
    )
    assert [(b.period, b.unit) for b in both] == [("day", "tokens"), ("day", "cost"), ("month", "tokens")]
    with pytest.raises(ReportError, match="has a budget already"):
        load(tmp_path, [{"tenant": "a", "tokens": 5}, {"tenant": "a", "tokens_per_day": 9}])


def test_periods_are_utc_calendar_periods():
    day = budgets.Budget("a", 5, "tokens", "day")
    month = budgets.Budget("a", 5, "tokens", "month")
    assert day.period_start(NOV_30_LATE) == ts("2026-11-30T00:00:00")
    assert day.period_end(NOV_30_LATE) == ts("2026-12-01T00:00:00")
    assert month.period_start(NOV_30_LATE) == ts("2026-11-01T00:00:00")
    assert month.period_end(NOV_30_LATE) == ts("2026-12-01T00:00:00")
    assert month.period_end(ts("2026-12-31T23:59:59")) == ts("2027-01-01T00:00:00")
    prepaid = budgets.Budget(
        "a", 100, "cost", "prepaid", since=ts("2026-11-15T00:00:00"), top_ups=((ts("2026-12-01T00:00:00"), 50),)
    )
    assert prepaid.period_start(ts("2026-11-14T00:00:00")) is None
    assert prepaid.period_end(DEC_1_EARLY) is None
    assert (prepaid.limit_at(NOV_30_LATE), prepaid.limit_at(DEC_1_EARLY)) == (100, 150)


# --- counting ----------------------------------------------------------------------------------------


def test_a_monthly_money_budget_and_a_prepaid_balance_across_a_month_boundary(tmp_path):
    entries = [
        {"tenant": "acme", "period": "month", "cost": 0.02},
        {
            "tenant": "acme",
            "period": "prepaid",
            "cost": 0.03,
            "since": "2026-11-15T00:00:00Z",
            "top_ups": [{"at": "2026-12-01T00:00:00Z", "amount": 0.01}],
        },
    ]
    # each request: 1000 input (400 cached) + 1000 output: (600 * 2 + 400 * 1 + 1000 * 10) / 1e6 = 0.0116
    spool = tmp_path / "spool"
    write(
        spool,
        [
            record("acme", ts("2026-11-10T00:00:00"), 1000, 400, 1000),  # before the balance began
            record("acme", NOV_30_LATE, 1000, 400, 1000),
        ],
    )
    t, clock = tracker(tmp_path, entries, ts("2026-11-30T23:59:30"), PRICES)
    t.refresh()
    assert used(t, "acme") == pytest.approx({("month", "USD"): 0.0232, ("prepaid", "USD"): 0.0116})
    november = t.check("acme")
    assert (november.allowed, november.retry_after) == (False, 30)  # the month is over its 0.02; it ends in 30 s

    clock[0] = ts("2026-12-01T00:02:00")  # the month turned: its figure starts again; the balance does not
    write(spool, [record("acme", DEC_1_EARLY, 1000, 400, 1000)])
    t.refresh()
    assert used(t, "acme") == pytest.approx({("month", "USD"): 0.0116, ("prepaid", "USD"): 0.0232})
    assert [(f["state"], f["limit"]) for f in t.check("acme").budgets] == [("ok", 0.02), ("ok", 0.04)]  # top-up

    clock[0] = ts("2026-12-01T00:04:00")
    write(spool, [record("acme", ts("2026-12-01T00:03:00"), 1000, 400, 1000)])
    t.refresh()
    assert used(t, "acme") == pytest.approx({("month", "USD"): 0.0232, ("prepaid", "USD"): 0.0348})
    december = t.check("acme")
    assert [f["state"] for f in december.budgets] == [semconv.BUDGET_STATE_OVER, semconv.BUDGET_STATE_NEAR]
    assert (december.allowed, december.retry_after) == (False, int(ts("2027-01-01T00:00:00") - clock[0]))


def test_an_exceeded_budget_is_refused_until_its_period_ends(tmp_path):
    entries = [
        {"tenant": "acme", "tokens": 100},
        {"tenant": "globex", "period": "prepaid", "tokens": 100, "since": "2026-12-01T00:00:00Z"},
    ]
    write(tmp_path / "spool", [record("acme", DEC_1_EARLY, 60, 0, 40), record("globex", DEC_1_EARLY, 60, 0, 40)])
    t, clock = tracker(tmp_path, entries, ts("2026-12-01T23:00:00"))
    assert t.check("acme").allowed  # nothing read yet
    t.refresh()
    acme, globex = t.check("acme"), t.check("globex")
    assert (acme.allowed, acme.state, acme.retry_after) == (False, semconv.BUDGET_STATE_OVER, 3600)
    assert (globex.allowed, globex.retry_after) == (False, PREPAID_RETRY_S)
    assert t.check("initech") == t.check("initech") and t.check("initech").allowed  # no budget: never refused
    clock[0] = ts("2026-12-02T00:00:00")
    assert t.check("acme").allowed and not t.check("globex").allowed


def test_progress_counts_while_a_stream_runs_and_its_bill_replaces_it(tmp_path):
    entries = [{"tenant": "acme", "tokens": 10_000}]
    spool = tmp_path / "spool"
    t, _ = tracker(tmp_path, entries, DEC_1_EARLY + 60)

    def progress(output):
        return record("acme", DEC_1_EARLY + output / 100, 50, 0, output, key="i/r1", kind=semconv.USAGE_KIND_PROGRESS)

    write(spool, [progress(100)])
    t.refresh()
    assert used(t, "acme") == {("day", "tokens"): 150}
    write(spool, [progress(300), progress(200)])  # (an older one after a newer one never lowers it)
    t.refresh()
    assert used(t, "acme") == {("day", "tokens"): 350}
    write(spool, [record("acme", DEC_1_EARLY + 5, 50, 0, 420, key="i/r1")])
    t.refresh()
    assert used(t, "acme") == {("day", "tokens"): 470}  # the bill, once
    assert t.bills == 1


def test_engine_records_count_only_where_they_are_the_bill(tmp_path):
    entries = [{"tenant": "acme", "tokens": 10_000}]
    engine = {semconv.USAGE_KIND: semconv.USAGE_KIND_ENGINE}
    write(
        tmp_path / "spool",
        [
            record("acme", DEC_1_EARLY, 10, 0, 1, key="e/1", **engine, **{semconv.USAGE_FRONTEND_BILLED: False}),
            record("acme", DEC_1_EARLY, 20, 0, 2, key="e/2", **engine, **{semconv.USAGE_FRONTEND_BILLED: True}),
            record(
                "acme",
                DEC_1_EARLY,
                40,
                0,
                4,
                key="e/3",
                **engine,
                **{semconv.USAGE_FRONTEND_BILLED: False, semconv.VLLM_PD_ROLE: semconv.PD_ROLE_PREFILL},
            ),
            record("acme", DEC_1_EARLY, 80, 0, 8, key="w/1", kind=semconv.USAGE_KIND_ENGINE_WINDOW),
        ],
    )
    t, _ = tracker(tmp_path, entries, DEC_1_EARLY + 60)
    t.refresh()
    assert used(t, "acme") == {("day", "tokens"): 11}


def test_scene_budgets_and_unpriced_models(tmp_path):
    entries = [
        {"tenant": "acme", "scene": "batch", "tokens": 1000, "token_types": ["output"]},
        {"tenant": "acme", "cost": 5},
    ]
    write(
        tmp_path / "spool",
        [
            record("acme", DEC_1_EARLY, 10, 0, 1, scene="batch"),
            record("acme", DEC_1_EARLY, 10, 0, 2, scene="chat"),
            record("acme", DEC_1_EARLY, 100, 0, 50, model="unpriced"),
        ],
    )
    t, _ = tracker(tmp_path, entries, DEC_1_EARLY + 60, PRICES)
    t.refresh()
    figures = {(f["scene"], f["unit"]): (f["used"], f["unpriced_tokens"]) for f in t.figures()}
    assert figures == {("batch", "tokens"): (1, 0), ("", "USD"): (pytest.approx((20 * 2 + 3 * 10) / 1e6), 150)}
    assert [f["scene"] for f in t.check("acme", "chat").budgets] == [""]


def test_the_spool_feed_reads_only_whole_new_lines(tmp_path):
    spool = tmp_path / "spool"
    write(spool, [record("acme", DEC_1_EARLY, 1, 0, 1)])
    with open(spool / "usage-x-1.jsonl", "a") as f:
        f.write(json.dumps(record("acme", DEC_1_EARLY, 5, 0, 5))[:20])  # a line being written
    t, _ = tracker(tmp_path, [{"tenant": "acme", "tokens": 100}], DEC_1_EARLY + 60)
    t.refresh()
    assert used(t, "acme") == {("day", "tokens"): 2}
    with open(spool / "usage-x-1.jsonl", "a") as f:
        f.write(json.dumps(record("acme", DEC_1_EARLY, 5, 0, 5))[20:] + "\nnot json\n")
    write(spool, [record("acme", DEC_1_EARLY, 7, 0, 7)], name="usage-x-2.jsonl")
    t.refresh()
    assert used(t, "acme") == {("day", "tokens"): 26}
    assert t.feed.unreadable == 1


def test_every_budget_is_served_with_exact_labels_however_many_tenants(tmp_path):
    tenants = [f"tenant-{i:03d}" for i in range(120)] + ['a "quoted" \\ one']
    write(tmp_path / "spool", [record(name, DEC_1_EARLY, i, 0, 1) for i, name in enumerate(tenants)])
    t, _ = tracker(tmp_path, [{"tenant": name, "tokens": 50} for name in tenants], DEC_1_EARLY + 60)
    t.refresh()
    text = t.exposition()
    used_name = semconv.prometheus_metric(semconv.BUDGET_USED)
    lines = [line for line in text.splitlines() if line.startswith(used_name + "{")]
    assert len(lines) == len(tenants)
    assert lines[0] == (
        f'{used_name}{{tenant_id="tenant-000",tenant_scene="",otel_llm_budget_period="day",'
        f'otel_llm_budget_unit="tokens"}} 1.0'
    )
    assert 'tenant_id="a \\"quoted\\" \\\\ one"' in lines[-1]
    assert sum(1 for f in t.figures() if f["state"] == semconv.BUDGET_STATE_OVER) == len(tenants) - 49  # i + 1 >= 50


# --- ClickHouse (a chDB session holding the collector's table) -----------------------------------------


def test_the_clickhouse_feed_sums_the_past_then_reads_new_records_once(tmp_path):
    now = [DEC_1_EARLY + 3600]
    old = [record("acme", DEC_1_EARLY + i, 10, 0, 1) for i in range(5)]
    progress = record("acme", now[0] - 10, 10, 0, 30, key="i/long", kind=semconv.USAGE_KIND_PROGRESS)
    recent = record("acme", now[0] - 5, 10, 0, 2)
    source = ledger.load_otel_logs(str(tmp_path / "session"), old + [progress, recent, recent])  # one came twice
    executor = source.executor
    t = BudgetTracker(
        load(tmp_path, [{"tenant": "acme", "tokens": 10_000}]),
        feed=LedgerFeed(source, lambda: now[0]),
        clock=lambda: now[0],
    )
    t.refresh()
    assert used(t, "acme") == {("day", "tokens"): 5 * 11 + 40 + 12}
    assert t.bills == 1  # the recent one, once (the older five came summed per hour)
    bill = record("acme", now[0] + 1, 10, 0, 50, key="i/long")
    executor.execute(ledger.insert_records_sql([bill, recent]))
    now[0] += 2
    t.refresh()
    assert used(t, "acme") == {("day", "tokens"): 5 * 11 + 60 + 12}
    assert t.bills == 2


# --- over HTTP ---------------------------------------------------------------------------------------


def test_the_budget_server_answers_checks_and_metrics(tmp_path):
    write(tmp_path / "spool", [record("acme", DEC_1_EARLY, 60, 0, 60)])
    t, _ = tracker(tmp_path, [{"tenant": "acme", "tokens": 100}], ts("2026-12-01T12:00:00"))
    ready = threading.Event()
    servers = []
    thread = threading.Thread(
        target=budget_server.serve,
        args=(t, "127.0.0.1", 0, 0.05),
        kwargs={"ready": lambda s: (servers.append(s), ready.set())},
        daemon=True,
    )
    thread.start()
    assert ready.wait(30)
    base = f"http://127.0.0.1:{servers[0].server_address[1]}"
    try:

        def get(path):
            try:
                with urllib.request.urlopen(base + path, timeout=30) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read().decode()

        for _ in range(600):
            if get("/healthz")[0] == 200:
                break
            threading.Event().wait(0.05)
        status, body = get(budget_server.CHECK_PATH + "?tenant=acme")
        answer = json.loads(body)
        assert (status, answer["allowed"], answer["state"], answer["retry_after"]) == (200, False, "over", 12 * 3600)
        assert answer["budgets"][0]["used"] == 120
        assert get(budget_server.CHECK_PATH)[0] == 400
        status, metrics = get("/metrics")
        assert status == 200 and semconv.prometheus_metric(semconv.BUDGET_TRACKER_LAG) in metrics
    finally:
        servers[0].shutdown()
