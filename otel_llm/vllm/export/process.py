"""The export process: builds and exports the request telemetry an API server hands over.

Started by otel_llm/vllm/export/channel.py with one end of a Unix socket. The first message holds the
API server's resource, our version and which signals come here; then one message per request
(its finished spans, its metric Measurement, its usage event), and one per live sweep (the token
counter's increments of the requests in flight, otel_llm/vllm/live.py). Exporters are made from the
same OTEL_* environment, as the SDK's configurator makes them for `opentelemetry-instrument`;
spans become the SDK's `ReadableSpan`s (span limits from the environment as in the server), so
the exported telemetry is what the SDK would have exported from the API server.

It stops, flushing within OTEL_LLM_SHUTDOWN_TIMEOUT, when the server says goodbye, when the
socket closes (the server died) or on SIGTERM; Ctrl-C reaches the whole process group and is
left to the server, which then says goodbye.

    python -m otel_llm.vllm.export.process FD
"""

from __future__ import annotations

import logging
import marshal
import signal
import socket
import sys
import time

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from otel_llm import config, semconv, usage
from otel_llm.sdk import internals, shutdown
from otel_llm.vllm.export import deferred
from otel_llm.vllm.export.wire import (
    BATCH,
    BYE,
    CONFIG,
    FIRST,
    HTTP_HISTOGRAMS,
    LAST,
    PROGRESS,
    REPORT,
    REQUEST,
    WHOLE,
    Part,
    ReplayRecord,
    SpanRecord,
)
from otel_llm.vllm.request_facts import END_NS, build, facts_from_plain
from otel_llm.vllm.request_metrics import Measurement, RequestMetrics
from otel_llm.warn import failed

_log = logging.getLogger("otel_llm.vllm.export")


class _Stop(Exception):
    pass


def _stop(signum, frame):
    raise _Stop()


# The socket is read every POLL_S, never waited on: a server's send that wakes a waiting reader
# costs it several times the send itself (measured: 27 us against 4 us on the 2-core VM).
POLL_S = 0.02


def messages(sock: socket.socket, frame: int):
    """Messages as the server sent them; a message whose frames stopped short (the buffer filled
    mid-message) is skipped."""
    parts: list[bytes] = []
    sock.setblocking(False)
    while True:
        try:
            data = sock.recv(frame + 1)
        except BlockingIOError:
            time.sleep(POLL_S)
            continue
        if not data:
            return
        flags = data[0]
        if flags & FIRST:
            parts = []
        parts.append(data[1:])
        if flags & LAST:
            yield marshal.loads(b"".join(parts))
            parts = []


class Exporter:
    """The SDK providers of this process, and how one request's message becomes their input."""

    def __init__(self, settings: dict, environ=None):
        self.resource = Resource(settings["resource"], settings.get("schema_url"))
        self.scope = InstrumentationScope(semconv.VLLM_SCOPE, settings["version"])
        self._scopes: dict[tuple, InstrumentationScope] = {}  # other instrumentations' (FastAPI's)
        self._http: dict[tuple, object] = {}  # meter scope -> the ASGI middleware whose HTTP instruments record
        span_exporters, metric_exporters, log_exporters = internals.exporters_from_environment(
            traces=settings["traces"], metrics=settings["metrics"], logs=settings["usage_events"]
        )

        self.tracer_provider = TracerProvider(resource=self.resource)
        for exporter in span_exporters.values():
            self.tracer_provider.add_span_processor(shutdown.span_processor_factory(exporter()))
        self._processors = [*internals.span_processors(self.tracer_provider)]
        self._limits = SpanLimits()
        # the API server's sampler and id generator, from the same environment (a request's phase spans)
        self.deferred_tracer = deferred.DeferredTracer(self.tracer_provider)
        self.settings = config.Settings.from_env()

        self.meter_provider = self.metrics = None
        if settings["metrics"]:
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader

            readers = [
                cls() if issubclass(cls, MetricReader) else PeriodicExportingMetricReader(cls())
                for cls in metric_exporters.values()
            ]
            self.meter_provider = MeterProvider(resource=self.resource, metric_readers=readers)
            self.metrics = RequestMetrics(self.meter_provider.get_meter(semconv.VLLM_SCOPE, settings["version"]))

        self.logger_provider = self.usage_logger = None
        if log_exporters:
            self.logger_provider = internals.sdk_logger_provider(self.resource)
            for exporter in log_exporters.values():
                self.logger_provider.add_log_record_processor(shutdown.log_record_processor_factory(exporter()))
            self.usage_logger = self.logger_provider.get_logger(semconv.USAGE_EVENT, settings["version"])

    def handle(self, parts) -> None:
        """One message: one request's parts (an HTTP server span, the GenAI requests in it)."""
        for part in parts:
            self.handle_part(Part(*part))

    def handle_part(self, part: Part) -> None:
        spans, measurement, usage_event, exemplar, http_metrics, http_replay = (
            part.spans,
            part.measurement,
            part.usage_event,
            part.exemplar,
            part.http_metrics,
            part.http_replay,
        )
        scope = self.scope if part.scope is None else self._scope(part.scope)
        if part.request is not None:
            built, built_measurement = self.build_request(part.request)
            spans = [*spans, *built]
            measurement = measurement if built_measurement is None else built_measurement
        if http_replay is not None:
            spans = self.replay_http(spans, http_replay)
        for span in spans:
            readable = self.readable_span(span, scope)
            for processor in self._processors:
                processor.on_end(readable)
        if exemplar is not None and (measurement is not None or usage_event is not None or http_metrics is not None):
            trace_id, span_id, flags = exemplar
            context = trace.set_span_in_context(
                NonRecordingSpan(SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(flags)))
            )
        else:
            context = None
        if measurement is not None and self.metrics is not None:
            self.metrics.record(Measurement(*measurement), context=context)
        if http_metrics is not None and self.meter_provider is not None:
            meter_scope, records = http_metrics
            instruments = self._http_replay(tuple(meter_scope)).middleware
            for name, value, attributes in records:
                if name in HTTP_HISTOGRAMS:
                    instrument = getattr(instruments, name)
                    if instrument is not None:
                        instrument.record(value, attributes, context=context)
        if usage_event is not None and self.usage_logger is not None:
            fields, end_ns = usage_event
            usage.emit_event(self.usage_logger, fields, end_ns, context)

    def build_request(self, request: tuple) -> tuple[list, tuple | None]:
        """A GenAI request's span an API server handed over unended, and its facts: its end, phase spans
        and measurement built as the API server would have built them (request_facts.py)."""
        span = deferred.resume(request, self.deferred_tracer)
        try:
            build(facts_from_plain(request[2]), span, None, deferred.OutboxSink, self.settings)
        except Exception:  # noqa: BLE001 - the request's other spans (its HTTP span) still go
            failed("building a request's span in the export process", "it goes with its start attributes only")
            if not span._ended:
                span.end(request[2][END_NS])
        return span.outbox.spans, span.outbox.measurement

    def count_progress(self, increments) -> None:
        """A live sweep's token counter increments (otel_llm/vllm/live.py)."""
        if self.metrics is not None:
            for key, tokens in increments:
                self.metrics.add_tokens(tuple(key), tuple(tokens))

    def replay_http(self, spans: list, record: tuple) -> list:
        """An HTTP request on the replayed path (otel_llm/vllm/export/http.py `HttpReplay`): its metrics
        recorded, its server span (where sampled) made and completed, after the request's other spans."""
        from otel_llm.vllm.export.http import merge_replayed, server_span

        try:
            record = ReplayRecord(*record)
            span = server_span(record)
        except Exception:  # noqa: BLE001
            failed("reading an HTTP request's replay record", "its HTTP span and metrics are lost")
            return spans
        try:
            captured = self._http_replay(tuple(record.meter_scope)).run(record)
        except Exception:  # noqa: BLE001
            failed("replaying an HTTP request's middleware", "its span goes without its HTTP attributes and metrics")
            return [*spans, span] if record.sampled else spans
        return [*spans, merge_replayed(span, captured, record.start)] if record.sampled else spans

    def _http_replay(self, meter_scope: tuple):
        """The ASGI instrumentation's middleware for the HTTP requests of one meter scope (the API
        server's middleware's: the same instruments, names, units, buckets and semantic-convention
        mode of this same environment)."""
        found = self._http.get(meter_scope)
        if found is None:
            from opentelemetry.metrics import NoOpMeter

            from otel_llm.vllm.export.http import HttpReplay

            name, version, schema_url = meter_scope
            meter = (
                self.meter_provider.get_meter(name, version, schema_url=schema_url)
                if self.meter_provider is not None
                else NoOpMeter(name, version, schema_url)
            )
            found = self._http[meter_scope] = HttpReplay(meter)
        return found

    def _scope(self, scope: tuple) -> InstrumentationScope:
        found = self._scopes.get(scope[:3])
        if found is None:
            name, version, schema_url, attributes = scope
            found = self._scopes[scope[:3]] = InstrumentationScope(name, version, schema_url, attributes)
        return found

    def readable_span(self, span: SpanRecord, scope: InstrumentationScope | None = None) -> ReadableSpan:
        (
            name,
            trace_id,
            span_id,
            flags,
            state,
            parent_id,
            parent_remote,
            parent_flags,
            kind,
            start,
            end,
            attributes,
            status,
            links,
            events,
        ) = span
        context = deferred.span_context(trace_id, span_id, flags, state, False)
        parent = (
            SpanContext(
                trace_id,
                parent_id,
                is_remote=parent_remote,
                trace_flags=TraceFlags(parent_flags),
                trace_state=context.trace_state,
            )
            if parent_id
            else None
        )
        limits = self._limits
        link_objects = [
            Link(
                deferred.span_context(*link[:5]),
                BoundedAttributes(limits.max_link_attributes, link[5], max_value_len=limits.max_attribute_length),
            )
            for link in links
        ]
        event_objects = [
            Event(
                e_name,
                BoundedAttributes(
                    limits.max_event_attributes, e_attrs, immutable=True, max_value_len=limits.max_attribute_length
                ),
                e_time,
            )
            for e_name, e_attrs, e_time in events
        ]
        return ReadableSpan(
            name=name,
            context=context,
            parent=parent,
            resource=self.resource,
            attributes=BoundedAttributes(
                limits.max_span_attributes, attributes, immutable=False, max_value_len=limits.max_span_attribute_length
            ),
            links=BoundedList.from_seq(limits.max_links, link_objects),
            kind=SpanKind(kind),
            events=BoundedList.from_seq(limits.max_events, event_objects),
            status=Status(StatusCode(status[0]), status[1]) if status is not None else Status(StatusCode.UNSET),
            start_time=start,
            end_time=end,
            instrumentation_scope=scope or self.scope,
        )

    def shutdown(self, timeout_s: float | None = None, warn: bool = True) -> dict:
        """Flush within `timeout_s` (default OTEL_LLM_SHUTDOWN_TIMEOUT); what was not exported."""
        if timeout_s is None:
            timeout_s = config.shutdown_timeout() or 30.0
        return shutdown.BoundedShutdown(timeout_s, self.tracer_provider, self.meter_provider, self.logger_provider).run(
            warn=warn
        )


def take(exporter: Exporter, kind: str, payload) -> None:
    if kind == REQUEST:
        try:
            exporter.handle(payload)
        except Exception:  # noqa: BLE001 - one bad message must not stop the others
            _log.warning("otel-llm: could not export one request's telemetry", exc_info=True)
    elif kind == PROGRESS:
        try:
            exporter.count_progress(payload)
        except Exception:  # noqa: BLE001
            _log.warning("otel-llm: could not count the tokens of requests in flight", exc_info=True)


def main(argv: list[str]) -> int:
    from otel_llm import ensure_log_handler

    ensure_log_handler()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop)
    sock = socket.socket(fileno=int(argv[1]))
    exporter = None
    goodbye = None  # the seconds the server gives the flush, when it said goodbye
    try:
        stream = messages(sock, 64 << 10)
        kind, settings = next(stream)
        assert kind == CONFIG, kind
        exporter = Exporter(settings)
        for kind, payload in messages(sock, settings["frame"]):
            if kind == BYE:
                goodbye = payload
                break
            if kind == BATCH:
                for message in payload:
                    take(exporter, *message)
            else:
                take(exporter, kind, payload)
    except (_Stop, StopIteration):
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if exporter is not None and goodbye is not None:  # the server warns, once, for both processes
            report = exporter.shutdown(goodbye, warn=False)
            try:
                sock.send(bytes((WHOLE,)) + marshal.dumps((REPORT, report)))
            except OSError:
                pass
        elif exporter is not None:  # the server is gone (or SIGTERM): warn here
            exporter.shutdown()
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
