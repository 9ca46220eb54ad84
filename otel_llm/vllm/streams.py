"""The stream proxy: wraps the async generator a streaming handler (or AsyncLLM.generate) returns,
so the request's record is current while vLLM adds its engine request, the first chunk is timed, and
the span ends exactly once: on the final SSE chunk, exhaustion, error, cancellation or close.
"""

from __future__ import annotations

from otel_llm import finalizer
from otel_llm.vllm.request_telemetry import attach, detach, end_with_exception
from otel_llm.warn import guard as _safe

_SSE_DONE = "data: [DONE]\n\n"  # the last chunk of every OpenAI-style SSE stream vLLM sends


class _StreamTelemetry:
    """Wraps the SSE generator a streaming handler returns: first chunk time and the end.

    Per chunk this adds one await and a flag test; the span ends exactly once on
    exhaustion, error, cancellation (client gone) or close.
    """

    __slots__ = ("_inner", "_record", "_started", "_sse")

    def __init__(self, inner, record, sse: bool = True):
        finalizer.ensure_started()
        self._inner = inner
        self._record = record
        self._started = False
        self._sse = sse  # an HTTP stream: its first chunk is the client's first byte

    def __aiter__(self):
        return self

    async def __anext__(self):
        record = self._record
        if self._started:
            try:
                chunk = await self._inner.__anext__()
            except BaseException as exc:
                _end_on_exception(record, exc)
                _end_if_not_ended(record)
                raise
            if chunk == _SSE_DONE:
                # the client holds a complete response once this is sent: end (and bill) it now,
                # so a server killed before the generator's own end loses no usage record
                record.end()
            return chunk
        # first chunk: the engine request is added now, in whatever task iterates us
        tokens = _make_current(record)
        try:
            chunk = await self._inner.__anext__()
        except BaseException as exc:
            _end_on_exception(record, exc)
            _end_if_not_ended(record)
            raise
        finally:
            _restore_context(tokens)
        self._started = True
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


_first_chunk = _safe("recording a stream's first chunk")(lambda record: record.on_first_chunk())

# Making a record current and restoring the context around vLLM's code are our calls on every
# request path too: a fault there leaves the span without its engine request (no tokens), and never
# fails the request. The lambdas look the functions up at call time.
_make_current = _safe("making a request's span current")(lambda record: attach(record))


_restore_context = _safe("restoring the context after a request")(
    lambda tokens: detach(tokens) if tokens is not None else None
)

# Called while vLLM's exception (or the end of a stream) propagates: a fault here must not
# replace that exception with ours.
_end_on_exception = _safe("ending a request's span on an exception")(
    lambda record, exc: _end_with_exception(record, exc)
)


_end_with_exception = end_with_exception  # (a name here: the fault-injection suite targets it)


def _end_if_not_ended(record) -> None:
    """Our end failed: end the span as __del__ would, but now. (The wrapper is often in a reference
    cycle with vLLM's exception, so __del__ may come only at a garbage collection, minutes later on
    an idle server.)"""
    if not record.ended:
        finalizer.defer(record.end, aborted=True)
