"""Every benchmark module imports: they reach into otel-llm's private names (the floor, the cache
simulator, the breakdown), and a rename elsewhere breaks them with no other test to notice."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.stem)
def test_a_benchmark_module_imports(path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # (they import each other by name)
    spec = importlib.util.spec_from_file_location(f"_benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    assert module.__doc__, f"{path.name} says what it measures in its docstring"
