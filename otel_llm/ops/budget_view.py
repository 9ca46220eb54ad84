"""`otel-llm report --budgets`: each budget's use in its current period, from the usage ledger or
Prometheus (the report's sources, otel_llm/billing/report.py); exit 1 when a budget is over."""

from __future__ import annotations

import csv
import io
import json
import sys

from otel_llm.billing import report
from otel_llm.billing.prices import load_prices
from otel_llm.billing.promql import ReportError
from otel_llm.billing.rows import UNSET, parse_time, time_range, utc_iso
from otel_llm.ops import budgets as budget_file

COLUMNS = ["tenant", "scene", "period", "unit", "used", "limit", "share", "state", "resets"]


def run_report(args, now: float, out=sys.stdout, err=sys.stderr) -> int:
    """`otel-llm report` (its arguments: report.add_arguments): this view with --budgets, else the usage report."""
    return (run if args.budgets else report.run)(args, now, out, err)


def run(args, now: float, out=sys.stdout, err=sys.stderr) -> int:
    try:
        report.parse_by(args.by)  # checked as the usage report checks it, though the view has its own rows
        return _view(args, now, out, err)
    except ReportError as exc:
        err.write(f"otel-llm report: {exc}\n")
        return 2


def _view(args, now: float, out, err) -> int:
    budgets = budget_file.load(args.budgets)
    prices, currency = load_prices(args.prices) if args.prices else ({}, None)
    budget_file.check_watchable(budgets, prices)
    end = parse_time(args.end) if args.end else now
    window_start = time_range(args.start, args.end, args.range_, now)[0] if args.start or args.range_ else None

    def usage_since(start: float) -> dict:
        start = start if window_start is None else window_start  # --start / --range: one window for all
        rows = report.usage_rows(args, start, end, ["tenant", "scene", "model"], err)
        report.warn_prometheus(args, start, end, err)
        return {tuple(None if v == UNSET else v for v in key): row.tokens for key, row in rows.items()}

    result = budget_file.status(budgets, usage_since, prices, end, currency)
    for row in result:
        row["resets"] = utc_iso(row["resets"]) if row["resets"] else ""
    if args.format == "json":
        out.write(json.dumps({"at": utc_iso(end), "budgets": result}, indent=2) + "\n")
    elif args.format == "csv":
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, COLUMNS, lineterminator="\n", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result)
        out.write(buffer.getvalue())
    else:
        table = [COLUMNS] + [[str(r[c]) if c != "share" else f"{r[c]:.1%}" for c in COLUMNS] for r in result]
        widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
        out.write(f"budgets at {utc_iso(end)} (each over its current period)\n")
        out.write("\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in table) + "\n")
        unpriced = sum(r["unpriced_tokens"] for r in result)
        if unpriced:
            err.write(f"warning: {unpriced} tokens of money-budgeted tenants have no price (not counted)\n")
    return 1 if any(r["state"] == "over" for r in result) else 0
