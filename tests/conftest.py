import os
import secrets

import pytest

from devkit.devserver import VLLMServer, otlp_env
from devkit.otlp_receiver import Receiver

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
    with Receiver() as rx:
        yield rx


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
