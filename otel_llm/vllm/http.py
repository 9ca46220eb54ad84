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
FastAPIInstrumentor builds it: its attributes, status rules, exclusions and hooks) is kept, with
three changes to what it does per request on the API server, vLLM's bottleneck at high request rates
(benchmarks/server_overhead.py --part fastapi):
- `LeanMiddleware`: its route lookup (a match against every route of the app until one fits) is done
  once per method and path, and its per-message `send` wrapper is one check per body chunk; what it
  does on the response start (status, response headers, content length) is its own code.
- With the export process, its HTTP metrics are not recorded here: the values it records go with the
  request's message (`DeferredHistogram`), and the export process records them in the same
  instruments (otel_llm/vllm/export_process.py). The server span's message is held until they are in
  (`HeldUntilRecorded`). Its active-requests counter counts in a plain dict, observed at collection
  (`ActiveRequests`).
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

from opentelemetry import trace
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware, asgi_getter
from opentelemetry.instrumentation.propagators import get_global_response_propagator
from starlette.routing import Mount, Route, WebSocketRoute

from otel_llm.config import Settings, disabled_instrumentations
from otel_llm.vllm import offload
from otel_llm.warn import entry, failed, inline_entry

_log = logging.getLogger("otel_llm.vllm")


def fastapi_disabled() -> bool:
    names = disabled_instrumentations()
    return "fastapi" in names or "*" in names


def instrument_app(app, settings: Settings, tracer_provider=None, offload_metrics: bool = False,
                  meter_provider=None) -> bool:
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
    span (otel_llm/vllm/offload.py `hand_over`)."""
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

    @inline_entry("LeanMiddleware._get_otel_send")
    def _get_otel_send(self, server_span, server_span_name, scope, send, duration_attrs):
        try:
            if scope["type"] != "http" or not self.exclude_send_span or self.client_response_hook is not None \
                    or get_global_response_propagator() is not None:
                otel_send = OpenTelemetryMiddleware._get_otel_send(self, server_span, server_span_name, scope,
                                                                   send, duration_attrs)
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
            return OpenTelemetryMiddleware._get_otel_send(self, server_span, server_span_name, scope, send,
                                                          duration_attrs)

    def _lean_send(self, server_span, send, duration_attrs):
        """The instrumentation's `otel_send` where it sends no `send` spans and no response
        propagator is set: a body message only ends the span after the last one; the response start
        does what `otel_send` does with it (status and captured headers on the span, the content
        length for the size metric)."""
        middleware = self

        async def otel_send(message):
            if message["type"] == "http.response.body":
                await send(message)
                if not message.get("more_body", False):
                    server_span.end()
                return
            status_code = message["status"] if message["type"] == "http.response.start" else None
            middleware._set_server_span(server_span, message, status_code, duration_attrs)
            content_length = asgi_getter.get(message, "content-length")
            if content_length:
                try:
                    middleware.content_length_header = int(content_length[0])
                except ValueError:
                    pass
            await send(message)

        return otel_send


ROUTE_CACHE_SIZE = 1024
# the routes whose match depends on the scope's type, path, root path and method only (not a Host's headers)
_CACHEABLE_ROUTES = (Route, WebSocketRoute, Mount)


def lean_middleware(middleware: OpenTelemetryMiddleware, offload_metrics: bool) -> LeanMiddleware:
    lean = LeanMiddleware.__new__(LeanMiddleware)
    lean.__dict__.update(middleware.__dict__)
    lean.route_cache = {}
    lean.default_span_details = cached_span_details(middleware.default_span_details, lean.route_cache)
    scope = getattr(middleware.meter, "_instrumentation_scope", None)  # (the SDK's meter)
    if offload_metrics and scope is not None:
        lean.meter_scope = (scope.name, scope.version, scope.schema_url)
        for name in offload.HTTP_HISTOGRAMS:
            if getattr(lean, name) is not None:
                setattr(lean, name, DeferredHistogram(name, lean.meter_scope))
        lean.active_requests_counter = ActiveRequests(lean.meter, middleware.active_requests_counter)
    return lean


def cached_span_details(details, cache: dict):
    """FastAPI's span name and http.route for a scope (a match against the app's routes in order),
    kept per (type, method, root path, path) while the app's routes are the same list of
    host-independent routes; at most ROUTE_CACHE_SIZE paths (then the others are matched each time)."""

    @entry("LeanMiddleware.default_span_details", fallback=None)
    def cached(scope):
        routes = scope["app"].routes
        key = (scope["type"], scope.get("method"), scope.get("root_path", ""), scope.get("path"), id(routes),
               len(routes))
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
            meter.create_observable_up_down_counter(counter.name, callbacks=[self.observe], unit=counter.unit,
                                                    description=counter.description)
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
    """Around LeanMiddleware with the export process: the server span ends when the response's last
    body is sent; the middleware records its metrics after that, and this hands the span's message
    over when they are in."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held: list = []
        token = _held.set(held)
        try:
            await self.app(scope, receive, send)
        finally:
            _held.reset(token)
            if held:
                release(held[0])


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
            _log.warning("otel-llm: could not wrap vLLM's routes; only handler-hooked endpoints get spans",
                         exc_info=True)
        if fastapi_disabled():
            return app
        try:
            instrument_app(app, tel.settings, tel.http_tracer_provider(),
                           offload_metrics=tel.channel is not None and tel.metrics is None)
        except Exception:
            _log.warning("otel-llm: could not instrument vLLM's FastAPI app", exc_info=True)
        return app

    return wrapper
