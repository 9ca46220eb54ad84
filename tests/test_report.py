"""`otel-llm report` without a server: the counter arithmetic, the range and price-file checks, and
every error path of the command (real Prometheus runs in test_report_e2e.py)."""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from otel_llm import report

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


@pytest.mark.parametrize("start,end,range_,message", [
    (None, None, "0h", "bad duration '0h'"),
    (None, None, "yesterday", "bad duration 'yesterday'"),
    ("2025-12-02", None, "24h", "give --range or --start, not both"),
    ("2025-12-02", "2025-12-01", None, "the range is empty"),
    ("last tuesday", None, None, "bad time 'last tuesday'"),
    (None, "2030-01-01", None, "is in the future"),
])
def test_bad_ranges_are_clear_errors(start, end, range_, message):
    with pytest.raises(report.ReportError, match=message):
        report.time_range(start, end, range_, NOW)


def test_range_defaults_to_the_last_day_and_dates_are_utc_midnight():
    assert report.time_range(None, None, None, NOW) == (NOW - 86400, NOW)
    assert report.time_range("2025-12-01", "2025-12-02T00:00:00Z", None, NOW) == (1764547200.0, 1764633600.0)


@pytest.mark.parametrize("content,message", [
    (None, "No such file"),
    ("{not json", "is not valid JSON"),
    ('{"models": {}}', "expected"),
    ('{"models": {"m": {"input": 1, "output": -2}}}', "output must be a number >= 0"),
    ('{"models": {"m": {"input": "cheap", "output": 1}}}', "input must be a number >= 0"),
    ('{"models": {"m": 3}}', "needs input, cached_input and output"),
])
def test_malformed_price_files(tmp_path, content, message):
    path = tmp_path / "prices.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(report.ReportError, match=message):
        report.load_prices(path)


def test_prices_yaml_and_cached_defaults_to_input(tmp_path):
    path = tmp_path / "prices.yaml"
    path.write_text("currency: EUR\nmodels:\n  m: {input: 2, output: 8}\n  '*': {input: 1, cached_input: 0.1, output: 2}\n")
    prices, currency = report.load_prices(path)
    assert currency == "EUR"
    assert prices["m"] == report.Price(input=2.0, cached_input=2.0, output=8.0)
    rows = {("m",): report.Row(("m",), {"input": 1_000_000, "cached_input": 400_000, "output": 10}),
            ("x",): report.Row(("x",), {"input": 0, "cached_input": 0, "output": 1_000_000})}
    assert report.price_rows(rows, ["model"], prices) == []
    assert rows[("m",)].cost == pytest.approx(0.6 * 2 + 0.4 * 2 + 10 * 8 / 1e6)
    assert rows[("x",)].cost == pytest.approx(2.0)  # the "*" default
    assert rows[("x",)].savings == 0


def cli(*argv):
    return subprocess.run([sys.executable, "-m", "otel_llm.cli", "report", *argv], capture_output=True, text=True,
                          timeout=60)


def test_cli_unreachable_server():
    result = cli("--prometheus", "http://127.0.0.1:9")
    assert result.returncode == 2
    assert result.stderr.startswith("otel-llm report: cannot reach Prometheus at http://127.0.0.1:9")
    assert "Traceback" not in result.stderr


def test_cli_bad_arguments_exit_2_with_one_line():
    for argv, message in ((["--by", "tenant,colour"], "--by 'tenant,colour': choose from"),
                          (["--range=-1d"], "bad duration"),
                          (["--prices", "/nonexistent/prices.json"], "price file /nonexistent/prices.json")):
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


@pytest.mark.parametrize("status,body,content_type,message", [
    (400, json.dumps({"status": "error", "errorType": "bad_data", "error": "parse error"}), "application/json",
     "answered 400: parse error"),
    (200, "<html>Grafana</html>", "text/html", "did not answer with Prometheus JSON"),
    (200, json.dumps({"status": "error", "error": "query timed out"}), "application/json", "query timed out"),
])
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
