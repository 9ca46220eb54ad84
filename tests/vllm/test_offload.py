"""The export process (otel_llm/vllm/export/: deferred.py, channel.py, process.py) with a real child process
and a real OTLP receiver: what it exports equals what the SDK exports in process, it honours
the sampler, it drops (and counts) instead of blocking, and it is restarted, forked and closed
as a server needs."""

from __future__ import annotations

import asyncio
import enum
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from fastapi import FastAPI, WebSocket  # (module level: the route's annotation is resolved in these globals)
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, TraceFlags, TraceState
from opentelemetry.trace.status import Status, StatusCode
from starlette.middleware.errors import ServerErrorMiddleware

from devkit.otlp_receiver import Receiver
from otel_llm import __version__, semconv
from otel_llm.sdk import shutdown
from otel_llm.vllm.export import channel as export_channel
from otel_llm.vllm.export import deferred, wire
from otel_llm.vllm.export import http as export_http

T0 = 1_700_000_000_000_000_000
RESOURCE = Resource({"service.name": "vllm", "service.instance.id": "node-1:8000", "process.pid": 4242})
REMOTE_PARENT = SpanContext(
    0x0AF7651916CD43DD8448EB211C80319C,
    0xB7AD6B7169203331,
    is_remote=True,
    trace_flags=TraceFlags(TraceFlags.SAMPLED),
    trace_state=TraceState([("vendor", "x1")]),
)


class Sequence(IdGenerator):
    """The same ids for the in-process SDK and the deferred tracer."""

    def __init__(self):
        self.next = 0x1000

    def generate_span_id(self) -> int:
        self.next += 1
        return self.next

    def generate_trace_id(self) -> int:
        self.next += 1
        return 0xABC << 64 | self.next


class Choice(enum.Enum):
    A = "stop"


class Reason(str, enum.Enum):  # a str subclass: marshal refuses it, the SDK exports its text
    LENGTH = "length"


def request_tree(tracer) -> trace.Span:
    """What RequestTelemetry does to one request's spans, with edge cases the SDK handles."""
    parent = trace.set_span_in_context(NonRecordingSpan(REMOTE_PARENT))
    root = tracer.start_span(
        "chat tiny",
        context=parent,
        kind=SpanKind.INTERNAL,
        start_time=T0,
        attributes={
            semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
            semconv.GEN_AI_REQUEST_MODEL: "tiny",
            semconv.GEN_AI_REQUEST_TEMPERATURE: 0.5,
        },
        links=[Link(SpanContext(0x1234, 0x5678, is_remote=True))],
    )
    context = trace.set_span_in_context(root)
    for i, name in enumerate(semconv.PHASE_SPANS):
        attributes = {semconv.VLLM_REQUEST_ID: "cmpl-1"} if i else None
        if isinstance(root, deferred.DeferredSpan):  # as RequestTelemetry makes them
            root.add_child(name, T0 + 10 * i, T0 + 10 * i + 5, attributes)
        else:
            tracer.start_span(name, context=context, start_time=T0 + 10 * i, attributes=attributes).end(T0 + 10 * i + 5)
    root.set_attributes(
        {
            semconv.GEN_AI_USAGE_INPUT_TOKENS: 12,
            semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 4,
            semconv.GEN_AI_RESPONSE_FINISH_REASONS: [Reason.LENGTH, "stop"],
            semconv.GEN_AI_REQUEST_MODEL: "tiny-again",  # overwritten: moves to the end, as in the SDK
            semconv.GEN_AI_RESPONSE_ID: "x" * 100,  # cut by OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT
            semconv.VLLM_ABORTED: True,
            "otel_llm.test.bad": Choice.A,  # a type the SDK does not take
        }
    )
    root.set_attribute(semconv.TENANT_ID, None)  # (the SDK exports an empty value)
    root.set_status(Status(StatusCode.ERROR, "engine failed"))
    root.end(end_time=T0 + 100)
    return root


@pytest.fixture
def export_env(monkeypatch):
    def configure(endpoint: str):
        for name, value in {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_LOGS_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_METRIC_EXPORT_INTERVAL": "200",
            "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "40",
            "OTEL_LLM_SHUTDOWN_TIMEOUT": "5",
        }.items():
            monkeypatch.setenv(name, value)

    return configure


def channel(metrics=False, events=False, drops=None) -> export_channel.ExportChannel:
    config = {
        "traces": True,
        "metrics": metrics,
        "usage_events": events,
        "resource": dict(RESOURCE.attributes),
        "schema_url": None,
        "version": __version__,
    }
    # (the export process flushes within this bound at close, and ends as soon as it has: a bound no busy
    # machine reaches; 5 s lost a test's spans with the cores shared by another test run)
    return export_channel.ExportChannel(
        config, on_drop=(drops.append if drops is not None else lambda reason: None), shutdown_timeout_s=120
    )


def deferred_request(tracer: deferred.DeferredTracer) -> wire.Outbox:
    return request_tree(tracer).outbox


def test_exported_spans_equal_the_sdks(export_env):
    with Receiver(grpc=False) as sdk_receiver, Receiver(grpc=False) as our_receiver:
        export_env(sdk_receiver.endpoint)
        provider = TracerProvider(resource=RESOURCE, id_generator=Sequence())
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        request_tree(provider.get_tracer("otel_llm.vllm", __version__))
        provider.shutdown()

        export_env(our_receiver.endpoint)
        tracer = deferred.DeferredTracer(TracerProvider(resource=RESOURCE, id_generator=Sequence()))
        outbox = deferred_request(tracer)
        link = channel()
        assert link.send(outbox.message())
        link.close()  # the export process flushes and exits

        expected = sorted(sdk_receiver.spans, key=lambda s: s.span_id)
        got = sorted(our_receiver.spans, key=lambda s: s.span_id)
        assert [s.name for s in got] == ["chat tiny", "queue", "prefill", "decode"]
        assert got == expected
        root = got[0]
        assert root.trace_id == format(REMOTE_PARENT.trace_id, "032x")
        assert root.parent_span_id == format(REMOTE_PARENT.span_id, "016x")
        assert root.attributes[semconv.GEN_AI_RESPONSE_ID] == "x" * 40
        assert root.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ["length", "stop"]
        assert root.attributes["otel_llm.test.bad"] == "Choice.A"  # the SDK's str() of a type it does not take
        keys = list(root.attributes)
        assert keys.index(semconv.GEN_AI_REQUEST_MODEL) > keys.index(semconv.GEN_AI_RESPONSE_FINISH_REASONS)
        assert (root.status, root.status_message) == ("ERROR", "engine failed")
        assert root.scope == "otel_llm.vllm" and root.resource["process.pid"] == 4242
        assert {s.parent_span_id for s in got[1:]} == {root.span_id}


FASTAPI_SCOPE = ("opentelemetry.instrumentation.fastapi", "0.66b2", "https://opentelemetry.io/schemas/1.11.0")


def http_request(http_tracer, tracer, hand_over=None) -> tuple:
    """What the FastAPI instrumentation's middleware and RequestTelemetry do to one HTTP request
    that fails: the server span (another scope, status rules, an exception event) and the GenAI
    span made under it."""
    parent = trace.set_span_in_context(NonRecordingSpan(REMOTE_PARENT))
    server = http_tracer.start_span(
        "POST /v1/chat/completions",
        context=parent,
        kind=SpanKind.SERVER,
        start_time=T0,
        attributes={"http.request.method": "POST", "url.path": "/v1/chat/completions"},
    )
    assert server.kind is SpanKind.SERVER  # read by the middleware; the redaction hook reads attributes:
    assert server.attributes.get("url.path") == ("/v1/chat/completions" if server.is_recording() else None)
    with trace.use_span(server, end_on_exit=False):
        genai = tracer.start_span("chat tiny", start_time=T0 + 1, attributes={semconv.GEN_AI_OPERATION_NAME: "chat"})
        genai.end(T0 + 50)
        if hand_over is not None:
            hand_over(genai)  # RequestTelemetry's Telemetry.finish
    server.set_status(Status(StatusCode.UNSET))  # ignored, as by the SDK
    server.record_exception(ValueError("engine gone"), attributes={"otel_llm.test": 1})
    server.add_event("retry", {"attempt": 2})
    server.set_status(Status(StatusCode.ERROR, "ValueError: engine gone"))
    server.set_status(StatusCode.OK, "ignored for OK")
    server.set_status(StatusCode.ERROR, "not after OK")
    server.set_attribute("http.response.status_code", 500)
    server.end(T0 + 60)
    return server, genai


def test_an_exception_recorded_on_a_deferred_span_is_redacted():
    key = "sk-proj-Q3v8Xk2Lm9Tz4Rb7Yw1Nc6Hd0Jf5Gp_Aa-Ss8Dd7Ff6Gg5Hh4Jj3Kk2"
    tracer = deferred.DeferredTracer(TracerProvider(resource=RESOURCE, id_generator=Sequence()))
    http_tracer = deferred.DeferredTracerProvider(tracer, None).get_tracer(*FASTAPI_SCOPE)
    span = http_tracer.start_span("POST /v1/chat/completions", kind=SpanKind.SERVER)
    try:
        raise RuntimeError(f"upstream said: invalid api key {key}")
    except RuntimeError as e:
        span.record_exception(e, attributes={"exception.message": f"caller's {key}", "otel_llm.test": 1})
    ((name, attributes, _),) = span._events  # (what the export process makes the event of)
    assert name == "exception" and attributes["exception.type"] == "RuntimeError"
    assert attributes["exception.message"] == "upstream said: invalid api key <SECRET>"
    assert attributes["exception.stacktrace"].endswith("RuntimeError: upstream said: invalid api key <SECRET>\n")
    assert "test_offload.py" in attributes["exception.stacktrace"]
    assert attributes["otel_llm.test"] == 1
    assert key[-8:] not in repr(attributes)


def test_an_http_server_span_and_its_requests_telemetry_leave_in_one_message(export_env):
    with Receiver(grpc=False) as sdk_receiver, Receiver(grpc=False) as our_receiver:
        export_env(sdk_receiver.endpoint)
        provider = TracerProvider(resource=RESOURCE, id_generator=Sequence())
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        http_request(provider.get_tracer(*FASTAPI_SCOPE), provider.get_tracer("otel_llm.vllm", __version__))
        provider.shutdown()

        export_env(our_receiver.endpoint)
        link = channel()
        tracer = deferred.DeferredTracer(TracerProvider(resource=RESOURCE, id_generator=Sequence()))
        http_tracers = deferred.DeferredTracerProvider(tracer, lambda span: deferred.hand_over(span, link))
        server, genai = http_request(
            http_tracers.get_tracer(*FASTAPI_SCOPE), tracer, lambda span: deferred.hand_over(span, link)
        )
        assert genai.holder is server
        assert link.sent == 1  # the GenAI span went along with the HTTP span
        link.close()

        expected = sorted(sdk_receiver.spans, key=lambda s: s.span_id)
        got = sorted(our_receiver.spans, key=lambda s: s.span_id)
        assert got == expected
        http, chat = got
        assert (http.scope, chat.scope) == (FASTAPI_SCOPE[0], "otel_llm.vllm")
        assert (http.status, http.status_message) == ("OK", "")
        assert [e["name"] for e in http.events] == ["exception", "retry"]
        assert http.events[0]["attributes"]["exception.type"] == "ValueError"
        assert chat.parent_span_id == http.span_id


def test_a_websocket_span_takes_nothing_along(export_env):
    from otel_llm.vllm.http import hold_nothing_hook

    with Receiver(grpc=False) as receiver:
        export_env(receiver.endpoint)
        link = channel()
        tracer = deferred.DeferredTracer(TracerProvider(resource=RESOURCE))
        http_tracer = deferred.DeferredTracerProvider(tracer, lambda span: deferred.hand_over(span, link)).get_tracer(
            *FASTAPI_SCOPE
        )
        socket_span = http_tracer.start_span("/v1/realtime websocket", kind=SpanKind.SERVER)
        hold_nothing_hook(socket_span, {"type": "websocket"})  # (the server request hook)
        with trace.use_span(socket_span, end_on_exit=False):
            genai = tracer.start_span("transcription tiny")
            genai.end()
            deferred.hand_over(genai, link)
        assert link.sent == 1  # at once, not when the connection closes
        receiver.wait_for(lambda r: _spans_named(r, "transcription tiny"))
        socket_span.end()
        assert link.sent == 2
        link.close()


def test_vllms_app_marks_websocket_spans_as_holding_nothing():
    from starlette.testclient import TestClient

    from otel_llm.config import Settings
    from otel_llm.vllm.export.http import instrument_app

    seen = {}
    app = FastAPI()

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket):
        await ws.accept()
        seen["websocket"] = trace.get_current_span()
        await ws.close()

    @app.get("/v1/models")
    async def models():
        seen["http"] = trace.get_current_span()
        return {}

    tracer = deferred.DeferredTracer(TracerProvider())
    instrument_app(app, Settings(), deferred.DeferredTracerProvider(tracer, lambda span: None))
    with TestClient(app) as client:
        with client.websocket_connect("/v1/realtime"):
            pass
        client.get("/v1/models?api_key=secret")
    assert not seen["websocket"].holds and seen["http"].holds
    # the query redaction hook still runs, on the deferred span
    assert seen["http"].attributes["http.url"] == "http://testserver/v1/models?api_key=REDACTED"


def test_an_unsampled_http_span_takes_nothing_along():
    tracer = deferred.DeferredTracer(TracerProvider(sampler=ALWAYS_OFF))
    http_tracers = deferred.DeferredTracerProvider(tracer, lambda span: None)
    server, genai = http_request(http_tracers.get_tracer(*FASTAPI_SCOPE), tracer)
    assert not server.is_recording() and genai.holder is None  # (the middleware never ends an unsampled span)


def test_a_span_started_under_another_requests_span_is_exported_on_its_own():
    tracer = deferred.DeferredTracer(TracerProvider())
    outer = tracer.start_span("chat outer")
    inner = tracer.start_span("chat inner", context=trace.set_span_in_context(outer))
    phase = outer.start_child("queue", T0)
    assert inner.outbox is not outer.outbox and phase.outbox is outer.outbox
    assert inner.get_span_context().trace_id == outer.get_span_context().trace_id
    for span in (phase, inner, outer):
        span.end()
    assert [s[0] for s in outer.outbox.spans] == ["queue", "chat outer"]
    assert [s[0] for s in inner.outbox.spans] == ["chat inner"]


def test_the_users_sampler_decides():
    off = deferred.DeferredTracer(TracerProvider(sampler=ALWAYS_OFF))
    span = off.start_span("chat", attributes={semconv.GEN_AI_OPERATION_NAME: "chat"})
    assert not span.is_recording() and not span.get_span_context().trace_flags.sampled
    span.end()
    assert span.outbox.spans == [] and span.outbox.exemplar[0] == span.get_span_context().trace_id

    parent_based = deferred.DeferredTracer(TracerProvider(sampler=ParentBased(ALWAYS_OFF)))
    sampled_parent = trace.set_span_in_context(NonRecordingSpan(REMOTE_PARENT))
    kept = parent_based.start_span("chat", context=sampled_parent)
    assert kept.is_recording() and kept.get_span_context().trace_id == REMOTE_PARENT.trace_id
    assert kept.get_span_context().trace_state == REMOTE_PARENT.trace_state
    unsampled_parent = trace.set_span_in_context(
        NonRecordingSpan(
            SpanContext(REMOTE_PARENT.trace_id, REMOTE_PARENT.span_id, is_remote=True, trace_flags=TraceFlags(0))
        )
    )
    assert not parent_based.start_span("chat", context=unsampled_parent).is_recording()
    assert not parent_based.start_span("chat").is_recording()  # a root: ALWAYS_OFF


def test_a_child_of_a_sampled_local_span_is_made_as_the_sdk_samples_it():
    """Under the SDK's ParentBased defaults the child of a sampled local span is sampled without asking
    the sampler (its answer is known): the same trace state, attributes and flags as the SDK's own
    tracer gives; with another sampler for that case, the sampler decides."""
    attributes = {semconv.GEN_AI_OPERATION_NAME: "chat"}
    remote = trace.set_span_in_context(NonRecordingSpan(REMOTE_PARENT))
    sdk = TracerProvider().get_tracer("t")
    sdk_parent = sdk.start_span("POST", context=remote)
    sdk_child = sdk.start_span("chat", context=trace.set_span_in_context(sdk_parent), attributes=attributes)
    tracer = deferred.DeferredTracer(TracerProvider())
    parent = tracer.start_span("POST", context=remote)
    child = tracer.start_span("chat", context=trace.set_span_in_context(parent), attributes=attributes)
    ours, theirs = child.get_span_context(), sdk_child.get_span_context()
    assert (ours.trace_flags, ours.trace_state, ours.is_remote) == (theirs.trace_flags, theirs.trace_state, False)
    assert ours.trace_state == REMOTE_PARENT.trace_state and child.attributes == dict(sdk_child.attributes)

    asked = deferred.DeferredTracer(TracerProvider(sampler=ParentBased(ALWAYS_ON, local_parent_sampled=ALWAYS_OFF)))
    parent = asked.start_span("POST", context=remote)
    assert parent.is_recording()
    assert not asked.start_span("chat", context=trace.set_span_in_context(parent)).is_recording()


@pytest.mark.parametrize(
    "sampler",
    [
        ParentBased(ALWAYS_ON),
        ParentBased(ALWAYS_OFF),
        ParentBased(TraceIdRatioBased(0.5)),
        ParentBased(ALWAYS_ON, remote_parent_not_sampled=ALWAYS_ON, local_parent_sampled=ALWAYS_OFF),
        ALWAYS_ON,
        TraceIdRatioBased(0.5),
    ],
    ids=["default", "root-off", "root-ratio", "mixed", "always-on", "ratio"],
)
def test_the_sampler_answers_as_the_sdk_asks_it(sampler, monkeypatch):
    """Under every kind of parent (none, remote sampled or not, local sampled or not) a DeferredSpan is
    sampled as the SDK's span, with its trace state and attributes; the SDK's ParentBased is asked only
    where its delegate is no static ALWAYS_ON / ALWAYS_OFF (internals.parent_based_answers)."""
    from otel_llm.sdk import internals

    attributes = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT}
    state = TraceState([("vendor", "x")])
    parents = {
        "none": None,
        "remote sampled": SpanContext(0xABC, 0xDEF, True, TraceFlags(TraceFlags.SAMPLED), state),
        "remote unsampled": SpanContext(0xABC, 0xDEF, True, TraceFlags(0), state),
        "local sampled": SpanContext(0xABC, 0xDEF, False, TraceFlags(TraceFlags.SAMPLED), state),
        "local unsampled": SpanContext(0xABC, 0xDEF, False, TraceFlags(0), state),
    }
    ours_tracer = deferred.DeferredTracer(TracerProvider(sampler=sampler, id_generator=Sequence()))
    sdk = TracerProvider(sampler=sampler, id_generator=Sequence()).get_tracer("t")
    asked = []
    ask = sampler.should_sample
    for what, parent in parents.items():
        context = None if parent is None else trace.set_span_in_context(NonRecordingSpan(parent))
        with monkeypatch.context() as patch:
            counted = lambda *args, _w=what, **kwargs: asked.append(_w) or ask(*args, **kwargs)  # noqa: E731
            patch.setattr(sampler, "should_sample", counted)
            ours = ours_tracer.start_span("chat", context, attributes=attributes)
        theirs = sdk.start_span("chat", context, attributes=attributes)
        mine, sdks = ours.get_span_context(), theirs.get_span_context()
        assert (mine.trace_id, mine.trace_flags) == (sdks.trace_id, sdks.trace_flags), what
        assert mine.trace_state == sdks.trace_state, what
        assert ours.is_recording() == theirs.is_recording(), what
        if theirs.is_recording():
            assert dict(ours.attributes) == dict(theirs.attributes), what
    answers = internals.parent_based_answers(sampler)
    if answers is None:
        assert asked == list(parents)
    else:
        assert asked == [what for what, answer in zip(parents, answers) if answer is None]
        assert ("none" in asked) == isinstance(sampler._root, TraceIdRatioBased)


def test_a_request_span_makes_its_start_attributes_when_they_are_read_or_set_here():
    """DeferredTracer.start_span with `_start_values` keeps a GenAI span's start attributes as values; what reads or
    sets its attributes in this process, or ends it here, sees them as the SDK's span has them: the
    same ids and flags as start_span, the start attributes first, an overwritten one moved last."""
    from otel_llm.vllm.request_facts import start_attributes
    from otel_llm.vllm.request_telemetry import RequestInfo

    values = RequestInfo(operation=semconv.OP_CHAT, model="tiny", temperature=0.5, tenant="acme").start_values()
    remote = trace.set_span_in_context(NonRecordingSpan(REMOTE_PARENT))
    made = {}
    for how in ("read", "set", "ended"):
        tracer = deferred.DeferredTracer(TracerProvider(id_generator=Sequence()))
        parent = trace.set_span_in_context(tracer.start_span("POST", context=remote))
        span = tracer.start_span("chat tiny", parent, trace.SpanKind.INTERNAL, None, None, T0, _start_values=values)
        assert type(span) is deferred.RequestSpan and span.start_values == values
        made[how] = span
        if how == "read":
            assert dict(span.attributes) == start_attributes(values)
        elif how == "set":
            span.set_attribute(semconv.GEN_AI_REQUEST_TEMPERATURE, 0.7)
            span.set_attributes({"otel_llm.test": 1})
            moved = [key for key in start_attributes(values) if key != semconv.GEN_AI_REQUEST_TEMPERATURE]
            assert list(span.attributes) == [*moved, semconv.GEN_AI_REQUEST_TEMPERATURE, "otel_llm.test"]
            assert span.attributes[semconv.GEN_AI_REQUEST_TEMPERATURE] == 0.7
        else:
            span.end(T0 + 5)
            [record] = span.outbox.spans
            assert wire.SpanRecord(*record).attributes == start_attributes(values)
    slow = deferred.DeferredTracer(TracerProvider(id_generator=Sequence()))
    parent = trace.set_span_in_context(slow.start_span("POST", context=remote))
    asked = slow.start_span("chat tiny", parent, attributes=start_attributes(values), start_time=T0)
    assert made["read"].get_span_context() == asked.get_span_context()
    assert made["read"].outbox.exemplar == asked.outbox.exemplar
    assert made["read"].holder is None and made["read"]._parent == asked._parent


def test_metrics_and_usage_events_are_recorded_with_exemplars(export_env):
    with Receiver(grpc=False) as receiver:
        export_env(receiver.endpoint)
        tracer = deferred.DeferredTracer(TracerProvider(resource=RESOURCE))
        span = tracer.start_span("chat tiny")
        key = ("chat", "tiny", "tiny", "acme", None, None)
        span.outbox.measurement = (key, None, 0.25, 0.01, 1.5, (12, 4, 3))
        deferred.UsageEvents().emit(
            timestamp=T0,
            context=trace.set_span_in_context(span),
            attributes={semconv.GEN_AI_USAGE_INPUT_TOKENS: 12, semconv.TENANT_ID: "acme"},
        )
        span.end()
        link = channel(metrics=True, events=True)
        assert link.send(span.outbox.message())
        link.close()
        ctx = span.get_span_context()
        duration = receiver.wait_for(
            lambda r: [p for p in r.latest_metrics() if p.name == semconv.SERVER_REQUEST_DURATION]
        )
        assert duration[0].count == 1 and duration[0].total == 1.5
        assert duration[0].attributes[semconv.TENANT_ID] == "acme"
        assert duration[0].exemplars[0]["trace_id"] == format(ctx.trace_id, "032x")
        assert duration[0].resource["process.pid"] == 4242
        tokens = {
            p.attributes[semconv.GEN_AI_TOKEN_TYPE]: p.value
            for p in receiver.latest_metrics()
            if p.name == semconv.SERVER_TOKEN_USAGE
        }
        assert tokens == {
            semconv.TOKEN_TYPE_INPUT: 12,
            semconv.TOKEN_TYPE_CACHED_INPUT: 4,
            semconv.TOKEN_TYPE_OUTPUT: 3,
        }
        [event] = receiver.logs
        assert event.event_name == semconv.USAGE_EVENT and event.time_ns == T0
        assert event.attributes == {semconv.GEN_AI_USAGE_INPUT_TOKENS: 12, semconv.TENANT_ID: "acme"}
        assert (event.trace_id, event.span_id) == (format(ctx.trace_id, "032x"), format(ctx.span_id, "016x"))


def _spans_named(receiver, name):
    return [s for s in receiver.spans if s.name == name]


def _one(name: str) -> wire.Outbox:
    span = deferred.DeferredTracer(TracerProvider()).start_span(name)
    span.end()
    return span.outbox


def exporting_channel(receiver, first: str) -> tuple[export_channel.ExportChannel, list]:
    """A channel whose export process has exported a first span (named `first`), and its drops."""
    drops = []
    link = channel(drops=drops)
    assert link.send(_one(first).message())
    receiver.wait_for(lambda r: _spans_named(r, first))
    return link, drops


def test_a_stalled_export_process_costs_drops_not_waits(export_env):
    with Receiver(grpc=False) as receiver:
        export_env(receiver.endpoint)
        link, drops = exporting_channel(receiver, "first")
        os.kill(link.process.pid, signal.SIGSTOP)
        try:
            big = _one("filler")
            big.spans[0][11]["padding"] = "p" * 20_000
            sends = 0
            while not drops and sends < 10_000:  # a blocking send would never end this loop
                link.send(big.message())
                sends += 1
            assert link.backlog() > 100_000
        finally:
            os.kill(link.process.pid, signal.SIGCONT)
        receiver.wait_for(lambda r: link.backlog() == 0)
        assert drops == [semconv.EXPORT_DROP_QUEUE_FULL]
        assert link.dropped == 1 and link.sent == sends  # the first send plus those that fit
        assert link.send(_one("after").message())
        receiver.wait_for(lambda r: _spans_named(r, "after"))
        link.close()


def test_a_dead_export_process_is_restarted(export_env, monkeypatch):
    monkeypatch.setattr(export_channel, "RESTART_BACKOFF_S", (3.0, 3.0))  # a margin for a busy machine
    with Receiver(grpc=False) as receiver:
        export_env(receiver.endpoint)
        link, drops = exporting_channel(receiver, "before")
        first = link.process
        first.kill()
        first.wait()
        assert not link.send(_one("lost").message())
        assert drops == [semconv.EXPORT_DROP_EXPORTER_DOWN]
        assert not link.send(_one("lost-too").message())  # within the backoff: not restarted yet
        assert drops == [semconv.EXPORT_DROP_EXPORTER_DOWN] * 2
        time.sleep(3.1)
        assert link.send(_one("restarted").message())
        assert link.process.pid != first.pid
        receiver.wait_for(lambda r: _spans_named(r, "restarted"))
        link.close()
        assert link.process.returncode == 0
        assert not _spans_named(receiver, "lost")


def test_messages_sent_on_an_event_loop_go_together(export_env, monkeypatch):
    """On an event loop's thread a message is held until the loop's timer sends the held ones in one
    packet, or the HELD_MAX'th goes with them; a send elsewhere takes the held ones along (their loop may
    have ended, its timer with it). Every message is exported once."""
    monkeypatch.setattr(export_channel, "HELD_MAX", 4)
    with Receiver(grpc=False) as receiver:
        export_env(receiver.endpoint)
        link, drops = exporting_channel(receiver, "first")  # (sent from this thread, which runs no loop: now)
        assert link.sent == 1

        async def requests():
            assert link.send(_one("a").message()) and link.send(_one("b").message())
            assert link.sent == 1  # held: nothing awaited since, so the loop's timer has not run
            for _ in range(3000):  # the timer, HOLD_S later (30 s: a margin for a busy machine)
                if link.sent > 1:
                    break
                await asyncio.sleep(0.01)
            assert link.sent == 3
            for name in "cdef":
                assert link.send(_one(name).message())
            assert link.sent == 7  # the fourth held one sent them, without the timer
            assert link.send(_one("g").message())  # held when the loop ends

        asyncio.run(requests())
        assert link.sent == 7
        assert link.send(_one("h").message()) and link.sent == 9
        receiver.wait_for(lambda r: len(r.spans) == 9)
        link.close()
        assert sorted(s.name for s in receiver.spans) == ["a", "b", "c", "d", "e", "f", "first", "g", "h"]
        assert not drops and link.dropped == 0


FORK_SCRIPT = """
import os, sys
from types import SimpleNamespace
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from otel_llm.vllm.export import channel as export_channel
from otel_llm.vllm.export import deferred

def one(name):
    tracer = deferred.DeferredTracer(SimpleNamespace(sampler=ALWAYS_ON, id_generator=RandomIdGenerator()))
    span = tracer.start_span(name)
    span.end()
    return span.outbox.message()

config = {"traces": True, "metrics": False, "usage_events": False, "resource": {"service.name": "fork"},
          "schema_url": None, "version": "0"}
link = export_channel.ExportChannel(config, on_drop=print, shutdown_timeout_s=120)
assert link.send(one("parent"))
parent_export = link.process.pid
pid = os.fork()
if pid == 0:  # the forked process: the parent's export process is not its own
    code = 3
    try:
        ok = link.send(one("forked"))
        own = link.process.pid
        link.close()
        code = 0 if ok and link.process.returncode == 0 and own != parent_export else 2
    finally:
        os._exit(code)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert link.send(one("parent-again")) and link.process.pid == parent_export
link.close()
assert link.process.returncode == 0
"""


def test_a_forked_process_starts_its_own(export_env):
    # in a fresh interpreter: the SDK TracerProviders other tests made here re-detect their resource
    # after a fork with a thread pool, which can hang the forked child (theirs, not ours)
    with Receiver(grpc=False) as receiver:
        export_env(receiver.endpoint)
        result = subprocess.run([sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr[-3000:]
        receiver.wait_for(lambda r: all(_spans_named(r, n) for n in ("parent", "forked", "parent-again")))
        assert len(receiver.spans) == 3


def test_large_messages_go_in_frames(export_env):
    with Receiver(grpc=False) as receiver:
        export_env(receiver.endpoint)
        os.environ["OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT"] = "2000000"
        outbox = _one("captured")
        text = "".join(chr(0x4E00 + i % 500) for i in range(1_500_000))  # 4.5 MB of UTF-8
        outbox.spans[0][11][semconv.GEN_AI_OUTPUT_MESSAGES] = text
        link = channel()
        assert link.send(outbox.message())
        link.close()
        [span] = _spans_named(receiver, "captured")
        assert span.attributes[semconv.GEN_AI_OUTPUT_MESSAGES] == text


def test_the_export_process_is_not_instrumented_itself():
    auto = os.path.join("site-packages", "opentelemetry", "instrumentation", "auto_instrumentation")
    env = export_channel.child_environment({"PYTHONPATH": f"/x/{auto}:/app", "OTEL_SERVICE_NAME": "vllm"})
    assert env == {"PYTHONPATH": "/app", "OTEL_SERVICE_NAME": "vllm"}


def test_the_export_process_joins_and_leaves_the_bounded_shutdown(monkeypatch):
    bounded = shutdown.BoundedShutdown(2.0)
    monkeypatch.setattr(shutdown, "_installed", bounded)
    given = []

    def close(seconds_left):  # what ExportChannel.close returns: what the export process lost
        given.append(seconds_left)
        return {"spans": 2, "log_records": 1, "metric_points": 3, "complete": False}

    assert shutdown.join_shutdown(close)
    report = bounded.run(warn=False)
    assert (report["spans"], report["log_records"], report["metric_points"], report["complete"]) == (2, 1, 3, False)
    assert len(given) == 1 and 0 <= given[0] <= 2.0  # the time left to the bound, never more
    shutdown.leave_shutdown(close)
    assert bounded.participants == []


# --- a fault in any entry point (issue 20) -----------------------------------------------------


def _fault_injector():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "e2e" / "reliability" / "fault_injector.py"
    spec = importlib.util.spec_from_file_location("fault_injector", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _serve_the_requests(http_module, replayed: bool) -> list[tuple[int, bytes]]:
    """A FastAPI app as vLLM's is instrumented with the export process (the HTTP server span from
    the deferred tracer provider, our request hooks), a handler making a GenAI span under it and
    handing it over: (status, body) of a request with a query, a failing handler and a 404.
    replayed: the HTTP metrics go to the export process too, which makes the span's attributes
    (ReplayingMiddleware.replayed_call); else the maintained middleware's `__call__` runs here."""
    from opentelemetry.sdk.metrics import MeterProvider
    from starlette.testclient import TestClient

    from otel_llm.config import Settings

    link = channel()
    link._closed = True  # (sends are dropped and counted: no export process here)
    tracer = deferred.DeferredTracer(TracerProvider())
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat():
        span = tracer.start_span("chat tiny", attributes={semconv.GEN_AI_OPERATION_NAME: "chat"})
        span.set_attributes({semconv.GEN_AI_REQUEST_MODEL: "tiny"})
        span.set_attribute(semconv.GEN_AI_USAGE_OUTPUT_TOKENS, 5)
        span.set_status(StatusCode.OK)
        span.end()
        if isinstance(span, deferred.DeferredSpan):  # (Telemetry.finish)
            deferred.hand_over(span, link)
        return {"choices": [{"text": "x"}]}

    @app.post("/v1/completions")
    async def fails():
        raise ValueError("the engine is gone")

    http_module.instrument_app(
        app,
        Settings(),
        deferred.DeferredTracerProvider(tracer, lambda span: deferred.hand_over(span, link), link.send),
        offload_metrics=replayed,
        meter_provider=MeterProvider() if replayed else None,
    )
    with TestClient(app, raise_server_exceptions=False) as client:
        responses = [
            client.post("/v1/chat/completions?api_key=secret", json={}),
            client.post("/v1/completions", json={}),
            client.get("/v1/nothing"),
        ]
    link.close()
    return [(r.status_code, r.content) for r in responses]


def _http_entry_points():
    from otel_llm.vllm import http
    from otel_llm.warn import entry_points

    return [
        (f"{m.__name__}:{name}", fn)
        for m in (deferred, export_channel, http, export_http)
        for name, fn in entry_points(m)
    ]


@pytest.mark.parametrize("replayed", [False, True], ids=["maintained call", "replayed"])
@pytest.mark.parametrize("name,fn", _http_entry_points(), ids=[n for n, _ in _http_entry_points()])
def test_a_fault_in_an_entry_point_loses_telemetry_never_the_request(name, fn, replayed):
    """Each entry point of the HTTP path (otel_llm/warn.py: `entry`, `inline_entry`), a fault raised
    inside its guard as the real-server fault test does: the responses are those without it, the
    failure is counted (otel_llm.instrumentation.failures), nothing escapes."""
    from otel_llm import warn

    expected = _serve_the_requests(export_http, replayed)
    injector = _fault_injector()
    hits = []

    def check(point):
        hits.append(point)
        raise injector.InjectedFault(point)

    before = warn.failures().get(fn.what, 0)
    undo = injector.inject(fn, name, check)
    try:
        got = _serve_the_requests(export_http, replayed)
    finally:
        undo()
    assert got == expected
    assert warn.failures().get(fn.what, 0) - before == len(hits)


# --- the HTTP server span and metrics: the maintained middleware against ours (issue 24) ----------


def _http_app():
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        if body.get("stream"):

            async def sse():
                for i in range(16):
                    yield f'data: {{"i": {i}}}\n\n'
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")
        return {"id": "chatcmpl-1", "choices": [{"message": {"content": "hi"}}]}

    @app.post("/v1/completions")
    async def fails(body: dict):
        raise ValueError("the engine is gone")

    @app.get("/v1/models/{model}")
    async def model(model: str):
        return JSONResponse({"error": "no such model"}, status_code=404 if model == "nope" else 400)

    return app


def _http_requests(app) -> list[int]:
    from starlette.testclient import TestClient

    with TestClient(app, raise_server_exceptions=False) as client:
        responses = [
            client.post("/v1/chat/completions?api_key=sk-secret&flag", json={"stream": False}),
            client.post("/v1/chat/completions", json={"stream": True}),
            client.post("/v1/completions", json={}),
            client.get("/v1/models/nope"),
            client.get("/v1/models/other"),
            client.get("/v1/models/other"),
            client.get("/health"),  # excluded: no span, no metrics
            client.get("/nowhere"),
            client.post(
                "/v1/chat/completions",
                json={"stream": False},
                headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
            ),
        ]
    return [r.status_code for r in responses]


def _metric_points(receiver) -> dict:
    return {(p.name, tuple(sorted(p.attributes.items()))): p for p in receiver.latest_metrics()}


# the HTTP conventions' modes (OTEL_SEMCONV_STABILITY_OPT_IN): the old names (default), both
HTTP_SEMCONV_MODES = {
    "": {"http.server.duration", "http.server.active_requests", "http.server.response.size", "http.server.request.size"}
}
HTTP_SEMCONV_MODES["http/dup"] = HTTP_SEMCONV_MODES[""] | {
    "http.server.request.duration",
    "http.server.response.body.size",
    "http.server.request.body.size",
}


def http_semconv_mode(monkeypatch, mode: str) -> None:
    """The instrumentation reads OTEL_SEMCONV_STABILITY_OPT_IN = `mode` again, into a mapping of this
    test's (an opt-in fills the mapping in place): the next tests find the mode as it was."""
    from opentelemetry.instrumentation import _semconv

    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", mode)
    stability = _semconv._OpenTelemetrySemanticConventionStability
    monkeypatch.setattr(stability, "_initialized", False)
    monkeypatch.setattr(stability, "_OTEL_SEMCONV_STABILITY_SIGNAL_MAPPING", {})


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "sampled out"])
@pytest.mark.parametrize("mode", list(HTTP_SEMCONV_MODES), ids=["old names", "http/dup"])
def test_the_http_span_and_metrics_equal_the_maintained_middlewares(export_env, monkeypatch, mode, sampled):
    """The HTTP server span and the HTTP metrics of vLLM's app (FastAPI instrumentation as http.py puts
    it on: query redaction, exclusions) are the same, field for field after decoding, whether the
    maintained middleware makes and records them with the SDK in process, or our lean middleware hands
    them to the export process (times aside: the spans' are the clock's; the durations come from one
    fake clock in both). Sampled out (the SDK's ALWAYS_OFF under ParentBased): the same spans (only the
    one with a sampled parent) and the same metrics."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

    sampler = ParentBased(ALWAYS_ON if sampled else ALWAYS_OFF)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.instrumentation import asgi
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    from otel_llm.config import Settings
    from otel_llm.vllm import http

    def meter_provider():
        reader = PeriodicExportingMetricReader(OTLPMetricExporter(), export_interval_millis=3_600_000)
        return MeterProvider(resource=RESOURCE, metric_readers=[reader])

    http_semconv_mode(monkeypatch, mode)

    def fake_clock():
        ticks = iter(range(1, 10_000))
        monkeypatch.setattr(asgi, "default_timer", lambda: next(ticks) * 0.0375)

    with Receiver(grpc=False) as sdk_receiver, Receiver(grpc=False) as our_receiver:
        export_env(sdk_receiver.endpoint)
        # (no length limit: the SDK cuts a URL before the redaction hook reads it back, ours after)
        monkeypatch.delenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT")
        fake_clock()
        provider = TracerProvider(resource=RESOURCE, id_generator=Sequence(), sampler=sampler)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        meters = meter_provider()
        app = _http_app()
        FastAPIInstrumentor.instrument_app(
            app,
            excluded_urls=Settings().http_excluded_urls,
            exclude_spans=["receive", "send"],
            tracer_provider=provider,
            meter_provider=meters,
            server_request_hook=http.redact_query_hook,
        )
        expected_status = _http_requests(app)
        provider.shutdown()
        meters.shutdown()

        export_env(our_receiver.endpoint)
        monkeypatch.delenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT")
        fake_clock()
        link = channel(metrics=True)
        tracer = deferred.DeferredTracer(TracerProvider(resource=RESOURCE, id_generator=Sequence(), sampler=sampler))
        meters = meter_provider()  # (the API server's: the active requests)
        app = _http_app()
        export_http.instrument_app(
            app,
            Settings(),
            deferred.DeferredTracerProvider(tracer, lambda span: deferred.hand_over(span, link), link.send),
            offload_metrics=True,
            meter_provider=meters,
        )
        assert _http_requests(app) == expected_status == [200, 200, 500, 404, 400, 400, 200, 404, 200]
        # in front of FastAPIInstrumentor's outer ServerErrorMiddleware, whose app is the one that hands over
        front = app.middleware_stack
        assert isinstance(front, export_http.HeldUntilRecorded) and type(front.outer) is ServerErrorMiddleware
        assert front.outer.app.behind_front and front.outer.app.app is front.app
        assert front.app.replayed  # (made in the export process: http.HttpReplay)
        assert link.flush() and link.sent == 8  # one message per traced request: its span with its metrics
        link.close()
        meters.shutdown()

        def times_aside(spans):
            return sorted((replace(s, start_ns=0, end_ns=0) for s in spans), key=lambda s: s.span_id)

        expected, got = times_aside(sdk_receiver.spans), times_aside(our_receiver.spans)
        for g, e in zip(got, expected):
            assert sorted(set(g.attributes.items()) ^ set(e.attributes.items()), key=str) == [], g.name
        # (sampled out: the one request whose traceparent says sampled, ParentBased follows it)
        assert len(got) == (8 if sampled else 1) and got == expected
        if sampled:
            chat = next(s for s in got if "?" in s.attributes["http.url"])
            assert chat.attributes["http.url"].endswith("?api_key=REDACTED&REDACTED")
            assert {s.status for s in got} == {"UNSET", "ERROR"}

        expected, got = _metric_points(sdk_receiver), _metric_points(our_receiver)
        assert got.keys() == expected.keys()
        assert {name for name, _ in got} == HTTP_SEMCONV_MODES[mode]
        for key, point in expected.items():
            if key[0] == "http.server.active_requests":  # observed, not measured: no exemplar (the SDK's
                point = replace(point, exemplars=[])  # is the span context current at the last +1, a
            assert got[key] == point, key  # client's span from its traceparent)
        assert any(p.exemplars for p in got.values())  # (sampled out: the request with a sampled parent)


def _scope(
    method="POST",
    path="/v1/chat/completions",
    host=b"vllm:8000",
    agent=b"openai/1.0",
    client=("10.0.0.7", 5123),
    server=("10.0.0.1", 8000),
    scheme="http",
    version="1.1",
    query=b"",
    extra=(),
) -> dict:
    headers = [(b"host", host), (b"user-agent", agent), (b"content-type", b"application/json"), *extra]
    return {
        "type": "http",
        "http_version": version,
        "method": method,
        "scheme": scheme,
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": client,
        "server": server,
    }


def _instrument_replayed(app, hand_over=lambda span: None) -> None:
    """`app`'s HTTP spans on the replayed path (spans handed to `hand_over`)."""
    from opentelemetry.sdk.metrics import MeterProvider

    from otel_llm.config import Settings

    export_http.instrument_app(
        app,
        Settings(),
        deferred.DeferredTracerProvider(deferred.DeferredTracer(TracerProvider()), hand_over),
        offload_metrics=True,
        meter_provider=MeterProvider(),
    )


def _lean():
    from fastapi import FastAPI

    from otel_llm.vllm import http

    app = FastAPI()
    _instrument_replayed(app)
    lean = app.build_middleware_stack().app
    assert isinstance(lean, http.LeanMiddleware) and lean.replayed
    return lean


@pytest.mark.parametrize("mode", ["", "http", "http/dup"])
def test_the_replayed_active_requests_attributes_are_the_maintained_ones(monkeypatch, mode):
    """LeanMiddleware keeps the active-requests counter's attributes per method, scheme, version,
    server and Host: for requests that differ in everything else (path, query, user agent, client)
    and in those, they equal what the maintained middleware computes for each."""
    from opentelemetry.instrumentation import asgi

    http_semconv_mode(monkeypatch, mode)
    lean = _lean()
    scopes = [
        _scope(),
        _scope(path="/v1/completions", query=b"a=1"),
        _scope(agent=b"curl/8", client=("10.0.0.9", 1)),
        _scope(method="GET", path="/v1/models"),
        _scope(host=b"other:8000"),
        _scope(scheme="https"),
        _scope(version="2"),
        _scope(server=("10.0.0.2", 8001)),
        _scope(method="BREW"),
        _scope(extra=((b"Host", b"shouting:8000"),)),
    ]
    for scope in scopes * 2:
        expected = asgi._parse_active_request_count_attrs(
            asgi.collect_request_attributes(scope, lean._sem_conv_opt_in_mode), lean._sem_conv_opt_in_mode
        )
        assert lean._active_attributes(scope) == expected
    assert len(lean.active_cache) == 8  # (the first three share one key)


def test_the_replayed_exclusion_is_the_maintained_one():
    """LeanMiddleware keeps whether a request is excluded (OTEL_PYTHON_FASTAPI_EXCLUDED_URLS) per scheme,
    Host, server and path: for requests that differ in those and in everything else, it equals the
    maintained middleware's answer for each."""
    from opentelemetry.instrumentation import asgi
    from opentelemetry.util.http import parse_excluded_urls

    lean = _lean()
    lean.excluded_urls = parse_excluded_urls("/health,internal:9,^https://")
    scopes = [
        _scope(),
        _scope(path="/health"),
        _scope(path="/v1/health/x", query=b"a=1"),
        _scope(host=b"internal:9"),
        _scope(extra=((b"Host", b"internal:9"),)),  # (the first Host header counts)
        _scope(host=b"internal:90", agent=b"curl/8"),
        _scope(scheme="https"),
        _scope(server=("internal", 9)),
        {**_scope(), "headers": [(b"user-agent", b"x")], "server": ("internal", 9)},  # no Host: the server's
        _scope(method="GET", path="/v1/models"),
    ]
    for scope in scopes * 2:
        expected = lean.excluded_urls.url_disabled(asgi.get_host_port_url_tuple(scope)[2])
        assert lean._excluded(scope) is expected, scope
    assert [lean._excluded(scope) for scope in scopes] == [
        False,
        True,
        True,
        True,
        False,
        True,
        True,
        False,
        True,
        False,
    ]
    assert len(lean.exclusion_cache) == 9  # (a query, a user agent or a method is not part of the URL)


def test_credentials_stay_in_the_api_server():
    """The replay record (what crosses to the export process) has the request's headers but its
    credentials, unless the user captures request headers (then the maintained middleware sanitizes
    them in the export process as configured)."""
    credentials = (
        (b"authorization", b"Bearer sk-live-1"),
        (b"cookie", b"session=2"),
        (b"x-api-key", b"sk-3"),
        (b"proxy-authorization", b"Basic 4"),
        (b"api-key", b"sk-5"),
        (b"Authorization", b"Bearer sk-6"),  # (ASGI names are lowercase; a server that sent it as it came)
    )
    from otel_llm.vllm.export.wire import ReplayRecord

    scope = _scope(extra=credentials)
    span = deferred.DeferredTracer(TracerProvider()).start_span("POST", _type=export_http.ServerSpan)
    span.response = None
    span.response_started({"type": "http.response.start", "status": 200, "headers": []})
    span.end()
    lean = _lean()
    lean.meter_scope, lean.redacts = ("fastapi", "1", None), False
    record = ReplayRecord(
        *lean._replay_record(span, ("POST /v1/chat/completions", {"http.route": "/v1/chat/completions"}), scope, 0.25)
    )
    assert [name for name, _ in record.headers] == [b"host", b"user-agent", b"content-type"]
    assert b"sk-" not in repr(record).encode() and "sk-" not in repr(record)
    assert record.start == (200, [], False) and record.duration_s == 0.25  # (no status set on the span after it)
    assert record.route_attributes == {"http.route": "/v1/chat/completions"} and record.end_ns == span.end_ns
    lean.http_capture_headers_server_request = [".*"]
    span.response = None
    record = ReplayRecord(*lean._replay_record(span, ("POST", {}), scope, 0.25))
    assert len(record.headers) == 3 + len(credentials) and record.start is None


def test_a_failing_replay_sends_the_span_as_the_api_server_made_it():
    """The export process: when the maintained middleware cannot be replayed on a record, the
    request's spans go as they came (the HTTP span without its HTTP attributes), the failure counted."""
    from otel_llm import warn
    from otel_llm.vllm.export.process import Exporter

    exporter = Exporter(
        {"resource": {}, "version": __version__, "traces": False, "metrics": False, "usage_events": False}
    )
    before = warn.failures().get("replaying an HTTP request's middleware", 0)
    span = ("GET", 1, 2, 1, "", 0, False, 0, SpanKind.SERVER.value, 10, 20, {"a": 1}, None, [], [])
    bad = (("fastapi", "1", None), False, *span[:4], "", 0, False, 0, True, 10, 20, {"a": 1}, None, [])
    bad += ({}, ("http",), [], None, ("not", "a start"), 0.1)
    assert exporter.replay_http([], bad) == [span]
    assert warn.failures()["replaying an HTTP request's middleware"] == before + 1
    before = warn.failures().get("reading an HTTP request's replay record", 0)
    assert exporter.replay_http([], bad[:-1]) == []  # (a record cut short: no span to send)
    assert warn.failures()["reading an HTTP request's replay record"] == before + 1


def test_the_header_getter_answers_as_the_asgi_getter():
    """LeanMiddleware's context extraction reads headers with its own getter: the same answers as the
    instrumentation's asgi_getter (values decoded alike, names matched lowercased, repeats kept)."""
    from opentelemetry.instrumentation.asgi import asgi_getter

    from otel_llm.vllm.export.http import _header_getter

    scopes = [
        {
            "headers": [
                (b"traceparent", b"00-1-2-01"),
                (b"Baggage", b"a=1"),
                (b"baggage", b"b=\xff"),
                (b"x-\xc3\xa9", b"\xc3\xa9t\xc3\xa9"),
                (b"tracestate", b""),
            ]
        },
        {"headers": [(b"TRACEPARENT", b"00-3-4-01")]},
        # each name once and lowercase: the index made in C (`_OneEach`)
        {
            "headers": [
                (b"traceparent", b"00-5-6-01"),
                (b"baggage", b"c=3"),
                (b"tracestate", b""),
                (b"x-\xc3\xa9", b"v"),
            ]
        },
        {"headers": []},
        {},
    ]
    for scope in scopes:
        for key in ("traceparent", "TraceParent", "baggage", "tracestate", "x-\u00e9", "missing"):
            assert _header_getter.get(scope, key) == asgi_getter.get(scope, key), (scope, key)


def _models_app(hand_over):
    """An app whose GET /v1/models records (the current span, the current baggage) in `seen`, its HTTP
    span on the replayed path (spans handed to `hand_over`): (app, seen)."""
    from opentelemetry import baggage

    seen = []
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        seen.append((trace.get_current_span(), baggage.get_all()))
        return {}

    _instrument_replayed(app, hand_over)
    return app, seen


def test_the_replayed_span_is_current_in_the_app_as_the_maintained_middleware_makes_it():
    """ReplayingMiddleware makes the HTTP span current as the maintained middleware does
    (`_start_internal_or_server_span`, then `use_span`), in one attach: inside the app the span is the
    current one, a SERVER child of the client's traceparent, and the client's baggage is current with
    it; after the request the context is the one before it."""
    from opentelemetry import context
    from starlette.testclient import TestClient

    ended = []
    app, seen = _models_app(ended.append)
    before = context.get_current()
    with TestClient(app) as client:
        client.get(
            "/v1/models",
            headers={
                "traceparent": f"00-{REMOTE_PARENT.trace_id:032x}-{REMOTE_PARENT.span_id:016x}-01",
                "baggage": "tenant.id=acme",
            },
        )
    assert context.get_current() == before
    assert app.middleware_stack.app.replayed  # (HeldUntilRecorded(ReplayingMiddleware))
    ((span, current_baggage),) = seen
    assert isinstance(span, deferred.DeferredSpan) and ended[-1] is span  # (handed over when it ended)
    assert (span._kind, span._parent.trace_id, span._parent.span_id, span._parent.is_remote) == (
        SpanKind.SERVER,
        REMOTE_PARENT.trace_id,
        REMOTE_PARENT.span_id,
        True,
    )
    assert span.get_span_context().trace_id == REMOTE_PARENT.trace_id
    assert current_baggage == {"tenant.id": "acme"}


@pytest.mark.parametrize(
    "headers, parent, expected_baggage",
    [
        ({"x-tenant-id": "acme"}, None, {}),  # neither header: the default propagator is not asked
        ({"baggage": "tenant.id=acme"}, None, {"tenant.id": "acme"}),
        ({"traceparent": f"00-{REMOTE_PARENT.trace_id:032x}-{REMOTE_PARENT.span_id:016x}-01"}, REMOTE_PARENT, {}),
    ],
)
def test_the_replayed_span_takes_its_parent_as_the_default_propagator_extracts_it(headers, parent, expected_baggage):
    """Without a traceparent or baggage header the replayed path makes the HTTP span a root span in an
    empty context without asking the API's default propagator (which extracts exactly that); with
    either header it asks it."""
    from starlette.testclient import TestClient

    app, seen = _models_app(lambda span: None)
    with TestClient(app) as client:
        client.get("/v1/models", headers=headers)
    ((span, current_baggage),) = seen
    assert isinstance(span, deferred.DeferredSpan) and span._kind == SpanKind.SERVER
    if parent is None:
        assert span._parent is None
    else:
        assert (span._parent.trace_id, span._parent.span_id, span._parent.is_remote) == (
            parent.trace_id,
            parent.span_id,
            True,
        )
    assert current_baggage == expected_baggage


def test_the_replayed_request_kind_is_the_maintained_exclusion_route_and_counter_attributes():
    """LeanMiddleware keeps, per request kind, whether it is excluded, its span name and route attributes
    (FastAPI's, from the app's routes) and the active-requests counter's attributes: for requests that
    differ in path, method, Host, scheme and server, each equals what the maintained functions answer."""
    from opentelemetry.instrumentation import asgi
    from opentelemetry.util.http import parse_excluded_urls

    from otel_llm.vllm.export.http import _EXCLUDED, _header_getter

    app = FastAPI()
    app.add_api_route("/v1/chat/completions", lambda: {}, methods=["POST"])
    app.add_api_route("/v1/models", lambda: {}, methods=["GET"])
    lean = _lean()
    lean.excluded_urls = parse_excluded_urls("/health")
    scopes = [
        _scope(),
        _scope(path="/health"),
        _scope(method="GET", path="/v1/models"),
        _scope(path="/v1/unknown"),
        _scope(host=b"other:8000"),
        _scope(scheme="https", server=("10.0.0.2", 8001)),
        _scope(agent=b"curl/8", query=b"a=1"),  # (the same kind as the first)
    ]
    for scope in scopes * 2:
        scope = {**scope, "app": app}
        found = lean._request_kind(scope, _header_getter.index(scope["headers"]))
        if lean.excluded_urls.url_disabled(asgi.get_host_port_url_tuple(scope)[2]):
            assert found is _EXCLUDED
            continue
        mode = lean._sem_conv_opt_in_mode
        active = asgi._parse_active_request_count_attrs(asgi.collect_request_attributes(scope, mode), mode)
        assert found == (lean.default_span_details(scope), tuple(active.items()))
    assert len(lean.request_cache) == 6


def test_recording_an_escaping_exception_never_raises_one_of_ours():
    """ReplayingMiddleware records an exception that leaves the app on the HTTP span as the maintained
    `use_span` does (an event, status ERROR with str(exc)); when that text cannot be made, the failure
    is ours, counted, and the app's exception goes on (replayed_call re-raises it)."""
    from otel_llm import warn

    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no text")

    tracer = deferred.DeferredTracer(TracerProvider())
    span = tracer.start_span("GET /v1/models", kind=SpanKind.SERVER)
    export_http._record_escaping(span, ValueError("the engine is gone"))
    assert span._status == (StatusCode.ERROR.value, "ValueError: the engine is gone")
    assert [event[0] for event in span._events] == ["exception"]

    before = warn.failures().get("recording an exception on the HTTP server span", 0)
    export_http._record_escaping(span, Unprintable())
    assert warn.failures()["recording an exception on the HTTP server span"] == before + 1


@pytest.mark.parametrize("handler", ["default", "debug", "async handler", "sync handler"])
def test_the_replayed_path_answers_an_exception_as_starlettes_server_error_middleware(handler):
    """The replayed path runs the ServerErrorMiddleware that FastAPIInstrumentor puts inside the
    maintained middleware itself (http.serve_server_error, one send wrapper per stream chunk instead
    of two): an exception from the app gets the same response as from Starlette's own, with its
    debug page or a handler of the user's, and a stream that fails after its start gets no second
    response."""
    from fastapi.responses import PlainTextResponse, StreamingResponse
    from opentelemetry.sdk.metrics import MeterProvider

    from otel_llm.config import Settings
    from otel_llm.vllm import http

    def app_with(instrumented: bool):
        app = FastAPI(debug=handler == "debug")

        @app.get("/fails")
        async def fails():
            raise ValueError("the engine is gone")

        @app.get("/fails-later")
        async def fails_later():
            async def chunks():
                yield "data: 1\n\n"
                raise ValueError("the engine is gone")

            return StreamingResponse(chunks(), media_type="text/event-stream")

        if handler == "async handler":

            @app.exception_handler(Exception)
            async def answer(request, exc):
                return PlainTextResponse(f"sorry: {exc}", status_code=503)

        elif handler == "sync handler":
            app.add_exception_handler(Exception, lambda request, exc: PlainTextResponse(f"{exc}!", status_code=502))
        if instrumented:
            spans = []
            provider = deferred.DeferredTracerProvider(deferred.DeferredTracer(TracerProvider()), spans.append)
            export_http.instrument_app(app, Settings(), provider, offload_metrics=True, meter_provider=MeterProvider())
        return app

    def sent(app, path: str) -> list:
        """The ASGI messages the app sends for one GET of `path` (the exception goes on, as from Starlette's)."""
        messages: list = []
        requests = [{"type": "http.request", "body": b"", "more_body": False}]

        async def receive():  # (the request, then no disconnect: a stream listens for one)
            if requests:
                return requests.pop()
            await asyncio.Event().wait()

        async def send(message):
            messages.append(message)

        scope = {**_scope(method="GET", path=path), "app": app}
        with pytest.raises(ValueError, match="the engine is gone"):
            asyncio.run(app(scope, receive, send))
        if handler == "debug":  # (its page shows the traceback: our frames are in it)
            return [(m["type"], m.get("status"), "the engine is gone" in m.get("body", b"").decode()) for m in messages]
        return [{key: value for key, value in m.items() if key != "headers"} for m in messages]

    instrumented = app_with(True)
    got = [sent(instrumented, "/fails"), sent(instrumented, "/fails-later")]
    lean = instrumented.middleware_stack.app
    assert lean.replayed and http.server_error_middleware(lean.app) is lean.server_errors is not None
    bare = app_with(False)
    assert got == [sent(bare, "/fails"), sent(bare, "/fails-later")]
    status = got[0][0][1] if handler == "debug" else got[0][0]["status"]
    assert status == {"default": 500, "debug": 500, "async handler": 503, "sync handler": 502}[handler]
    assert [m["type"] if isinstance(m, dict) else m[0] for m in got[1]] == [
        "http.response.start",
        "http.response.body",
    ]  # (the stream's first chunk: no second response after the start)


def test_a_body_chunk_with_more_to_come_goes_straight_to_the_next_send():
    """The HTTP span's send (http._ending_send): a body chunk with more to come is the next send's own
    call (no coroutine of ours per chunk), and so is the response start, after it went to `on_other`;
    the last body ends the span after it is sent."""
    from otel_llm.vllm import http

    seen: list = []

    class Span:
        def end(self):
            seen.append("end")

    def send(message):
        seen.append(message["type"])
        return ("sent", message)

    start = {"type": "http.response.start", "status": 200, "headers": []}
    chunk = {"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True}
    last = {"type": "http.response.body", "body": b"", "more_body": False}

    async def awaited(message):
        seen.append(message["type"])

    otel_send = http._ending_send(Span(), send, lambda message: seen.append(("on_other", message["status"])))
    assert otel_send(chunk) == ("sent", chunk)  # (the next send's own return value)
    assert otel_send(start) == ("sent", start) and seen[-2:] == [("on_other", 200), "http.response.start"]
    otel_send = http._ending_send(Span(), awaited, lambda message: seen.append(("on_other", message["status"])))
    seen.clear()

    async def run():
        await otel_send(start)
        await otel_send(chunk)
        await otel_send(last)

    asyncio.run(run())
    assert seen == [("on_other", 200), "http.response.start", "http.response.body", "http.response.body", "end"]


def test_a_replayed_streams_chunks_pass_no_server_error_middleware_wrapper():
    """On the replayed path the HTTP layer's one wrapper of the response's messages is ours: the outer
    ServerErrorMiddleware FastAPIInstrumentor adds (and the inner one, whose part `replayed_call` does) put
    no `_send` of theirs between the app and the server; a chunk with more to come reaches the server's
    send from Starlette's own code, our wrapper returning the server's awaitable. An app not instrumented
    has its one ServerErrorMiddleware's."""
    import sys

    from fastapi.responses import StreamingResponse

    def app_with(instrumented: bool):
        app = FastAPI()

        @app.get("/v1/stream")
        async def stream():
            async def chunks():
                for i in range(3):
                    yield f"data: {i}\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")

        if instrumented:
            _instrument_replayed(app)
        return app

    def wrappers(app) -> list[list[str]]:
        callers: list[list[str]] = []
        received: list = []

        async def receive():  # (then the client stays: Starlette's disconnect listener waits, cancelled at the end)
            if received:
                await asyncio.Event().wait()
            received.append(True)
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            if message.get("more_body"):
                frame, names = sys._getframe(1), []
                while frame is not None and "starlette/responses.py" not in frame.f_code.co_filename:
                    names.append(f"{frame.f_code.co_filename.rsplit('/', 2)[-2]}.{frame.f_code.co_name}")
                    frame = frame.f_back
                callers.append(names)

        asyncio.run(app({**_scope(method="GET", path="/v1/stream"), "app": app}, receive, send))
        return callers

    # Starlette's two `sender`s (its exception handling, the app's and the route's) in both
    assert wrappers(app_with(False)) == [["middleware._send", "starlette.sender", "starlette.sender"]] * 3
    assert wrappers(app_with(True)) == [["starlette.sender", "starlette.sender"]] * 3


def test_an_exception_with_no_response_started_gets_the_outer_server_error_middlewares_500():
    """Where the app inside the maintained middleware is no ServerErrorMiddleware whose part the replayed path
    does itself, an exception before any response gets, on the replayed path, the 500 that FastAPIInstrumentor's
    outer ServerErrorMiddleware sends on the maintained path, and goes on."""

    async def raising(scope, receive, send):
        raise ValueError("the engine is gone")

    app = FastAPI()
    _instrument_replayed(app)
    front = app.build_middleware_stack()
    front.app.app = front.app.replayed_app = raising
    front.app.server_errors = None

    def sent(asgi_app) -> list:
        messages: list = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            messages.append(message)

        with pytest.raises(ValueError, match="the engine is gone"):
            asyncio.run(asgi_app({**_scope(method="GET", path="/v1/models"), "app": app}, receive, send))
        return messages

    replayed, maintained = sent(front), sent(front.outer)  # (the outer's app: the maintained `__call__`)
    assert replayed == maintained and replayed[0]["status"] == 500 and replayed[1]["body"] == b"Internal Server Error"


def test_the_header_index_follows_a_list_that_grew():
    from otel_llm.vllm.export.http import _header_getter

    headers = [(b"traceparent", b"00-1-2-01")]
    scope = {"headers": headers}
    assert _header_getter.get(scope, "baggage") is None
    headers.append((b"Baggage", b"a=1"))
    assert _header_getter.get(scope, "baggage") == ["a=1"]


def test_the_export_sink_hands_the_export_process_report_to_the_exit_flush(export_env):
    """ExportProcessSink.close (what the bounded exit flush calls, otel_llm/sdk/shutdown.py) returns what
    the export process could not export, so the API server's one warning counts both processes."""
    from opentelemetry.sdk.metrics import MeterProvider

    from otel_llm.vllm.export.sink import ExportProcessSink

    export_env("http://127.0.0.1:9")  # (refused: nothing exported)
    plan = {"traces": True, "metrics": False, "usage_events": False, "resource": dict(RESOURCE.attributes)}
    sink = ExportProcessSink(
        TracerProvider(resource=RESOURCE), MeterProvider().get_meter("t"), {**plan, "schema_url": None}, __version__, 5
    )
    sink.start()
    span = sink.tracer.start_span("chat tiny")
    span.end()
    sink.finish(span)
    # (the bound counts from the close: the export process, started just now, must have started up within it,
    # which on a busy machine took more than 3 s)
    report = sink.close(10)
    assert report is not None and report["spans"] == 1, report


def test_a_request_message_and_a_sweep_marshal_as_they_are():
    """What the request path hands the export process is plain tuples (the named tuples of wire.py made
    plain): marshal takes a whole message as it is, never through the slow path that cleans values
    (wire.plain, meant for attribute values of unusual types)."""
    import marshal

    from opentelemetry.sdk.metrics import MeterProvider

    from otel_llm.vllm.export.sink import ExportProcessSink
    from otel_llm.vllm.request_metrics import Measurement, MetricKey

    plan = {"traces": True, "metrics": True, "usage_events": False, "resource": dict(RESOURCE.attributes)}
    sink = ExportProcessSink(
        TracerProvider(resource=RESOURCE), MeterProvider().get_meter("t"), {**plan, "schema_url": None}, __version__, 5
    )
    key = MetricKey("chat", "tiny", "tiny", "acme", None, None)
    span = sink.tracer.start_span("chat tiny", attributes={semconv.GEN_AI_OPERATION_NAME: "chat"})
    sink.child_span(span, None, semconv.SPAN_QUEUE, T0, T0 + 10, None)
    sink.record_request(span, None, Measurement(key, None, 0.1, 0.01, 0.5, (10, 4, 16), 0.2, 0.05, (8, 6)))
    span.outbox.http_replay = (
        *(("fastapi", "1", None), True, "POST /x", 1, 2, 1, "", 0, False, 0, True, T0, T0 + 5, {}, None, []),
        {},
        ("http", {"version": "3.0"}, "1.1", "POST", "http", "/x", b"/x", b"", "", ("10.0.0.7", 5123), ("10.0.0.1", 80)),
        *([(b"host", b"x")], None, (200, [], False), 0.5),
    )
    span.end()
    message = span.outbox.message()
    assert marshal.loads(marshal.dumps(message)) == message
    sent = []
    sink.channel.send_progress = sent.append
    sink.count_progress([(key, (10, 4, 7))])
    assert marshal.loads(marshal.dumps(sent[0])) == [(tuple(key), (10, 4, 7))]


@pytest.mark.parametrize("sampled, local_parent", [(True, False), (False, False), (True, True)])
def test_a_requests_end_built_in_the_export_process_equals_the_one_built_in_process(
    export_env, monkeypatch, sampled, local_parent
):
    """RequestTelemetry hands the export process its span unended and the request's facts
    (request_facts.py); the span's end attributes, its phase spans and its metrics built there are
    the ones the SDK builds from the same facts in the API server, field for field (the phase spans'
    own ids aside: the export process makes them). Under a sampled parent (an HTTP server span, a
    remote one) its start attributes are made there too (DeferredTracer.start_span's `_start_values`)."""
    from types import SimpleNamespace

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from test_request_telemetry import state

    from otel_llm.config import Settings
    from otel_llm.vllm import request_telemetry
    from otel_llm.vllm.export.sink import ExportProcessSink
    from otel_llm.vllm.request_telemetry import RequestInfo, start_request
    from otel_llm.vllm.sink import InProcessSink
    from otel_llm.vllm.telemetry import Telemetry

    wall, mono = T0 / 1e9 + 2.0, 5000.0  # the end: 2 s after the start, engine clock at 5000 s
    monkeypatch.setattr(
        request_telemetry,
        "time",
        SimpleNamespace(time_ns=lambda: int(wall * 1e9), time=lambda: wall, monotonic=lambda: mono),
    )
    stats = SimpleNamespace(
        queued_ts=mono - 1.5,
        scheduled_ts=mono - 1.4,
        first_token_ts=mono - 1.0,
        last_token_ts=mono - 0.2,
        first_token_latency=0.61,
        num_generation_tokens=9,
        num_preemptions=1,
    )

    def one_request(sink, meter):
        tel = Telemetry(sink, meter, Settings())
        remote = REMOTE_PARENT if sampled else SpanContext(REMOTE_PARENT.trace_id, REMOTE_PARENT.span_id, True)
        parent = trace.set_span_in_context(NonRecordingSpan(remote))  # (parent based: sampled as it is)
        info = RequestInfo(operation="chat", model="tiny", max_tokens=9, tenant="acme", stream=True, top_k=3)
        links = [Link(SpanContext(0x1234, 0x5678, is_remote=True), {"otel_llm.test": 1})]
        if local_parent:  # (left open: not exported)
            parent, links = trace.set_span_in_context(sink.tracer.start_span("POST", parent, start_time=T0)), None
        record = start_request(tel, info, start_ns=T0, context=parent, links=links)
        record.first_chunk_ns = T0 + 700_000_000
        record.attach_engine_request(state("r1", prompt_len=12, output_tokens=9, cached=4, st=stats))
        record.on_engine_finished(SimpleNamespace(request_id="r1"), "length")
        record.end(error_type="EngineDeadError", error_message="engine died (key sk-live-0123456789abcdefghij)")
        return record

    def comparable(spans) -> list:
        genai = next(s for s in spans if s.name.startswith("chat"))
        return sorted(
            (s.name, s.parent_span_id == genai.span_id, s.start_ns, s.end_ns, s.attributes, s.status, s.status_message)
            for s in spans
        ) + [(genai.span_id, genai.parent_span_id, genai.trace_id, genai.events, genai.links)]

    with Receiver(grpc=False) as sdk_receiver, Receiver(grpc=False) as our_receiver:
        export_env(sdk_receiver.endpoint)
        provider = TracerProvider(resource=RESOURCE, id_generator=Sequence())
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        reader = InMemoryMetricReader()
        meter = MeterProvider(metric_readers=[reader], resource=RESOURCE).get_meter("t")
        one_request(InProcessSink(provider.get_tracer(semconv.VLLM_SCOPE, __version__), meter), meter)
        provider.shutdown()
        expected_points = {
            m.name: [
                (dict(p.attributes), getattr(p, "sum", None), getattr(p, "value", None)) for p in m.data.data_points
            ]
            for rm in reader.get_metrics_data().resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
            if m.name.startswith("otel_llm.server.")
        }

        export_env(our_receiver.endpoint)
        plan = {"traces": True, "metrics": True, "usage_events": False, "resource": dict(RESOURCE.attributes)}
        sink = ExportProcessSink(
            TracerProvider(resource=RESOURCE, id_generator=Sequence()),
            MeterProvider().get_meter("t"),
            {**plan, "schema_url": None},
            __version__,
            5,
        )
        sink.start()
        record = one_request(sink, MeterProvider().get_meter("t"))
        # its start attributes' values went to the export process (made there) wherever the sampler's
        # answer was known without them (ParentBased's defaults: a sampled parent, remote or local)
        assert (type(record.span) is deferred.RequestSpan) == sampled
        got_points = our_receiver.wait_for(
            lambda r: [p for p in r.latest_metrics() if p.name.startswith("otel_llm.server.")]
        )
        sink.close(5)  # (the export process flushes its spans and exits)

        assert len(our_receiver.spans) == len(sdk_receiver.spans) == (4 if sampled else 0)
        assert expected_points[semconv.SERVER_REQUESTS]
        got = {}
        for p in got_points:
            got.setdefault(p.name, []).append((p.attributes, p.total, p.value))
        for name, points in expected_points.items():
            assert sorted(map(repr, got[name])) == sorted(map(repr, points)), name
        if not sampled:
            return
        assert comparable(our_receiver.spans) == comparable(sdk_receiver.spans)
        genai = next(s for s in our_receiver.spans if s.name.startswith("chat"))
        assert genai.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == 12
        assert genai.attributes[semconv.VLLM_PREEMPTIONS] == 1
        assert genai.attributes[semconv.GEN_AI_REQUEST_TOP_K] == 3
        assert genai.attributes[semconv.TENANT_ID] == "acme"
        if not local_parent:
            assert [(link.trace_id, link.span_id) for link in genai.links] == [
                (format(0x1234, "032x"), "0" * 12 + "5678")
            ]
        assert "sk-live" not in genai.status_message


def test_a_request_whose_build_fails_in_the_export_process_goes_with_its_start_attributes(monkeypatch):
    """A failure building a request's end in the export process (request_facts.build) is counted, and
    the span still goes, ended at the request's end with what it started with; the rest of the message
    (its HTTP span) is not lost with it."""
    from otel_llm import warn
    from otel_llm.vllm.export import process

    def broken(*args):
        raise RuntimeError("injected")

    monkeypatch.setattr(process, "build", broken)
    exporter = process.Exporter(
        {"resource": {}, "version": __version__, "traces": False, "metrics": False, "usage_events": False}
    )
    span = deferred.DeferredTracer(TracerProvider()).start_span("chat tiny", attributes={"a": 1}, start_time=T0)
    from otel_llm.vllm.request_facts import RequestFacts

    facts = tuple(RequestFacts(*[None] * len(RequestFacts._fields))._replace(start_ns=T0, end_ns=T0 + 50, engines=[]))
    # its start attributes on the span, or as the values the export process makes them from
    start_values = (semconv.OP_CHAT, "tiny", *[None] * 13, True, None)
    made = {
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
        semconv.GEN_AI_PROVIDER_NAME: semconv.PROVIDER_VLLM,
        semconv.GEN_AI_REQUEST_MODEL: "tiny",
        semconv.GEN_AI_REQUEST_STREAM: True,
    }
    unmade = tuple(span.record(0))[:11] + ({},) + tuple(span.record(0))[12:]
    what = "building a request's span in the export process"
    for request, attributes in (
        ((tuple(span.record(0)), True, facts, None), {"a": 1}),
        ((unmade, True, facts, start_values), made),
    ):
        before = warn.failures().get(what, 0)
        spans, measurement = exporter.build_request(request)
        assert warn.failures()[what] == before + 1
        [record] = [wire.SpanRecord(*s) for s in spans]
        assert (record.name, record.start_ns, record.end_ns) == ("chat tiny", T0, T0 + 50)
        assert record.attributes == attributes
        assert measurement is None


def test_a_replay_record_with_values_marshal_does_not_take_is_made_plain():
    """The replayed path's record carries its server span's attributes and events: where one holds a value
    marshal does not take, wire.plain cleans them as the SDK's BoundedAttributes does (a str subclass made a
    str, a value of a type the SDK does not take left as None), as it cleans every other span's."""
    import marshal

    from otel_llm.vllm.export.wire import REQUEST, ReplayRecord, plain

    class Name(str):
        pass

    attributes = {"a": Name("b"), "bad": object()}
    record = (("fastapi", "1", None), False, "GET /x", 1, 2, 1, "", 0, False, 0, True, 10, 20, attributes, None)
    record += ([("exception", {"x": Name("y")}, 15)], {}, ("http",), [], None, None, 0.1)
    message = (REQUEST, [([], None, None, None, None, None, record, None)])
    with pytest.raises(ValueError):
        marshal.dumps(message)
    made = plain(message)
    replay = ReplayRecord(*made[1][0][6])
    assert replay.attributes == {"a": "b", "bad": None} and type(replay.attributes["a"]) is str
    assert replay.events == [("exception", {"x": "y"}, 15)] and type(replay.events[0][1]["x"]) is str
    assert marshal.loads(marshal.dumps(made)) == made
