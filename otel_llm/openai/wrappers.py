"""The wrapt wrappers around openai's create/parse methods (sync and async)."""

from __future__ import annotations

import logging

from opentelemetry import context
from opentelemetry.instrumentation.utils import is_instrumentation_enabled
from opentelemetry.trace import set_span_in_context

from otel_llm.openai.streams import AsyncStreamProxy, StreamProxy
from otel_llm.openai.telemetry import ClientTelemetry, Invocation, is_raw_response_call
from otel_llm.warn import failed

_log = logging.getLogger("otel_llm.openai")
# set while one of our spans is current: a wrapped method that calls another (an openai helper
# built on create) makes one span, not two
_IN_CALL = context.create_key("otel_llm.openai.in_call")


def _warn_once(what: str) -> None:
    failed(what, "the call goes on untraced")


def _start(tel: ClientTelemetry, operation: str, api_type: str | None, instance, kwargs: dict):
    if not is_instrumentation_enabled() or context.get_value(_IN_CALL):
        return None, kwargs
    inv = None
    try:
        inv = Invocation(tel, operation, api_type, instance, kwargs)
        return inv, inv.prepare(kwargs)
    except Exception:
        _warn_once("starting an OpenAI client span")
        if inv is not None:
            inv.span.end()
        return None, kwargs


def _finish(inv: Invocation, result, kwargs: dict, is_async: bool):
    try:
        raw = is_raw_response_call(kwargs)
        if raw is not None:
            # with_raw_response / with_streaming_response: the body is the caller's to read.
            # A parsed non-stream body is cached by openai, so parsing it here costs the caller nothing.
            if raw == "true" and not inv.stream:
                inv.end_with_response(result.parse())
            else:
                inv.end_stream()
            return result
        if inv.stream:
            return AsyncStreamProxy(result, inv) if is_async else StreamProxy(result, inv)
        inv.end_with_response(result)
    except Exception:
        _warn_once("reading an OpenAI response")
        inv.end_stream()
    return result


def _fail(inv: Invocation, exc: BaseException) -> None:
    try:
        inv.fail(exc)
    except Exception:
        _warn_once("recording an OpenAI client error")


class _InCall:
    """While openai runs: the call's span current (and marked: a nested wrapped call makes no span);
    an exception, cancellation included, recorded on the span before it propagates."""

    __slots__ = ("inv", "token")

    def __init__(self, inv: Invocation):
        self.inv = inv

    def __enter__(self):
        self.token = context.attach(context.set_value(_IN_CALL, True, set_span_in_context(self.inv.span)))

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc is not None:
                _fail(self.inv, exc)
        finally:
            context.detach(self.token)
        return False


def make_wrapper(tel: ClientTelemetry, operation: str, api_type: str | None, is_async: bool):
    if is_async:

        async def async_wrapper(wrapped, instance, args, kwargs):
            inv, kwargs = _start(tel, operation, api_type, instance, kwargs)
            if inv is None:
                return await wrapped(*args, **kwargs)
            with _InCall(inv):
                result = await wrapped(*args, **kwargs)
            return _finish(inv, result, kwargs, True)

        return async_wrapper

    def wrapper(wrapped, instance, args, kwargs):
        inv, kwargs = _start(tel, operation, api_type, instance, kwargs)
        if inv is None:
            return wrapped(*args, **kwargs)
        with _InCall(inv):
            result = wrapped(*args, **kwargs)
        return _finish(inv, result, kwargs, False)

    return wrapper
