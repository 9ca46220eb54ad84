"""Usage schema 2 without a server: API-server records joined to the engine core's records exactly once
(n > 1, engine-only requests, an API server's half that never arrived, duplicates, schema 1 unchanged),
the engine cost report (`report --costs`: compute, kv, blend, spread, idle rows, exact sums, a
hand-computed example), the same over the otel_logs table, reconcile's engine check, and cost-file
errors. Spools are JSON lines written here."""

import argparse
import csv
import io
import json

import pytest

from otel_llm import semconv
from otel_llm.billing import costs, ledger, reconcile, report
from otel_llm.billing.promql import ReportError

T0 = 1_796_169_600  # 2026-12-02T00:00:00Z
WINDOW = (T0, T0 + 3600)  # the report window
S = 10**9  # ns
A, B = "host:8000", "host:8001"  # service instances, one engine each
ENGINE_A, ENGINE_B = f"{A}/engine0", f"{B}/engine0"


def ns(t: float) -> int:
    return int(round(t * S))


def api(rid, tenant, end, inp, out, cached=0, engine_ids=(), n=None, instance=A):
    """An API server's record (schema 2 when it lists engine ids, else schema 1)."""
    rec = {
        semconv.USAGE_ID: f"{instance}/{rid}",
        semconv.SERVICE_INSTANCE_ID: instance,
        semconv.GEN_AI_REQUEST_MODEL: "tiny",
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
        semconv.GEN_AI_USAGE_INPUT_TOKENS: inp,
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: cached,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: out,
        semconv.USAGE_TIME: ns(end),
    }
    if tenant:
        rec[semconv.TENANT_ID] = tenant
    if n:
        rec[semconv.GEN_AI_REQUEST_CHOICE_COUNT] = n
    if engine_ids:
        rec.update(
            {
                semconv.USAGE_SCHEMA_VERSION: 2,
                semconv.USAGE_KIND: semconv.USAGE_KIND_REQUEST,
                semconv.USAGE_ENGINE_REQUEST_IDS: list(engine_ids),
            }
        )
    return rec


def engine(eid, end, compute_s, prefill_s, kv_block_s, billed=True, tenant=None, inp=0, out=0, instance=A):
    """The engine core's record of one engine request."""
    rec = {
        semconv.USAGE_ID: f"{instance}/engine0/{eid}",
        semconv.USAGE_SCHEMA_VERSION: 2,
        semconv.USAGE_KIND: semconv.USAGE_KIND_ENGINE,
        semconv.SERVICE_NAME: "vllm",
        semconv.SERVICE_INSTANCE_ID: instance,
        semconv.VLLM_ENGINE_INSTANCE: f"{instance}/engine0",
        semconv.VLLM_ENGINE_REQUEST_ID: eid,
        semconv.USAGE_FRONTEND_BILLED: billed,
        semconv.GEN_AI_REQUEST_MODEL: "tiny",
        semconv.GEN_AI_USAGE_INPUT_TOKENS: inp,
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 0,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: out,
        semconv.REQUEST_OUTCOME: semconv.OUTCOME_FINISHED,
        semconv.COST_COMPUTE_NS: ns(compute_s),
        semconv.COST_PREFILL_COMPUTE_NS: ns(prefill_s),
        semconv.COST_SCHEDULED_TOKENS: inp + out,
        semconv.COST_KV_BLOCK_NS: ns(kv_block_s),
        semconv.COST_KV_HIT_BLOCK_NS: 0,
        semconv.COST_PREEMPTED_NS: 0,
        semconv.VLLM_PREEMPTIONS: 0,
        semconv.USAGE_TIME: ns(end),
    }
    if tenant:
        rec[semconv.TENANT_ID] = tenant
    return rec


def window(instance, start, end, busy_s, model="tiny", capacity=1000):
    return {
        semconv.USAGE_ID: f"{instance}/engine0/window/{ns(end)}",
        semconv.USAGE_SCHEMA_VERSION: 2,
        semconv.USAGE_KIND: semconv.USAGE_KIND_ENGINE_WINDOW,
        semconv.SERVICE_NAME: "vllm",
        semconv.SERVICE_INSTANCE_ID: instance,
        semconv.VLLM_ENGINE_INSTANCE: f"{instance}/engine0",
        semconv.GEN_AI_REQUEST_MODEL: model,
        semconv.ENGINE_WINDOW_START: ns(start),
        semconv.USAGE_TIME: ns(end),
        semconv.ENGINE_BUSY_NS: ns(busy_s),
        semconv.ENGINE_IDLE_NS: ns(end - start) - ns(busy_s),
        semconv.ENGINE_KV_CAPACITY_BLOCKS: capacity,
        semconv.ENGINE_KV_BLOCK_SIZE: 16,
        semconv.ENGINE_KV_BLOCK_NS: 0,
    }


def windows(instance, busy_first, model="tiny"):
    """Ten-minute windows, an hour of them ending inside the report window (the first at its start);
    the first was busy for busy_first seconds."""
    return [window(instance, T0 + 600 * (k - 1), T0 + 600 * k, busy_first if k == 0 else 0, model) for k in range(6)]


N2 = ("0_cmpl-b-22222222", "1_cmpl-b-22222222")
RECORDS = [
    # acme: one engine request; its engine record ended just before the window (joined across the edge)
    api("cmpl-a-11111111", "acme", T0 + 0.002, 100, 50, cached=20, engine_ids=["cmpl-a-11111111"]),
    engine("cmpl-a-11111111", T0 - 0.001, 12, 3, 6000, inp=100, out=50),
    # beta: n = 2, two engine requests, one bill
    api("cmpl-b-22222222", "beta", T0 + 200, 40, 80, engine_ids=N2, n=2),
    engine(N2[0], T0 + 199.9, 6, 1, 1500, inp=40, out=40),
    engine(N2[1], T0 + 199.9, 6, 1, 1500, inp=40, out=40),
    # gamma: a frontend otel-llm cannot see: the engine record is the bill
    engine("cmpl-g-33333333", T0 + 300, 3, 1, 600, billed=False, tenant="gamma", inp=10, out=10),
    # the API server's half never arrived: the engine record bills it (no tenant)
    engine("cmpl-o-44444444", T0 + 400, 3, 1, 900, inp=30, out=5),
    # schema 1: no engine ids, no cost figures
    api("cmpl-e-55555555", "epsilon", T0 + 500, 10, 5, cached=4),
    # schema 2 listing engine requests whose records are missing: one bill, no figures
    api("cmpl-h-66666666", "eta", T0 + 600, 7, 3, engine_ids=("0_cmpl-h-66666666", "1_cmpl-h-66666666"), n=2),
    # its engine record ends inside, its API record after the window: billed in the next window
    api("cmpl-l-77777777", "late", T0 + 3600 + 0.001, 1, 1, engine_ids=["cmpl-l-77777777"]),
    engine("cmpl-l-77777777", T0 + 3599.999, 2, 1, 100, inp=1, out=1),
    # an engine record that ended before the window and before its API record: joined, and outside
    api("cmpl-x-88888888", "early", T0 - 1, 1, 1, engine_ids=["cmpl-x-88888888"]),
    engine("cmpl-x-88888888", T0 - 1.001, 1, 0, 10, inp=1, out=1),
    # zeta on the second instance
    api("cmpl-z-99999999", "zeta", T0 + 1000, 20, 10, engine_ids=["cmpl-z-99999999"], instance=B),
    engine("cmpl-z-99999999", T0 + 999.9, 36, 6, 7200, instance=B, inp=20, out=10),
    *windows(A, 20.5),  # the engine records ended inside: beta 12 + gamma 3 + orphan 3 + late 2 = 20
    *windows(B, 36.2),
    window(A, T0 - 1200, T0 - 600, 5),  # ends before the window
]
# read twice (a re-shipped spool): the first API record, an engine record of n = 2, a window
DUPLICATES = [RECORDS[0], RECORDS[3], RECORDS[-3]]
KEY = {
    "acme": f"{A}/cmpl-a-11111111",
    "beta": f"{A}/cmpl-b-22222222",
    "gamma": f"{ENGINE_A}/cmpl-g-33333333",
    "orphan": f"{ENGINE_A}/cmpl-o-44444444",
    "epsilon": f"{A}/cmpl-e-55555555",
    "eta": f"{A}/cmpl-h-66666666",
    "zeta": f"{B}/cmpl-z-99999999",
}


def write_spool(directory, records):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "usage-a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[::2]))
    (directory / "usage-b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[1::2]))
    return str(directory)


@pytest.fixture
def spool(tmp_path):
    return write_spool(tmp_path / "spool", RECORDS + DUPLICATES)


def otel_logs_ledger(tmp_path, records):
    return ledger.load_otel_logs(str(tmp_path / "session"), records)


# --- the join: every bill once ------------------------------------------------------------------


def usage(source, by=("tenant",)):
    return {
        k: (r.tokens, r.requests, r.compute_ns, r.prefill_compute_ns, r.kv_block_ns, r.orphans)
        for k, r in source.usage(*WINDOW, list(by)).items()
    }


EXPECTED_BILLS = {  # tokens, requests, compute_ns, prefill_compute_ns, kv_block_ns, orphans
    ("-",): ({"input": 30, "cached_input": 0, "output": 5}, 1, 3 * S, 1 * S, 900 * S, 1),
    ("acme",): ({"input": 100, "cached_input": 20, "output": 50}, 1, 12 * S, 3 * S, 6000 * S, 0),
    ("beta",): ({"input": 40, "cached_input": 0, "output": 80}, 1, 12 * S, 2 * S, 3000 * S, 0),
    ("epsilon",): ({"input": 10, "cached_input": 4, "output": 5}, 1, 0, 0, 0, 0),
    ("eta",): ({"input": 7, "cached_input": 0, "output": 3}, 1, 0, 0, 0, 0),
    ("gamma",): ({"input": 10, "cached_input": 0, "output": 10}, 1, 3 * S, 1 * S, 600 * S, 0),
    ("zeta",): ({"input": 20, "cached_input": 0, "output": 10}, 1, 36 * S, 6 * S, 7200 * S, 0),
}


def test_each_request_is_billed_once_with_its_engine_figures(spool):
    assert usage(ledger.open_ledger(spool)) == EXPECTED_BILLS
    records = ledger.open_ledger(spool).records(*WINDOW)
    assert sorted(r["key"] for r in records) == sorted(KEY.values())
    by_key = {r["key"]: r for r in records}
    assert by_key[KEY["beta"]]["engine_instance"] == ENGINE_A and int(by_key[KEY["beta"]]["n"]) == 2
    assert by_key[KEY["zeta"]]["engine_instance"] == ENGINE_B
    assert by_key[KEY["epsilon"]]["engine_instance"] == "" and by_key[KEY["epsilon"]]["costed"] == 0
    assert by_key[KEY["gamma"]]["kind"] == semconv.USAGE_KIND_ENGINE and by_key[KEY["gamma"]]["orphan"] == 0
    assert by_key[KEY["orphan"]]["orphan"] == 1
    # the edges: the late request is the next window's, the early one the previous window's
    assert [r["key"] for r in ledger.open_ledger(spool).records(T0 + 3600, T0 + 7200)] == [f"{A}/cmpl-l-77777777"]
    assert [r["key"] for r in ledger.open_ledger(spool).records(T0 - 3600, T0)] == [f"{A}/cmpl-x-88888888"]


def test_a_pd_prefill_legs_engine_record_is_never_a_bill(spool, tmp_path):
    """The prefill node's engine record of a P/D request: its API server wrote no bill (the decode node
    bills the request), and the engine record must not bill it either."""
    leg = engine("cmpl-p-12121212", T0 + 100, 2, 2, 50, inp=64, out=1)
    leg[semconv.VLLM_PD_ROLE] = semconv.PD_ROLE_PREFILL
    with_leg = write_spool(tmp_path / "pd", RECORDS + DUPLICATES + [leg])
    assert usage(ledger.open_ledger(with_leg)) == EXPECTED_BILLS


def test_engine_records_leave_the_token_report_as_it_was(tmp_path):
    """API-server records alone, then with their engine records (joined, one of them twice) and the
    engines' windows: the report without --costs prints the same bytes, in every format."""
    api_only = [r for r in RECORDS if r.get(semconv.USAGE_KIND) in (None, semconv.USAGE_KIND_REQUEST)]
    joined = [
        r
        for r in RECORDS
        if r.get(semconv.USAGE_KIND) == semconv.USAGE_KIND_ENGINE
        and r[semconv.USAGE_FRONTEND_BILLED]
        and r[semconv.VLLM_ENGINE_REQUEST_ID] != "cmpl-o-44444444"
    ]
    windows_only = [r for r in RECORDS if r.get(semconv.USAGE_KIND) == semconv.USAGE_KIND_ENGINE_WINDOW]
    before = write_spool(tmp_path / "before", api_only)
    after = write_spool(tmp_path / "after", api_only + joined + windows_only + joined[:1])
    for argv in (
        ["--by", "tenant,model,day", "--format", "json"],
        ["--by", "instance,operation", "--format", "csv"],
        ["--by", "tenant"],
    ):
        assert run_report(before, *argv) == run_report(after, *argv)


def test_an_aborted_request_is_billed_what_its_engine_computed(tmp_path):
    """The engine computes tokens the API server never reads once the client left (its outputs in flight
    when vLLM dropped the request): an aborted bill takes the engine records' output and cached input
    where they are more. A finished one keeps its own (a stop string: the client's usage said so), as
    does an aborted one whose engine records are missing. reconcile compares the API server's own
    counts, as vLLM's counters count what the API server read."""

    def aborted(record):
        return {**record, semconv.REQUEST_OUTCOME: semconv.OUTCOME_ABORTED}

    def hits(record, cached):
        return {**record, semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: cached}

    pair = ("0_cmpl-p-2", "1_cmpl-p-2")
    records = [
        # left mid-stream: 374 tokens read, 375 computed
        aborted(api("cmpl-s-1", "left", T0 + 10, 100, 374, engine_ids=["cmpl-s-1"])),
        aborted(engine("cmpl-s-1", T0 + 10.1, 1, 0.1, 10, inp=100, out=375)),
        # n = 2, left before the first output arrived: nothing read, its hits unknown to the API server
        aborted(api("cmpl-p-2", "early", T0 + 20, 64, 0, engine_ids=pair, n=2)),
        aborted(hits(engine(pair[0], T0 + 20.1, 1, 0.5, 10, inp=64, out=2), 32)),
        aborted(hits(engine(pair[1], T0 + 20.1, 1, 0.5, 10, inp=64, out=1), 32)),
        # a stop string: the client got usage for 5; the engine ran 2 more until the abort reached it
        api("cmpl-f-3", "stopped", T0 + 30, 10, 5, engine_ids=["cmpl-f-3"]),
        aborted(engine("cmpl-f-3", T0 + 30.1, 1, 0.1, 10, inp=10, out=7)),
        # aborted, its engine record not (yet) in the ledger
        aborted(api("cmpl-m-4", "missing", T0 + 40, 10, 3, engine_ids=["cmpl-m-4"])),
        *windows(A, 4),
    ]
    expected = {
        ("left",): ({"input": 100, "cached_input": 0, "output": 375}, 1, S, S // 10, 10 * S, 0),
        ("early",): ({"input": 64, "cached_input": 32, "output": 3}, 1, 2 * S, S, 20 * S, 0),
        ("stopped",): ({"input": 10, "cached_input": 0, "output": 5}, 1, S, S // 10, 10 * S, 0),
        ("missing",): ({"input": 10, "cached_input": 0, "output": 3}, 1, 0, 0, 0, 0),
    }
    spool = write_spool(tmp_path / "spool", records)
    for open_source in (lambda: ledger.open_ledger(spool), lambda: otel_logs_ledger(tmp_path, records)):
        source = open_source()  # (one chDB session at a time)
        assert usage(source) == expected
        read = source.reconcile_totals(*WINDOW, ["model"])[("tiny",)]
        assert (read["input"], read["cached_input"], read["output"]) == (184, 0, 382)
    code, out, err = run_report(spool, "--by", "tenant", "--format", "json")
    assert code == 0, err
    assert {r["tenant"]: r["tokens"]["output"] for r in json.loads(out)["rows"]} == {
        "early": 3,
        "left": 375,
        "missing": 3,
        "stopped": 5,
    }


def test_the_otel_logs_table_gives_the_same_bills(spool, tmp_path):
    table = otel_logs_ledger(tmp_path, RECORDS + DUPLICATES)
    assert usage(table) == EXPECTED_BILLS
    spool_ledger = ledger.open_ledger(spool)
    for by in (["tenant", "engine_instance"], ["instance", "day"]):
        assert usage(table, by) == usage(spool_ledger, by)
    units = ["engine_instance", "day"]
    assert table.windows(*WINDOW, units) == spool_ledger.windows(*WINDOW, units)
    assert table.engine_check(*WINDOW) == spool_ledger.engine_check(*WINDOW)


# --- costs ----------------------------------------------------------------------------------------


def run_report(where, *argv, now=T0 + 7200):
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    code = report.run(
        parser.parse_args(["--ledger", where, "--start", str(WINDOW[0]), "--end", str(WINDOW[1]), *argv]),
        now=now,
        out=out,
        err=err,
    )
    return code, out.getvalue(), err.getvalue()


def cost_report(where, tmp_path, cost_file, *argv, by="tenant"):
    path = tmp_path / "costs.yaml"
    path.write_text(cost_file)
    code, out, err = run_report(where, "--costs", str(path), "--by", by, "--format", "json", *argv)
    assert code == 0, err
    return json.loads(out), err


RATES = 'usd_per_hour: 3.6\ninstances:\n  "host:8001": {gpu: H100, gpus: 2, usd_per_gpu_hour: 3.5}\n'
# the report window holds one hour of windows per instance: instance cost = its hourly rate
INSTANCE_COST = {ENGINE_A: 3.6, ENGINE_B: 7.0}


def costs_by_tenant(result):
    return {(r["tenant"], r.get("engine_instance")): r["cost"] for r in result["rows"]}


def test_compute_share_by_hand(spool, tmp_path):
    result, err = cost_report(spool, tmp_path, RATES, by="tenant,engine_instance")
    # host:8000 costs 3.6 per hour = 0.001 per second of its wall time; host:8001 7.0 (2 GPUs x 3.5)
    assert costs_by_tenant(result) == pytest.approx(
        {
            ("acme", ENGINE_A): 0.012,
            ("beta", ENGINE_A): 0.012,
            ("gamma", ENGINE_A): 0.003,
            ("-", ENGINE_A): 0.003,
            ("epsilon", "-"): 0.0,
            ("eta", "-"): 0.0,
            ("zeta", ENGINE_B): 7.0 * 36 / 3600,
            ("idle", ENGINE_A): 3.6 - 0.030,  # includes the late request's 2 s: billed in the next window
            ("idle", ENGINE_B): 7.0 - 0.07,
        },
        rel=1e-12,
        abs=0,
    )
    acme = next(r for r in result["rows"] if r["tenant"] == "acme")
    assert acme["compute_seconds"] == 12.0 and acme["kv_block_seconds"] == 6000.0 and acme["requests"] == 1
    # prefill 3 of 12 s: 0.003 for 100 input tokens, 0.009 for 50 output tokens
    assert acme["cost_per_million_input"] == pytest.approx(30.0, rel=1e-12)
    assert acme["cost_per_million_output"] == pytest.approx(180.0, rel=1e-12)
    idle = next(r for r in result["rows"] if r["tenant"] == "idle" and r["engine_instance"] == ENGINE_A)
    assert idle["compute_seconds"] == 3600 - 30 and idle["kv_block_seconds"] == 1000 * 3600 - 10500
    assert idle["cost_per_million_input"] is None and idle["requests"] == 0
    total = result["total"]
    assert total["cost"] == pytest.approx(3.6 + 7.0, rel=1e-9)
    assert total["compute_seconds"] == 2 * 3600  # bills + idle = the instances' wall time
    assert "2 request(s) have no engine cost figures" in err
    assert "1 request(s) billed from the engine's record alone" in err
    assert result["currency"] == "USD"


@pytest.mark.parametrize(
    "allocate,expected",
    [
        ("compute", {"acme": 0.012, "beta": 0.012, "gamma": 0.003, "-": 0.003}),
        # kv: block-seconds over 1000 blocks x 3600 s
        ("kv", {"acme": 0.006, "beta": 0.003, "gamma": 0.0006, "-": 0.0009}),
        (
            "{compute: 0.7, kv: 0.3}",
            {
                "acme": 0.7 * 0.012 + 0.3 * 0.006,
                "beta": 0.7 * 0.012 + 0.3 * 0.003,
                "gamma": 0.7 * 0.003 + 0.3 * 0.0006,
                "-": 0.7 * 0.003 + 0.3 * 0.0009,
            },
        ),
    ],
)
def test_allocations_and_idle_add_up_to_the_instance_hours(spool, tmp_path, allocate, expected):
    result, _ = cost_report(spool, tmp_path, f"usd_per_hour: 3.6\nallocate: {allocate}\n", by="engine_instance,tenant")
    got = {r["tenant"]: r["cost"] for r in result["rows"] if r["engine_instance"] == ENGINE_A}
    assert got == pytest.approx({**expected, "idle": 3.6 - sum(expected.values())}, rel=1e-12, abs=0)
    for instance in (ENGINE_A, ENGINE_B):
        spent = sum(r["cost"] for r in result["rows"] if r["engine_instance"] == instance)
        assert spent == pytest.approx(3.6, rel=1e-9)  # tenants + idle = rate x wall time


def test_spread_shares_the_whole_instance_cost(spool, tmp_path):
    result, _ = cost_report(spool, tmp_path, RATES + "idle: spread\n", by="tenant,engine_instance")
    got = costs_by_tenant(result)
    # compute weights 12 : 12 : 3 : 3 share host:8000's 3.6; zeta alone pays host:8001's 7.0
    assert got == pytest.approx(
        {
            ("acme", ENGINE_A): 1.44,
            ("beta", ENGINE_A): 1.44,
            ("gamma", ENGINE_A): 0.36,
            ("-", ENGINE_A): 0.36,
            ("epsilon", "-"): 0.0,
            ("eta", "-"): 0.0,
            ("zeta", ENGINE_B): 7.0,
        },
        rel=1e-12,
        abs=0,
    )
    assert sum(v for (_, i), v in got.items() if i == ENGINE_A) == pytest.approx(3.6, rel=1e-12)


def test_revenue_margin_and_idle_rows_per_instance_and_day(spool, tmp_path):
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"models": {"*": {"input": 1000.0, "cached_input": 500.0, "output": 2000.0}}}))
    result, _ = cost_report(spool, tmp_path, RATES, "--prices", str(prices), by="tenant,instance,day")
    rows = {(r["tenant"], r["instance"]): r for r in result["rows"]}
    acme = rows[("acme", A)]
    # (80 x 1000 + 20 x 500 + 50 x 2000) per million tokens
    assert acme["revenue"] == pytest.approx(0.19, rel=1e-12)
    assert acme["margin"] == pytest.approx(0.19 - 0.012, rel=1e-12)
    assert rows[("idle", A)]["day"] == "2026-12-02"
    assert rows[("idle", A)]["revenue"] == 0.0 and rows[("idle", A)]["margin"] == pytest.approx(-3.57, rel=1e-12)
    assert rows[("idle", B)]["cost"] == pytest.approx(6.93, rel=1e-12)
    total = result["total"]
    assert total["margin"] == pytest.approx(total["revenue"] - 10.6, rel=1e-12)
    assert list(total) == ["tokens", *report.COST_COLUMNS, "revenue", "margin", "cache_savings"]


def test_csv_and_table_carry_the_json_keys(spool, tmp_path):
    path = tmp_path / "costs.yaml"
    path.write_text("usd_per_hour: 3.6\n")
    _, out, _ = run_report(spool, "--costs", str(path), "--by", "tenant", "--format", "csv")
    table = list(csv.DictReader(io.StringIO(out)))
    assert list(table[0]) == ["tenant", "input", "cached_input", "output", *report.COST_COLUMNS]
    acme = next(r for r in table if r["tenant"] == "acme")
    assert (acme["compute_seconds"], acme["cost"], acme["cost_per_million_input"]) == (
        "12.000000000",
        "0.012000",
        "30.000000",
    )
    assert table[-1]["tenant"] == "TOTAL" and table[-1]["cost"] == "7.200000"
    _, out, _ = run_report(spool, "--costs", str(path), "--by", "tenant")
    assert out.startswith("token usage 2026-12-02T00:00:00Z .. 2026-12-02T01:00:00Z (costs in USD)\n")
    assert out.splitlines()[1].split() == ["tenant", "input", "cached_input", "output", *report.COST_COLUMNS]


def test_the_cost_report_is_the_same_over_the_otel_logs_table(spool, tmp_path):
    otel_logs_ledger(tmp_path, RECORDS + DUPLICATES)
    where = f"chdb://{tmp_path / 'session'}?table=otel_logs"
    for cost_file in (RATES, RATES + "idle: spread\nallocate: {compute: 0.5, kv: 0.5}\n"):
        for by in ("tenant", "tenant,engine_instance,day"):
            assert cost_report(where, tmp_path, cost_file, by=by) == cost_report(spool, tmp_path, cost_file, by=by)


def test_rates_by_engine_instance_then_service_instance_then_model():
    c = costs.Costs(usd_per_hour=1.0, instances={ENGINE_A: 5.0, B: 6.0}, models={"big": 9.0})
    assert c.rate(ENGINE_A, A, "big") == 5.0
    assert c.rate(ENGINE_B, B, "big") == 6.0
    assert c.rate("h:9/engine0", "h:9", "big") == 9.0
    assert c.rate("h:9/engine0", "h:9", "tiny") == 1.0


def test_the_smallest_cost_file(tmp_path):
    path = tmp_path / "costs.yaml"
    path.write_text("usd_per_hour: 3.5\n")
    assert costs.load(path) == costs.Costs("USD", 3.5, {"compute": 1.0, "kv": 0.0}, "row", {}, {})


@pytest.mark.parametrize(
    "content,message",
    [
        ("- 3.5\n", "expected a mapping"),
        ("usd_per_hr: 3.5\n", "unknown key.* usd_per_hr"),
        ("usd_per_hour: -1\n", "usd_per_hour must be a number >= 0, got -1"),
        ("usd_per_hour: cheap\n", "usd_per_hour must be a number >= 0"),
        ("idle: row\n", "no rate: set usd_per_hour"),
        ("usd_per_hour: 1\nallocate: gpu\n", "allocate must be compute, kv or weights"),
        ("usd_per_hour: 1\nallocate: {compute: 0.5, kv: 0.4}\n", "must add up to 1"),
        ("usd_per_hour: 1\nallocate: {compute: 0.5, memory: 0.5}\n", "allocate must be compute, kv or weights"),
        ("usd_per_hour: 1\nidle: never\n", "idle must be row or spread"),
        ("instances: {a: 3}\n", "instances 'a': expected"),
        ("instances: {a: {usd_per_hour: 1, gpus: 2, usd_per_gpu_hour: 1}}\n", "not both"),
        ("instances: {a: {gpus: 0, usd_per_gpu_hour: 1}}\n", "gpus must be a whole number >= 1"),
        ("instances: {a: {gpus: 8}}\n", "usd_per_gpu_hour must be a number >= 0, got None"),
        ("models: [tiny]\n", "models must map names to rates"),
        ("usd_per_hour: 1\ncurrency: 3\n", "currency must be a name"),
        ("usd_per_hour: [1\n", "is not valid YAML"),
    ],
)
def test_malformed_cost_files(tmp_path, content, message):
    path = tmp_path / "costs.yaml"
    path.write_text(content)
    with pytest.raises(ReportError, match=message):
        costs.load(path)


def test_cost_errors_on_the_command_line(spool, tmp_path):
    path = tmp_path / "costs.yaml"
    path.write_text('instances: {"host:8000": {usd_per_hour: 1}}\n')
    code, out, err = run_report(spool, "--costs", str(path))
    assert code == 2 and out == ""
    assert err.splitlines()[-1].startswith(
        "otel-llm report: no rate for engine instance host:8001/engine0 (service.instance.id host:8001, model tiny)"
    )
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"currency": "EUR", "models": {"*": {"input": 1, "output": 1}}}))
    path.write_text("usd_per_hour: 1\n")
    code, _, err = run_report(spool, "--costs", str(path), "--prices", str(prices))
    assert code == 2 and "margins need one currency" in err
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    code = report.run(parser.parse_args(["--costs", str(path)]), now=T0, out=io.StringIO(), err=(err := io.StringIO()))
    assert code == 2 and "--costs needs --ledger" in err.getvalue()


# --- reconcile: engine compute vs window busy time --------------------------------------------------


def test_reconcile_checks_engine_compute_against_busy_time(tmp_path):
    # host:8000's engine wrote one more window (idle), after its last request: every record is covered
    closing = window(A, T0 + 3000, T0 + 3599.9995, 0)
    spool = write_spool(tmp_path / "spool", RECORDS + DUPLICATES + [closing])
    rows = reconcile.engine_check(ledger.open_ledger(spool), *WINDOW)
    assert rows == [
        {
            "engine_instance": ENGINE_A,
            "engine_records": 5,
            "compute_s": 20.0,
            "busy_s": 20.5,
            "difference_s": -0.5,
            "state": "ok",
            "note": "",
        },
        {
            "engine_instance": ENGINE_B,
            "engine_records": 1,
            "compute_s": 36.0,
            "busy_s": 36.2,
            "difference_s": pytest.approx(-0.2, abs=1e-9),
            "state": "ok",
            "note": "",
        },
    ]
    text = reconcile.render([], ["instance", "model"], "table", *WINDOW, rows)
    assert "engine records' compute vs engine_window busy time" in text
    assert f"{ENGINE_A}  5               20.000     20.500  -0.500        ok" in text
    # 2 s more busy time than compute on host:8001 (over 1 s and 1 %); none at all on another engine
    extra = [window(B, T0 + 3000, T0 + 3001, 0.0)]
    extra[0][semconv.ENGINE_BUSY_NS] = 2 * S
    lost = engine("cmpl-q", T0 + 10, 5, 1, 1, instance="host:9000")
    rows = reconcile.engine_check(ledger.open_ledger(write_spool(tmp_path / "bad", RECORDS + extra + [lost])), *WINDOW)
    # without the closing window, host:8000's last request waits for its engine's next window; host:9000
    # has written none yet (a running engine writes one when it is next busy after a window's time)
    assert [(r["engine_instance"], r["state"], r["note"]) for r in rows] == [
        (ENGINE_A, "MISMATCH", "1 engine records after the last window, not compared"),
        (ENGINE_B, "MISMATCH", ""),
        ("host:9000/engine0", "pending", "no engine_window record yet (1 engine records wait for one)"),
    ]
    assert json.loads(reconcile.render([], ["model"], "json", *WINDOW, rows))["engines"][1]["difference_s"] == -2.2


def test_reconcile_without_engine_records_is_as_before(tmp_path):
    where = write_spool(tmp_path / "s1", [api("r1", "acme", T0 + 1, 1, 1)])
    assert reconcile.engine_check(ledger.open_ledger(where), *WINDOW) == []
    assert "engines" not in json.loads(reconcile.render([], ["model"], "json", *WINDOW, []))
