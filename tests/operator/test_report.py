"""`otel-llm report` without vLLM: the counter arithmetic, the range and price-file checks, every error
path of the command, and the exact increase read from a real Prometheus (Debian package) over a TSDB
built with promtool from chosen samples (vLLM scraped by Prometheus runs in test_report_e2e.py)."""

import argparse
import contextlib
import datetime as dt
import io
import json
import random
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from devkit.devserver import PrometheusServer
from otel_llm import semconv
from otel_llm.billing import report
from otel_llm.ops import budget_view

NOW = 1_764_700_000.0  # 2025-12-02T18:26:40Z


def test_increments_add_up_exactly_across_resets_and_new_series():
    # a series with a value before the window: only what was added inside counts
    assert report.increments(100.0, [(1, 100.0), (2, 130.0), (3, 131.0)]) == [(2, 30.0), (3, 1.0)]
    # a reset (server restarted): counts from zero again
    assert report.increments(50.0, [(1, 70.0), (2, 5.0), (3, 9.0)]) == [(1, 20.0), (2, 5.0), (3, 4.0)]
    # a series born inside the window counts from zero
    assert report.increments(None, [(1, 12.0), (2, 12.0)]) == [(1, 12.0)]


@pytest.mark.parametrize("text,seconds", [("30m", 1800), ("24h", 86400), ("7d", 604800), ("2w", 1209600)])
def test_durations(text, seconds):
    assert report.parse_duration(text) == seconds


@pytest.mark.parametrize(
    "start,end,range_,message",
    [
        (None, None, "0h", "bad duration '0h'"),
        (None, None, "yesterday", "bad duration 'yesterday'"),
        ("2025-12-02", None, "24h", "give --range or --start, not both"),
        ("2025-12-02", "2025-12-01", None, "the range is empty"),
        ("last tuesday", None, None, "bad time 'last tuesday'"),
        (None, "2030-01-01", None, "is in the future"),
    ],
)
def test_bad_ranges_are_clear_errors(start, end, range_, message):
    with pytest.raises(report.ReportError, match=message):
        report.time_range(start, end, range_, NOW)


def test_range_defaults_to_the_last_day_and_dates_are_utc_midnight():
    assert report.time_range(None, None, None, NOW) == (NOW - 86400, NOW)
    assert report.time_range("2025-12-01", "2025-12-02T00:00:00Z", None, NOW) == (1764547200.0, 1764633600.0)


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "No such file"),
        ("{not json", "is not valid JSON"),
        ('{"models": {}}', "expected"),
        ('{"models": {"m": {"input": 1, "output": -2}}}', "output must be a number >= 0"),
        ('{"models": {"m": {"input": "cheap", "output": 1}}}', "input must be a number >= 0"),
        ('{"models": {"m": 3}}', "needs input, cached_input and output"),
    ],
)
def test_malformed_price_files(tmp_path, content, message):
    path = tmp_path / "prices.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(report.ReportError, match=message):
        report.load_prices(path)


def test_a_yaml_file_without_pyyaml_says_so(tmp_path, monkeypatch):
    path = tmp_path / "prices.yml"
    path.write_text("models: {m: {input: 1, output: 2}}\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    with pytest.raises(report.ReportError, match="reading YAML needs PyYAML .* or write it as JSON"):
        report.load_prices(path)


def test_prices_yaml_and_cached_defaults_to_input(tmp_path):
    path = tmp_path / "prices.yaml"
    path.write_text(
        "currency: EUR\nmodels:\n  m: {input: 2, output: 8}\n  '*': {input: 1, cached_input: 0.1, output: 2}\n"
    )
    prices, currency = report.load_prices(path)
    assert currency == "EUR"
    assert prices["m"] == report.Price(input=2.0, cached_input=2.0, output=8.0)
    rows = {
        ("m",): report.Row(("m",), {"input": 1_000_000, "cached_input": 400_000, "output": 10}),
        ("x",): report.Row(("x",), {"input": 0, "cached_input": 0, "output": 1_000_000}),
    }
    assert report.price_rows(rows, ["model"], prices) == []
    assert rows[("m",)].cost == pytest.approx(0.6 * 2 + 0.4 * 2 + 10 * 8 / 1e6)
    assert rows[("x",)].cost == pytest.approx(2.0)  # the "*" default
    assert rows[("x",)].savings == 0


def cli(*argv):
    return subprocess.run(
        [sys.executable, "-m", "otel_llm.cli", "report", *argv], capture_output=True, text=True, timeout=60
    )


def test_cli_unreachable_server():
    result = cli("--prometheus", "http://127.0.0.1:9")
    assert result.returncode == 2
    assert result.stderr.startswith("otel-llm report: cannot reach Prometheus at http://127.0.0.1:9")
    assert "Traceback" not in result.stderr


def test_cli_bad_arguments_exit_2_with_one_line():
    for argv, message in (
        (["--by", "tenant,colour"], "--by 'tenant,colour': choose from"),
        (["--range=-1d"], "bad duration"),
        (["--prices", "/nonexistent/prices.json"], "price file /nonexistent/prices.json"),
    ):
        result = cli("--prometheus", "http://127.0.0.1:9", *argv)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


class FakeAPI:
    """Fault injection: a server that is not a healthy Prometheus."""

    def __init__(self, status, body, content_type="application/json"):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.mark.parametrize(
    "status,body,content_type,message",
    [
        (
            400,
            json.dumps({"status": "error", "errorType": "bad_data", "error": "parse error"}),
            "application/json",
            "answered 400: parse error",
        ),
        (200, "<html>Grafana</html>", "text/html", "did not answer with Prometheus JSON"),
        (200, json.dumps({"status": "error", "error": "query timed out"}), "application/json", "query timed out"),
    ],
)
def test_cli_server_errors(status, body, content_type, message):
    api = FakeAPI(status, body, content_type)
    try:
        result = cli("--prometheus", api.url)
    finally:
        api.close()
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_cli_shows_progress_for_ranges_over_a_day():
    api = FakeAPI(200, json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}}))
    try:
        result = cli("--prometheus", api.url, "--range", "3d", "--format", "json")
    finally:
        api.close()
    assert result.returncode == 0, result.stderr
    assert "(1/3)" in result.stderr and "(3/3)" in result.stderr
    assert json.loads(result.stdout)["rows"] == []


# --- exact_increase against the raw samples, on a real Prometheus --------------------------------

METRIC = report.TOKEN_METRIC
TENANT, MODEL, INSTANCE = (report.DIMENSIONS[d] for d in ("tenant", "model", "instance"))
TYPE = report.TYPE_LABEL
S, MIN, HOUR, DAY = 1000, 60_000, 3_600_000, 86_400_000  # ms
T0 = 1_762_732_800_000  # 2025-11-10T00:00:00Z
LOOKBACK = report.parse_duration(report.BASE_LOOKBACK) * S


def raw_reference(histories, start, end, by):
    """The definition: increments() over every raw sample in (start, end], from each series' last
    sample in the BASE_LOOKBACK before start (Prometheus 2's range selectors include both edges)."""
    totals = {}
    for labels, samples in histories:
        before = [v for t, v in samples if start - LOOKBACK <= t <= start]
        inside = [(t, v) for t, v in samples if start < t <= end]
        for t, added in report.increments(before[-1] if before else None, inside):
            day = dt.datetime.fromtimestamp(t / 1000, dt.timezone.utc).strftime("%Y-%m-%d")
            key = tuple(day if n == "day" else labels.get(n, report.UNSET) for n in by)
            totals[key] = totals.get(key, 0.0) + added
    return totals


def counter(times, rng, value=0, resets=None, most=40):
    """(time, value) samples of a counter that grows by 0..most per sample; resets: time -> value."""
    samples = []
    for t in times:
        value = resets[t] if resets and t in resets else value + rng.choice([0, rng.randint(1, most)])
        samples.append((t, value))
    return samples


def every(first, last, step=MIN):
    return list(range(first, last + 1, step))


START_A = T0 + 7 * HOUR + 30 * MIN  # windows that do not start at midnight
END_A = T0 + 2 * DAY + 12 * HOUR + 43 * MIN + 17_123
END = T0 + 3 * DAY + HOUR  # the last sample


def histories():
    rng = random.Random(7)
    h = []

    def series(tenant, samples, token_type=semconv.TOKEN_TYPE_INPUT, **labels):
        base = {TENANT: tenant, MODEL: "m1", TYPE: token_type, INSTANCE: "10.0.0.1:8000"}
        h.append(({**base, **labels}, sorted(samples)))

    series("steady", counter(every(T0 - 2 * DAY, END), rng, 1000))
    series("steady", counter(every(T0 - 2 * DAY, END), rng), token_type=semconv.TOKEN_TYPE_OUTPUT)
    # restarts inside a chunk, one of them to exactly 0
    series(
        "reset-inside",
        counter(every(T0 - DAY, END), rng, 50, {T0 + 13 * HOUR + 17 * MIN: 3, T0 + DAY + 20 * HOUR + 1 * MIN: 0}),
    )
    # restarts on chunk edges: day chunks are cut 1 ms before midnight, others at START_A + k days
    edge = set(every(T0 - DAY, END)) | {T0 + DAY - 1, T0 + 2 * DAY - 1}
    series(
        "reset-edge",
        counter(
            sorted(edge),
            rng,
            9,
            {
                T0 + DAY: 1,  # the first sample of a day, after one at 23:59:59.999
                START_A + DAY + MIN: 2,  # the first sample after a chunk edge with a sample on it
                START_A + 2 * DAY: 4,  # a sample on a chunk edge
                T0 + 2 * DAY: 5,
            },
        ),
    )
    # restarted and grew past its old value inside a chunk (seen: the drop is between two samples);
    # a restart that grew past the old value between two scrapes can't be seen by any method that
    # reads the counter: like the raw samples, the result counts the difference
    times = every(T0 - DAY, END)
    grows = counter(times, rng, 100_000)
    at = times.index(T0 + DAY + 3 * HOUR)
    grows[at:] = counter(times[at:], rng, 0, {times[at]: 5}, most=5_000_000)
    series("grows-back", grows)
    unseen = counter(times, rng, 1000)  # "restarted" between these two scrapes, counted 1500 since
    unseen[at] = (times[at], unseen[at - 1][1] + 1500)
    series("unseen-restart", unseen[: at + 1] + counter(times[at + 1 :], rng, unseen[at][1]))
    # several restarts in a row, and one in the same chunk later
    series(
        "double-reset",
        counter(
            every(T0, END),
            rng,
            700,
            {T0 + 9 * HOUR: 7, T0 + 9 * HOUR + MIN: 3, T0 + 9 * HOUR + 2 * MIN: 3, T0 + 15 * HOUR: 1},
        ),
    )
    # drops between samples 1 ms apart: windows can't be halved between them, the raw samples settle it
    close = {T0 + 12 * HOUR + 1: 3, T0 + 12 * HOUR + 2: 2, T0 + DAY + 2 * HOUR + 1: 8}
    series("ms-apart", counter(sorted(set(every(T0, END)) | set(close)), rng, 900, close))
    # label values that need quoting and regex escaping, one long enough for a POST
    series(
        'q"uo\\te|ü.*',
        counter(every(T0, END), rng, 5, {T0 + 11 * HOUR: 1, T0 + 11 * HOUR + 5 * MIN: 0}),
        **{report.DIMENSIONS["scene"]: "s" * 7000},
    )
    series("born", counter(every(T0 + DAY + 6 * HOUR + 13 * MIN, END), rng, 17))
    series("born-on-start", counter(every(START_A, END), rng, 3))
    # a scrape gap before the window: the value before it is the base, no new series
    series("gap", counter(every(T0 - 10 * DAY, T0 - 3 * DAY) + every(T0 + 9 * HOUR, END), rng, 10_000))
    # ... and one where the server restarted in the gap: a reset at the first sample after it
    gap = counter(every(T0 - 10 * DAY, T0 - 3 * DAY), rng, 10_000)
    series("gap-reset", gap + counter(every(T0 + 9 * HOUR, END), rng, 20))
    # ... and again later in the same chunk, after a gap over the chunk's first half
    series(
        "gap-resets",
        counter(
            every(T0 - DAY, T0 + 7 * HOUR) + every(T0 + 20 * HOUR, END),
            rng,
            10_000,
            {T0 + 20 * HOUR: 5, T0 + DAY + 5 * HOUR: 1},
        ),
    )
    # silent for longer than BASE_LOOKBACK: counts from zero, as a new series
    series(
        "ancient",
        counter(every(T0 - 40 * DAY, T0 - 40 * DAY + HOUR), rng, 400) + counter(every(T0 + 10 * HOUR, END), rng, 900),
    )
    series(semconv.LABEL_OTHER, counter(every(T0 + DAY, T0 + DAY + 6 * HOUR), rng, 1))
    h.append(({TENANT: "no-model", TYPE: semconv.TOKEN_TYPE_OUTPUT}, counter(every(T0, END), rng)))
    # random scrape intervals with millisecond jitter, gaps and restarts
    for index in range(12):
        t, samples, value = T0 - DAY + rng.randint(0, MIN), [], rng.randint(0, 10**6)
        while t <= END:
            value = rng.randint(0, 30) if rng.random() < 0.003 else value + rng.choice([0, rng.randint(1, 99)])
            samples.append((t, value))
            t += rng.randint(15 * S, 60 * S) + rng.randint(0, 999) + (6 * HOUR if rng.random() < 0.001 else 0)
        series(f"fuzz-{index % 4}", samples, instance=f"10.0.1.{index}:8000")
    return h


@contextlib.contextmanager
def prometheus_over(tmp_path, series_samples):
    """A real Prometheus over a TSDB holding exactly these samples (promtool backfill)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    lines = []
    for labels, samples in series_samples:
        text = ",".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in sorted(labels.items()))
        lines += [f"{METRIC}{{{text}}} {v} {t / 1000:.3f}" for t, v in samples]
    (tmp_path / "samples.om").write_text("\n".join(lines) + "\n# EOF\n")
    subprocess.run(
        [
            "promtool",
            "tsdb",
            "create-blocks-from",
            "openmetrics",
            "--max-block-duration=2400h",
            str(tmp_path / "samples.om"),
            str(tmp_path / "data"),
        ],
        check=True,
        capture_output=True,
    )
    server = PrometheusServer([], tmp_path)
    server.command.append("--storage.tsdb.retention.time=100y")  # old samples stay
    server.start()
    try:
        yield report.Prometheus(server.url)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def history():
    return histories()


@pytest.fixture(scope="module")
def prom(history, tmp_path_factory):
    with prometheus_over(tmp_path_factory.mktemp("prometheus"), history) as api:
        yield api


@pytest.mark.parametrize(
    "start,end",
    [
        (START_A, END_A),  # days, not starting or ending at midnight
        (T0 + DAY, T0 + 3 * DAY),  # midnight to midnight: a sample at 00:00:00 is the next day's
        (T0 + 5 * HOUR + 500, T0 + DAY + HOUR + 1),  # odd milliseconds
    ],
)
@pytest.mark.parametrize("by", [[TENANT, TYPE], [TENANT, TYPE, "day"], [INSTANCE, MODEL, "day"], ["day"]])
@pytest.mark.parametrize("chunk", [86400, 3 * 3600])
def test_exact_increase_equals_the_raw_samples(prom, history, start, end, by, chunk):
    got = report.exact_increase(prom, METRIC, start / 1000, end / 1000, by, chunk=chunk)
    expected = raw_reference(history, start, end, by)
    assert got == expected


def test_exact_increase_sees_each_case(prom, history):
    """The cases above, by name, in the first window (their meaning checked by hand)."""
    got = report.exact_increase(prom, METRIC, START_A / 1000, END_A / 1000, [TENANT])
    samples = {labels[TENANT]: s for labels, s in history if labels.get(TYPE) == semconv.TOKEN_TYPE_INPUT}

    def value_at(tenant, t):
        return [v for ts, v in samples[tenant] if ts <= t][-1]

    # born inside the window, on its start: counted from zero, from its first sample on
    assert got[("born",)] == value_at("born", END_A)
    assert got[("born-on-start",)] == value_at("born-on-start", END_A) - value_at("born-on-start", START_A)
    # the gap before the window: from the value before it; silent for over 35 days: from zero
    assert got[("gap",)] == value_at("gap", END_A) - value_at("gap", START_A)
    assert got[("gap-reset",)] == value_at("gap-reset", END_A)
    assert got[("ancient",)] == value_at("ancient", END_A)
    # grew back past its old value: what came before the restart plus all after it
    restart = T0 + DAY + 3 * HOUR
    assert got[("grows-back",)] == (
        value_at("grows-back", restart - MIN) - value_at("grows-back", START_A) + value_at("grows-back", END_A)
    )
    assert value_at("grows-back", END_A) > value_at("grows-back", restart - MIN)
    # a restart between two scrapes that grew past the old value is a rise like any other
    assert got[("unseen-restart",)] == value_at("unseen-restart", END_A) - value_at("unseen-restart", START_A)


def test_collect_and_the_report_command_equal_the_raw_samples(prom, history):
    rows = report.collect(prom, START_A / 1000, END_A / 1000, ["tenant", "model", "day"])
    expected = raw_reference(history, START_A, END_A, [TENANT, MODEL, "day", TYPE])
    assert {(*k, t): v for k, row in rows.items() for t, v in row.tokens.items() if v} == expected
    code, out, err = run_report(
        prom, "--start", str(START_A / 1000), "--end", str(END_A / 1000), "--by", "tenant,model,day", "--format", "json"
    )
    assert code == 0, err
    got = {
        (r["tenant"], r["model"], r["day"], t): n for r in json.loads(out)["rows"] for t, n in r["tokens"].items() if n
    }
    assert got == expected


def run_report(prom, *argv):
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    code = budget_view.run_report(
        parser.parse_args(["--prometheus", prom.url, *argv]), now=END / 1000 + 60, out=out, err=err
    )
    return code, out.getvalue(), err.getvalue()


def iso(ms):
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize(
    "start,end,expected",
    [
        (T0 + 2 * DAY, T0 + 2 * DAY + 12 * HOUR, []),
        (START_A, END_A, ["tenant"]),  # the "other" tenant: the label cap was hit
        (T0 - 41 * DAY, T0 - 39 * DAY, ["from"]),  # before the first sample (the "ancient" series')
        (T0 - 50 * DAY, T0 - 45 * DAY, ["no data"]),
    ],
)
def test_warnings(prom, start, end, expected):
    found = report.prometheus_warnings(prom, start / 1000, end / 1000)
    assert len(found) == len(expected), found
    for line, what in zip(found, expected):
        assert "--ledger" in line
        if what == "tenant":
            assert f'{TENANT}="{semconv.LABEL_OTHER}"' in line and "OTEL_LLM_METRIC_LABEL_LIMIT" in line
        elif what == "from":
            first = T0 - 40 * DAY
            assert line == (
                f"Prometheus holds data for {METRIC} only from {iso(first)}: the report covers "
                f"{iso(first)}..{iso(end)}; use --ledger for bills"
            )
        else:
            assert line.startswith(f"Prometheus holds no data for {METRIC} ")


def test_the_report_and_the_budget_view_warn_on_stderr_and_still_print(prom, tmp_path):
    code, out, err = run_report(
        prom, "--start", str(T0 / 1000 - 41 * 86400), "--end", str(START_A / 1000), "--by", "tenant"
    )
    assert code == 0 and "TOTAL" in out
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert warnings == [
        f"warning: Prometheus holds data for {METRIC} only from {iso(T0 - 40 * DAY)}: the report "
        f"covers {iso(T0 - 40 * DAY)}..{iso(START_A)}; use --ledger for bills"
    ]
    budgets = tmp_path / "budgets.json"
    budgets.write_text(json.dumps({"budgets": [{"tenant": "steady", "tokens_per_day": 10**12}]}))
    code, out, err = run_report(
        prom, "--budgets", str(budgets), "--start", str(START_A / 1000), "--end", str(END_A / 1000), "--format", "json"
    )
    assert code == 0 and json.loads(out)["budgets"][0]["state"] == "ok"
    assert err.count("warning: ") == 1 and f'warning: {TENANT}="{semconv.LABEL_OTHER}"' in err
    code, out, err = run_report(prom, "--start", str(T0 / 1000 + 2 * 86400), "--range", "12h")
    assert "warning" not in err


class CountingPrometheus(report.Prometheus):
    """Counts the queries made and the values that come back (a raw sample is a value)."""

    calls = values = 0

    def query(self, expr, at):
        result = super().query(expr, at)
        self.calls += 1
        self.values += sum(len(r["values"]) if "values" in r else 1 for r in result)
        return result


def scraped(every_ms, resets):
    """The same counters scraped every `every_ms`: tokens at a steady rate per series from 1 h before
    the window; resets: series index -> restart times (the counter counts from 0 again)."""
    h = []
    for index in range(6):
        labels = {TENANT: f"t{index}", TYPE: semconv.TOKEN_TYPE_OUTPUT, INSTANCE: f"10.0.0.{index}:8000"}
        since, samples = T0 - HOUR + index * 7 * S, []
        for t in range(since, T0 + 12 * HOUR + 1, every_ms):
            since = max([since, *(r for r in resets.get(index, ()) if r <= t)])
            samples.append((t, (t - since) // S * (index + 1)))
        h.append((labels, samples))
    return h


@pytest.mark.parametrize(
    "resets",
    [
        {},
        {
            1: [T0 + 2 * HOUR],  # stays below its old value in the chunk: settles at once
            2: [T0 + 3 * HOUR + 20 * MIN, T0 + 4 * HOUR],  # grows back past it, then restarts again
            4: [T0 + 9 * HOUR],
        },
    ],
)
def test_cost_grows_with_series_not_samples(tmp_path, resets):
    """The same counters over the same 12 h, scraped every second and every 15 s: 15 times the
    samples, the same answer, and (with no restarts) the same values transferred."""
    start, end, by = T0, T0 + 12 * HOUR, [TENANT, "day"]
    cost = {}
    for every_ms in (S, 15 * S):
        history = scraped(every_ms, resets)
        with prometheus_over(tmp_path / str(every_ms), history) as api:
            prom = CountingPrometheus(api.url)
            got = report.exact_increase(prom, METRIC, start / 1000, end / 1000, by, chunk=3 * 3600)
        assert got == raw_reference(history, start, end, by)
        samples = sum(1 for _, s in history for t, _ in s if start < t <= end)
        cost[every_ms] = (prom.calls, prom.values, samples)
    (calls_1s, values_1s, samples_1s), (calls_15s, values_15s, samples_15s) = cost[S], cost[15 * S]
    assert samples_1s > 14 * samples_15s
    if not resets:
        assert (calls_1s, values_1s) == (calls_15s, values_15s)
        assert values_1s == 6 + 4 * 2 * 6  # the base, then last and low per chunk and series
    else:
        # a halving per factor of 2 in samples, only where a restart did not settle at once
        assert values_1s <= values_15s + 8 * 4 * len(resets[2]) and calls_1s <= calls_15s + 4 * len(resets[2])
    assert values_1s * 1000 < samples_1s
