"""The package's layering, read from its imports (ast; nothing is imported), by package prefix:

- the names (semconv) import nothing of ours;
- the instrumentation (everything outside billing/, ops/ and cli/) imports no operator tool;
- among the operator tools, billing/ imports nothing of ops/ or cli/, ops/ nothing of cli/;
- the OpenAI client layer never imports vLLM code, ours or vLLM's;
- vLLM's request path (otel_llm/vllm/ outside export/) imports nothing of the export mode: the
  instrumentor (otel_llm/vllm/__init__.py) chooses the sink once;
- no module imports one that imports it back, directly or through others (lazy imports inside
  functions count);
- nothing in the package imports the repo-only scaffolding (devkit) or the tests.
"""

import ast
from pathlib import Path

import otel_llm

PACKAGE = Path(otel_llm.__file__).parent
OPERATOR_TOOLS = ("otel_llm.billing", "otel_llm.ops", "otel_llm.cli")
EXPORT_MODE = "otel_llm.vllm.export"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p) for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path, text: str | None = None) -> set[str]:
    """Absolute names of the modules a file imports (also inside functions): `from a import b` is the
    module a.b where there is one, else a."""
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
            for alias in node.names:
                member = f"{base}.{alias.name}"
                found.add(member if member in MODULES or not base.startswith("otel_llm") else base)
                if not base.startswith("otel_llm"):
                    found.add(base)
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


def under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_graph_is_read():
    assert "otel_llm.vllm.hooks" in GRAPH and "otel_llm.semconv" in GRAPH["otel_llm.vllm.hooks"]
    assert {"otel_llm.billing.ledger", "otel_llm.ops.budgets", "otel_llm.vllm.export.sink"} <= MODULES


def test_names_import_nothing_of_ours():
    assert not {n for n in GRAPH["otel_llm.semconv"] if n.startswith("otel_llm")}


def test_the_instrumentation_imports_no_operator_tool():
    instrumentation = {m for m in GRAPH if not under(m, *OPERATOR_TOOLS)}
    assert {m for m in closure(instrumentation) if under(m, *OPERATOR_TOOLS)} == set()


def test_operator_tools_import_down_only():
    billing = {m for m in GRAPH if under(m, "otel_llm.billing")}
    ops = {m for m in GRAPH if under(m, "otel_llm.ops")}
    assert {m for m in closure(billing) if under(m, "otel_llm.ops", "otel_llm.cli")} == set()
    assert {m for m in closure(ops) if under(m, "otel_llm.cli")} == set()


def test_the_client_layer_never_imports_vllm_code():
    reached = closure({m for m in GRAPH if m.startswith("otel_llm.openai")})
    vllm_code = {m for m in reached if m.startswith("otel_llm.vllm")}
    third_party = {n for m in reached for n in GRAPH[m] if n == "vllm" or n.startswith("vllm.")}
    assert (vllm_code, third_party) == (set(), set())


def test_the_request_path_imports_nothing_of_the_export_mode():
    request_path = {
        m for m in GRAPH if under(m, "otel_llm.vllm") and m != "otel_llm.vllm" and not under(m, EXPORT_MODE)
    }
    assert "otel_llm.vllm.request_telemetry" in request_path
    assert {m for m in closure(request_path) if under(m, EXPORT_MODE)} == set()


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or of one that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(n for n in graph[module] if n in graph):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == module:
                    break
            if len(component) > 1 or module in graph[module]:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycle():
    assert cycles(GRAPH) == []


def test_the_cycle_search_finds_one():
    graph = {"otel_llm.a": {"otel_llm.b"}, "otel_llm.b": {"otel_llm.c"}, "otel_llm.c": {"otel_llm.a"}}
    graph["otel_llm.d"] = {"otel_llm.a", "otel_llm.d"}
    assert cycles(graph) == [["otel_llm.a", "otel_llm.b", "otel_llm.c"], ["otel_llm.d"]]


def test_the_package_never_imports_scaffolding():
    bad = {(m, n) for m, names in GRAPH.items() for n in names if n.split(".")[0] in ("devkit", "tests", "conftest")}
    assert bad == set()


def test_the_reading_finds_relative_and_nested_imports():
    """A made-up module of the vLLM layer importing an operator tool and vLLM (the checks above would
    report both)."""
    found = imports_of(
        PACKAGE / "vllm" / "x.py", "from ..billing.report import Prometheus\ndef f():\n    import vllm.v1\n"
    )
    assert {"otel_llm.billing.report", "vllm.v1"} <= found
