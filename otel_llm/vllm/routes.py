"""vLLM's HTTP routes that reach the engine: one GenAI span per logical request on every one.

The handler hooks (hooks.py) give the richest spans, but many routes reach the engine without
passing one: Responses API tool turns, chat batch, the pooling endpoints, /inference/v1/generate,
speech-to-text... Each route of ROUTES has its ASGI app wrapped so that the request is in scope
while vLLM serves it. A handler hook running inside makes the span as before; otherwise the first
engine request of the route starts the span (at the request's arrival, with the operation of the
route and the request parameters read from its JSON body), every later one attaches to the same
span, and the span ends when the response has been sent. A route that answers 4xx/5xx without
reaching the engine gets an error span too. A handler-hooked route's send also watches a stream its
handler hands over (`take_stream`): its first chunk timed, then its span ended by its engine
requests, or at its [DONE] chunk where they cannot end it. Where the HTTP server span's send on the
export process's replayed path (otel_llm/vllm/export/http.py `ServerSpan.sending`) is behind the route,
the route watches through it and adds no send of its own: a stream's chunks pass one function of ours.

The table is also the rejection table: a request FastAPI rejects on one of these paths before any
handler runs gets an error span (hooks.validation_rejection).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect

from otel_llm import semconv
from otel_llm.sdk import current
from otel_llm.vllm import contract
from otel_llm.vllm.request_telemetry import RequestTelemetry, end_with_exception, request_info, start_request
from otel_llm.vllm.telemetry import Telemetry
from otel_llm.warn import failed, guarded

_log = logging.getLogger("otel_llm.vllm")


@dataclass(frozen=True)
class Route:
    operation: str | None  # None: the handler decides (SageMaker's /invocations dispatches by body)
    # a handler hook makes this route's span; the route only scopes it (no per-chunk work here)
    handler_hooked: bool = False
    api_type: str | None = None


ROUTES: dict[str, Route] = {
    "/v1/chat/completions": Route(semconv.OP_CHAT, handler_hooked=True),
    "/v1/completions": Route(semconv.OP_TEXT_COMPLETION, handler_hooked=True),
    "/v1/responses": Route(semconv.OP_CHAT, handler_hooked=True, api_type=semconv.OPENAI_API_TYPE_RESPONSES),
    "/v1/messages": Route(semconv.OP_CHAT, handler_hooked=True),  # Anthropic, through the chat handler
    "/cohere/v2/chat": Route(semconv.OP_CHAT, handler_hooked=True),  # Cohere, through the chat handler
    # ServingEmbedding is hooked; token-embed models (vLLM >= 0.33) reach the engine without it
    "/v1/embeddings": Route(semconv.OP_EMBEDDINGS, handler_hooked=True),
    "/v1/chat/completions/batch": Route(semconv.OP_CHAT),
    "/v2/embed": Route(semconv.OP_EMBEDDINGS),
    "/pooling": Route(semconv.OP_POOLING),
    "/classify": Route(semconv.OP_CLASSIFY),
    "/score": Route(semconv.OP_SCORE),
    "/v1/score": Route(semconv.OP_SCORE),
    "/rerank": Route(semconv.OP_RERANK),
    "/v1/rerank": Route(semconv.OP_RERANK),
    "/v2/rerank": Route(semconv.OP_RERANK),
    "/generative_scoring": Route(semconv.OP_GENERATIVE_SCORING),
    "/inference/v1/generate": Route(semconv.OP_TEXT_COMPLETION),
    "/v1/decisions": Route(semconv.OP_CHAT),
    "/v1/systemone": Route(semconv.OP_CHAT),  # structured decisions, vLLM 0.32's path
    "/v1/audio/transcriptions": Route(semconv.OP_TRANSCRIPTION),
    "/v1/audio/translations": Route(semconv.OP_TRANSLATION),
    "/invocations": Route(None),
}

# What reaches vLLM's engine without passing through any route above: listed by `otel-llm doctor`.
NOT_COVERED = {
    "/v1/realtime": "WebSocket sessions (realtime transcription): engine requests get the AsyncLLM.generate span",
    "vllm serve --grpc": "the gRPC frontend bypasses the Python HTTP server: nothing is traced",
    "VLLM_USE_RUST_FRONTEND=1": "the Rust frontend bypasses the Python API server: nothing is traced",
}


_SSE_DONE = contract.SSE_DONE.encode()  # (as the server sends it)


class WatchingServerSpan:
    """An HTTP server span whose send is the send of every app inside it (the export process's replayed
    path: otel_llm/vllm/export/http.py `ServerSpan.sending`), and shows each message to `watch` first
    where that is set: a handler-hooked route inside it watches a stream through it (`RouteScope.watch`)
    and adds no send of its own."""

    __slots__ = ()
    watch: Callable[[dict], None] | None


class RouteScope:
    """One request on a ROUTES path while vLLM serves it."""

    __slots__ = (
        "route",
        "scope",
        "start_ns",
        "record",
        "status",
        "body",
        "send",
        "sender",
        "server_span",
        "stream",
        "streamed",
    )

    def __init__(self, route: Route, scope: dict):
        self.route = route
        self.scope = scope
        self.start_ns = time.time_ns()
        self.record: RequestTelemetry | None = None
        self.status: int | None = None
        self.body: list[bytes] | None = None if route.handler_hooked else []
        self.send = None  # a handler-hooked route's send (the server's)
        self.sender = None  # what `forward` calls: `send`, or `watching` while a stream is watched
        self.server_span: WatchingServerSpan | None = None  # the server span whose send a stream is watched through
        self.stream: RequestTelemetry | None = None  # a stream's record while its chunks are watched
        self.streamed = 0  # a stream's record was handed to this route (take_stream): 1, 2 once it sent a chunk

    def forward(self, message):
        """A handler-hooked route's send where no HTTP server span's send watches for it: `sender`'s (the
        server's send, or `watching` until a stream's first chunk or last). A bound method, one small frame
        per message run by the interpreter's own call path: calling the scope itself through a `__call__`
        property (no frame of ours) ran a dozen C functions per message, evicted from the instruction cache
        by each chunk's own work (cachesim.py)."""
        sender = self.sender  # (read as an attribute: `self.sender(...)` looks a slot up the generic way, in C)
        return sender(message)

    def watching(self, message):
        """`forward`'s sender while a stream is watched: `watch`, then send's awaitable (no coroutine of
        ours per message)."""
        self.watch(message)
        return self.send(message)

    def watch(self, message) -> None:
        """A stream's message before it goes out, until its first chunk or, where its engine requests do
        not end it, its last, as streams.py `_StreamTelemetry` does around a stream: the first chunk is
        timed, and from then on the record ends with its engine requests (RequestTelemetry.end_with_engines)
        and nothing more is watched; where it cannot (no engine request, or one finished before the first
        chunk), it ends at the [DONE] chunk or the last one, before it goes out (a server killed after the
        client has the whole response loses no usage record). Never raises."""
        try:  # (`guarded`'s, without its frame)
            if message["type"] == "http.response.body":
                record = self.stream
                if self.streamed == 1:
                    self.streamed = 2
                    record.on_first_chunk()
                    if record.end_with_engines():
                        self.unwatch()
                        return
                if message.get("body") == _SSE_DONE or not message.get("more_body", False):
                    self.unwatch()
                    record.end()
        except Exception:  # noqa: BLE001
            failed("watching a stream's chunks")
            self.unwatch()  # (our fault: its route ends it when the response is done)

    def unwatch(self) -> None:
        """No more watching: each message goes to the server's send, and nothing holds this scope (its
        record is freed without the collector)."""
        self.stream, self.sender = None, self.send
        if self.server_span is not None:
            self.server_span.watch = None


SCOPE: ContextVar[RouteScope | None] = ContextVar("otel_llm_vllm_route", default=None)


def wrap_routes(app, tel: Telemetry) -> int:
    """Wrap the ASGI app of every route of `app` listed in ROUTES; returns how many."""
    wrapped = 0
    for route in getattr(app, "routes", ()):
        spec = ROUTES.get(getattr(route, "path", None))
        inner = getattr(route, "app", None)
        if spec is None or inner is None or getattr(inner, "_otel_llm_route", False):
            continue
        route.app = _route_app(inner, spec, tel)
        wrapped += 1
    return wrapped


def _route_app(inner, spec: Route, tel: Telemetry):
    # (our steps each under a try of their own, as `guarded` would run them, without its frame per request)
    async def app(scope, receive, send):
        try:
            entered = _enter(spec, scope)
        except Exception:  # noqa: BLE001
            failed("putting a request in its route's scope")
            entered = None
        if entered is None:
            return await inner(scope, receive, send)
        state, token = entered
        if not spec.handler_hooked:  # the body (for request parameters) and the status (for errors)
            receive, send = _tee_receive(receive, state), _status_send(send, state, tel)
        else:  # a stream's chunks, where the handler hands its record over (take_stream)
            state.send = send
            if state.server_span is None:  # (else the stream is watched through its send, behind this route)
                state.sender = send
                send = state.forward
        try:
            await inner(scope, receive, send)
        except BaseException as exc:
            guarded("ending a route's span", _finish, state, tel, exc)
            raise
        finally:
            try:
                SCOPE.reset(token)
            except Exception:  # noqa: BLE001
                failed("leaving a route's scope")
        try:
            _finish(state, tel, None)
        except Exception:  # noqa: BLE001
            failed("ending a route's span")

    app._otel_llm_route = True
    return app


def _enter(spec: Route, scope) -> tuple[RouteScope, Any] | None:
    """The request in scope, or None (not HTTP). A handler-hooked route's scope keeps the current span
    where it is the HTTP server span of the export process's replayed path: its `sending` is the send of
    every app inside it."""
    if scope.get("type") != "http":
        return None
    state = RouteScope(spec, scope)
    if spec.handler_hooked:
        span = current.current_context().get(current.SPAN_KEY)
        if isinstance(span, WatchingServerSpan):
            state.server_span = span
    return state, SCOPE.set(state)


def _tee_receive(receive, state: RouteScope):
    async def tee():
        message = await receive()
        try:
            body = state.body
            if body is not None and message.get("type") == "http.request":
                chunk = message.get("body")
                if chunk and sum(map(len, body)) < _MAX_BODY:
                    body.append(chunk)
        except Exception:
            failed("keeping a request body for its parameters")
        return message

    return tee


_MAX_BODY = 1 << 20  # request parameters are read from at most the first MiB of a body


def _status_send(send, state: RouteScope, tel: Telemetry):
    """The response's status, and its span ended just before the last body message goes out (inside
    the HTTP server span, which ends when that message is sent)."""

    async def status_send(message):
        kind = message.get("type")
        if kind == "http.response.start":
            try:
                state.status = int(message.get("status"))
            except Exception:
                failed("reading a response status")
        elif kind == "http.response.body" and not message.get("more_body", False):
            guarded("ending a route's span", _finish, state, tel, None)
        await send(message)

    return status_send


def take_stream(record: RequestTelemetry) -> bool:
    """A handler-hooked route's stream: its route, in scope while the stream is served, watches its
    chunks (RouteScope.watch) instead of a proxy around it (streams.py `_StreamTelemetry`, whose
    once-per-stream work costs the API server more), and ends its record at the end of the response
    where nothing ended it before. False where no route of this request can (not in scope, not
    handler-hooked, or another record)."""
    state = SCOPE.get()
    if state is None or state.send is None or state.record is not record:
        return False
    state.stream = record
    state.streamed = 1
    if state.server_span is not None:
        state.server_span.watch = state.watch
    else:
        state.sender = state.watching
    return True


def _finish(state: RouteScope, tel: Telemetry, exc: BaseException | None) -> None:
    """End the span this route started, or record a route's error that reached no engine."""
    record = state.record
    if record is None:
        if exc is None and state.status is not None and state.status >= 400 and not _traced(state):
            state.record = record = _start(state, tel)
            record.end(error_type=str(state.status), error_message="request failed before reaching the engine")
        return
    if state.server_span is not None:  # (its watch no longer: the scope and its record are freed without the collector)
        state.server_span.watch = None
    state.sender = state.send
    # a handler hook made it and ends it; a stream's with its engine requests or at its last chunk, but where
    # that never came (then a handler-hooked route's status is not kept: 200, ended as below)
    if record.ended or not (record.route_made or record.engine_owned or state.streamed):
        return
    cut = state.stream is not None  # a stream that ended before its last chunk: the client left
    if exc is not None and not (cut and isinstance(exc, ClientDisconnect)):
        end_with_exception(record, exc)
        return
    if cut:
        record.end(aborted=True)
        return
    status = state.status or 200
    if status >= 400:
        record.end(error_type=str(status), error_message=f"HTTP {status}")
    else:
        # a client that left a stream: the response ends quietly, vLLM aborted the engine requests
        record.end(aborted=record.engine_aborted)


def _traced(state: RouteScope) -> bool:
    return bool((state.scope.get("state") or {}).get("otel_llm_traced"))


def claim(record: RequestTelemetry) -> None:
    """A handler hook made `record` for the request in scope: the route adds no span of its own."""
    state = SCOPE.get()
    if state is not None and state.record is None:
        state.record = record


def record_for_engine_request(tel: Telemetry) -> RequestTelemetry | None:
    """The span of the request in scope for an engine request no handler hook claimed: started by
    the first one, shared by the rest; None outside a route or once the route's span ended."""
    state = SCOPE.get()
    if state is None:
        return None
    if state.record is None:
        # on a handler-hooked route (its hook failed, or vLLM took another way) no per-chunk work is
        # done here: the span ends when the engine finishes or aborts the request
        state.record = _start(state, tel, engine_owned=state.route.handler_hooked)
        state.record.route_made = True
        state.scope.setdefault("state", {})["otel_llm_traced"] = True
    return state.record


def _start(state: RouteScope, tel: Telemetry, engine_owned: bool = False) -> RequestTelemetry:
    from starlette.datastructures import Headers

    route = state.route
    body = _json_body(state)
    # lenient: what cannot be read of the caller is left out, the request still gets its span and bill
    caller = tel.attribution.request_caller(Headers(scope=state.scope), body.get, lenient=True)
    info = request_info(
        route.operation or semconv.OP_TEXT_COMPLETION, _body_params(body), caller=caller, api_type=route.api_type
    )
    return start_request(tel, info, start_ns=state.start_ns, engine_owned=engine_owned)


def _json_body(state: RouteScope) -> dict:
    if not state.body:
        return {}
    try:
        body = json.loads(b"".join(state.body))
    except (ValueError, UnicodeDecodeError):  # multipart (audio), or cut at _MAX_BODY
        return {}
    return body if isinstance(body, dict) else {}


def _body_params(body: dict):
    """get(name) over a JSON request body (its `sampling_params` first, as /inference/v1/generate
    nests them), typed as a validated request would be: None for anything else."""
    params = body.get("sampling_params") if isinstance(body.get("sampling_params"), dict) else body

    def get(name):
        value = params.get(name, body.get(name))
        if name in ("stream", "use_beam_search"):
            return value
        if name == "model":
            return value if isinstance(value, str) else None
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    return get
