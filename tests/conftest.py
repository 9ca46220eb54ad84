"""Fixtures shared by every folder. Helpers that test modules import live in plain modules
(helpers.py), never here: with one conftest.py per folder (tests/e2e/conftest.py), `import conftest`
would name whichever pytest loaded last."""

import os

import pytest
from helpers import InMemoryOtel, Traceparent, spec_violations

from devkit.otlp_receiver import Receiver

# Each e2e server is one real `opentelemetry-instrument vllm serve` on CPU (~40 s to start):
# tests share them per module.
for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"):
    os.environ.pop(name, None)


@pytest.fixture(scope="module")
def receiver():
    """An OTLP receiver for the module's servers. At the end of the module, everything otel-llm
    emitted to it is checked against the names spec (otel_llm/semconv.py)."""
    with Receiver() as rx:
        yield rx
        with rx._lock:
            spans, logs = list(rx.spans), list(rx.logs)
            points = [p for batch in rx.metric_batches for p in batch]
        violations = spec_violations(spans, points, logs)
        assert not violations, "telemetry outside the names spec:\n" + "\n".join(violations)


@pytest.fixture
def traceparent():
    return Traceparent()


@pytest.fixture
def memory_otel():
    """A tracer provider and a meter provider on in-memory readers (helpers.InMemoryOtel)."""
    return InMemoryOtel()
