"""`otel-llm` command: doctor (which vLLM hooks the installed vLLM offers), report (token usage and
cost from the usage ledger or Prometheus), reconcile (ledger vs vLLM's counters), export (ledger
records as Lago / Stripe events or CSV), budget-rules (alerts from a budget file), budget-server (each
budget's current use, for gateways and Prometheus), rules (the
Prometheus recording and alerting rules), price-rules (each model's token prices as recording rules),
dashboards (the Grafana dashboards)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from otel_llm.billing import exports, ledger, reconcile, report
from otel_llm.billing.prices import load_prices
from otel_llm.billing.promql import ReportError
from otel_llm.billing.rows import add_window_arguments, time_range
from otel_llm.cli import doctor
from otel_llm.ops import budget_server, budget_view, budgets, dashboards, price_rules, rules


@dataclass(frozen=True)
class Command:
    """One subcommand, as vLLM's CLI has them: its name and help, a way to add its arguments, and
    run(args), which returns the exit code. A ReportError it raises is printed as `otel-llm NAME: ...`,
    exit 2. description: what `otel-llm NAME --help` says (kept as written)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str | None = None


def _out_argument(parser, help: str, metavar: str = "FILE") -> None:
    """--out / -o, every command's one spelling of where its output goes (--output: the older, hidden one)."""
    parser.add_argument("--out", "-o", metavar=metavar, help=help)
    parser.add_argument("--output", dest="out", help=argparse.SUPPRESS)


def _write(text: str, path: str | None) -> None:
    """text to the file at path (its directory made), or to standard output."""
    if path is None:
        sys.stdout.write(text)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)


def _export_arguments(parser) -> None:
    ledger.add_ledger_argument(parser)
    parser.add_argument("--format", choices=exports.FORMATS, required=True)
    add_window_arguments(parser)
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
    _out_argument(parser, "write here (default: standard output)")
    parser.add_argument("--timeout", type=float, default=60.0)


def _export(args) -> int:
    start, end = time_range(args.start, args.end, args.range_, time.time())
    customers = exports.load_customers(args.customers)
    records = ledger.open_ledger(args.ledger, args.timeout).records(start, end)
    text, missing = exports.render(
        records, args.format, customers, lago_code=args.lago_code, stripe_prefix=args.stripe_event_prefix
    )
    if missing:
        print(
            f"warning: no customer for tenant(s) {', '.join(sorted(missing))} in {args.customers}; "
            "their records were left out",
            file=sys.stderr,
        )
    _write(text, args.out)
    print(f"exported {len(records)} record(s)", file=sys.stderr)
    return 0


def _budget_rules_arguments(parser) -> None:
    parser.add_argument("--budgets", required=True, help="budget file (see `otel-llm report --help`)")
    _out_argument(parser, "write the rules here (default: standard output)")
    parser.add_argument(
        "--prices", help="price file the budget tracker prices money budgets with (its currency labels their series)"
    )


def _budget_rules(args) -> int:
    loaded = budgets.load(args.budgets)
    prices, currency = load_prices(args.prices) if args.prices else ({}, None)
    budgets.check_watchable(loaded, prices)
    _write(budgets.rules_yaml(loaded, currency), args.out)
    return 0


def _budget_server(args) -> int:
    try:
        return budget_server.run(args)
    except KeyboardInterrupt:  # how it is stopped
        return 0


def _rules_arguments(parser) -> None:
    _out_argument(parser, "write the rules here (default: standard output)")
    for f in fields(rules.Params):
        parser.add_argument(
            rules.option(f.name), dest=f.name, type=type(f.default), default=f.default, help="default %(default)s"
        )


def _rules(args) -> int:
    try:
        params = rules.Params(**{f.name: getattr(args, f.name) for f in fields(rules.Params)})
    except ValueError as exc:
        raise ReportError(str(exc)) from None
    _write(rules.render(params), args.out)
    return 0


def _price_rules_arguments(parser) -> None:
    parser.add_argument("--prices", required=True, help="price file (see `otel-llm report --help`)")
    _out_argument(parser, "write the rules here (default: standard output)")


def _price_rules(args) -> int:
    prices, currency = load_prices(args.prices)
    _write(price_rules.render(prices, currency, args.prices), args.out)
    return 0


def _dashboards_arguments(parser) -> None:
    _out_argument(parser, "write every dashboard (or --name's) into DIR", metavar="DIR")
    parser.add_argument("--name", help="one dashboard, e.g. overview.json: printed unless --out")


def _dashboards(args) -> int:
    files = dashboards.render()
    if args.name is not None and args.name not in files:
        raise ReportError(f"no dashboard {args.name!r}; there are {', '.join(files)}")
    if args.out is None:
        if args.name is None:
            raise ReportError("give --out DIR (write them all) or --name NAME (print one)")
        sys.stdout.write(files[args.name])
        return 0
    for name, text in files.items():
        if args.name in (None, name):
            _write(text, str(Path(args.out) / name))
    return 0


COMMANDS = (
    Command(
        "doctor",
        "check the installed vLLM (or unpacked sources) against otel-llm's hook table and field contract",
        doctor.add_arguments,
        doctor.run,
    ),
    Command(
        "report",
        "token usage and cost by tenant/scene/model/day, exact, from the usage ledger or Prometheus; "
        "engine cost and margin with --costs",
        report.add_arguments,
        lambda args: budget_view.run_report(args, now=time.time()),
        report.__doc__,
    ),
    Command(
        "reconcile",
        "usage ledger totals vs vLLM's own token counters, per instance and model",
        reconcile.add_arguments,
        lambda args: reconcile.run(args, now=time.time()),
        reconcile.__doc__,
    ),
    Command(
        "export",
        "usage ledger records as Lago / Stripe usage events or CSV (idempotent)",
        _export_arguments,
        _export,
        exports.__doc__,
    ),
    Command(
        "budget-rules",
        "Prometheus alerting rules from a budget file (over the budget-server's figures)",
        _budget_rules_arguments,
        _budget_rules,
    ),
    Command(
        "budget-server",
        "every budget's current use, from the usage ledger, over HTTP: checks for gateways, /metrics for Prometheus",
        budget_server.add_arguments,
        _budget_server,
        budget_server.__doc__,
    ),
    Command(
        "rules",
        "Prometheus recording and alerting rules for our and vLLM's metrics (thresholds as options)",
        _rules_arguments,
        _rules,
    ),
    Command(
        "price-rules",
        "Prometheus recording rules of each model's token prices, from a price file (the cost dashboard reads them)",
        _price_rules_arguments,
        _price_rules,
    ),
    Command("dashboards", "the Grafana dashboards (JSON)", _dashboards_arguments, _dashboards),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="otel-llm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_arguments(
            sub.add_parser(
                command.name,
                help=command.help,
                description=command.description,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )
    args = parser.parse_args(argv)
    try:
        return next(c for c in COMMANDS if c.name == args.command).run(args)
    except ReportError as exc:
        print(f"otel-llm {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
