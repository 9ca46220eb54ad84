"""Where a request's telemetry goes, chosen once at instrument time (otel_llm/vllm/__init__.py): the SDK in
this process (`InProcessSink`, here) or the export process (otel_llm/vllm/export/sink.py, the same
methods). The request path talks to `Telemetry.sink` only and imports nothing of the export mode."""

from __future__ import annotations

from opentelemetry.trace import SpanKind

from otel_llm import semconv
from otel_llm.vllm import http
from otel_llm.vllm.request_facts import build
from otel_llm.vllm.request_metrics import Measurement, RequestMetrics
from otel_llm.warn import guarded


class InProcessSink:
    """The SDK in this process makes, records and exports every span and metric."""

    usage_events = None  # the usage ledger's events go through the global logger provider

    def __init__(self, tracer, meter):
        self.tracer = tracer
        self.metrics = RequestMetrics(meter)

    def start_request_span(self, info, context, links, start_ns: int):
        """A request's GenAI span (info: request_telemetry.RequestInfo)."""
        return self.tracer.start_span(
            semconv.genai_span_name(info.operation, info.model),
            context=context,
            kind=SpanKind.INTERNAL,
            attributes=info.span_attributes(),
            links=links,
            start_time=start_ns,
        )

    def child_span(self, parent, context, name: str, start_ns: int, end_ns: int, attributes) -> None:
        """A finished child span of a request's span (a phase span)."""
        self.tracer.start_span(
            name, context=context, kind=SpanKind.INTERNAL, start_time=start_ns, attributes=attributes
        ).end(end_time=end_ns)

    def record_request(self, span, context, measurement: Measurement) -> None:
        self.metrics.record(measurement, context=context)

    def count_progress(self, increments: list[tuple]) -> None:
        """A live sweep's token counter increments, (metric key, (input, cached input, output)) each."""
        for key, tokens in increments:
            self.metrics.add_tokens(key, tokens)

    def finish_request(self, span, context, facts, telemetry) -> None:
        """A request ended: its span's end, phase spans and metrics built here (request_facts.py)."""
        build_here(self, span, context, facts, telemetry)

    def finish(self, span) -> None:
        """The request is done (its spans ended): the SDK's processors have them already."""

    def instrument_http(self, app, settings) -> bool:
        """The HTTP server span and metrics on vLLM's app, through the global providers."""
        return http.instrument_app(app, settings)

    def start(self) -> None:
        """This process serves (vLLM built its app)."""

    def close(self, timeout_s: float | None = None) -> None:
        """Nothing of its own to flush: the SDK's providers are shut down by otel_llm/sdk/shutdown.py."""


def build_here(sink, span, context, facts, telemetry) -> None:
    """Build a request's end from its facts in this process, and hand it over."""
    build(facts, span, context, sink, telemetry.settings)
    guarded("handing a request's telemetry to the export process", sink.finish, span)
