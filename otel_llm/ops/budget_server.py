"""`otel-llm budget-server`: the budget tracker (otel_llm/ops/budget_tracker.py) over HTTP, for gateways
and Prometheus.

    GET /v1/budgets/check?tenant=T[&scene=S]  -> {"allowed", "state", "retry_after", "budgets": [...]}
    GET /v1/budgets                            -> every budget's figures, and how fresh they are
    GET /metrics                               -> the figures for Prometheus (`otel-llm budget-rules`)
    GET /healthz                               -> 200 once the ledger was read through, 503 before

A gateway asks /v1/budgets/check before it sends a request upstream and answers 429 when
`allowed` is false (examples/gateway). Every answer is read from memory; the ledger is read by one
background thread every --interval seconds.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from otel_llm.ops.budget_tracker import BudgetTracker

log = logging.getLogger("otel_llm.ops.budget_server")
CHECK_PATH = "/v1/budgets/check"


def make_handler(tracker: BudgetTracker):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):  # noqa: N802 - http.server's name
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query)
            if url.path == CHECK_PATH:
                tenant = (query.get("tenant") or [None])[0]
                if not tenant:
                    return self._send(400, {"error": "tenant is required"})
                decision = tracker.check(tenant, (query.get("scene") or [None])[0])
                return self._send(
                    200,
                    {
                        "allowed": decision.allowed,
                        "state": decision.state,
                        "retry_after": decision.retry_after,
                        "budgets": decision.budgets,
                    },
                )
            if url.path == "/v1/budgets":
                return self._send(
                    200,
                    {
                        "lag_seconds": tracker.lag(),
                        "bills": tracker.bills,
                        "budgets": [{k: v for k, v in f.items() if k != "budget"} for f in tracker.figures()],
                    },
                )
            if url.path == "/metrics":
                return self._send(200, tracker.exposition(), "text/plain; version=0.0.4")
            if url.path == "/healthz":
                ready = tracker.lag() is not None
                return self._send(200 if ready else 503, {"ready": ready})
            return self._send(404, {"error": "not found"})

        def _send(self, status: int, body, content_type: str = "application/json"):
            data = (body if isinstance(body, str) else json.dumps(body)).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args):  # noqa: A002 - quiet: one line per gateway request otherwise
            pass

    return Handler


def refresh_forever(tracker: BudgetTracker, interval: float, stop: threading.Event) -> None:
    failed = False
    while not stop.is_set():
        try:
            tracker.refresh()
            tracker.forget_stale_progress()
            failed = False
        except Exception:  # noqa: BLE001 - keep serving the last figures; the lag metric shows the age
            if not failed:
                log.exception("otel-llm budget-server: reading the ledger failed (retrying every %.1f s)", interval)
            failed = True
        stop.wait(interval)


def serve(tracker: BudgetTracker, host: str, port: int, interval: float, ready=None) -> None:
    server = ThreadingHTTPServer((host, port), make_handler(tracker))
    server.daemon_threads = True
    stop = threading.Event()
    threading.Thread(target=refresh_forever, args=(tracker, interval, stop), name="budget-refresh", daemon=True).start()
    print(f"otel-llm budget-server: listening on http://{host}:{server.server_address[1]}", file=sys.stderr, flush=True)
    if ready is not None:
        ready(server)
    try:
        server.serve_forever()
    finally:
        stop.set()
        server.server_close()


def run(args) -> int:
    from otel_llm.billing.ledger import open_ledger
    from otel_llm.billing.prices import load_prices
    from otel_llm.ops import budgets as budget_file
    from otel_llm.ops.budget_tracker import LedgerFeed, SpoolFeed

    loaded = budget_file.load(args.budgets)
    prices, currency = load_prices(args.prices) if args.prices else ({}, None)
    budget_file.check_watchable(loaded, prices)
    ledgers = args.ledger
    if len(ledgers) == 1 and "://" in ledgers[0]:
        feed = LedgerFeed(open_ledger(ledgers[0]))
    elif any("://" in where for where in ledgers):
        raise budget_file.ReportError("--ledger: several ledgers must all be spool directories")
    else:
        feed = SpoolFeed(*ledgers)
    tracker = BudgetTracker(loaded, prices, currency, feed)
    host, _, port = args.listen.rpartition(":")
    serve(tracker, host or "127.0.0.1", int(port), args.interval)
    return 0


def add_arguments(parser) -> None:
    parser.add_argument("--budgets", required=True, help="budget file (see otel_llm/ops/budgets.py)")
    parser.add_argument(
        "--ledger",
        required=True,
        action="append",
        help="spool directory (repeat for several), clickhouse://HOST:PORT/DB or chdb://PATH",
    )
    parser.add_argument("--prices", help="price file: needed by money budgets")
    parser.add_argument("--listen", default="127.0.0.1:9470", help="HOST:PORT to serve on (default 127.0.0.1:9470)")
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="seconds between reads of the ledger (default 1: figures are this fresh)",
    )
