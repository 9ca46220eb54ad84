"""Helpers shared across folders: assertions over exported traces, in-memory OTel providers, the
e2e servers (start_server, start_prometheus, Traceparent) and the names spec check (spec_violations)."""

import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from devkit.devserver import PrometheusServer, VLLMServer, otlp_env
from otel_llm import semconv
from otel_llm.openai import OpenAIInstrumentor

# A stream a test abandons asks vLLM for one chunk per this many tokens (`stream_interval`), so the
# serving task waits between chunks and Starlette's disconnect listener runs.
ABORT_STREAM_INTERVAL = 50


@dataclass
class Abandoned:
    """One stream the client left, and what the engine made of it (its own counters)."""

    headers: dict
    aborted: bool

    @property
    def trace_id(self) -> str:
        return self.headers["traceparent"].split("-")[1]


def _engine_state(url: str) -> tuple[float, float]:
    """(requests running or waiting, requests the engine finished) from vLLM's own /metrics."""
    busy = finished = 0.0
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                busy += sample.value
            elif sample.name == "vllm:request_success_total" and sample.labels.get("finished_reason") != "abort":
                finished += sample.value
    return busy, finished


def wait_engine_idle(url: str, timeout: float = 120.0) -> float:
    """Waits until the engine runs nothing; returns how many requests it has finished."""
    deadline = time.monotonic() + timeout
    while True:
        busy, finished = _engine_state(url)
        if not busy:
            return finished
        if time.monotonic() > deadline:
            raise TimeoutError(f"vLLM still runs {busy} requests after {timeout} s")
        time.sleep(0.05)


def until_engine_aborts(url: str, leave, attempts: int = 5) -> list[tuple]:
    """Calls `leave()` (a client leaving a request early) until the engine reports it aborted one;
    returns (what `leave` returned, aborted) for every attempt, the aborted one last, so that tests
    account for each. Whether the server sees the client leave before the engine ends is vLLM's
    race, not otel-llm's. The servers of such tests are paced (VLLMServer(paced=True): with the
    tiny model's 2 ms step a loaded API server stops serving its event loop until the engine
    ends); each attempt starts on an idle engine (vLLM on CPU stalls a request sent while the
    previous one is being aborted); and the outcome is read from vLLM's own counters (one more
    finished: it ran to the end), not assumed. Measured next to 3 busy processes, 10 streams of
    1900 tokens: paced, 10 aborted at the first attempt; the tiny model needed up to 4."""
    done = []
    for _ in range(attempts):
        finished_before = wait_engine_idle(url)
        result = leave()
        done.append((result, wait_engine_idle(url) == finished_before))
        if done[-1][1]:
            return done
    raise AssertionError(f"vLLM ran all {attempts} abandoned requests to the end: it never saw the client leave")


def abandon_stream(url: str, path: str, body: dict, make_headers, after_events: int = 3) -> list[Abandoned]:
    """Streams `body` and closes the connection after `after_events` SSE events (see
    until_engine_aborts)."""

    def leave():
        headers = make_headers()
        with httpx.Client(timeout=60) as client:
            with client.stream(
                "POST",
                url + path,
                headers=headers,
                json={**body, "stream": True, "stream_interval": ABORT_STREAM_INTERVAL},
            ) as response:
                assert response.status_code == 200, response.read()
                events = 0
                for line in response.iter_lines():
                    events += line.startswith("data: ")
                    if events == after_events:
                        break
        return headers

    return [Abandoned(headers, aborted) for headers, aborted in until_engine_aborts(url, leave)]


# A prompt long enough to fill several KV blocks: the second send hits the prefix cache.
LONG_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 30)


def genai_spans(spans):
    return [s for s in spans if semconv.GEN_AI_OPERATION_NAME in s.attributes]


def children(spans, parent):
    return sorted((s for s in spans if s.parent_span_id == parent.span_id), key=lambda s: s.start_ns)


def request_trace(receiver, trace_id, phases=3, timeout=30.0):
    """Wait until the trace has its HTTP server span, its GenAI span and `phases` phase spans."""

    def complete(rx):
        spans = rx.traces().get(trace_id, [])
        http = [s for s in spans if s.kind == "SERVER"]
        genai = genai_spans(spans)
        phase = [s for s in spans if s.name in semconv.PHASE_SPANS]
        if http and genai and len(phase) >= phases:
            return spans
        return None

    return receiver.wait_for(complete, timeout)


def assert_server_tree(spans, parent_span_id=None, phases=semconv.PHASE_SPANS):
    """HTTP SERVER -> GenAI INTERNAL -> phases in order, inside the parent, not overlapping.

    Returns (http, genai, phase spans)."""
    (http,) = [s for s in spans if s.kind == "SERVER"]
    if parent_span_id is not None:
        assert http.parent_span_id == parent_span_id
    (genai,) = genai_spans(spans)
    assert genai.kind == "INTERNAL"
    assert genai.parent_span_id == http.span_id
    assert http.start_ns <= genai.start_ns and genai.end_ns <= http.end_ns
    kids = children(spans, genai)
    assert [k.name for k in kids] == list(phases)
    previous_end = genai.start_ns
    for kid in kids:
        assert kid.kind == "INTERNAL"
        assert previous_end <= kid.start_ns <= kid.end_ns <= genai.end_ns
        previous_end = kid.end_ns
    # nothing else in the trace: no per-chunk `http send` spans
    names = {s.name for s in spans}
    assert names == {http.name, genai.name, *phases}, names
    return http, genai, kids


def assert_phase_durations_match(genai, kids):
    """Phase span durations equal vLLM's own stats (ns rounding only)."""
    expected = {
        semconv.SPAN_QUEUE: genai.attributes[semconv.VLLM_QUEUE_SECONDS],
        semconv.SPAN_PREFILL: genai.attributes[semconv.VLLM_PREFILL_SECONDS],
        semconv.SPAN_DECODE: genai.attributes[semconv.VLLM_DECODE_SECONDS],
    }
    for kid in kids:
        assert abs(kid.duration_s - expected[kid.name]) < 2e-6, (kid.name, kid.duration_s, expected[kid.name])


def assert_usage(genai, usage):
    attrs = genai.attributes
    assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == usage.prompt_tokens
    assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == usage.completion_tokens
    details = getattr(usage, "prompt_tokens_details", None)
    cached = (details.cached_tokens if details is not None else None) or 0
    assert attrs[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == cached


class InMemoryOtel:
    """A tracer provider and a meter provider on in-memory readers (in-process tests; the
    `memory_otel` fixture)."""

    def __init__(self):
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def finished(self):
        return list(self.spans.get_finished_spans())

    def only_span(self):
        spans = self.finished()
        assert len(spans) == 1, [s.name for s in spans]
        return spans[0]

    def points(self, name):
        data = self.reader.get_metrics_data()
        result = []
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name == name:
                        result.extend(metric.data.data_points)
        return result


class Otel(InMemoryOtel):
    """The OpenAI client instrumentation on in-memory span and metric readers (in-process tests)."""

    def __init__(self, **options):
        super().__init__()
        OpenAIInstrumentor().instrument(
            tracer_provider=self.tracer_provider, meter_provider=self.meter_provider, **options
        )

    def close(self):
        OpenAIInstrumentor().uninstrument()


# --- servers -------------------------------------------------------------------------------------


def start_server(receiver, tmp_path_factory, name, extra_args=(), env=None, grpc=False, paced=False):
    """paced: for modules whose server must see a client leave mid-stream (VLLMServer)."""
    log = tmp_path_factory.mktemp("logs") / f"vllm-{name}.log"
    otlp = otlp_env(receiver.grpc_endpoint, protocol="grpc") if grpc else otlp_env(receiver.endpoint)
    server = VLLMServer(env={**otlp, **(env or {})}, extra_args=extra_args, log_path=log, paced=paced)
    server.start()
    return server


def export_processes(server) -> dict[int, int]:
    """The server's telemetry export processes (otel_llm/vllm/export/channel.py): pid -> parent pid."""
    found = {}
    for pid in server.pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue  # gone meanwhile
        if b"otel_llm.vllm.export.process" in cmdline:
            found[pid] = ppid
    return found


class Traceparent:
    """A W3C traceparent for one test request, so its trace can be found among all others."""

    def __init__(self):
        self.trace_id = secrets.token_hex(16)
        self.span_id = secrets.token_hex(8)
        self.header = f"00-{self.trace_id}-{self.span_id}-01"

    def headers(self, **extra):
        return {"traceparent": self.header, **extra}


def start_prometheus(vllm, tmp_path_factory, **options):
    """A real Prometheus scraping the server every second, returned after its first scrape of vLLM's
    counters: traffic sent before it would be missed (a series' first sample counts from zero)."""
    prom = PrometheusServer([f"127.0.0.1:{vllm.port}"], tmp_path_factory.mktemp("prometheus"), **options)
    prom.start()
    deadline = time.monotonic() + 60
    while not prom.query("vllm:generation_tokens_total"):
        if time.monotonic() > deadline:
            prom.stop()
            raise TimeoutError("Prometheus never scraped vLLM")
        time.sleep(0.5)
    return prom


# --- the names spec ----------------------------------------------------------------------------

_SCOPE_LAYERS = {"otel_llm.vllm": semconv.VLLM, "otel_llm.openai": semconv.CLIENT}


def _type_error(name: str, value) -> str | None:
    spec = semconv.ATTRIBUTES[name]
    if (
        spec.type == semconv.DOUBLE
        and isinstance(value, bool)
        or spec.type == semconv.INT
        and isinstance(value, bool)
        or not isinstance(value, semconv.PYTHON_TYPES[spec.type])
    ):
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
