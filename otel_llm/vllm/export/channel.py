"""Telemetry off the API server's hot path: the API-server side.

With `opentelemetry-instrument` (our configurator, exporters named in OTEL_*_EXPORTER), a
request's GenAI span and its phase spans are not SDK spans in the API server. A request keeps
what it will export in plain Python values: a `DeferredSpan` per span (ids from the user's
sampler and id generator, at the moment the SDK would have made them), the request's metric
`Measurement` and its usage event. When the request ends they go, as one `marshal`led message
through a non-blocking Unix socket, to a child process (otel_llm/vllm/export/process.py) that
builds the SDK's `ReadableSpan`s, records the metrics and sends everything with the exporters
the user configured, with the API server's resource. The API server pays for the values and
one `send`; the SDK's span objects, attribute validation, metric aggregation and OTLP encoding
run in the other process.

The socket buffer is the bounded queue: when it is full (the export process is stalled) or the
export process is gone, the request's telemetry is dropped and counted in
`otel_llm.export.dropped` (`error.type`: queue_full, exporter_down); a request never waits. A
dead export process is restarted, with a backoff, by the next request that finds it gone. A
forked child (vLLM's engine core) drops its inherited socket and would start its own; a
spawned API server (`--api-server-count N`) is instrumented on its own and has its own.
"""

from __future__ import annotations

import fcntl
import logging
import marshal
import os
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
import weakref
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import Span as _SDKSpan
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from otel_llm import redaction, semconv
from otel_llm.warn import WarnOnce, entry, failed, inline_entry

_log = logging.getLogger("otel_llm.vllm")

# message kinds (the first element of each message); REPORT goes back: what the flush lost; PROGRESS: a
# live sweep's token counter increments (otel_llm/vllm/live.py)
CONFIG, REQUEST, BYE, REPORT, PROGRESS = "config", "request", "bye", "report", "progress"
# frame header: one byte; a message larger than one frame goes as first .. last
FIRST, LAST = 1, 2
WHOLE = FIRST | LAST
SOCKET_BUFFER = 4 << 20  # asked for; the kernel caps it (net.core.wmem_max)
RESTART_BACKOFF_S = (1.0, 30.0)
_INTERNAL = SpanKind.INTERNAL.value
# the ASGI instrumentation's HTTP server histograms (attributes of its OpenTelemetryMiddleware) whose values
# the API server hands over (otel_llm/vllm/http.py); the export process records them
HTTP_HISTOGRAMS = (
    "duration_histogram_old",
    "duration_histogram_new",
    "server_response_size_histogram",
    "server_response_body_size_histogram",
    "server_request_size_histogram",
    "server_request_body_size_histogram",
)
_AUTO_INSTRUMENTATION_DIR = os.path.join("opentelemetry", "instrumentation", "auto_instrumentation")


class Outbox:
    """What one request exports: finished spans, its metric Measurement, its usage event; and what
    the requests nested in it handed over to go with it (`adopted`: the GenAI telemetry of the
    requests under an HTTP server span), so that one message carries one HTTP request.
    `http_metrics`: the HTTP server metrics' values of an HTTP request ((meter scope, [(instrument,
    value, attributes)]), otel_llm/vllm/http.py), recorded by the export process; `http_replay`: what
    the export process needs to make an HTTP request's span attributes and metrics with the
    maintained middleware (http.py `LeanMiddleware._replay_record`); `held`: not handed over when its
    span ends (an HTTP server span, until its metrics are in: http.py `release`)."""

    __slots__ = (
        "spans",
        "measurement",
        "usage_event",
        "exemplar",
        "scope",
        "adopted",
        "http_metrics",
        "http_replay",
        "held",
    )

    def __init__(self, scope: tuple | None = None):
        self.spans: list[tuple] = []
        self.measurement: tuple | None = None
        self.usage_event: tuple | None = None
        self.exemplar: tuple | None = None  # (trace_id, span_id, flags) of the request's span
        self.scope = scope  # (name, version, schema_url, attributes) of another instrumentation; None: ours
        self.adopted: list[tuple] = []
        self.http_metrics: tuple | None = None
        self.http_replay: tuple | None = None
        self.held = False

    def empty(self) -> bool:
        return (
            not self.spans
            and self.measurement is None
            and self.usage_event is None
            and not self.adopted
            and self.http_metrics is None
            and self.http_replay is None
        )

    def parts(self) -> list[tuple]:
        return [
            (
                self.spans,
                self.measurement,
                self.usage_event,
                self.exemplar,
                self.scope,
                self.http_metrics,
                self.http_replay,
            ),
            *self.adopted,
        ]

    def message(self) -> tuple:
        return REQUEST, self.parts()


class DeferredSpan(trace.Span):
    """A span whose ids and sampling decision are made now and whose SDK object is built in the
    export process. Attribute order and overwrite rules follow the SDK's (BoundedAttributes)."""

    __slots__ = (
        "_name",
        "_context",
        "_parent",
        "_kind",
        "_attributes",
        "_links",
        "_start",
        "_status",
        "_sampled",
        "outbox",
        "_ended",
        "_tracer",
        "_events",
        "holder",
        "holds",
    )

    def __init__(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes,
        links,
        start_ns: int,
        sampled: bool,
        outbox: Outbox,
        tracer: DeferredTracer,
        holder: DeferredSpan | None = None,
    ):
        self._name = name
        self._context = context
        self._parent = parent
        self._kind = kind
        self._attributes: dict[str, Any] = dict(attributes) if attributes else {}
        self._links = links or ()
        self._start = start_ns
        self._status: tuple | None = None
        self._sampled = sampled
        self.outbox = outbox
        self._ended = False
        self._tracer = tracer
        self._events: list[tuple] = []
        # the open span (of another instrumentation: the HTTP server span) this one's telemetry goes with
        self.holder = holder
        self.holds = True  # False: nothing goes with this span (a websocket's: hold_nothing)

    def add_child(self, name: str, start_ns: int, end_ns: int, attributes=None) -> None:
        """A finished child span (a phase span) exported with this request: what
        start_child(...).end(end_ns) exports, made without a span object where the sampler's answer
        for a sampled local parent is known (the SDK's ParentBased with its default ALWAYS_ON
        there): sampled, the attributes as given, the parent's trace state."""
        tracer = self._tracer
        if not (tracer.children_follow_parent and self._sampled):
            self.start_child(name, start_ns, attributes).end(end_ns)
            return
        ctx = self._context
        self.outbox.spans.append(
            (
                name,
                ctx.trace_id,
                tracer.id_generator.generate_span_id(),
                TraceFlags.SAMPLED | (ctx.trace_flags & TraceFlags.RANDOM_TRACE_ID),
                self._trace_state_header(),
                ctx.span_id,
                False,
                int(ctx.trace_flags),
                _INTERNAL,
                start_ns,
                end_ns,
                dict(attributes) if attributes else {},
                None,
                [],
                [],
            )
        )

    def _trace_state_header(self) -> str:
        state = self._context.trace_state
        return state.to_header() if state else ""

    def start_child(self, name: str, start_time: int, attributes=None) -> DeferredSpan:
        """A child span exported with this span's request (a phase span). Any other span started
        under this one (another request's, nested in it) has its own Outbox."""
        return self._tracer.start_span(
            name,
            trace.set_span_in_context(self),
            SpanKind.INTERNAL,
            attributes,
            start_time=start_time,
            _outbox=self.outbox,
        )

    # Called by other instrumentations (the FastAPI middleware, dozens of times per request) and by
    # ours: each guards itself (otel_llm/warn.py `inline_entry`: no wrapper call on this hot path) and
    # answers, on a failure of ours, what a span that records nothing answers.
    @inline_entry("DeferredSpan.get_span_context")
    def get_span_context(self) -> SpanContext:
        try:
            return self._context
        except Exception:  # noqa: BLE001
            failed("DeferredSpan.get_span_context")
            return trace.INVALID_SPAN_CONTEXT

    # read by other instrumentations' hooks, as on the SDK's span (our query redaction reads attributes)
    @property
    @inline_entry("DeferredSpan.name")
    def name(self) -> str:
        try:
            return self._name
        except Exception:  # noqa: BLE001
            failed("DeferredSpan.name")
            return ""

    @property
    @inline_entry("DeferredSpan.kind")
    def kind(self) -> SpanKind:
        try:
            return self._kind
        except Exception:  # noqa: BLE001
            failed("DeferredSpan.kind")
            return SpanKind.INTERNAL

    @property
    @inline_entry("DeferredSpan.attributes")
    def attributes(self):
        try:
            return MappingProxyType(self._attributes)
        except Exception:  # noqa: BLE001
            failed("DeferredSpan.attributes")
            return MappingProxyType({})

    @inline_entry("DeferredSpan.is_recording")
    def is_recording(self) -> bool:
        try:
            return self._sampled and not self._ended
        except Exception:  # noqa: BLE001
            failed("DeferredSpan.is_recording")
            return False

    @inline_entry("DeferredSpan.set_attribute")
    def set_attribute(self, key: str, value) -> None:
        try:
            if self._ended:
                return
            attrs = self._attributes
            if key in attrs:
                del attrs[key]  # the SDK moves an overwritten attribute to the end
            attrs[key] = value
        except Exception:  # noqa: BLE001
            failed("DeferredSpan.set_attribute")

    @inline_entry("DeferredSpan.set_attributes")
    def set_attributes(self, attributes) -> None:
        try:
            if self._ended:
                return
            if self._attributes.keys().isdisjoint(attributes):
                self._attributes.update(attributes)
                return
            for key, value in attributes.items():
                self.set_attribute(key, value)
        except Exception:  # noqa: BLE001
            failed("DeferredSpan.set_attributes")

    @inline_entry("DeferredSpan.set_status")
    def set_status(self, status, description: str | None = None) -> None:
        try:
            # the SDK's rules: OK is final, UNSET is ignored, a Status object's description wins
            if self._ended or (self._status is not None and self._status[0] == StatusCode.OK.value):
                return
            if isinstance(status, Status):
                code, description = status.status_code, status.description
            else:
                code = status
                description = description if code is StatusCode.ERROR else None
            if code is StatusCode.UNSET:
                return
            self._status = (code.value, description)
        except Exception:  # noqa: BLE001
            failed("DeferredSpan.set_status")

    @inline_entry("DeferredSpan.update_name")
    def update_name(self, name: str) -> None:
        try:
            if not self._ended:
                self._name = name
        except Exception:  # noqa: BLE001
            failed("DeferredSpan.update_name")

    @inline_entry("DeferredSpan.add_event")
    def add_event(self, name, attributes=None, timestamp=None) -> None:
        try:
            if not self._ended:
                self._events.append(
                    (
                        name,
                        dict(attributes) if attributes else {},
                        timestamp if timestamp is not None else time.time_ns(),
                    )
                )
        except Exception:  # noqa: BLE001
            failed("DeferredSpan.add_event")

    @inline_entry("DeferredSpan.record_exception")
    def record_exception(self, exception, attributes=None, timestamp=None, escaped=False) -> None:
        try:
            if not self._ended:  # the SDK's own event (type, message, stacktrace, escaped), its text redacted
                attributes = {**(attributes or {}), **redaction.exception_attributes(exception)}
                _SDKSpan.record_exception(self, exception, attributes, timestamp, escaped)
        except Exception:  # noqa: BLE001
            failed("DeferredSpan.record_exception")

    @inline_entry("DeferredSpan.end")
    def end(self, end_time: int | None = None) -> None:
        try:
            if self._ended:
                return
            self._ended = True
            if self._sampled:
                ctx, parent = self._context, self._parent
                self.outbox.spans.append(
                    (
                        self._name,
                        ctx.trace_id,
                        ctx.span_id,
                        int(ctx.trace_flags),
                        self._trace_state_header(),
                        parent.span_id if parent is not None else 0,
                        parent is not None and parent.is_remote,
                        int(parent.trace_flags) if parent is not None else 0,
                        self._kind.value,
                        self._start,
                        end_time or time.time_ns(),
                        self._attributes,
                        self._status,
                        [_link(link) for link in self._links],
                        self._events,
                    )
                )
            if self._tracer.hand_over is not None:  # another instrumentation's span: nobody else sends it
                self._tracer.hand_over(self)
        except Exception:  # noqa: BLE001 - the span's telemetry (and what it holds) is lost, not the request
            failed("DeferredSpan.end")


def _link(link) -> tuple:
    ctx = link.context
    return (
        ctx.trace_id,
        ctx.span_id,
        int(ctx.trace_flags),
        ctx.trace_state.to_header(),
        ctx.is_remote,
        dict(link.attributes or {}),
    )


class DeferredTracer(trace.Tracer):
    """`start_span` as the SDK's Tracer does it (the user's sampler and id generator), making a
    DeferredSpan with an Outbox of its own (a request's phase spans: DeferredSpan.start_child).
    `scope` and `hand_over`: the tracer of another instrumentation (DeferredTracerProvider), whose
    spans hand themselves over when they end."""

    def __init__(self, provider, scope: tuple | None = None, hand_over=None):
        """provider: the SDK's TracerProvider, or another DeferredTracer (its sampler and id generator)."""
        self.scope = scope
        self.hand_over = hand_over
        self.sampler = provider.sampler
        self.id_generator = provider.id_generator
        # the SDK's ParentBased samples every child of a sampled local span (its default)
        self.children_follow_parent = (
            isinstance(self.sampler, ParentBased) and getattr(self.sampler, "_local_parent_sampled", None) is ALWAYS_ON
        )

    @inline_entry("DeferredTracer.start_span")
    def start_span(
        self,
        name: str,
        context=None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes=None,
        links=None,
        start_time: int | None = None,
        _outbox: Outbox | None = None,
        **_ignored,
    ) -> trace.Span:
        """A DeferredSpan; on a failure of ours a span that records nothing (the caller, the FastAPI
        middleware among them, goes on: the request is served without this span)."""
        try:
            links = links or ()
            parent_span = trace.get_current_span(context)
            parent = parent_span.get_span_context()
            if parent is None or not parent.is_valid:
                parent = None
                trace_id = self.id_generator.generate_trace_id()
                random_trace_id = self.id_generator.is_trace_id_random()
            else:
                trace_id = parent.trace_id
                random_trace_id = parent.trace_flags.random_trace_id
            result = self.sampler.should_sample(context, trace_id, name, kind, attributes, links)
            flags = TraceFlags.SAMPLED if result.decision.is_sampled() else TraceFlags.DEFAULT
            if random_trace_id:
                flags |= TraceFlags.RANDOM_TRACE_ID
            span_context = SpanContext(
                trace_id,
                self.id_generator.generate_span_id(),
                is_remote=False,
                trace_flags=TraceFlags(flags),
                trace_state=result.trace_state,
            )
            outbox = _outbox if _outbox is not None else Outbox(self.scope)
            # recording-but-unsampled spans are never exported by the SDK's batch processor: not kept
            sampled = result.decision.is_sampled()
            # an open, recording span of another instrumentation (the HTTP server span) takes this
            # one's telemetry along when it ends (an unsampled one may never be ended)
            holder = (
                parent_span
                if isinstance(parent_span, DeferredSpan)
                and parent_span._tracer.hand_over is not None
                and parent_span.is_recording()
                else None
            )
            span = DeferredSpan(
                name,
                span_context,
                parent,
                kind,
                result.attributes if sampled else None,
                links,
                start_time or time.time_ns(),
                sampled,
                outbox,
                self,
                holder,
            )
            if outbox.exemplar is None:
                outbox.exemplar = (trace_id, span_context.span_id, int(span_context.trace_flags))
            return span
        except Exception:  # noqa: BLE001
            failed("DeferredTracer.start_span")
            return trace.INVALID_SPAN

    @inline_entry("DeferredTracer.start_as_current_span")
    @contextmanager
    def start_as_current_span(
        self,
        name: str,
        context=None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes=None,
        links=None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ):
        try:  # (only our part: what the caller's block raises goes to the caller)
            span = self.start_span(name, context, kind, attributes, links, start_time)
        except Exception:  # noqa: BLE001
            failed("DeferredTracer.start_as_current_span")
            span = trace.INVALID_SPAN
        with trace.use_span(
            span,
            end_on_exit=end_on_exit,
            record_exception=record_exception,
            set_status_on_exception=set_status_on_exception,
        ) as current:
            yield current


class DeferredTracerProvider(trace.TracerProvider):
    """The tracer provider handed to another instrumentation (FastAPI's, for the HTTP server span):
    its spans are DeferredSpans with their own scope, exported by the export process."""

    def __init__(self, tracer: DeferredTracer, hand_over):
        self._tracer = tracer  # whose sampler and id generator (the user's) its tracers use
        self._hand_over = hand_over

    @entry("DeferredTracerProvider.get_tracer", fallback=trace.NoOpTracer())
    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes=None,
    ) -> trace.Tracer:
        scope = (
            instrumenting_module_name,
            instrumenting_library_version,
            schema_url,
            dict(attributes) if attributes else None,
        )
        return DeferredTracer(self._tracer, scope, self._hand_over)


def hold_nothing(span) -> None:
    """Telemetry of requests under `span` is sent on its own (a long-lived span: a websocket's)."""
    if isinstance(span, DeferredSpan):
        span.holds = False


@entry("hand_over")
def hand_over(span: DeferredSpan, channel: ExportChannel) -> None:
    """A finished span's telemetry: along with its holder when that is still open, else to the
    export process now."""
    outbox = span.outbox
    if outbox.held or outbox.empty():
        return
    holder = span.holder
    if holder is not None and holder.holds and not holder._ended:
        holder.outbox.adopted.extend(outbox.parts())
    else:
        channel.send(outbox.message())


def outbox_of(context) -> Outbox | None:
    span = trace.get_current_span(context)
    return span.outbox if isinstance(span, DeferredSpan) else None


class UsageEvents:
    """The usage ledger's event logger when events are exported by the export process: the event
    goes with its request's message."""

    def emit(
        self, timestamp=None, observed_timestamp=None, context=None, event_name=None, attributes=None, **_ignored
    ) -> None:
        outbox = outbox_of(context)
        if outbox is None:
            raise LookupError("a usage event without its request's span")
        outbox.usage_event = (attributes, timestamp)


def plan(settings, tracer_provider, explicit_providers: bool) -> dict[str, Any] | None:
    """What the export process takes over here, or None (the SDK exports in this process): only
    where our configurator set the SDK up from the environment alone, so that the export process
    can make the same exporters from the same environment."""
    from otel_llm.sdk import distro

    if not settings.export_process or explicit_providers or not distro.configured_from_environment():
        return None
    if type(tracer_provider).__module__ != "opentelemetry.sdk.trace" or not hasattr(tracer_provider, "sampler"):
        return None
    if getattr(tracer_provider, "_disabled", False):  # OTEL_SDK_DISABLED: the SDK's tracers make no spans
        return None
    from opentelemetry import _logs
    from opentelemetry.sdk._configuration import _get_exporter_names, _import_exporters
    from opentelemetry.sdk.metrics.export import MetricReader

    # a metric reader (Prometheus) serves from this process: such metrics stay here
    _, metric_exporters, _ = _import_exporters([], _get_exporter_names("metrics"), [])
    metrics = not any(issubclass(cls, MetricReader) for cls in metric_exporters.values())
    events = settings.usage_events and type(_logs.get_logger_provider()).__module__.startswith("opentelemetry.sdk")
    resource = tracer_provider.resource
    return {
        "traces": True,
        "metrics": metrics,
        "usage_events": events,
        "resource": dict(resource.attributes),
        "schema_url": resource.schema_url or None,
    }


class ExportChannel:
    """The socket to this process's export process, which it starts, supervises and restarts."""

    def __init__(self, config: dict[str, Any], on_drop, shutdown_timeout_s: float | None):
        self._config = config
        self._on_drop = on_drop
        self._shutdown_timeout_s = shutdown_timeout_s
        self._lock = threading.Lock()
        self._warn = WarnOnce(_log)
        self._sock: socket.socket | None = None
        self._process: subprocess.Popen | None = None
        self._owner = os.getpid()
        self._started_at = 0.0
        self._retry_at = 0.0
        self._backoff = RESTART_BACKOFF_S[0]
        self._frame = 64 << 10
        self.buffer_size = 0  # the socket's send buffer, as the kernel granted it
        self._closed = False
        self.sent = 0
        self.dropped = 0
        weak = weakref.WeakMethod(self._after_fork)  # a closed channel is not kept alive for forks
        os.register_at_fork(after_in_child=lambda: (method := weak()) and method())

    @entry("ExportChannel._after_fork")
    def _after_fork(self) -> None:
        # the parent's socket and process are the parent's; this process starts its own if it sends
        self._lock = threading.Lock()
        if self._sock is not None:
            try:
                self._sock.detach()  # not close(): shutdown semantics are the parent's
            except OSError:
                pass
        self._sock, self._process, self._owner = None, None, os.getpid()
        self._retry_at = 0.0

    @property
    def process(self) -> subprocess.Popen | None:
        return self._process

    def backlog(self) -> int:
        """Bytes sent to the export process that it has not read yet (0 without one)."""
        sock = self._sock
        if sock is None:
            return 0
        try:
            return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        except OSError:
            return 0

    def start(self) -> bool:
        """Start the export process now (else the first request does). Never raises."""
        with self._lock:
            try:
                return self._ensure_started()
            except Exception as exc:  # noqa: BLE001 - requests retry after the backoff
                return self._start_failed(exc)

    def _start_failed(self, exc) -> bool:
        self._warn(
            "start",
            "otel-llm: cannot start the telemetry export process (%s); request telemetry is dropped and counted in %s",
            exc,
            semconv.EXPORT_DROPPED,
        )
        self._retry_at = time.monotonic() + RESTART_BACKOFF_S[1]
        return False

    @entry("ExportChannel.send", fallback=False)
    def send(self, message: tuple) -> bool:
        """Hand one message over, never blocking. False when it was dropped (and counted), or when it
        failed (counted in otel_llm.instrumentation.failures)."""
        try:
            data = marshal.dumps(message)
        except ValueError:  # a value marshal does not take: the attributes, made plain
            data = marshal.dumps(_plain(message))
        with self._lock:
            try:
                started = self._sock is not None or self._ensure_started()
            except OSError as exc:
                self._lost(exc)
                started = False
            if not started:
                return self._drop(semconv.EXPORT_DROP_EXPORTER_DOWN)
            try:
                self._send_frames(data)
            except BlockingIOError:
                return self._drop(semconv.EXPORT_DROP_QUEUE_FULL)
            except OSError as exc:  # EPIPE, ECONNRESET: the export process is gone
                self._lost(exc)
                return self._drop(semconv.EXPORT_DROP_EXPORTER_DOWN)
            self.sent += 1
            return True

    def send_progress(self, increments: list[tuple]) -> bool:
        """One live sweep's token counter increments: [(metric key, (input, cached input, output))]."""
        return self.send((PROGRESS, increments))

    def _send_frames(self, data: bytes) -> None:
        frame, sock = self._frame, self._sock
        if len(data) < frame:
            sock.send(bytes((WHOLE,)) + data)
            return
        parts = range(0, len(data), frame - 1)
        for i in parts:
            flags = (FIRST if i == 0 else 0) | (LAST if i + frame - 1 >= len(data) else 0)
            sock.send(bytes((flags,)) + data[i : i + frame - 1])

    def _drop(self, reason: str) -> bool:
        self.dropped += 1
        if reason == semconv.EXPORT_DROP_QUEUE_FULL:
            self._warn(
                "full",
                "otel-llm: the export process does not keep up; request telemetry is dropped (counted in %s)",
                semconv.EXPORT_DROPPED,
            )
        try:
            self._on_drop(reason)
        except Exception:  # noqa: BLE001
            pass
        return False

    def _lost(self, exc) -> None:
        code = self._process.poll() if self._process is not None else None
        self._warn(
            "lost",
            "otel-llm: the telemetry export process is gone (%s, exit code %s); it is restarted, "
            "telemetry in between is dropped and counted in %s",
            exc,
            code,
            semconv.EXPORT_DROPPED,
        )
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        if time.monotonic() - self._started_at > 60:  # it lived a minute: back to the shortest wait
            self._backoff = RESTART_BACKOFF_S[0]
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, RESTART_BACKOFF_S[1])

    def _ensure_started(self) -> bool:
        if self._owner != os.getpid():
            self._after_fork()
        if self._sock is not None:
            return True
        if self._closed or time.monotonic() < self._retry_at:
            return False
        if self._process is not None:
            self._process.poll()  # reap the old one
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            for sock, option in ((parent, socket.SO_SNDBUF), (child, socket.SO_RCVBUF)):
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
            # the largest message one send takes whole, with room for the kernel's own bookkeeping
            self.buffer_size = parent.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            self._frame = max(4096, self.buffer_size // 2 - 1024)
            self._process = subprocess.Popen(
                [sys.executable, "-m", "otel_llm.vllm.export.process", str(child.fileno())],
                pass_fds=(child.fileno(),),
                env=child_environment(os.environ),
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )
        except OSError as exc:
            parent.close()
            return self._start_failed(exc)
        finally:
            child.close()
        try:
            parent.sendall(bytes((WHOLE,)) + marshal.dumps((CONFIG, {**self._config, "frame": self._frame})))
        except OSError:
            parent.close()
            self._started_at = time.monotonic()
            raise
        parent.setblocking(False)
        self._sock, self._started_at = parent, time.monotonic()
        return True

    def close(self, timeout_s: float | None = None) -> dict | None:
        """Tell the export process to flush within `timeout_s` and exit; wait for it. Returns what
        its flush could not export (shutdown.BoundedShutdown's report), or None. Once."""
        with self._lock:
            if self._closed or self._owner != os.getpid():
                return None
            self._closed = True
            sock, process, self._sock = self._sock, self._process, None
        if sock is None or process is None:
            return None
        timeout = timeout_s if timeout_s is not None else (self._shutdown_timeout_s or 30.0)
        deadline = time.monotonic() + timeout
        report = {"complete": False}
        try:
            sock.settimeout(max(0.05, timeout))
            # the export process flushes a little within the bound: time to hear its report
            sock.send(bytes((WHOLE,)) + marshal.dumps((BYE, max(0.0, timeout - min(0.5, 0.1 * timeout)))))
            data = sock.recv(self._frame + 1)
            if data:
                kind, report = marshal.loads(data[1:])
        except (OSError, ValueError, EOFError, TypeError):
            pass
        finally:
            sock.close()
        try:
            process.wait(max(0.05, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass  # it ends on its own within its bound
        return report


def child_environment(environ) -> dict[str, str]:
    """The export process's environment: the server's (its OTEL_* settings), without
    opentelemetry-instrument's sitecustomize, so the export process is not instrumented itself."""
    env = dict(environ)
    path = [
        p
        for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and not p.rstrip(os.sep).endswith(_AUTO_INSTRUMENTATION_DIR)
    ]
    if path:
        env["PYTHONPATH"] = os.pathsep.join(path)
    else:
        env.pop("PYTHONPATH", None)
    return env


def _plain(message: tuple) -> tuple:
    """A request message with its attributes cleaned as the SDK cleans them (a value of a type the
    SDK does not take is dropped) and every value of a subclass (a str or int enum) made its base
    type, which marshal takes."""
    from opentelemetry.attributes import BoundedAttributes

    def clean(attributes) -> dict:
        return dict(BoundedAttributes(attributes=attributes))

    kind, parts = message
    if kind != REQUEST:  # (a live sweep's increments: label values and counts)
        return _base_types(message)
    plain = []
    for spans, measurement, usage_event, exemplar, scope, http_metrics, http_replay in parts:
        spans = [
            (
                *s[:11],
                clean(s[11]),
                s[12],
                [(*link[:5], clean(link[5])) for link in s[13]],
                [(name, clean(attrs), ts) for name, attrs, ts in s[14]],
            )
            for s in spans
        ]
        if usage_event is not None:
            usage_event = (clean(usage_event[0]), *usage_event[1:])
        if scope is not None and scope[3]:
            scope = (*scope[:3], clean(scope[3]))
        if http_metrics is not None:
            meter_scope, records = http_metrics
            http_metrics = (meter_scope, [(name, value, clean(attributes)) for name, value, attributes in records])
        plain.append((spans, measurement, usage_event, exemplar, scope, http_metrics, http_replay))
    return _base_types((kind, plain))


def _base_types(value):
    if value is None or type(value) in (str, int, float, bool, bytes):
        return value
    if isinstance(value, dict):
        return {_base_types(k): _base_types(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_base_types(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    for base in (bool, str, int, float, bytes):
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    return repr(value)
