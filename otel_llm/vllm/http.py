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
the HTTP span and metrics; `LeanMiddleware` takes it over with less per-request work on the API server,
vLLM's bottleneck at high request rates (benchmarks/server_overhead.py --part fastapi and --part api):
the route lookup cached per method and path, one check per body chunk instead of its send wrapper.
With the export process, the sink takes it over further (otel_llm/vllm/export/http.py): the span's
attributes and the HTTP metrics are made again in the export process.
"""

from __future__ import annotations

import logging

from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware, asgi_getter
from opentelemetry.instrumentation.propagators import get_global_response_propagator
from starlette.concurrency import run_in_threadpool
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.requests import Request
from starlette.routing import Mount, Route, WebSocketRoute

from otel_llm.config import Settings, disabled_instrumentations
from otel_llm.sdk import internals
from otel_llm.warn import entry, failed, inline_entry

try:  # (ServerErrorMiddleware's own import of it)
    from starlette._utils import is_async_callable
except ImportError:  # then the ServerErrorMiddleware runs as it is (`server_error_middleware`)
    is_async_callable = None

_log = logging.getLogger("otel_llm.vllm")


def fastapi_disabled() -> bool:
    names = disabled_instrumentations()
    return "fastapi" in names or "*" in names


def instrument_app(app, settings: Settings, tracer_provider=None, meter_provider=None, *, take_over=None) -> bool:
    """The HTTP server span and metrics on vLLM's app. tracer_provider / meter_provider: where they go
    (None: the global ones; a tracer provider of ours: its server spans hold nothing for a websocket,
    `hold_nothing_hook`). take_over(middleware): the ASGI app that replaces the maintained middleware in
    the stack (default `lean_middleware`; the export process's sink passes its own,
    otel_llm/vllm/export/http.py)."""
    try:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    except ImportError:
        _log.warning("otel-llm: opentelemetry-instrumentation-fastapi is not installed; no HTTP server spans")
        return False
    if internals.fastapi_app_instrumented(app):
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
    take_over = take_over or lean_middleware

    def build_middleware_stack():  # (FastAPIInstrumentor's, then its middleware taken over)
        stack = build()
        try:
            middleware = getattr(stack, "app", None)  # ServerErrorMiddleware(app=OpenTelemetryMiddleware(...))
            if type(middleware) is OpenTelemetryMiddleware:
                stack.app = taken = take_over(middleware)
                # an app that serves what it can in front of the outermost ServerErrorMiddleware, as that would
                in_front = getattr(taken, "in_front_of", None)
                if in_front is not None and server_error_middleware(stack) is not None:
                    return in_front(stack)
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
    """FastAPI server_request_hook with our tracer provider: a websocket's span lives as long as the
    connection, so the requests made in it send their telemetry on their own instead of with that span
    (a span that holds what is nested in it has `holds`: otel_llm/vllm/export/deferred.py)."""
    if scope.get("type") != "http" and hasattr(span, "holds"):
        span.holds = False


@entry("redacting_hold_nothing_hook")
def redacting_hold_nothing_hook(span, scope) -> None:
    """Both server request hooks (queries redacted)."""
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

    @inline_entry("LeanMiddleware._get_otel_send")
    def _get_otel_send(self, server_span, server_span_name, scope, send, duration_attrs):
        try:
            if (
                scope["type"] != "http"
                or not self.exclude_send_span
                or self.client_response_hook is not None
                or get_global_response_propagator() is not None
            ):
                otel_send = internals.asgi_otel_send(self, server_span, server_span_name, scope, send, duration_attrs)
            else:
                otel_send = self._lean_send(server_span, send, duration_attrs)
            return otel_send
        except Exception:  # noqa: BLE001
            failed("LeanMiddleware._get_otel_send")
            return internals.asgi_otel_send(self, server_span, server_span_name, scope, send, duration_attrs)

    def _lean_send(self, server_span, send, duration_attrs):
        """The instrumentation's `otel_send` where it sends no `send` spans and no response
        propagator is set: the response start does what `otel_send` does with it (status and
        captured headers on the span, the content length for the size metric)."""

        def on_start(message) -> None:
            status_code = message["status"] if message["type"] == "http.response.start" else None
            internals.asgi_set_server_span(self, server_span, message, status_code, duration_attrs)
            content_length = asgi_getter.get(message, "content-length")
            if content_length:
                try:
                    self.content_length_header = int(content_length[0])
                except ValueError:
                    pass

        return _ending_send(server_span, send, on_start)


def _ending_send(span, send, on_other):
    """An ASGI send that ends `span` after the response's last body, as the maintained `otel_send`
    does; any other message (the response start) goes to `on_other` before it is sent. Only the last
    body passes a coroutine of ours: a body chunk with more to come goes straight to `send` after one
    dictionary lookup (only a body message has `more_body`), the only work of ours per chunk of a
    stream, and so does the response start, after `on_other`."""

    def otel_send(message):
        if message.get("more_body"):
            return send(message)
        if message["type"] == "http.response.body":
            return _sent_and_ended(span, send, message)
        on_other(message)
        return send(message)

    return otel_send


async def _sent_and_ended(span, send, message) -> None:
    """The response's last body sent, the span ended (as the maintained `otel_send`)."""
    await send(message)
    span.end()


def server_error_middleware(app):
    """`app` if it is Starlette's ServerErrorMiddleware as `serve_server_error` knows it (the one
    FastAPIInstrumentor puts inside the maintained middleware, so that an error response is sent inside
    the span); else None (then it runs as it is)."""
    if (
        is_async_callable is not None
        and type(app) is ServerErrorMiddleware
        and all(hasattr(app, name) for name in ("app", "handler", "debug", "error_response", "debug_response"))
    ):
        return app
    return None


async def serve_server_error(errors, scope, receive, send, exc: Exception, started: bool) -> None:
    """What Starlette's ServerErrorMiddleware (`errors`) does with an exception from the app it wraps:
    its 500 response (its debug page, its handler's or its default one), sent unless a response has
    started; the caller raises the exception on. The replayed path calls `errors.app` itself and
    tracks the response start in its own send, so a stream's chunks pass one wrapper of ours, not two
    (tests/vllm/test_offload.py compares the responses with Starlette's own)."""
    request = Request(scope)
    if errors.debug:
        response = await run_in_threadpool(errors.debug_response, request, exc)
    elif errors.handler is None:
        response = errors.error_response(request, exc)
    elif is_async_callable(errors.handler):
        response = await errors.handler(request, exc)
    else:
        response = await run_in_threadpool(errors.handler, request, exc)
    if not started:
        await response(scope, receive, send)


ROUTE_CACHE_SIZE = 1024
# the routes whose match depends on the scope's type, path, root path and method only (not a Host's headers)
_CACHEABLE_ROUTES = (Route, WebSocketRoute, Mount)


def may_keep(cache: dict, routes) -> bool:
    """Whether `cache`, whose answers hold while the app's routes are the same list, may take one more:
    room left (ROUTE_CACHE_SIZE), and every route matched on the scope's type, path, root path and
    method alone."""
    return len(cache) < ROUTE_CACHE_SIZE and all(isinstance(r, _CACHEABLE_ROUTES) for r in routes)


def lean_middleware(middleware: OpenTelemetryMiddleware, cls=None) -> LeanMiddleware:
    """`middleware` (FastAPIInstrumentor's) taken over by LeanMiddleware (or its subclass cls), the
    same state, its route lookup cached."""
    lean = (cls or LeanMiddleware).__new__(cls or LeanMiddleware)
    lean.__dict__.update(middleware.__dict__)
    lean.route_cache = {}
    lean.default_span_details = cached_span_details(middleware.default_span_details, lean.route_cache)
    return lean


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
            if may_keep(cache, routes):
                cache[key] = found
        return found[0], dict(found[1])

    def span_details(scope):
        return cached(scope) or details(scope)

    return span_details


def build_app_wrapper(tel):
    def wrapper(wrapped, instance, args, kwargs):
        app = wrapped(*args, **kwargs)
        try:  # this process serves: an export process starts now, not on a request
            tel.sink.start()
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
            tel.sink.instrument_http(app, tel.settings)
        except Exception:
            _log.warning("otel-llm: could not instrument vLLM's FastAPI app", exc_info=True)
        return app

    return wrapper
