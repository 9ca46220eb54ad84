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
"""

from __future__ import annotations

import logging

from otel_llm.config import Settings, disabled_instrumentations
from otel_llm.vllm import offload
from otel_llm.warn import entry

_log = logging.getLogger("otel_llm.vllm")


def fastapi_disabled() -> bool:
    names = disabled_instrumentations()
    return "fastapi" in names or "*" in names


def instrument_app(app, settings: Settings, tracer_provider=None) -> bool:
    """tracer_provider: where the HTTP server spans go (the export process's, Telemetry.http_tracer_provider);
    None: the global one."""
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
        server_request_hook=hook,
    )
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
            instrument_app(app, tel.settings, tel.http_tracer_provider())
        except Exception:
            _log.warning("otel-llm: could not instrument vLLM's FastAPI app", exc_info=True)
        return app

    return wrapper
