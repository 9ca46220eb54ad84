"""`otel-llm` command: doctor (which vLLM hooks the installed vLLM offers), report (token usage and
cost from the usage ledger or Prometheus), reconcile (ledger vs vLLM's counters), export (ledger
records as Lago / Stripe events or CSV), budget-rules (alerts from a budget file), budget-server (each
budget's current use, for gateways and Prometheus), rules (the
Prometheus recording and alerting rules), price-rules (each model's token prices as recording rules),
dashboards (the Grafana dashboards)."""

from __future__ import annotations

import argparse
import sys


def _budget_rules(args) -> int:
    from otel_llm.billing.prices import load_prices
    from otel_llm.billing.report import ReportError
    from otel_llm.ops import budgets

    try:
        loaded = budgets.load(args.budgets)
        prices, currency = load_prices(args.prices) if args.prices else ({}, None)
        budgets.check_watchable(loaded, prices)
        text = budgets.rules_yaml(loaded, currency)
    except ReportError as exc:
        print(f"otel-llm budget-rules: {exc}", file=sys.stderr)
        return 2
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def _budget_server(args) -> int:
    from otel_llm.billing.report import ReportError
    from otel_llm.ops import budget_server

    try:
        return budget_server.run(args)
    except ReportError as exc:
        print(f"otel-llm budget-server: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


def _price_rules(args) -> int:
    from otel_llm.billing.report import ReportError, load_prices
    from otel_llm.ops import price_rules

    try:
        prices, currency = load_prices(args.prices)
    except ReportError as exc:
        print(f"otel-llm price-rules: {exc}", file=sys.stderr)
        return 2
    _write(price_rules.render(prices, currency, args.prices), args.out)
    return 0


def _write(text: str, path: str | None) -> None:
    """text to the file at path (its directory made), or to standard output."""
    if path is None:
        sys.stdout.write(text)
        return
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)


def _rules_arguments(parser) -> None:
    from dataclasses import fields

    from otel_llm.ops import rules

    parser.add_argument("--out", "-o", metavar="FILE", help="write the rules here (default: standard output)")
    for f in fields(rules.Params):
        parser.add_argument(
            rules.option(f.name), dest=f.name, type=type(f.default), default=f.default, help="default %(default)s"
        )


def _rules(args) -> int:
    from dataclasses import fields

    from otel_llm.ops import rules

    try:
        params = rules.Params(**{f.name: getattr(args, f.name) for f in fields(rules.Params)})
    except ValueError as exc:
        print(f"otel-llm rules: {exc}", file=sys.stderr)
        return 2
    _write(rules.render(params), args.out)
    return 0


def _dashboards(args) -> int:
    from pathlib import Path

    from otel_llm.ops import dashboards

    files = dashboards.render()
    if args.name is not None and args.name not in files:
        print(f"otel-llm dashboards: no dashboard {args.name!r}; there are {', '.join(files)}", file=sys.stderr)
        return 2
    if args.out is None:
        if args.name is None:
            print("otel-llm dashboards: give --out DIR (write them all) or --name NAME (print one)", file=sys.stderr)
            return 2
        sys.stdout.write(files[args.name])
        return 0
    for name, text in files.items():
        if args.name in (None, name):
            _write(text, str(Path(args.out) / name))
    return 0


def _export_arguments(parser) -> None:
    from otel_llm.billing.exports import FORMATS

    parser.add_argument(
        "--ledger",
        required=True,
        metavar="DIR|URL",
        help="spool directory, clickhouse://HOST:8123/DB or chdb://SESSION_DIR",
    )
    parser.add_argument("--format", choices=FORMATS, required=True)
    parser.add_argument("--range", dest="range_", metavar="DURATION", help="window ending at --end (default 24h)")
    parser.add_argument("--start")
    parser.add_argument("--end")
    parser.add_argument(
        "--customers",
        help='JSON/YAML {"customers": {"TENANT": "ID"}}: Lago subscription or Stripe '
        "customer per tenant (default: the tenant itself); others are left out",
    )
    parser.add_argument("--lago-code", default="llm_tokens", help="Lago billable metric code (default %(default)s)")
    parser.add_argument(
        "--stripe-event-prefix",
        default="llm_",
        help="Stripe meter event names are PREFIX + input|cached_input|output + _tokens",
    )
    parser.add_argument("--output", "-o", help="write here (default: standard output)")
    parser.add_argument("--timeout", type=float, default=60.0)


def _export(args) -> int:
    import time

    from otel_llm.billing import exports, ledger
    from otel_llm.billing.report import ReportError, time_range

    try:
        start, end = time_range(args.start, args.end, args.range_, time.time())
        customers = exports.load_customers(args.customers)
        records = ledger.open_ledger(args.ledger, args.timeout).records(start, end)
        text, missing = exports.render(
            records, args.format, customers, lago_code=args.lago_code, stripe_prefix=args.stripe_event_prefix
        )
    except ReportError as exc:
        print(f"otel-llm export: {exc}", file=sys.stderr)
        return 2
    if missing:
        print(
            f"warning: no customer for tenant(s) {', '.join(sorted(missing))} in {args.customers}; "
            "their records were left out",
            file=sys.stderr,
        )
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    print(f"exported {len(records)} record(s)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="otel-llm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    doctor_parser = sub.add_parser(
        "doctor", help="check the installed vLLM (or unpacked sources) against otel-llm's hook table and field contract"
    )
    doctor_parser.add_argument(
        "--source",
        metavar="DIR",
        help="check vLLM's Python sources under DIR (the directory holding `vllm/`, e.g. an "
        "unpacked wheel) without importing them",
    )
    from otel_llm.billing import report

    report.add_arguments(
        sub.add_parser(
            "report",
            help="token usage and cost by tenant/scene/model/day, exact, from the usage ledger or Prometheus; "
            "engine cost and margin with --costs",
            description=report.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    from otel_llm.billing import reconcile

    reconcile.add_arguments(
        sub.add_parser(
            "reconcile",
            help="usage ledger totals vs vLLM's own token counters, per instance and model",
            description=reconcile.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    _export_arguments(
        sub.add_parser(
            "export",
            help="usage ledger records as Lago / Stripe usage events or CSV (idempotent)",
            formatter_class=argparse.RawDescriptionHelpFormatter,
            description=__import__("otel_llm.billing.exports", fromlist=["x"]).__doc__,
        )
    )
    rules = sub.add_parser(
        "budget-rules", help="Prometheus alerting rules from a budget file (over the budget-server's figures)"
    )
    rules.add_argument("--budgets", required=True, help="budget file (see `otel-llm report --help`)")
    rules.add_argument("--output", "-o", help="write the rules here (default: standard output)")
    rules.add_argument(
        "--prices", help="price file the budget tracker prices money budgets with (its currency labels their series)"
    )
    from otel_llm.ops import budget_server

    budget_server.add_arguments(
        sub.add_parser(
            "budget-server",
            help="every budget's current use, from the usage ledger, over HTTP: checks for gateways, "
            "/metrics for Prometheus",
            description=budget_server.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    _rules_arguments(
        sub.add_parser(
            "rules", help="Prometheus recording and alerting rules for our and vLLM's metrics (thresholds as options)"
        )
    )
    prices = sub.add_parser(
        "price-rules",
        help="Prometheus recording rules of each model's token prices, from a "
        "price file (the cost dashboard reads them)",
    )
    prices.add_argument("--prices", required=True, help="price file (see `otel-llm report --help`)")
    prices.add_argument("--out", "-o", metavar="FILE", help="write the rules here (default: standard output)")
    boards = sub.add_parser("dashboards", help="the Grafana dashboards (JSON)")
    boards.add_argument("--out", "-o", metavar="DIR", help="write every dashboard (or --name's) into DIR")
    boards.add_argument("--name", help="one dashboard, e.g. overview.json: printed unless --out")
    args = parser.parse_args(argv)
    if args.command == "budget-rules":
        return _budget_rules(args)
    if args.command == "budget-server":
        return _budget_server(args)
    if args.command == "report":
        import time

        return report.run(args, now=time.time())
    if args.command == "reconcile":
        import time

        return reconcile.run(args, now=time.time())
    if args.command == "export":
        return _export(args)
    if args.command == "doctor":
        from otel_llm.cli.doctor import doctor

        return doctor(sys.stdout, args.source)
    if args.command == "rules":
        return _rules(args)
    if args.command == "dashboards":
        return _dashboards(args)
    if args.command == "price-rules":
        return _price_rules(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
