"""The package's layering, read from its imports (ast; nothing is imported):

- the names (semconv) import nothing of ours;
- the instrumentation (vllm/, openai/ and everything they import) imports no operator tool;
- the OpenAI client layer never imports vLLM code, ours or vLLM's;
- nothing in the package imports the repo-only scaffolding (devkit) or the tests.
"""

import ast
from pathlib import Path

import otel_llm

PACKAGE = Path(otel_llm.__file__).parent
OPERATOR_TOOLS = {
    "otel_llm." + m
    for m in (
        "cli",
        "cli.doctor",
        "billing.report",
        "ops.budgets",
        "ops.budget_tracker",
        "ops.budget_server",
        "billing.prices",
        "ops.price_rules",
        "billing.promql",
        "ops.rules",
        "ops.dashboards",
        "billing.ledger",
        "billing.reconcile",
        "billing.exports",
    )
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, text: str | None = None) -> set[str]:
    """Absolute names of the modules a file imports (also inside functions)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if text is None else text)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                prefix = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(prefix + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


GRAPH = {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}


def ours(names: set[str]) -> set[str]:
    return {n for n in names if n in GRAPH}


def closure(roots: set[str]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(ours(GRAPH[module]) - seen)
    return seen


def test_the_graph_is_read():
    assert "otel_llm.vllm.hooks" in GRAPH and "otel_llm.semconv" in GRAPH["otel_llm.vllm.hooks"]


def test_names_import_nothing_of_ours():
    assert not {n for n in GRAPH["otel_llm.semconv"] if n.startswith("otel_llm")}


def test_the_instrumentation_imports_no_operator_tool():
    roots = {m for m in GRAPH if m.startswith(("otel_llm.vllm", "otel_llm.openai"))} | {"otel_llm.sdk.distro"}
    assert closure(roots) & OPERATOR_TOOLS == set()


def test_the_client_layer_never_imports_vllm_code():
    reached = closure({m for m in GRAPH if m.startswith("otel_llm.openai")})
    vllm_code = {m for m in reached if m.startswith("otel_llm.vllm")}
    third_party = {n for m in reached for n in GRAPH[m] if n == "vllm" or n.startswith("vllm.")}
    assert (vllm_code, third_party) == (set(), set())


def test_the_package_never_imports_scaffolding():
    bad = {(m, n) for m, names in GRAPH.items() for n in names if n.split(".")[0] in ("devkit", "tests", "conftest")}
    assert bad == set()


def test_the_reading_finds_relative_and_nested_imports():
    """A made-up module of the vLLM layer importing an operator tool and vLLM (the checks above would
    report both)."""
    found = imports_of(
        PACKAGE / "vllm" / "x.py", "from ..billing.report import Prometheus\ndef f():\n    import vllm.v1\n"
    )
    assert {"otel_llm.billing.report", "otel_llm.billing.report.Prometheus", "vllm.v1"} <= found
