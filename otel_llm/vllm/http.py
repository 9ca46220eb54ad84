"""HTTP server spans on vLLM's FastAPI app (opentelemetry-instrumentation-fastapi).

`opentelemetry-instrument` may already have instrumented every FastAPI app with its defaults,
which include an INTERNAL `http send` span per SSE chunk: on a token stream that is a span
per token and doubles the API server's CPU. vLLM's app is re-instrumented here without the
send/receive spans and without health/metrics noise.

A key in the URL query (`?api_key=...`) would be recorded by the HTTP layer: the instrumentation
puts the whole URL in `http.url` (old HTTP semconv; it redacts only a few cloud signature
parameters) or the raw query in `url.query` (new semconv), and uvicorn's access log prints the path
with its query. By default every query value is replaced with `REDACTED` in both (names are kept);
OTEL_LLM_HTTP_REDACT_QUERY=false keeps them.

The instrumentation's middleware (opentelemetry-instrumentation-asgi's OpenTelemetryMiddleware, as
FastAPIInstrumentor builds it: its attributes, status rules, exclusions and hooks) stays the source of
the HTTP span and metrics, with its per-request work moved off the API server, vLLM's bottleneck at
high request rates (benchmarks/server_overhead.py --part fastapi and --part api):
- `LeanMiddleware` takes it over. With the export process (and a setup the export process can
  reproduce: `replayable`) an HTTP request goes through `LeanMiddleware.replayed_call`: the API server
  checks the exclusions, looks the route up (once per method and path), starts the span (ids, parent,
  sampling: the maintained `_start_internal_or_server_span`), counts the request as active (in a dict
  observed at collection: `ActiveRequests`) and keeps plain values: the request's ASGI connection scope
  (its credential headers dropped unless request headers are captured), the route template, the
  response start and the duration. The export process runs the maintained middleware again on them
  (`HttpReplay`: its own `__call__`, with the API server's span context and duration), which sets the
  span's attributes and status and records the HTTP metrics in the same instruments; `merge_replayed`
  completes the API server's span with them. tests/vllm/test_offload.py compares the exported span
  and metric points with the maintained middleware's, field for field.
- Any other request (a websocket, one inside another span, a hook of the user's) goes through the
  maintained `__call__`, with the route cached, one check per body chunk instead of its send
  wrapper, and with the export process its histograms' values sent along (`DeferredHistogram`), the
  span's message held until they are in (`HeldUntilRecorded`).
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.instrumentation import asgi
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware, asgi_getter
from opentelemetry.instrumentation.propagators import get_global_response_propagator
from opentelemetry.trace import SpanContext, StatusCode, TraceFlags
from starlette.routing import Mount, Route, WebSocketRoute

from otel_llm.config import Settings, disabled_instrumentations
from otel_llm.vllm.export import channel as offload
from otel_llm.warn import entry, failed, inline_entry

_log = logging.getLogger("otel_llm.vllm")


def fastapi_disabled() -> bool:
    names = disabled_instrumentations()
    return "fastapi" in names or "*" in names


def instrument_app(
    app, settings: Settings, tracer_provider=None, offload_metrics: bool = False, meter_provider=None
) -> bool:
    """tracer_provider: where the HTTP server spans go (the export process's, Telemetry.http_tracer_provider);
    None: the global one. offload_metrics: the export process records the HTTP metrics (with a
    deferred tracer provider); meter_provider: where the HTTP metrics recorded here go (None: the global one)."""
    try:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    except ImportError:
        _log.warning("otel-llm: opentelemetry-instrumentation-fastapi is not installed; no HTTP server spans")
        return False
    if getattr(app, "_is_instrumented_by_opentelemetry", False):
        FastAPIInstrumentor.uninstrument_app(app)
        app.middleware_stack = None  # rebuilt lazily, with our instrumentation, on the first request
    redact = settings.http_redact_query
    # (module-level functions, each guarded: otel_llm/warn.py `entry`)
    if tracer_provider is not None:
        hook = redacting_hold_nothing_hook if redact else hold_nothing_hook
    else:
        hook = redact_query_hook if redact else None
    FastAPIInstrumentor.instrument_app(
        app,
        excluded_urls=settings.http_excluded_urls,
        exclude_spans=["receive", "send"],
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        server_request_hook=hook,
    )
    build = app.build_middleware_stack
    offload_metrics = offload_metrics and isinstance(tracer_provider, offload.DeferredTracerProvider)

    def build_middleware_stack():  # (FastAPIInstrumentor's, then its middleware made lean)
        stack = build()
        try:
            middleware = getattr(stack, "app", None)  # ServerErrorMiddleware(app=OpenTelemetryMiddleware(...))
            if type(middleware) is OpenTelemetryMiddleware:
                lean = lean_middleware(middleware, offload_metrics)
                stack.app = HeldUntilRecorded(lean) if lean.meter_scope is not None else lean
        except Exception:  # noqa: BLE001 - the maintained middleware as it is
            _log.warning("otel-llm: could not streamline the HTTP server middleware", exc_info=True)
        return stack

    app.build_middleware_stack = build_middleware_stack
    if redact:
        access_log = logging.getLogger("uvicorn.access")
        if not any(isinstance(f, _AccessLogQueryFilter) for f in access_log.filters):
            access_log.addFilter(_AccessLogQueryFilter())
    return True


@entry("hold_nothing_hook")
def hold_nothing_hook(span, scope) -> None:
    """FastAPI server_request_hook with the export process: a websocket's span lives as long as the
    connection, so the requests made in it send their telemetry on their own instead of with that
    span (otel_llm/vllm/export/channel.py `hand_over`)."""
    if scope.get("type") != "http":
        offload.hold_nothing(span)


@entry("redacting_hold_nothing_hook")
def redacting_hold_nothing_hook(span, scope) -> None:
    """Both server request hooks (with the export process, queries redacted)."""
    hold_nothing_hook(span, scope)
    redact_query_hook(span, scope)


REDACTED = "REDACTED"
# one warning for both places a query is redacted: the same function fails in both
_REDACTION_FAILED = ("redacting a URL query (HTTP span or access log)", "the span keeps it, the log line is dropped")
_URL_ATTRIBUTES = ("http.url", "url.full", "http.target")


def redact_query(query: str) -> str:
    """`a=1&key=sk-x&flag` -> `a=REDACTED&key=REDACTED&flag=REDACTED`: names kept, values gone (a
    part without `=` may itself be the secret)."""
    parts = []
    for part in query.split("&"):
        name, sep, _ = part.partition("=")
        parts.append(f"{name}={REDACTED}" if sep else REDACTED if part else part)
    return "&".join(parts)


@entry(*_REDACTION_FAILED)
def redact_query_hook(span, scope) -> None:
    """FastAPI server_request_hook: runs after the instrumentation set the span's URL attributes."""
    if not scope.get("query_string") or not span.is_recording():
        return
    attributes = getattr(span, "attributes", None) or {}
    for key in _URL_ATTRIBUTES:
        value = attributes.get(key)
        if isinstance(value, str) and "?" in value:
            base, _, query = value.partition("?")
            span.set_attribute(key, f"{base}?{redact_query(query)}")
    if isinstance(attributes.get("url.query"), str):
        span.set_attribute("url.query", redact_query(attributes["url.query"]))


class _AccessLogQueryFilter(logging.Filter):
    """uvicorn's access log line `%s - "%s %s HTTP/%s" %d`: the third argument is the path and query."""

    # runs inside uvicorn's send(): never fail a response over a log line; on a failure the line is
    # dropped (False), as it may hold a key, rather than logged unredacted
    @entry(*_REDACTION_FAILED, fallback=False)
    def filter(self, record):
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            base, _, query = args[2].partition("?")
            record.args = (*args[:2], f"{base}?{redact_query(query)}", *args[3:])
        return True


class LeanMiddleware(OpenTelemetryMiddleware):
    """The maintained middleware (made by FastAPIInstrumentor, taken over by `lean_middleware`) with
    its per-request work on the API server cut down; what it exports is unchanged."""

    route_cache: dict
    meter_scope: tuple | None = None  # with the HTTP metrics recorded by the export process
    replayed = False  # an HTTP request's span and metrics are made by the export process (`HttpReplay`)
    redacts = False  # (with `replayed`) the replay runs the query-redaction hook
    active_cache: dict

    async def replayed_call(self, scope, receive, send) -> bool:
        """What the maintained middleware's `__call__` does for an HTTP request in the API server when
        the export process makes its span attributes and metrics (`replayed`; HeldUntilRecorded
        calls it): the span and its context, the app, one message. False, before anything is sent,
        on a failure of ours (counted): then the maintained `__call__` serves it."""
        start = asgi.default_timer()  # (the maintained middleware's clock, read where it reads it)
        begun = self._begin(scope)
        if begun is None:
            return False
        if begun is _EXCLUDED:
            await self.app(scope, receive, send)
            return True
        span, token, active, details = begun
        response: list = []

        def keep_start(message) -> None:  # (and the status set on the span before it)
            if message["type"] == "http.response.start":
                response.append((message, span._status))

        try:
            with trace.use_span(span, end_on_exit=False):
                await self.app(scope, receive, _ending_send(span, send, keep_start))
        finally:
            self._finish(span, token, active, details, scope, response, asgi.default_timer() - start)
        return True

    @inline_entry("LeanMiddleware._begin")
    def _begin(self, scope):
        """What the maintained middleware does before the app, less what the export process does
        again (`HttpReplay`): the exclusion, the route, the span (its ids, parent and sampling)
        made current, the active-requests count. None on a failure of ours."""
        try:
            _, _, url = asgi.get_host_port_url_tuple(scope)
            if self.excluded_urls and self.excluded_urls.url_disabled(url):
                return _EXCLUDED
            details = self.default_span_details(scope)
            active = self._active_attributes(scope)
            span, token = _replay_parts.start_internal_or_server_span(
                tracer=self.tracer,
                span_name=details[0],
                start_time=None,
                context_carrier=scope,
                context_getter=_header_getter,
            )
            if not isinstance(span, offload.DeferredSpan):  # (ours failed: a span that records nothing)
                if token:
                    context_api.detach(token)
                return None
            span.outbox.held = True  # its message waits for what the export process needs after it ends
            self.active_requests_counter.add(1, active)
            return span, token, active, details
        except Exception:  # noqa: BLE001
            failed("LeanMiddleware._begin")
            return None

    def _active_attributes(self, scope) -> dict:
        """The active-requests counter's attributes (the maintained middleware's: from the request's
        attributes), kept per method, scheme, HTTP version, server and Host header, which are all
        they read (tests/vllm/test_offload.py checks it against the maintained functions)."""
        host = tuple(value for name, value in scope.get("headers") or () if name.lower() == b"host")
        key = (
            scope.get("method"),
            scope.get("scheme"),
            scope.get("http_version"),
            tuple(scope.get("server") or ()),
            host,
        )
        found = self.active_cache.get(key)
        if found is None:
            mode = self._sem_conv_opt_in_mode
            found = _replay_parts.parse_active_request_count_attrs(asgi.collect_request_attributes(scope, mode), mode)
            if len(self.active_cache) < ROUTE_CACHE_SIZE:
                self.active_cache[key] = found
        return found

    @inline_entry("LeanMiddleware._finish")
    def _finish(self, span, token, active, details, scope, response: list, duration_s: float) -> None:
        """After the app (as the maintained middleware's `finally`): the count, the context, and the
        request's message with what the export process replays."""
        try:
            self.active_requests_counter.add(-1, active)
            if token:
                context_api.detach(token)
            span.outbox.http_replay = self._replay_record(span, details, scope, response, duration_s)
            if span.is_recording():
                span.end()
            release(span)
        except Exception:  # noqa: BLE001
            failed("LeanMiddleware._finish")

    def _replay_record(self, span, details, scope, response: list, duration_s: float) -> tuple:
        """Plain values: the request's ASGI scope (the HTTP connection scope's keys; its headers but
        credentials, unless request headers are captured), the route template the router matched, the
        response start (status, headers), the duration, the span's ids, name and route attributes."""
        snapshot = {key: scope[key] for key in _SCOPE_KEYS if key in scope}
        headers = scope.get("headers") or []
        if self.http_capture_headers_server_request is None:
            headers = [header for header in headers if header[0] not in _CREDENTIAL_HEADERS]
        snapshot["headers"] = headers
        route = getattr(scope.get("route"), "path_format", None)
        start = None
        if response:  # (status, headers, whether the span's status was set in the API server after it)
            message, status = response[0]
            start = (message["status"], list(message.get("headers") or ()), span._status is not status)
        ctx = span._context
        return (
            self.meter_scope,
            self.redacts,
            ctx.trace_id,
            ctx.span_id,
            int(ctx.trace_flags),
            span._sampled,
            details[0],
            details[1],
            snapshot,
            route,
            start,
            duration_s,
        )

    @inline_entry("LeanMiddleware._get_otel_send")
    def _get_otel_send(self, server_span, server_span_name, scope, send, duration_attrs):
        try:
            if (
                scope["type"] != "http"
                or not self.exclude_send_span
                or self.client_response_hook is not None
                or get_global_response_propagator() is not None
            ):
                otel_send = OpenTelemetryMiddleware._get_otel_send(
                    self, server_span, server_span_name, scope, send, duration_attrs
                )
            else:
                otel_send = self._lean_send(server_span, send, duration_attrs)
            if self.meter_scope is not None and isinstance(server_span, offload.DeferredSpan):
                held = _held.get()
                if held is not None:  # its message waits for the metrics recorded after it ends
                    server_span.outbox.held = True
                    held.append(server_span)
            return otel_send
        except Exception:  # noqa: BLE001
            failed("LeanMiddleware._get_otel_send")
            return OpenTelemetryMiddleware._get_otel_send(
                self, server_span, server_span_name, scope, send, duration_attrs
            )

    def _lean_send(self, server_span, send, duration_attrs):
        """The instrumentation's `otel_send` where it sends no `send` spans and no response
        propagator is set: the response start does what `otel_send` does with it (status and
        captured headers on the span, the content length for the size metric)."""

        def on_start(message) -> None:
            status_code = message["status"] if message["type"] == "http.response.start" else None
            self._set_server_span(server_span, message, status_code, duration_attrs)
            content_length = asgi_getter.get(message, "content-length")
            if content_length:
                try:
                    self.content_length_header = int(content_length[0])
                except ValueError:
                    pass

        return _ending_send(server_span, send, on_start)


def _ending_send(span, send, on_other):
    """An ASGI send that ends `span` after the response's last body, as the maintained `otel_send`
    does, with one check per body chunk; any other message (the response start) goes to `on_other`
    before it is sent."""

    async def otel_send(message):
        if message["type"] == "http.response.body":
            await send(message)
            if not message.get("more_body", False):
                span.end()
            return
        on_other(message)
        await send(message)

    return otel_send


class _ReplayParts:
    """The maintained instrumentation's functions the replayed path calls by name (private ones
    among them); None when a release lacks one: then the maintained middleware runs as it is."""

    def __init__(self):
        from opentelemetry.instrumentation.asgi import _decode_header_item, _parse_active_request_count_attrs
        from opentelemetry.instrumentation.utils import _start_internal_or_server_span, is_http_instrumentation_enabled

        self.parse_active_request_count_attrs = _parse_active_request_count_attrs
        self.decode_header_item = _decode_header_item
        self.start_internal_or_server_span = _start_internal_or_server_span
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

    @inline_entry("_HeaderGetter.get")
    def get(self, carrier: dict, key: str):
        try:
            headers = carrier.get("headers")
            if not headers:
                return None
            if not isinstance(headers[0][0], bytes):
                return asgi_getter.get(carrier, key)
            name = key.lower().encode()
            decoded = [_replay_parts.decode_header_item(value) for key_, value in headers if key_.lower() == name]
            return decoded or None
        except Exception:  # noqa: BLE001 - the maintained getter answers
            failed("_HeaderGetter.get")
            return asgi_getter.get(carrier, key)


_header_getter = _HeaderGetter()
_EXCLUDED = object()
# the ASGI HTTP connection scope's keys (the spec's), which the maintained middleware reads
_SCOPE_KEYS = (
    "type",
    "asgi",
    "http_version",
    "method",
    "scheme",
    "path",
    "raw_path",
    "query_string",
    "root_path",
    "client",
    "server",
)
# never sent to the export process unless the user captures request headers (then sanitized there)
_CREDENTIAL_HEADERS = frozenset((b"authorization", b"proxy-authorization", b"cookie", b"x-api-key", b"api-key"))

ROUTE_CACHE_SIZE = 1024
# the routes whose match depends on the scope's type, path, root path and method only (not a Host's headers)
_CACHEABLE_ROUTES = (Route, WebSocketRoute, Mount)


def lean_middleware(middleware: OpenTelemetryMiddleware, offload_metrics: bool) -> LeanMiddleware:
    lean = LeanMiddleware.__new__(LeanMiddleware)
    lean.__dict__.update(middleware.__dict__)
    lean.route_cache = {}
    lean.active_cache = {}
    lean.default_span_details = cached_span_details(middleware.default_span_details, lean.route_cache)
    scope = getattr(middleware.meter, "_instrumentation_scope", None)  # (the SDK's meter)
    if offload_metrics and scope is not None:
        lean.meter_scope = (scope.name, scope.version, scope.schema_url)
        for name in offload.HTTP_HISTOGRAMS:
            if getattr(lean, name) is not None:
                setattr(lean, name, DeferredHistogram(name, lean.meter_scope))
        lean.active_requests_counter = ActiveRequests(lean.meter, middleware.active_requests_counter)
        lean.replayed = replayable(lean)
        lean.redacts = _hook(lean) is redacting_hold_nothing_hook
    return lean


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
        and isinstance(tracer, offload.DeferredTracer)
        and type(sampler).__module__ == "opentelemetry.sdk.trace.sampling"
        and _hook(middleware) in (hold_nothing_hook, redacting_hold_nothing_hook)
        and middleware.client_request_hook is None
        and middleware.client_response_hook is None
        and middleware.exclude_send_span
        and middleware.exclude_receive_span
    )


def cached_span_details(details, cache: dict):
    """FastAPI's span name and http.route for a scope (a match against the app's routes in order),
    kept per (type, method, root path, path) while the app's routes are the same list of
    host-independent routes; at most ROUTE_CACHE_SIZE paths (then the others are matched each time)."""

    @entry("LeanMiddleware.default_span_details", fallback=None)
    def cached(scope):
        routes = scope["app"].routes
        key = (
            scope["type"],
            scope.get("method"),
            scope.get("root_path", ""),
            scope.get("path"),
            id(routes),
            len(routes),
        )
        found = cache.get(key)
        if found is None:
            found = details(scope)
            if len(cache) < ROUTE_CACHE_SIZE and all(isinstance(r, _CACHEABLE_ROUTES) for r in routes):
                cache[key] = found
        return found[0], dict(found[1])

    def span_details(scope):
        return cached(scope) or details(scope)

    return span_details


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
            if isinstance(span, offload.DeferredSpan):
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
        sdk_log = logging.getLogger("opentelemetry.metrics._internal")
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
            key = tuple(attributes.items()) if attributes else ()
            counts = self._counts
            if key not in counts and len(counts) >= ACTIVE_REQUESTS_LIMIT:
                key = _OVERFLOW
            counts[key] = counts.get(key, 0) + amount
        except Exception:  # noqa: BLE001
            failed("ActiveRequests.add")

    @entry("ActiveRequests.observe", fallback=())
    def observe(self, options=None):
        return [self._observation(count, dict(key)) for key, count in list(self._counts.items())]


class _InstrumentConflict(logging.Filter):
    instrument = ""

    @entry("ActiveRequests: the SDK's log filter", fallback=True)
    def filter(self, record):
        return not (record.args and record.args[0] == self.instrument)


_held: ContextVar[list | None] = ContextVar("otel_llm_http_held", default=None)


class HeldUntilRecorded:
    """Around LeanMiddleware with the export process. An HTTP request whose span and metrics the
    export process makes (`LeanMiddleware.replayed`) goes to `LeanMiddleware.replayed_call`. Any other
    goes through the maintained middleware's `__call__`: the server span ends when the response's
    last body is sent, the middleware records its metrics after that, and this hands the span's
    message over when they are in."""

    def __init__(self, app: LeanMiddleware):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if (
            self.app.replayed
            and trace.get_current_span() is trace.INVALID_SPAN
            and _replay_parts.is_http_instrumentation_enabled()
            and get_global_response_propagator() is None
            and await self.app.replayed_call(scope, receive, send)
        ):
            return
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
        self.span: offload.DeferredSpan | None = None

    def start_span(
        self, name, context=None, kind=trace.SpanKind.INTERNAL, attributes=None, links=None, start_time=None, **_ignored
    ):
        span_context, sampled = self.next
        self.span = offload.DeferredSpan(
            name, span_context, None, kind, attributes if sampled else None, links, 0, sampled, offload.Outbox(), self
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
    kept of one HTTP request (`LeanMiddleware._replay_record`): its own code sets the span's
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

    def run(self, record: tuple) -> offload.DeferredSpan:
        (_, redacts, trace_id, span_id, flags, sampled, name, attributes, scope, route, start, duration_s) = record
        self.middleware.server_request_hook = redact_query_hook if redacts else None
        self.tracer.next = (SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(flags)), sampled)
        self.tracer.span = None
        self._details = (name, attributes)
        self._start = start
        if route is not None:
            scope["route"] = _Route(route)
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


def merge_replayed(span: tuple, captured: offload.DeferredSpan, start: tuple | None) -> tuple:
    """The API server's span (its ids, times and what was set on it during the request: an exception's
    event and status) completed with what the replayed middleware set: its attributes first (those
    set in the API server win), its events first, and the status the span had last (the replay's is
    set at the response start: the API server's wins if it was set after that, or is OK, which is
    final)."""
    attributes = dict(captured._attributes)
    for key, value in span[11].items():
        attributes.pop(key, None)
        attributes[key] = value
    status, replayed = span[12], captured._status
    if replayed is not None and (
        status is None or (status[0] != StatusCode.OK.value and not (start is not None and start[2]))
    ):
        status = replayed
    return (*span[:11], attributes, status, span[13], [*captured._events, *span[14]])


@entry("http.release")
def release(span: offload.DeferredSpan) -> None:
    span.outbox.held = False
    if span._tracer.hand_over is not None:
        span._tracer.hand_over(span)


def build_app_wrapper(tel):
    def wrapper(wrapped, instance, args, kwargs):
        app = wrapped(*args, **kwargs)
        try:  # this process serves: its export process starts now, not on a request
            tel.start_export_process()
        except Exception:  # noqa: BLE001 - the first request starts it then
            _log.warning("otel-llm: could not start the telemetry export process", exc_info=True)
        try:
            from otel_llm.vllm import routes

            routes.wrap_routes(app, tel)
        except Exception:
            _log.warning(
                "otel-llm: could not wrap vLLM's routes; only handler-hooked endpoints get spans", exc_info=True
            )
        if fastapi_disabled():
            return app
        try:
            instrument_app(
                app,
                tel.settings,
                tel.http_tracer_provider(),
                offload_metrics=tel.channel is not None and tel.metrics is None,
            )
        except Exception:
            _log.warning("otel-llm: could not instrument vLLM's FastAPI app", exc_info=True)
        return app

    return wrapper
