"""Spans of the API server with the export process (otel_llm/vllm/export/channel.py): a `DeferredSpan`
keeps in plain values what the SDK's span would (ids from the user's sampler and id generator, made at
the moment the SDK would have made them); its request's `Outbox` (otel_llm/vllm/export/wire.py) goes to
the export process when the request ends, which builds the SDK's spans from them."""

from __future__ import annotations

import time
from contextlib import contextmanager
from functools import partial
from random import getrandbits
from types import MappingProxyType
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import DEFAULT_TRACE_STATE, SpanContext, SpanKind, TraceFlags, TraceState
from opentelemetry.trace.status import Status, StatusCode

from otel_llm import redaction
from otel_llm.sdk import current, internals
from otel_llm.vllm.export.wire import Outbox, SpanRecord
from otel_llm.vllm.request_facts import RequestFacts, plain_facts, start_attributes
from otel_llm.warn import entry, failed, inline_entry

_INTERNAL = SpanKind.INTERNAL.value
_new_span_context = partial(tuple.__new__, SpanContext)
_new_span_record = partial(tuple.__new__, SpanRecord)
_TRACE_ID_MAX, _SPAN_ID_MAX = 2**128 - 1, 2**64 - 1
_SAMPLED, _RANDOM_TRACE_ID = int(TraceFlags.SAMPLED), int(TraceFlags.RANDOM_TRACE_ID)
_EMPTY = Context()  # (a parent context with nothing in it: a new trace)


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
        self.holds = True  # False: nothing goes with this span (a websocket's: http.py hold_nothing_hook)

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
            SpanRecord(
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
                internals.sdk_record_exception(self, exception, attributes, timestamp, escaped)
        except Exception:  # noqa: BLE001
            failed("DeferredSpan.record_exception")

    @inline_entry("DeferredSpan.end")
    def end(self, end_time: int | None = None) -> None:
        try:
            if self._ended:
                return
            self._ended = True
            if self._sampled:
                self.outbox.spans.append(self.record(end_time or time.time_ns()))
            if self._tracer.hand_over is not None:  # another instrumentation's span: nobody else sends it
                self._tracer.hand_over(self)
        except Exception:  # noqa: BLE001 - the span's telemetry (and what it holds) is lost, not the request
            failed("DeferredSpan.end")

    def context_fields(self) -> tuple:
        """SpanRecord's fields from trace_id to parent_trace_flags (ReplayRecord has them in the same order)."""
        trace_id, span_id, _, flags, state, _ = self._context  # (internals.SPAN_CONTEXT_FIELDS)
        header = "" if state is DEFAULT_TRACE_STATE or not state else state.to_header()
        parent = self._parent
        if parent is None:
            return trace_id, span_id, int(flags), header, 0, False, 0
        _, parent_id, parent_remote, parent_flags, _, _ = parent
        return trace_id, span_id, int(flags), header, parent_id, parent_remote, int(parent_flags)

    def record(self, end_ns: int) -> SpanRecord:
        """The span as it is now, ending at end_ns."""
        return _new_span_record(self.record_values(end_ns))

    def record_values(self, end_ns: int) -> tuple:
        """`record`'s values as a plain tuple (marshal's)."""
        return (
            self._name,
            *self.context_fields(),
            self._kind.value,
            self._start,
            end_ns,
            self._attributes,
            self._status,
            list(map(_link, self._links)),
            self._events,
        )

    def hand_over_unended(self, facts: RequestFacts, channel) -> None:
        """A request's span, not ended here: it goes to the export process as it is, with the facts
        its end is built from there (request_facts.py, `resume`)."""
        self._ended = True
        self.outbox.request = (self.record_values(0), self._sampled, plain_facts(facts), None)
        hand_over(self, channel)


class RequestSpan(DeferredSpan):
    """A request's GenAI span made by DeferredTracer.start_span with `_start_values`: its start attributes kept as
    RequestInfo.start_values, made into attributes only when something in this process reads or sets
    the span's attributes, or ends it here. Handed over unended, the values go, and the export process
    makes them (`resume`)."""

    __slots__ = ("start_values",)

    def _start_attributes(self) -> None:
        values = self.start_values
        if values is not None:  # (nothing was set before them: every setter comes here first)
            self.start_values = None
            self._attributes = start_attributes(values)

    @property
    @inline_entry("RequestSpan.attributes")
    def attributes(self):
        try:
            self._start_attributes()
            return MappingProxyType(self._attributes)
        except Exception:  # noqa: BLE001
            failed("RequestSpan.attributes")
            return MappingProxyType({})

    @inline_entry("RequestSpan.set_attribute")
    def set_attribute(self, key: str, value) -> None:
        try:
            self._start_attributes()
            DeferredSpan.set_attribute(self, key, value)
        except Exception:  # noqa: BLE001
            failed("RequestSpan.set_attribute")

    @inline_entry("RequestSpan.set_attributes")
    def set_attributes(self, attributes) -> None:
        try:
            self._start_attributes()
            DeferredSpan.set_attributes(self, attributes)
        except Exception:  # noqa: BLE001
            failed("RequestSpan.set_attributes")

    def record(self, end_ns: int) -> SpanRecord:
        self._start_attributes()
        return DeferredSpan.record(self, end_ns)

    def hand_over_unended(self, facts: RequestFacts, channel) -> None:
        self._ended = True
        self.outbox.request = (
            DeferredSpan.record_values(self, 0),
            self._sampled,
            plain_facts(facts),
            self.start_values,
        )
        hand_over(self, channel)


def resume(request: tuple, tracer: DeferredTracer) -> DeferredSpan:
    """In the export process: a span an API server handed over unended (`hand_over_unended`), to be
    ended there, in an Outbox of its own."""
    record, sampled, _, start = SpanRecord(*request[0]), *request[1:]
    trace_id = record.trace_id
    context = span_context(trace_id, record.span_id, record.trace_flags, record.trace_state, False)
    parent = (
        SpanContext(trace_id, record.parent_span_id, record.parent_is_remote, TraceFlags(record.parent_trace_flags))
        if record.parent_span_id
        else None
    )
    links = [trace.Link(span_context(*link[:5]), link[5]) for link in record.links]
    span = DeferredSpan(
        record.name,
        context,
        parent,
        SpanKind(record.kind),
        record.attributes if start is None else start_attributes(start),
        links,
        record.start_ns,
        sampled,
        Outbox(),
        tracer,
    )
    span._status = tuple(record.status) if record.status is not None else None
    span._events = list(record.events)
    return span


def span_context(trace_id: int, span_id: int, flags: int, state: str, remote: bool) -> SpanContext:
    """A SpanContext from a SpanRecord's plain values (its trace state as a W3C tracestate header)."""
    trace_state = TraceState.from_header([state]) if state else TraceState()
    return SpanContext(trace_id, span_id, is_remote=remote, trace_flags=TraceFlags(flags), trace_state=trace_state)


class OutboxSink:
    """Where request_facts.build puts a DeferredSpan's phase spans and measurement: in its Outbox."""

    @staticmethod
    def child_span(parent, context, name: str, start_ns: int, end_ns: int, attributes) -> None:
        parent.add_child(name, start_ns, end_ns, attributes)

    @staticmethod
    def record_request(span, context, measurement) -> None:
        span.outbox.measurement = (tuple(measurement.key), *measurement[1:])  # (plain: marshal's)


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

    def __init__(self, provider, scope: tuple | None = None, hand_over=None, send=None):
        """provider: the SDK's TracerProvider, or another DeferredTracer (its sampler and id generator);
        send: where a message goes straight to the export process (the replayed HTTP path's), if anywhere."""
        self.scope = scope
        self.hand_over = hand_over
        self.send = send
        self.id_generator = provider.id_generator
        self._random_ids = type(provider.id_generator) is RandomIdGenerator
        self.use_sampler(provider.sampler)

    def use_sampler(self, sampler) -> None:
        self.sampler = sampler
        # the SDK's ParentBased answers without being asked where its delegate is static (its defaults:
        # ALWAYS_ON but for an unsampled parent); it samples every child of a sampled local span (its default)
        self._answers = internals.parent_based_answers(sampler)
        self.children_follow_parent = internals.children_follow_sampled_parent(sampler)

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
        _start_values: tuple | None = None,
        _type: type | None = None,
        **_ignored,
    ) -> trace.Span:
        """A DeferredSpan; on a failure of ours a span that records nothing (the caller, the FastAPI
        middleware among them, goes on: the request is served without this span). `_start_values`: a
        GenAI span's start attributes as RequestInfo.start_values, made into attributes only where the
        sampler must see them (else a RequestSpan keeps the values). `_type`: a DeferredSpan subclass to make
        (the replayed path's ServerSpan: otel_llm/vllm/export/http.py)."""
        try:
            links = links or ()
            if context is not None and not context:  # an empty Context (the HTTP server span's, most requests)
                parent_span, parent = trace.INVALID_SPAN, None
            else:
                parent_span = (current.current_context() if context is None else context).get(current.SPAN_KEY)
                if not isinstance(parent_span, trace.Span):  # (trace.get_current_span's, without its frames)
                    parent_span = trace.INVALID_SPAN
                parent = parent_span.get_span_context()
            if parent is None or not parent[5]:  # (internals.SPAN_CONTEXT_FIELDS: is_valid)
                parent = parent_state = None
                if self._random_ids:  # (RandomIdGenerator's, without its frames: it redraws a 0)
                    trace_id = getrandbits(128) or self.id_generator.generate_trace_id()
                    random_trace_id = True
                else:
                    trace_id = self.id_generator.generate_trace_id()
                    random_trace_id = self.id_generator.is_trace_id_random()
                kind_of_parent = 0
            else:
                trace_id, _, parent_remote, parent_flags, parent_state, _ = parent  # (SPAN_CONTEXT_FIELDS)
                random_trace_id = parent_flags & _RANDOM_TRACE_ID
                kind_of_parent = (1 if parent_remote else 3) + (0 if parent_flags & _SAMPLED else 1)
            answers = self._answers
            known = None if answers is None else answers[kind_of_parent]
            if known is None:
                if _start_values is not None:
                    attributes, _start_values = start_attributes(_start_values), None
                result = self.sampler.should_sample(context, trace_id, name, kind, attributes, links)
                sampled, trace_state, attributes = result.decision.is_sampled(), result.trace_state, result.attributes
            else:
                # the SDK's ParentBased's static answer for this kind of parent, without asking it (as
                # add_child): the attributes as given, the parent's trace state
                sampled, trace_state = known, parent_state
            flags = TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT
            if random_trace_id:
                flags |= TraceFlags.RANDOM_TRACE_ID
            span_id = (
                (getrandbits(64) or self.id_generator.generate_span_id())
                if self._random_ids
                else self.id_generator.generate_span_id()
            )
            # SpanContext(trace_id, span_id, False, TraceFlags(flags), trace_state) without its __new__'s frame:
            # the tuple of its fields (internals.SPAN_CONTEXT_FIELDS), is_valid as it computes it
            span_context = _new_span_context(
                (
                    trace_id,
                    span_id,
                    False,
                    TraceFlags(flags),
                    DEFAULT_TRACE_STATE if trace_state is None else trace_state,
                    0 < trace_id <= _TRACE_ID_MAX and 0 < span_id <= _SPAN_ID_MAX,
                )
            )
            outbox = _outbox if _outbox is not None else Outbox(self.scope)
            # (recording-but-unsampled spans are never exported by the SDK's batch processor: not kept)
            # an open, recording span of another instrumentation (the HTTP server span) takes this
            # one's telemetry along when it ends (an unsampled one may never be ended)
            holder = (
                parent_span
                if isinstance(parent_span, DeferredSpan)
                and parent_span._tracer.hand_over is not None
                and parent_span.is_recording()
                else None
            )
            deferred = sampled and _start_values is not None
            span = (RequestSpan if deferred else _type or DeferredSpan)(
                name,
                span_context,
                parent,
                kind,
                attributes if sampled else None,
                links,
                start_time or time.time_ns(),
                sampled,
                outbox,
                self,
                holder,
            )
            if deferred:
                span.start_values = _start_values
            if outbox.exemplar is None:
                outbox.exemplar = (trace_id, span_id, int(flags))
            return span
        except Exception:  # noqa: BLE001
            failed("DeferredTracer.start_span")
            return trace.INVALID_SPAN

    def start_root_span(self, name: str, kind: SpanKind, span_type: type) -> trace.Span:
        """start_span(name, Context(), kind, _type=span_type): a span of a new trace (the HTTP server span
        of a request that came with no trace context), made here in one step where the sampler's answer
        for a root span is known without asking it and the ids are the SDK's random ones; else start_span."""
        answers = self._answers
        sampled = None if answers is None else answers[0]
        if sampled is None or not self._random_ids:
            return self.start_span(name, _EMPTY, kind, _type=span_type)
        trace_id = getrandbits(128) or self.id_generator.generate_trace_id()
        span_id = getrandbits(64) or self.id_generator.generate_span_id()
        flags = _SAMPLED | _RANDOM_TRACE_ID if sampled else _RANDOM_TRACE_ID
        outbox = Outbox(self.scope)
        outbox.exemplar = (trace_id, span_id, flags)
        return span_type(
            name,
            _new_span_context((trace_id, span_id, False, TraceFlags(flags), DEFAULT_TRACE_STATE, True)),
            None,
            kind,
            None,
            (),
            time.time_ns(),
            sampled,
            outbox,
            self,
            None,
        )

    def start_request_span(self, name: str, start_ns: int, start_values: tuple) -> trace.Span:
        """A request's GenAI span (a RequestSpan, its start attributes kept as `start_values`), started
        in the current context: start_span's, where the current span is a recording DeferredSpan of this
        process (the HTTP server span) whose children the sampler samples without being asked
        (`children_follow_parent`, with the SDK's random ids) made here in one step (a frame and some
        hundred bytecodes less per request); else start_span."""
        parent_span = current.current_context().get(current.SPAN_KEY)
        if not (
            self.children_follow_parent
            and self._random_ids
            and isinstance(parent_span, DeferredSpan)
            and parent_span._sampled
            and not parent_span._ended
            and parent_span._context[5]  # (is_valid)
        ):
            return self.start_span(name, None, SpanKind.INTERNAL, None, None, start_ns, _start_values=start_values)
        parent = parent_span._context
        trace_id, _, _, parent_flags, trace_state, _ = parent  # (internals.SPAN_CONTEXT_FIELDS)
        flags = _SAMPLED | (parent_flags & _RANDOM_TRACE_ID)
        span_id = getrandbits(64) or self.id_generator.generate_span_id()
        outbox = Outbox(self.scope)
        outbox.exemplar = (trace_id, span_id, flags)
        span = RequestSpan(
            name,
            _new_span_context((trace_id, span_id, False, TraceFlags(flags), trace_state, True)),  # (valid: both ids)
            parent,
            SpanKind.INTERNAL,
            None,
            (),
            start_ns,
            True,
            outbox,
            self,
            parent_span if parent_span._tracer.hand_over is not None else None,
        )
        span.start_values = start_values
        return span

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

    def __init__(self, tracer: DeferredTracer, hand_over, send=None):
        self._tracer = tracer  # whose sampler and id generator (the user's) its tracers use
        self._hand_over = hand_over
        self._send = send  # (ExportChannel.send)

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
        return DeferredTracer(self._tracer, scope, self._hand_over, self._send)


@entry("hand_over")
def hand_over(span: DeferredSpan, channel) -> None:
    """A finished span's telemetry: along with its holder when that is still open, else to the
    export process now."""
    outbox = span.outbox
    if outbox.request is None and (outbox.held or outbox.empty()):  # (a request's span is never held or empty)
        return
    holder = span.holder
    if holder is not None and holder.holds and not holder._ended:
        holder.outbox.adopted.extend(outbox.parts())
    else:
        channel.send(outbox.message())


def outbox_of(context) -> Outbox | None:
    span = (current.current_context() if context is None else context).get(current.SPAN_KEY)
    return span.outbox if isinstance(span, DeferredSpan) else None


class UsageEvents:
    """The usage ledger's event logger when events are exported by the export process: the event
    goes with its request's message."""

    def emit(
        self, timestamp=None, observed_timestamp=None, context=None, event_name=None, attributes=None, **_ignored
    ) -> None:
        span = (current.current_context() if context is None else context).get(current.SPAN_KEY)  # (outbox_of's)
        if not isinstance(span, DeferredSpan):
            raise LookupError("a usage event without its request's span")
        span.outbox.usage_event = (attributes, timestamp)
