"""HTTP server spans on vLLM's FastAPI app (opentelemetry-instrumentation-fastapi).

`opentelemetry-instrument` may already have instrumented every FastAPI app with its defaults,
which include an INTERNAL `http send` span per SSE chunk: on a token stream that is a span
per token and doubles the API server's CPU. vLLM's app is re-instrumented here without the
send/receive spans and without health/metrics noise.
"""

from __future__ import annotations

import logging
import os

from otel_llm.config import Settings

_log = logging.getLogger("otel_llm.vllm")


def fastapi_disabled() -> bool:
    disabled = os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "")
    names = {name.strip() for name in disabled.split(",")}
    return "fastapi" in names or "*" in names


def instrument_app(app, settings: Settings) -> bool:
    try:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    except ImportError:
        _log.warning("otel-llm: opentelemetry-instrumentation-fastapi is not installed; no HTTP server spans")
        return False
    if getattr(app, "_is_instrumented_by_opentelemetry", False):
        FastAPIInstrumentor.uninstrument_app(app)
        app.middleware_stack = None  # rebuilt lazily, with our instrumentation, on the first request
    FastAPIInstrumentor.instrument_app(
        app,
        excluded_urls=settings.http_excluded_urls,
        exclude_spans=["receive", "send"],
    )
    return True


def build_app_wrapper(tel):
    def wrapper(wrapped, instance, args, kwargs):
        app = wrapped(*args, **kwargs)
        if fastapi_disabled():
            return app
        try:
            instrument_app(app, tel.settings)
        except Exception:
            _log.warning("otel-llm: could not instrument vLLM's FastAPI app", exc_info=True)
        return app

    return wrapper
