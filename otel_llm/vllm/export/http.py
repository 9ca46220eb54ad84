"""The HTTP server span and metrics with the export process (otel_llm/vllm/http.py is the mode-neutral part).

The instrumentation's middleware (opentelemetry-instrumentation-asgi's OpenTelemetryMiddleware, as
FastAPIInstrumentor builds it: its attributes, status rules, exclusions and hooks) stays the source of
the HTTP span and metrics, with its per-request work moved off the API server, vLLM's bottleneck at
high request rates (benchmarks/server_overhead.py --part fastapi and --part api):
- With a setup the export process can reproduce (`replayable`) an HTTP request takes the replayed path
  (`HeldUntilRecorded.__call__`, in front of the outer ServerErrorMiddleware, doing the part of both
  ServerErrorMiddlewares, which it skips): the API server checks the exclusions,
  looks the route up (once per method and path), starts the span (ids, parent, sampling: as the maintained
  `_start_internal_or_server_span` does with no span current) and makes it current, counts the
  request as active (in a dict observed at collection: `ActiveRequests`) and keeps plain values:
  the request's ASGI connection scope (its credential headers dropped unless request headers are
  captured), the route template, the response start and the duration, with the server span's fields,
  in one ReplayRecord (otel_llm/vllm/export/wire.py). The export process runs the
  maintained middleware again on them (`HttpReplay`: its own `__call__`, with the API server's span
  context and duration), which sets the span's attributes and status and records the HTTP metrics in
  the same instruments; `merge_replayed` completes the server span with them.
  tests/vllm/test_offload.py compares the exported span and metric points with the maintained
  middleware's, field for field.
- Any other request (a websocket, one inside another span, a hook of the user's) goes through the
  maintained `__call__` (otel_llm/vllm/http.py `LeanMiddleware`), its histograms' values sent along
  (`DeferredHistogram`), the span's message held until they are in (`HeldUntilRecorded`).
"""

from __future__ import annotations

import functools
import logging
import operator
import time
from contextvars import ContextVar

from opentelemetry import context as context_api
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.instrumentation import asgi
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware, asgi_getter
from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags

from otel_llm.config import Settings
from otel_llm.sdk import current, internals
from otel_llm.vllm import http
from otel_llm.vllm.export.deferred import DeferredSpan, DeferredTracer
from otel_llm.vllm.export.wire import HTTP_HISTOGRAMS, REQUEST, SCOPE_KEYS, Outbox, ReplayRecord, SpanRecord
from otel_llm.vllm.http import (
    ROUTE_CACHE_SIZE,
    LeanMiddleware,
    hold_nothing_hook,
    lean_middleware,
    redact_query_hook,
    redacting_hold_nothing_hook,
)
from otel_llm.vllm.routes import WatchingServerSpan
from otel_llm.warn import entry, failed, guard, inline_entry

_log = logging.getLogger("otel_llm.vllm")


def instrument_app(
    app, settings: Settings, tracer_provider, offload_metrics: bool = False, meter_provider=None
) -> bool:
    """tracer_provider: the export process's (deferred spans); offload_metrics: the export process
    records the HTTP metrics (else they are recorded here, through meter_provider: None, the global one)."""
    return http.instrument_app(
        app,
        settings,
        tracer_provider,
        meter_provider,
        take_over=functools.partial(take_over, offload_metrics=offload_metrics),
    )


class ServerSpan(DeferredSpan, WatchingServerSpan):
    """The HTTP server span of a request on the replayed path: its end only marks the time (its fields go
    in the request's ReplayRecord, `ReplayingMiddleware._finish`); `response_started` keeps the response
    start and the status the span had then. `sending` is the app's send: `send`, the server's, behind it,
    and `watch`, where a route watches a stream's messages through it (routes.py `RouteScope.watch`)."""

    __slots__ = ("end_ns", "response", "send", "watch")

    def sending(self, message):
        """The app's send, as the maintained `otel_send` (http.py `_ending_send`, with `response_started`
        for its `on_other`), which also shows the messages to `watch` while a route watches a stream, before
        they go out. A body chunk with more to come and no watch goes straight to `send` (its own
        awaitable): on the replayed path the one frame of ours per chunk of a stream, the HTTP span's and
        the route's (a bound method: the interpreter's own call path, no closure's cells)."""
        send = self.send  # (read as attributes: `self.send(...)` would look the slot up in C on every call)
        watch = self.watch
        if watch is not None:
            watch(message)  # (never raises: RouteScope.watch)
        if message.get("more_body"):
            return send(message)
        if message["type"] == "http.response.body":
            return http._sent_and_ended(self, send, message)
        self.response_started(message)
        return send(message)

    def response_started(self, message) -> None:
        if message["type"] == "http.response.start":
            self.response = (message, self._status)

    @inline_entry("ServerSpan.end")
    def end(self, end_time: int | None = None) -> None:
        try:
            if not self._ended:
                self._ended = True
                self.end_ns = end_time or time.time_ns()
        except Exception:  # noqa: BLE001
            failed("ServerSpan.end")


class ReplayingMiddleware(LeanMiddleware):
    """LeanMiddleware with the export process recording the HTTP metrics: what the export process can
    make again (`replayed`) takes the replayed path (`HeldUntilRecorded.__call__`)."""

    meter_scope: tuple
    replayed = False  # an HTTP request's span and metrics are made by the export process (`HttpReplay`)
    redacts = False  # (with `replayed`) the replay runs the query-redaction hook
    active_cache: dict
    exclusion_cache: dict
    request_cache: dict
    # the app the replayed path calls (`HeldUntilRecorded.__call__`), doing the part of the middleware it is
    # inside, `server_errors`: the ServerErrorMiddleware FastAPIInstrumentor puts inside the maintained one
    replayed_app = None
    server_errors = None

    @inline_entry("LeanMiddleware._begin")
    def _begin(self, scope):
        """What the maintained middleware does before the app, less what the export process does
        again (`HttpReplay`): the exclusion, the route, the span (a ServerSpan: its ids, parent and
        sampling) made current, the active-requests count. None where the maintained `__call__` serves
        the request (inside another span, instrumentation suppressed, a response propagator set) or on a
        failure of ours."""
        try:
            now = current.current_context()
            if now and (
                current.span_in(now) is not trace.INVALID_SPAN or not _replay_parts.is_http_instrumentation_enabled()
            ):
                return None
            if _response_propagator() is not None:
                return None
            headers = scope.get("headers")
            index = _header_getter.index(headers) if headers else _NO_HEADERS
            known = self._request_kind(scope, index)
            if known is _EXCLUDED:
                return _EXCLUDED
            details, active = known
            # the maintained `_start_internal_or_server_span` with no span current: the parent context from
            # the headers, a SERVER span in it, both made current at once (the maintained middleware
            # attaches the extracted context, then the span in `use_span`). The API's default propagator
            # extracts an empty Context where neither of its headers came (most requests): not asked then.
            if _default_propagation(_textmap()) and b"traceparent" not in index and b"baggage" not in index:
                parent = _EMPTY_CONTEXT
                span = self.tracer.start_root_span(details[0], trace.SpanKind.SERVER, ServerSpan)
            else:
                parent = propagate.extract(scope, getter=_header_getter)
                span = self.tracer.start_span(details[0], context=parent, kind=trace.SpanKind.SERVER, _type=ServerSpan)
            if not isinstance(span, ServerSpan):  # (ours failed: a span that records nothing)
                return None
            span.response = span.watch = None
            token = current.attach(Context({**parent, current.SPAN_KEY: span}))  # (trace.set_span_in_context's)
            self.active_requests_counter.add_key(active, 1)
            return span, token, active, details
        except Exception:  # noqa: BLE001
            failed("LeanMiddleware._begin")
            return None

    def _request_kind(self, scope, index: dict):
        """_EXCLUDED, or (span name and route attributes, the active-requests counter's attribute key) of
        an HTTP request: kept per method, scheme, HTTP version, server, Host headers, root path, path and
        the app's routes, which are all the maintained middleware's exclusion, span details and counter
        attributes read (the span details only while the routes are host-independent)."""
        app = scope["app"]
        router = getattr(app, "router", None)  # (Starlette's `routes` property reads it: no frame of its here)
        routes = app.routes if router is None else router.routes
        host = dict.get(index, b"host")  # (a _OneEach's value itself: no list made for it)
        key = (
            scope.get("method"),
            scope.get("scheme"),
            scope.get("http_version"),
            tuple(scope.get("server") or ()),
            tuple(host) if type(host) is list else host,
            scope.get("root_path", ""),
            scope.get("path"),
            id(routes),
            len(routes),
        )
        found = self.request_cache.get(key)
        if found is None:
            if self.excluded_urls and self._excluded(scope):
                found = _EXCLUDED
            else:
                found = self.default_span_details(scope), tuple(self._active_attributes(scope).items())
            if http.may_keep(self.request_cache, routes):
                self.request_cache[key] = found
        return found

    def _excluded(self, scope) -> bool:
        """The maintained exclusion (its URL matched against OTEL_PYTHON_FASTAPI_EXCLUDED_URLS), kept per
        scheme, first Host header, server and path, which are all the URL is made of (the maintained
        `get_host_port_url_tuple` decodes every header of every request to find the Host)."""
        headers = scope.get("headers")
        host = _header_getter.index(headers).get(b"host") if headers else None
        key = (scope.get("scheme"), host[0] if host else None, tuple(scope.get("server") or ()), scope.get("path"))
        found = self.exclusion_cache.get(key)
        if found is None:
            _, _, url = asgi.get_host_port_url_tuple(scope)
            found = self.excluded_urls.url_disabled(url)
            if len(self.exclusion_cache) < ROUTE_CACHE_SIZE:
                self.exclusion_cache[key] = found
        return found

    def _active_attributes(self, scope) -> dict:
        """The active-requests counter's attributes (the maintained middleware's: from the request's
        attributes), kept per method, scheme, HTTP version, server and Host header, which are all
        they read (tests/vllm/test_offload.py checks it against the maintained functions)."""
        headers = scope.get("headers")
        host = tuple(_header_getter.index(headers).get(b"host", ())) if headers else ()
        key = (
            scope.get("method"),
            scope.get("scheme"),
            scope.get("http_version"),
            tuple(scope.get("server") or ()),
            host,
        )
        found = self.active_cache.get(key)
        if found is None:
            mode = internals.asgi_sem_conv_mode(self)
            found = _replay_parts.parse_active_request_count_attrs(asgi.collect_request_attributes(scope, mode), mode)
            if len(self.active_cache) < ROUTE_CACHE_SIZE:
                self.active_cache[key] = found
        return found

    @inline_entry("LeanMiddleware._finish")
    def _finish(self, span: ServerSpan, token, active, details, scope, duration_s: float) -> None:
        """After the app (as the maintained middleware's `finally`): the count, the context, and the
        request's message: its ReplayRecord and what the requests in it handed over."""
        try:
            self.active_requests_counter.add_key(active, -1)
            if token:
                current.detach(token)
            if not span._ended:  # (no last body was sent)
                span.end()
            record = self._replay_record(span, details, scope, duration_s)
            tracer = span._tracer
            if tracer.send is None:
                span.outbox.http_replay = record
                tracer.hand_over(span)
            else:  # (deferred.hand_over's message, made here: a Part with the record alone, then what it adopted)
                tracer.send((REQUEST, [([], None, None, None, tracer.scope, None, record, None), *span.outbox.adopted]))
        except Exception:  # noqa: BLE001
            failed("LeanMiddleware._finish")

    def _replay_record(self, span: ServerSpan, details, scope, duration_s: float) -> tuple:
        """The request's ReplayRecord as a plain tuple (marshal's): the server span's fields, the ASGI
        connection scope's values (its headers but credentials, unless request headers are captured),
        the route template the router matched, the response start (status, headers), the duration."""
        try:  # (a server's scope has them all)
            values = _scope_values(scope)
        except KeyError:
            values = {key: scope[key] for key in SCOPE_KEYS if key in scope}
        headers = scope.get("headers") or []
        # copied without credentials only where there are some: the header index (lowercased names) the
        # span's context was extracted with says so in C
        if self.http_capture_headers_server_request is None:
            index = _header_getter.index(headers)
            if not _CREDENTIAL_HEADERS.isdisjoint(index):
                if type(index) is _OneEach:  # (every name lowercase already)
                    headers = [header for header in headers if header[0] not in _CREDENTIAL_HEADERS]
                else:
                    headers = [header for header in headers if header[0].lower() not in _CREDENTIAL_HEADERS]
        response = span.response
        start = None
        if response is not None:  # (status, headers, whether the span's status was set after it)
            message, status = response
            start = (message["status"], list(message.get("headers") or ()), span._status is not status)
        return (
            self.meter_scope,
            self.redacts,
            span._name,
            *span.context_fields(),
            span._sampled,
            span._start,
            span.end_ns,
            span._attributes,
            span._status,
            span._events,
            details[1],
            values,
            headers,
            getattr(scope.get("route"), "path_format", None),
            start,
            duration_s,
        )

    @inline_entry("ReplayingMiddleware._get_otel_send")
    def _get_otel_send(self, server_span, server_span_name, scope, send, duration_attrs):
        try:
            otel_send = LeanMiddleware._get_otel_send(self, server_span, server_span_name, scope, send, duration_attrs)
            held = _held.get()
            if held is not None and isinstance(server_span, DeferredSpan):
                server_span.outbox.held = True  # its message waits for the metrics recorded after it ends
                held.append(server_span)
            return otel_send
        except Exception:  # noqa: BLE001
            failed("ReplayingMiddleware._get_otel_send")
            return internals.asgi_otel_send(self, server_span, server_span_name, scope, send, duration_attrs)


class _ReplayParts:
    """The maintained instrumentation's functions the replayed path calls by name (private ones
    among them); None when a release lacks one: then the maintained middleware runs as it is."""

    def __init__(self):
        from opentelemetry.instrumentation.utils import is_http_instrumentation_enabled

        self.parse_active_request_count_attrs, self.decode_header_item = internals.asgi_private_functions()
        self.is_http_instrumentation_enabled = is_http_instrumentation_enabled
        for name in ("default_timer", "get_host_port_url_tuple", "collect_request_attributes"):
            getattr(asgi, name)


try:
    _replay_parts: _ReplayParts | None = _ReplayParts()
except (ImportError, AttributeError):
    _log.warning(
        "otel-llm: this opentelemetry-instrumentation-asgi lacks what the export process needs to make "
        "the HTTP server spans: they are made in the API server"
    )
    _replay_parts = None


class _HeaderGetter(type(asgi_getter)):
    """asgi_getter's answers (a header's values, decoded as it decodes them) without decoding every
    header name for each lookup: ASGI names are bytes, compared lowercased."""

    _last: tuple = (None, 0, {})  # (headers, their length, their index): the propagators ask for several keys in a row

    @inline_entry("_HeaderGetter.get")
    def get(self, carrier: dict, key: str):
        try:
            headers = carrier.get("headers")
            if not headers:
                return None
            if not isinstance(headers[0][0], bytes):
                return asgi_getter.get(carrier, key)
            values = self.index(headers).get(key.lower().encode())
            return [_replay_parts.decode_header_item(value) for value in values] if values else None
        except Exception:  # noqa: BLE001 - the maintained getter answers
            failed("_HeaderGetter.get")
            return asgi_getter.get(carrier, key)

    def index(self, headers: list) -> dict:
        """ASGI headers (bytes) by lowercased name, values in order: made once per header list. Where
        each name comes once and lowercase (the ASGI rule; a client rarely repeats one), from one dict
        made in C (`_OneEach`), not a loop of ours over the headers."""
        last = self._last
        if last[0] is headers and last[1] == len(headers):
            return last[2]
        try:
            first = _OneEach(reversed(headers))
            names = b"\n".join(first)
            if len(first) == len(headers) and names == names.lower():
                self._last = (headers, len(headers), first)
                return first
        except (TypeError, ValueError):  # (names that are not bytes: the loop lowercases them as they are)
            pass
        index: dict[bytes, list] = {}
        for name, value in headers:
            name = name.lower()
            found = index.get(name)
            if found is None:
                index[name] = [value]
            else:
                found.append(value)
        self._last = (headers, len(headers), index)
        return index


class _OneEach(dict):
    """An index of headers whose every name comes once: each name's value as a list of one (`index`)."""

    def get(self, name, default=None):
        value = dict.get(self, name)
        return default if value is None else [value]


_header_getter = _HeaderGetter()
_response_propagator, _textmap = internals.global_propagator_readers()
_EXCLUDED = object()
_NO_HEADERS: dict = {}
_EMPTY_CONTEXT = context_api.Context()  # (a Context takes no item once made: one serves every request)


@functools.lru_cache(maxsize=4)
def _default_propagation(propagator) -> bool:
    """internals.default_propagation, per global propagator (set once, at start-up)."""
    return internals.default_propagation(propagator)


_scope_values = operator.itemgetter(*SCOPE_KEYS)
# never sent to the export process unless the user captures request headers (then sanitized there)
_CREDENTIAL_HEADERS = frozenset((b"authorization", b"proxy-authorization", b"cookie", b"x-api-key", b"api-key"))


def take_over(middleware: OpenTelemetryMiddleware, offload_metrics: bool):
    """The ASGI app that replaces the maintained middleware: with the HTTP metrics recorded by the
    export process, ReplayingMiddleware inside HeldUntilRecorded; else LeanMiddleware."""
    scope = internals.meter_instrumentation_scope(middleware.meter)
    if not offload_metrics or scope is None:
        return lean_middleware(middleware)
    lean = lean_middleware(middleware, ReplayingMiddleware)
    lean.active_cache = {}
    lean.exclusion_cache = {}
    lean.request_cache = {}
    lean.meter_scope = (scope.name, scope.version, scope.schema_url)
    for name in HTTP_HISTOGRAMS:
        if getattr(lean, name) is not None:
            setattr(lean, name, DeferredHistogram(name, lean.meter_scope))
    lean.active_requests_counter = ActiveRequests(lean.meter, middleware.active_requests_counter)
    lean.replayed = replayable(lean)
    lean.redacts = _hook(lean) is redacting_hold_nothing_hook
    lean.server_errors = errors = http.server_error_middleware(lean.app)
    lean.replayed_app = lean.app if errors is None else errors.app
    return HeldUntilRecorded(lean)


def _hook(middleware: OpenTelemetryMiddleware):
    hook = middleware.server_request_hook  # (the middleware may wrap it)
    return getattr(hook, "__wrapped__", hook)


def replayable(middleware: OpenTelemetryMiddleware) -> bool:
    """Whether the export process can make this middleware's HTTP spans and metrics again from plain
    values (`HttpReplay`): what it does per request depends on nothing that stays in the API server
    (no hooks but ours, no send spans; a response propagator is checked per request), and the sampler
    reads no attributes (the span is sampled before the export process knows them: the SDK's own
    samplers)."""
    tracer = middleware.tracer
    sampler = getattr(tracer, "sampler", None)
    return (
        _replay_parts is not None
        and isinstance(tracer, DeferredTracer)
        and internals.is_sdk_sampler(sampler)
        and _hook(middleware) in (hold_nothing_hook, redacting_hold_nothing_hook)
        and middleware.client_request_hook is None
        and middleware.client_response_hook is None
        and middleware.exclude_send_span
        and middleware.exclude_receive_span
    )


class DeferredHistogram:
    """One of the middleware's histograms with the export process: the value goes with the request's
    message (the outbox of the server span the record's context holds) and is recorded there."""

    __slots__ = ("name", "meter_scope")

    def __init__(self, name: str, meter_scope: tuple):
        self.name = name
        self.meter_scope = meter_scope

    @inline_entry("DeferredHistogram.record")
    def record(self, amount, attributes=None, context=None) -> None:
        try:
            span = trace.get_current_span(context)
            if isinstance(span, DeferredSpan):
                outbox = span.outbox
                if outbox.http_metrics is None:
                    outbox.http_metrics = (self.meter_scope, [])
                outbox.http_metrics[1].append((self.name, amount, dict(attributes) if attributes else {}))
        except Exception:  # noqa: BLE001
            failed("DeferredHistogram.record")


ACTIVE_REQUESTS_LIMIT = 2000  # attribute sets, as the SDK's default cardinality limit; then its overflow set
_OVERFLOW = (("otel.metric.overflow", True),)


class ActiveRequests:
    """The middleware's active-requests counter with the export process: counted here in a plain dict
    (no SDK measurement per request), observed by the SDK at collection with the counter's name, unit
    and description (the same points: a non-monotonic cumulative sum per attribute set)."""

    def __init__(self, meter, counter):
        from opentelemetry.metrics import Observation

        self._counts: dict[tuple, int] = {}
        self._observation = Observation
        sdk_log = logging.getLogger(internals.INSTRUMENT_CONFLICT_LOGGER)
        conflict = _InstrumentConflict()
        conflict.instrument = counter.name
        sdk_log.addFilter(conflict)  # (the counter is there, unused: the same name again is expected)
        try:
            meter.create_observable_up_down_counter(
                counter.name, callbacks=[self.observe], unit=counter.unit, description=counter.description
            )
        finally:
            sdk_log.removeFilter(conflict)

    @inline_entry("ActiveRequests.add")
    def add(self, amount, attributes=None, context=None) -> None:
        try:
            self.add_key(tuple(attributes.items()) if attributes else (), amount)
        except Exception:  # noqa: BLE001
            failed("ActiveRequests.add")

    def add_key(self, key: tuple, amount: int) -> None:
        """add() with the attributes as their items' tuple (the replayed path keeps them so); over
        ACTIVE_REQUESTS_LIMIT attribute sets, a new one counts in the overflow set."""
        counts = self._counts
        if key not in counts and len(counts) >= ACTIVE_REQUESTS_LIMIT:
            key = _OVERFLOW
        counts[key] = counts.get(key, 0) + amount

    @entry("ActiveRequests.observe", fallback=())
    def observe(self, options=None):
        return [self._observation(count, dict(key)) for key, count in list(self._counts.items())]


class _InstrumentConflict(logging.Filter):
    instrument = ""

    @entry("ActiveRequests: the SDK's log filter", fallback=True)
    def filter(self, record):
        return internals.conflicting_instrument_name(record) != self.instrument


_held: ContextVar[list | None] = ContextVar("otel_llm_http_held", default=None)


class HeldUntilRecorded:
    """Around LeanMiddleware with the export process. An HTTP request whose span and metrics the
    export process makes (`ReplayingMiddleware.replayed`) takes the replayed path here. Any other
    goes through the maintained middleware's `__call__`: the server span ends when the response's
    last body is sent, the middleware records its metrics after that, and this hands the span's
    message over when they are in.

    `in_front_of`: where FastAPIInstrumentor put a ServerErrorMiddleware around the maintained middleware
    (`outer`), a HeldUntilRecorded in front of it takes the requests of the replayed path (it does that
    middleware's part: no wrapper of its on every message) and hands the rest to it."""

    def __init__(self, app: ReplayingMiddleware, outer=None):
        self.app = app
        self.outer = outer  # the ServerErrorMiddleware around the maintained middleware, with this in front
        self.behind_front = False  # the one inside `outer`: the one in front took the replayed path already

    def in_front_of(self, outer) -> HeldUntilRecorded:
        self.behind_front = True
        return HeldUntilRecorded(self.app, outer)

    async def __call__(self, scope, receive, send):
        lean = self.app
        if scope["type"] == "http" and lean.replayed and not self.behind_front:
            # the replayed path: what the maintained middleware's `__call__` does in the API server when the
            # export process makes the span's attributes and metrics (`HttpReplay`); the maintained
            # `__call__` serves the request where `_begin` cannot (None: nothing was sent yet)
            start = asgi.default_timer()  # (the maintained middleware's clock, read where it reads it)
            begun = lean._begin(scope)
            if begun is _EXCLUDED:  # (the inner ServerErrorMiddleware answers an exception: nothing left for `outer`)
                return await lean.app(scope, receive, send)
            if begun is not None:
                span, token, active, details = begun
                span.send = send
                ending_send = span.sending
                try:
                    try:
                        await lean.replayed_app(scope, receive, ending_send)
                    except Exception as exc:
                        errors = lean.server_errors
                        if errors is not None:  # (the part of the ServerErrorMiddleware `replayed_app` is inside)
                            started = span.response is not None
                            await http.serve_server_error(errors, scope, receive, ending_send, exc, started)
                        raise
                except Exception as exc:  # what the maintained middleware's `use_span` records of it
                    _record_escaping(span, exc)
                    if self.outer is not None and span.response is None:
                        await http.serve_server_error(self.outer, scope, receive, send, exc, started=False)
                    raise
                finally:
                    lean._finish(span, token, active, details, scope, asgi.default_timer() - start)
                return
        if self.outer is not None:
            return await self.outer(scope, receive, send)
        if scope["type"] != "http":
            return await lean(scope, receive, send)
        held: list = []
        token = _held.set(held)
        try:
            await self.app(scope, receive, send)
        finally:
            _held.reset(token)
            if held:
                release(held[0])


class _Capture:
    """The replayed middleware's tracer (it calls `start_span` only): its one span is a DeferredSpan
    with the API server's span context, read (`merge_replayed`), never sent."""

    hand_over = None

    def __init__(self):
        self.next: tuple | None = None  # (span context, sampled) of the request replayed
        self.span: DeferredSpan | None = None

    def start_span(
        self, name, context=None, kind=trace.SpanKind.INTERNAL, attributes=None, links=None, start_time=None, **_ignored
    ):
        span_context, sampled = self.next
        self.span = DeferredSpan(
            name, span_context, None, kind, attributes if sampled else None, links, 0, sampled, Outbox(), self
        )
        return self.span


class _NotCounted:
    """The replayed middleware's active-requests counter: they are counted live in the API server."""

    def add(self, amount, attributes=None, context=None) -> None:
        pass


class _Route:
    __slots__ = ("path_format",)

    def __init__(self, path_format: str):
        self.path_format = path_format


async def _disconnected():
    return {"type": "http.disconnect"}


async def _sent(message) -> None:
    pass


class HttpReplay:
    """In the export process: the maintained middleware (opentelemetry-instrumentation-asgi's, as
    FastAPIInstrumentor configures it from the same environment) run again on what the API server
    kept of one HTTP request (`ReplayingMiddleware._replay_record`): its own code sets the span's
    attributes and status and records the HTTP metrics, with the API server's span context, route,
    response start and duration (its clock, `asgi.default_timer`, answers the request's times)."""

    def __init__(self, meter):
        self.tracer = _Capture()
        self.middleware = OpenTelemetryMiddleware(
            self._app,
            tracer=self.tracer,
            meter=meter,
            default_span_details=self._span_details,
            exclude_spans=["receive", "send"],
        )
        self.middleware.active_requests_counter = _NotCounted()
        self._details: tuple = ("", {})
        self._start: tuple | None = None

    def _span_details(self, scope):
        return self._details[0], dict(self._details[1])

    async def _app(self, scope, receive, send):
        if self._start is not None:
            status, headers, _ = self._start
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    def run(self, record: ReplayRecord) -> DeferredSpan:
        self.middleware.server_request_hook = redact_query_hook if record.redacts else None
        self.tracer.next = (
            SpanContext(record.trace_id, record.span_id, is_remote=False, trace_flags=TraceFlags(record.trace_flags)),
            record.sampled,
        )
        self.tracer.span = None
        self._details = (record.name, record.route_attributes)
        self._start = record.start
        values = record.scope
        scope = dict(values) if isinstance(values, dict) else dict(zip(SCOPE_KEYS, values))
        scope["headers"] = record.headers
        if record.route is not None:
            scope["route"] = _Route(record.route)
        duration_s = record.duration_s
        ticks = iter((0.0, duration_s))
        clock = asgi.default_timer
        asgi.default_timer = lambda: next(ticks, duration_s)
        try:
            coroutine = self.middleware(scope, _disconnected, _sent)
            try:
                coroutine.send(None)
            except StopIteration:
                pass
            else:
                coroutine.close()
                raise RuntimeError("the replayed middleware waited for something")
        finally:
            asgi.default_timer = clock
        if self.tracer.span is None:
            raise RuntimeError("the replayed middleware made no span")
        return self.tracer.span


def server_span(record: ReplayRecord) -> SpanRecord:
    """The server span a ReplayRecord carries, as the API server left it (`merge_replayed` completes it)."""
    return SpanRecord(
        record.name,
        record.trace_id,
        record.span_id,
        record.trace_flags,
        record.trace_state,
        record.parent_span_id,
        record.parent_is_remote,
        record.parent_trace_flags,
        trace.SpanKind.SERVER.value,
        record.start_ns,
        record.end_ns,
        dict(record.attributes),
        None if record.status is None else tuple(record.status),
        [],
        list(record.events),
    )


def merge_replayed(span: SpanRecord, captured: DeferredSpan, start: tuple | None) -> SpanRecord:
    """The API server's span (its ids, times and what was set on it during the request: an exception's
    event and status) completed with what the replayed middleware set: its attributes first (those
    set in the API server win), its events first, and the status the span had last (the replay's is
    set at the response start: the API server's wins if it was set after that, or is OK, which is
    final)."""
    attributes = dict(captured._attributes)
    for key, value in span.attributes.items():
        attributes.pop(key, None)
        attributes[key] = value
    status, replayed = span.status, captured._status
    if replayed is not None and (
        status is None or (status[0] != StatusCode.OK.value and not (start is not None and start[2]))
    ):
        status = replayed
    return span._replace(attributes=attributes, status=status, events=[*captured._events, *span.events])


@guard("recording an exception on the HTTP server span")
def _record_escaping(span, exc: Exception) -> None:
    """What `trace.use_span` (the maintained middleware's, around the app) does with an exception that
    leaves it: the exception as an event, and the status ERROR (never an exception of ours in place of
    the app's)."""
    if span.is_recording():
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, description=f"{type(exc).__name__}: {exc}"))


@entry("http.release")
def release(span: DeferredSpan) -> None:
    span.outbox.held = False
    if span._tracer.hand_over is not None:
        span._tracer.hand_over(span)
