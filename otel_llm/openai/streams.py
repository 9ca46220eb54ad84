"""Stream proxies: the span of a streamed call ends exactly once, on whichever path comes first:
exhausted, exception (cancellation included), close(), context-manager exit, the openai stream
helpers closing the HTTP response, or garbage collection of an abandoned stream.

Per chunk: one timestamp, a counter and the choices' finish reasons (see Invocation.on_chunk).
"""

from __future__ import annotations

import wrapt

from otel_llm import finalizer
from otel_llm.openai.telemetry import Invocation
from otel_llm.warn import failed

CLOSED_EARLY = "stream closed before its end"
COLLECTED = "stream garbage-collected before its end"


def end(inv: Invocation, exc: BaseException | None = None, abandoned: str | None = None) -> None:
    try:
        if inv.ended:
            return
        if exc is None and abandoned is not None and inv.finished_all_choices():
            abandoned = None  # every choice had its finish reason: only the trailer went unread
        inv.end_stream(exc, abandoned)
    except Exception:  # noqa: BLE001 - the stream's span is lost, not the stream
        failed("openai stream end")


def _chunk(inv: Invocation, chunk) -> bool:
    try:
        return inv.on_chunk(chunk)
    except Exception:  # noqa: BLE001
        failed("openai stream chunk")
        return True


class ResponseProxy(wrapt.ObjectProxy):
    """The stream's HTTP response as the openai stream helpers see it: closing it ends the span."""

    def __init__(self, response, inv: Invocation):
        super().__init__(response)
        self._self_inv = inv

    def close(self):
        try:
            return self.__wrapped__.close()
        finally:
            end(self._self_inv, abandoned=CLOSED_EARLY)

    async def aclose(self):
        try:
            return await self.__wrapped__.aclose()
        finally:
            end(self._self_inv, abandoned=CLOSED_EARLY)


class _StreamEnds:
    """What both stream proxies share: the HTTP response the openai stream helpers close, and the end
    of a stream garbage-collected unfinished."""

    @property
    def response(self):
        return ResponseProxy(self.__wrapped__.response, self._self_inv)

    def __del__(self):  # never ended here: see otel_llm/finalizer.py
        finalizer.defer(end, self._self_inv, abandoned=COLLECTED)


class StreamProxy(_StreamEnds, wrapt.ObjectProxy):
    def __init__(self, stream, inv: Invocation):
        super().__init__(stream)
        self._self_inv = inv
        finalizer.ensure_started()

    def __iter__(self):
        return self

    def __next__(self):
        inv = self._self_inv
        while True:
            try:
                chunk = self.__wrapped__.__next__()
            except StopIteration:
                end(inv)
                raise
            except BaseException as exc:
                end(inv, exc=exc)
                raise
            if _chunk(inv, chunk):
                return chunk

    def __enter__(self):
        self.__wrapped__.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            return self.__wrapped__.__exit__(exc_type, exc, tb)
        finally:
            end(self._self_inv, exc=exc, abandoned=CLOSED_EARLY)

    def close(self):
        try:
            return self.__wrapped__.close()
        finally:
            end(self._self_inv, abandoned=CLOSED_EARLY)


class AsyncStreamProxy(_StreamEnds, wrapt.ObjectProxy):
    def __init__(self, stream, inv: Invocation):
        super().__init__(stream)
        self._self_inv = inv
        finalizer.ensure_started()

    def __aiter__(self):
        return self

    async def __anext__(self):
        inv = self._self_inv
        while True:
            try:
                chunk = await self.__wrapped__.__anext__()
            except StopAsyncIteration:
                end(inv)
                raise
            except BaseException as exc:  # asyncio.CancelledError is a BaseException
                end(inv, exc=exc)
                raise
            if _chunk(inv, chunk):
                return chunk

    async def __aenter__(self):
        await self.__wrapped__.__aenter__()
        return self

    async def __aexit__(self, exc_type, exc, tb):
        try:
            return await self.__wrapped__.__aexit__(exc_type, exc, tb)
        finally:
            end(self._self_inv, exc=exc, abandoned=CLOSED_EARLY)

    async def close(self):
        try:
            return await self.__wrapped__.close()
        finally:
            end(self._self_inv, abandoned=CLOSED_EARLY)
