"""Everything under tests/e2e is end-to-end (a real vLLM engine on CPU, in a server or in-process):
marked `e2e` here, by folder, so `pytest -m "not e2e" tests` runs only the unit tests."""

from pathlib import Path

import pytest
from helpers import start_prometheus

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="module")
def prometheus(vllm, tmp_path_factory):
    """A real Prometheus scraping the module's `vllm` server (helpers.start_prometheus)."""
    prom = start_prometheus(vllm, tmp_path_factory)
    yield prom
    prom.stop()
