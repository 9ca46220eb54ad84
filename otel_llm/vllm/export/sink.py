"""The export process as the request path's sink (the methods of otel_llm/vllm/sink.py `InProcessSink`):
a request's spans are DeferredSpans whose telemetry goes, when the request ends, in one message to the
export process (otel_llm/vllm/export/channel.py)."""

from __future__ import annotations

from opentelemetry.trace import SpanKind

from otel_llm import semconv
from otel_llm.vllm.export import http as export_http
from otel_llm.vllm.export.channel import ExportChannel
from otel_llm.vllm.export.deferred import (
    DeferredSpan,
    DeferredTracer,
    DeferredTracerProvider,
    OutboxSink,
    UsageEvents,
    hand_over,
)
from otel_llm.vllm.request_facts import RequestFacts
from otel_llm.vllm.request_metrics import Measurement, RequestMetrics
from otel_llm.vllm.request_telemetry import start_values
from otel_llm.vllm.sink import InProcessSink, build_here
from otel_llm.warn import failed


class ExportProcessSink(InProcessSink):
    """InProcessSink's methods where something stays in this process (a span that is not ours, the
    request metrics when a Prometheus reader serves them from here)."""

    def __init__(self, provider, meter, plan: dict, version: str, shutdown_timeout_s: float | None):
        self.tracer = DeferredTracer(provider)
        # a metric reader that serves from this process (Prometheus) keeps the request metrics here
        self.metrics = None if plan["metrics"] else RequestMetrics(meter)
        self.usage_events = UsageEvents() if plan["usage_events"] else None
        self._dropped = semconv.create_instrument(meter, semconv.EXPORT_DROPPED)
        self.channel = ExportChannel(
            {**plan, "version": version}, on_drop=self._count_drop, shutdown_timeout_s=shutdown_timeout_s
        )

    def _count_drop(self, reason: str) -> None:
        self._dropped.add(1, {semconv.ERROR_TYPE: reason})

    def start_request_span(self, info, context, links, start_ns: int):
        """A request's GenAI span, its start attributes built in the export process where it can
        (DeferredTracer.start_span's `_start_values`: a RequestSpan where the sampler's answer is known without
        them)."""
        if context is None and not links:  # (the current context: under the HTTP server span)
            return self.tracer.start_request_span(
                semconv.genai_span_name(info.operation, info.model), start_ns, start_values(info)
            )
        return self.tracer.start_span(
            semconv.genai_span_name(info.operation, info.model),
            context,
            SpanKind.INTERNAL,
            None,
            links,
            start_ns,
            _start_values=start_values(info),
        )

    def finish_request(self, span, context, facts: RequestFacts, telemetry) -> None:
        """A request's span goes to the export process unended with its facts, and its end, phase spans
        and metrics are built there; here only where the request metrics stay in this process."""
        if self.metrics is None and isinstance(span, DeferredSpan) and not span._ended:
            try:  # (`guarded`'s, without its frame per request)
                span.hand_over_unended(facts, self.channel)
            except Exception:  # noqa: BLE001
                failed("handing a request's telemetry to the export process")
        else:
            build_here(self, span, context, facts, telemetry)

    def child_span(self, parent, context, name: str, start_ns: int, end_ns: int, attributes) -> None:
        if isinstance(parent, DeferredSpan):  # exported with this request
            OutboxSink.child_span(parent, context, name, start_ns, end_ns, attributes)
        else:
            InProcessSink.child_span(self, parent, context, name, start_ns, end_ns, attributes)

    def record_request(self, span, context, measurement: Measurement) -> None:
        """Recorded here, or sent with the request's spans."""
        if self.metrics is not None:
            InProcessSink.record_request(self, span, context, measurement)
        elif isinstance(span, DeferredSpan):
            OutboxSink.record_request(span, context, measurement)

    def count_progress(self, increments: list[tuple]) -> None:
        """Added here, or sent to the export process in one message."""
        if self.metrics is not None:
            InProcessSink.count_progress(self, increments)
        else:
            self.channel.send_progress([(tuple(key), tokens) for key, tokens in increments])

    def finish(self, span) -> None:
        """Hand what the request exports to the export process, along with its HTTP server span's when
        that is still open."""
        if isinstance(span, DeferredSpan):
            hand_over(span, self.channel)

    def instrument_http(self, app, settings) -> bool:
        """The HTTP server span made here and exported with the request's telemetry; its attributes and
        metrics made by the export process where it can (otel_llm/vllm/export/http.py)."""
        channel = self.channel
        provider = DeferredTracerProvider(self.tracer, lambda span: hand_over(span, channel), channel.send)
        return export_http.instrument_app(app, settings, provider, offload_metrics=self.metrics is None)

    def start(self) -> None:
        """Start the export process now, and make the drop counter's series exist at 0, so an alert's
        increase() sees the first drop. (Not at instrument time: vLLM's engine core, spawned and
        instrumented too, serves nothing.)"""
        self.channel.start()
        for reason in (semconv.EXPORT_DROP_QUEUE_FULL, semconv.EXPORT_DROP_EXPORTER_DOWN):
            self._dropped.add(0, {semconv.ERROR_TYPE: reason})

    def close(self, timeout_s: float | None = None) -> dict | None:
        """Flush and stop the export process within timeout_s; its report of what it could not export
        (the bounded exit flush, otel_llm/sdk/shutdown.py, counts it in its one warning)."""
        return self.channel.close(timeout_s)
