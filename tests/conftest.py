import os
import secrets

import pytest

from devkit.devserver import VLLMServer, otlp_env
from devkit.otlp_receiver import Receiver
from otel_llm import semconv

# Each e2e server is one real `opentelemetry-instrument vllm serve` on CPU (~40 s to start):
# tests share them per module.
for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"):
    os.environ.pop(name, None)


def pytest_collection_modifyitems(items):
    for item in items:
        if "e2e" in item.nodeid.split("::")[0]:
            item.add_marker(pytest.mark.e2e)


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


_SCOPE_LAYERS = {"otel_llm.vllm": semconv.VLLM, "otel_llm.openai": semconv.CLIENT}


def _type_error(name: str, value) -> str | None:
    spec = semconv.ATTRIBUTES[name]
    if spec.type == semconv.DOUBLE and isinstance(value, bool) or \
            spec.type == semconv.INT and isinstance(value, bool) or \
            not isinstance(value, semconv.PYTHON_TYPES[spec.type]):
        return f"is {type(value).__name__}, the spec says {spec.type}"
    return None


def spec_violations(spans, points, logs) -> list[str]:
    """What otel-llm's layers emitted that the names spec does not describe: span attributes of our
    scopes, our metrics and their attributes, usage records' fields, with the spec's types."""
    found: list[str] = []

    def check(attributes: dict, layer: str, what: str, where: str = "") -> None:
        for name, value in attributes.items():
            spec = semconv.ATTRIBUTES.get(name)
            if spec is None or layer not in spec.emitted_by:
                found.append(f"{what} {name!r}{where} is not in semconv.ATTRIBUTES for layer {layer}")
            elif (error := _type_error(name, value)) is not None:
                found.append(f"{what} {name!r}{where} {error}")

    for span in spans:
        if span.scope in _SCOPE_LAYERS:
            check(span.attributes, _SCOPE_LAYERS[span.scope], "span attribute", f" ({span.scope})")
    for point in points:
        if point.name in semconv.METRICS:
            check(point.attributes, semconv.METRIC, "metric attribute", f" of {point.name}")
        elif point.name.startswith(("gen_ai.", "otel_llm.")):
            found.append(f"metric {point.name!r} is not in semconv.METRICS")
    for record in logs:
        if record.event_name == semconv.USAGE_EVENT:
            check(record.attributes, semconv.USAGE, "usage record field")
    return list(dict.fromkeys(found))


def start_server(receiver, tmp_path_factory, name, extra_args=(), env=None, grpc=False, paced=False):
    """paced: for modules whose server must see a client leave mid-stream (VLLMServer)."""
    log = tmp_path_factory.mktemp("logs") / f"vllm-{name}.log"
    otlp = otlp_env(receiver.grpc_endpoint, protocol="grpc") if grpc else otlp_env(receiver.endpoint)
    server = VLLMServer(env={**otlp, **(env or {})}, extra_args=extra_args, log_path=log, paced=paced)
    server.start()
    return server


class Traceparent:
    """A W3C traceparent for one test request, so its trace can be found among all others."""

    def __init__(self):
        self.trace_id = secrets.token_hex(16)
        self.span_id = secrets.token_hex(8)
        self.header = f"00-{self.trace_id}-{self.span_id}-01"

    def headers(self, **extra):
        return {"traceparent": self.header, **extra}


@pytest.fixture
def traceparent():
    return Traceparent()


def start_prometheus(vllm, tmp_path_factory, **options):
    """A real Prometheus scraping the server every second, returned after its first scrape of vLLM's
    counters: traffic sent before it would be missed (a series' first sample counts from zero)."""
    import time

    from devkit.devserver import PrometheusServer

    prom = PrometheusServer([f"127.0.0.1:{vllm.port}"], tmp_path_factory.mktemp("prometheus"), **options)
    prom.start()
    deadline = time.monotonic() + 60
    while not prom.query("vllm:generation_tokens_total"):
        if time.monotonic() > deadline:
            prom.stop()
            raise TimeoutError("Prometheus never scraped vLLM")
        time.sleep(0.5)
    return prom
