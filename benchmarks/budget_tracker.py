"""The budget tracker at fleet scale: how long its first read of a large ledger takes, how long each
poll takes, and how long a gateway's check takes, for a ledger in ClickHouse (here a chDB session
holding the collector's `otel_logs` table) and for spool files.

The ClickHouse ledger gets N bills (default 10 M) of 1,000 tenants over the last 30 days, made in
the engine itself (INSERT ... SELECT FROM numbers(N)); every tenant has a prepaid budget that began
31 days ago, so the whole ledger is inside the tracker's horizon. Then 1,000 new bills arrive and
the tracker polls. The spool part writes M records (default 1 M) and reads them the way the
tracker tails spool files.

    .venv/bin/python benchmarks/budget_tracker.py [--records 10000000] [--spool-records 1000000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from otel_llm import semconv  # noqa: E402
from otel_llm.billing import ledger
from otel_llm.ops import budgets
from otel_llm.ops.budget_tracker import BudgetTracker, LedgerFeed, SpoolFeed  # noqa: E402

TENANTS = 1000


def generated_bills(n: int, start_s: int, span_s: int, prefix: str) -> str:
    attrs = {
        semconv.USAGE_ID: f"concat('{prefix}/', toString(number))",
        semconv.USAGE_KIND: f"'{semconv.USAGE_KIND_REQUEST}'",
        semconv.TENANT_ID: f"concat('tenant-', toString(number % {TENANTS}))",
        semconv.GEN_AI_REQUEST_MODEL: "'m'",
        semconv.GEN_AI_USAGE_INPUT_TOKENS: "toString(100 + number % 7)",
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: "'0'",
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: "toString(50 + number % 5)",
    }
    pairs = ", ".join(f"'{k}', {v}" for k, v in attrs.items())
    return (
        f"INSERT INTO otel_logs (Timestamp, ServiceName, LogAttributes) "
        f"SELECT fromUnixTimestamp64Nano(toInt64(({start_s} + number % {span_s}) * 1000000000)), 'vllm', "
        f"map({pairs}) FROM numbers({n})"
    )


def budget_list(since: float) -> list[budgets.Budget]:
    return [
        budgets.Budget(f"tenant-{i}", 10**12, semconv.BUDGET_UNIT_TOKENS, semconv.BUDGET_PERIOD_PREPAID, since=since)
        for i in range(TENANTS)
    ]


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def clickhouse(n: int, work: Path) -> None:
    now = time.time()
    executor = ledger.ChdbExecutor(str(work / "session"))
    executor.execute(ledger.otel_logs_ddl("default", "otel_logs"))
    load_s, _ = timed(lambda: executor.execute(generated_bills(n, int(now) - 30 * 86400, 30 * 86400 - 600, "i")))
    print(f"ClickHouse (chDB) ledger: {n:,} bills of {TENANTS} tenants over 30 days, loaded in {load_s:.1f} s")
    source = ledger.Ledger(ledger.otel_logs_source("otel_logs"), executor, "bench")
    tracker = BudgetTracker(budget_list(now - 31 * 86400), feed=LedgerFeed(source))
    first_s, _ = timed(tracker.refresh)
    total = sum(f["used"] for f in tracker.figures())
    print(
        f"  first read (hourly sums of the horizon's bills, then the last {300} s): {first_s:.1f} s; "
        f"{total:,.0f} tokens counted"
    )
    executor.execute(generated_bills(1000, int(time.time()) - 1, 1, "new"))
    polls = []
    for _ in range(5):
        seconds, _ = timed(tracker.refresh)
        polls.append(seconds)
    after = sum(f["used"] for f in tracker.figures())
    print(
        f"  poll (1,000 new bills in the window): median {statistics.median(polls) * 1000:.0f} ms; "
        f"counted {after - total:,.0f} new tokens once"
    )
    checks = []
    for i in range(20000):
        t0 = time.perf_counter()
        tracker.check(f"tenant-{i % TENANTS}")
        checks.append(time.perf_counter() - t0)
    print(
        f"  check: median {statistics.median(checks) * 1e6:.1f} us, p99 "
        f"{sorted(checks)[int(len(checks) * 0.99)] * 1e6:.1f} us"
    )


def spool(m: int, work: Path) -> None:
    directory = work / "spool"
    directory.mkdir()
    now = time.time()
    with open(directory / "usage-bench-1.jsonl", "w") as f:
        for i in range(m):
            f.write(
                json.dumps(
                    {
                        semconv.USAGE_ID: f"i/{i}",
                        semconv.USAGE_TIME: int((now - i % 86400) * 1e9),
                        semconv.TENANT_ID: f"tenant-{i % TENANTS}",
                        semconv.GEN_AI_REQUEST_MODEL: "m",
                        semconv.GEN_AI_USAGE_INPUT_TOKENS: 100,
                        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 50,
                        semconv.USAGE_SCHEMA_VERSION: semconv.USAGE_SCHEMA,
                    }
                )
                + "\n"
            )
    size = os.path.getsize(directory / "usage-bench-1.jsonl")
    tracker = BudgetTracker(budget_list(now - 2 * 86400), feed=SpoolFeed(str(directory)))
    seconds, counted = timed(tracker.refresh)
    print(
        f"spool: {m:,} records ({size / 1e6:.0f} MB) read through in {seconds:.1f} s "
        f"({counted / seconds:,.0f} records/s); a poll with nothing new: "
        f"{timed(tracker.refresh)[0] * 1000:.1f} ms"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--spool-records", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        clickhouse(args.records, Path(tmp))
        spool(args.spool_records, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
