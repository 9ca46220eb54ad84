"""The request's span around vLLM's code, and the stream proxy.

`current_span(record)`: the context manager every path that runs vLLM's code for a request uses (a
handler, AsyncLLM.generate's first step, LLMEngine.add_request): the record is current while vLLM adds
its engine request, an exception of vLLM's ends it, and the context is restored after.

`_StreamTelemetry` wraps the async generator AsyncLLM.generate returns, or a streaming handler's where
no route watches it (routes.py `take_stream`: the handler's route does that with less work per
stream), so the first chunk is timed and the span ends exactly once: with its engine requests (no
code of ours per chunk after the first), or, for a stream without them, on the final SSE chunk,
exhaustion, error, cancellation or close.
"""

from __future__ import annotations

from otel_llm import finalizer
from otel_llm.vllm import contract
from otel_llm.vllm.request_telemetry import attach, detach, end_with_exception
from otel_llm.warn import guard as _safe

_SSE_DONE = contract.SSE_DONE


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

    The first chunk runs with the record current (vLLM adds its engine request then). After it, the
    record ends when its engine requests do (RequestTelemetry.end_with_engines: finished, with their
    final outputs, or aborted when the client left; before the last chunks are sent), and each later
    chunk is the inner generator's own awaitable, handed out by `__anext__`: no coroutine or generator
    of ours per chunk. Where that cannot be (no engine request, or one finished by the first chunk), and
    for AsyncLLM.generate's stream (`sse` False: an error there is an exception, not a chunk),
    the later chunks come from `_following`, which ends the record at the [DONE] chunk, exhaustion,
    error, cancellation or close. The span ends exactly once either way; the request's route
    (routes.py `_finish`) and this proxy's `__del__` end one whose engine end never came.
    """

    __slots__ = ("_inner", "_record", "_next", "_sse", "_with_engines")

    def __init__(self, inner, record, sse: bool = True):
        finalizer.ensure_started()
        self._inner = inner
        self._record = record
        self._next = None  # after the first chunk: the inner generator's `__anext__`, or `_following`'s
        self._sse = sse  # an HTTP stream: its first chunk is the client's first byte
        self._with_engines = False  # its record ends with its engine requests (after the first chunk)

    def __aiter__(self):
        return self

    def __anext__(self):
        following = self._next
        if following is not None:
            return following()
        return self._first()

    async def _first(self):
        record = self._record
        try:
            # first chunk: the engine request is added now, in whatever task iterates us, with the record
            # current (current_span's steps, without its three methods' frames)
            tokens = _make_current(record)
            try:
                chunk = await self._inner.__anext__()
            except BaseException as exc:
                _end_on_exception(record, exc)
                raise
            finally:
                _restore_context(tokens)
        except BaseException:
            _end_if_not_ended(record)
            raise
        if self._sse:
            _first_chunk(record)
        # (an HTTP stream's: vLLM answers an error in one with an error chunk. AsyncLLM.generate's raises it,
        # and _following ends the record for it, where the engine's end would say only aborted or nothing)
        self._with_engines = self._sse and bool(_ends_with_engines(record))
        self._next = self._inner.__anext__ if self._with_engines else _following(self._inner, record).__anext__
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
            # (one handed to its engine requests, whose end never came: as they left it, as its route would)
            finalizer.defer(record.end, aborted=record.engine_aborted if self._with_engines else True)


_EXHAUSTED = StopAsyncIteration()


async def _following(inner, record):
    """The stream's chunks after the first, where its record does not end with its engine requests. The
    record ends at the [DONE] chunk (before it is sent: the client holds a complete response once it
    is, so a server killed before the generator's own end loses no usage record), at exhaustion, or on
    the exception that stops the stream (a cancellation or close: aborted)."""
    try:
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


@_safe("handing a stream's end to its engine requests")
def _ends_with_engines(record) -> bool:
    return record.end_with_engines()


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
