"""The request's span around vLLM's code, and the stream proxy.

`current_span(record)`: the context manager every path that runs vLLM's code for a request uses (a
handler, AsyncLLM.generate's first step, LLMEngine.add_request): the record is current while vLLM adds
its engine request, an exception of vLLM's ends it, and the context is restored after.

`_StreamTelemetry` wraps the async generator a streaming handler (or AsyncLLM.generate) returns, so
the first chunk is timed and the span ends exactly once: on the final SSE chunk, exhaustion, error,
cancellation or close.
"""

from __future__ import annotations

from otel_llm import finalizer
from otel_llm.vllm.request_telemetry import attach, detach, end_with_exception
from otel_llm.warn import guard as _safe

_SSE_DONE = "data: [DONE]\n\n"  # the last chunk of every OpenAI-style SSE stream vLLM sends


class current_span:
    """`with current_span(record):` runs vLLM's code with `record` current (its span in the OTel
    context, the record in CURRENT for the engine hooks); an exception from the block ends the record
    and goes on unchanged; the context is restored after. Our part runs under the guards below: a
    failure of ours never fails the request."""

    __slots__ = ("_record", "_tokens")

    def __init__(self, record):
        self._record = record
        self._tokens = None

    def __enter__(self):
        self._tokens = _make_current(self._record)
        return self._record

    def __exit__(self, kind, exc, traceback) -> bool:
        if exc is not None:
            _end_on_exception(self._record, exc)
        _restore_context(self._tokens)
        return False  # the exception, if any, is vLLM's: it goes on as it was


class _StreamTelemetry:
    """Wraps the SSE generator a streaming handler returns: first chunk time and the end.

    The first chunk runs with the record current (vLLM adds its engine request then); every later one
    comes from `_following`, an async generator whose item is returned as it is. `async for` (Starlette's
    StreamingResponse, a user of AsyncLLM.generate) iterates `_following` itself (`__aiter__`): per chunk
    its own loop and one comparison, no frame of this class. `__anext__` on the proxy hands out its
    awaitable (no coroutine of ours per chunk). The span ends exactly once on exhaustion, error,
    cancellation (client gone) or close.
    """

    __slots__ = ("_inner", "_record", "_next", "_sse")

    def __init__(self, inner, record, sse: bool = True):
        finalizer.ensure_started()
        self._inner = inner
        self._record = record
        self._next = None  # after the first chunk: `_following(...).__anext__`
        self._sse = sse  # an HTTP stream: its first chunk is the client's first byte

    def __aiter__(self):
        # (the generator keeps this proxy alive: its __del__ ends a stream never started, as before)
        return _following(self._inner, self._record, self)

    def __anext__(self):
        following = self._next
        if following is not None:
            return following()
        return self._first()

    async def _first(self):
        chunk = await self._first_chunk()
        self._next = _following(self._inner, self._record).__anext__
        return chunk

    async def _first_chunk(self):
        record = self._record
        try:
            with current_span(record):  # first chunk: the engine request is added now, in whatever task iterates us
                chunk = await self._inner.__anext__()
        except BaseException:
            _end_if_not_ended(record)
            raise
        if self._sse:
            _first_chunk(record)
        return chunk

    async def aclose(self):
        try:
            await self._inner.aclose()
        finally:
            self._record.end(aborted=True)

    async def athrow(self, *args):
        return await self._inner.athrow(*args)

    def __del__(self):
        record = self._record
        if not record.ended:  # never ended here: see otel_llm/finalizer.py
            finalizer.defer(record.end, aborted=True)


_EXHAUSTED = StopAsyncIteration()


async def _following(inner, record, proxy: _StreamTelemetry | None = None):
    """The stream's chunks (after the first, or all of them from `proxy`'s first). The record ends at
    the [DONE] chunk (before it is sent: the client holds a complete response once it is, so a server
    killed before the generator's own end loses no usage record), at exhaustion, or on the exception
    that stops the stream (a cancellation or close: aborted)."""
    try:
        if proxy is not None:
            try:
                chunk = await proxy._first_chunk()
            except StopAsyncIteration:  # an empty stream (its record ended): no RuntimeError from this generator
                return
            yield chunk
        async for chunk in inner:
            if chunk == _SSE_DONE:
                record.end()
            yield chunk
    except BaseException as exc:
        _end_on_exception(record, exc)
        _end_if_not_ended(record)
        raise
    _end_on_exception(record, _EXHAUSTED)
    _end_if_not_ended(record)


@_safe("recording a stream's first chunk")
def _first_chunk(record) -> None:
    record.on_first_chunk()


# Making a record current and restoring the context around vLLM's code are our calls on every
# request path too: a fault there leaves the span without its engine request (no tokens), and never
# fails the request. Each looks up what it calls (attach, detach, _end_with_exception) at call time.
@_safe("making a request's span current")
def _make_current(record):
    return attach(record)


@_safe("restoring the context after a request")
def _restore_context(tokens) -> None:
    if tokens is not None:
        detach(tokens)


# Called while vLLM's exception (or the end of a stream) propagates: a fault here must not
# replace that exception with ours.
@_safe("ending a request's span on an exception")
def _end_on_exception(record, exc) -> None:
    _end_with_exception(record, exc)


_end_with_exception = end_with_exception  # (a name here: the fault-injection suite targets it)


def _end_if_not_ended(record) -> None:
    """Our end failed: end the span as __del__ would, but now. (The wrapper is often in a reference
    cycle with vLLM's exception, so __del__ may come only at a garbage collection, minutes later on
    an idle server.)"""
    if not record.ended:
        finalizer.defer(record.end, aborted=True)
