"""The response stream wrapper (otel_llm/vllm/streams.py): its record ends exactly once, on
exhaustion, error, cancellation, early close or garbage collection (then on the finalizer thread,
otel_llm/finalizer.py), and before the [DONE] chunk leaves."""

import asyncio
import gc

import pytest

from otel_llm import finalizer
from otel_llm.vllm import streams


class FakeRecord:
    def __init__(self, engines_end_it: bool = False):
        self.ended = False
        self.calls = []
        self.context = None
        self.first_chunk = 0
        self.engines_end_it = engines_end_it  # RequestTelemetry.end_with_engines' answer
        self.engine_aborted = False

    def end_with_engines(self) -> bool:
        return self.engines_end_it

    def end(self, **kwargs):
        if not self.ended:
            self.ended = True
            self.calls.append(kwargs)

    def on_first_chunk(self):
        self.first_chunk += 1


@pytest.fixture
def fake_record(monkeypatch):
    monkeypatch.setattr(streams, "attach", lambda record: None)
    monkeypatch.setattr(streams, "detach", lambda tokens: None)
    return FakeRecord()


async def _chunks(n, fail_at=None):
    for i in range(n):
        if i == fail_at:
            raise ValueError("boom")
        await asyncio.sleep(0)
        yield f"data: {i}\n\n"


def test_stream_ends_once_on_exhaustion(fake_record):
    async def run():
        return [c async for c in streams._StreamTelemetry(_chunks(3), fake_record)]

    assert len(asyncio.run(run())) == 3
    assert fake_record.calls == [{}] and fake_record.first_chunk == 1


def test_stream_error_midway(fake_record):
    async def run():
        async for _ in streams._StreamTelemetry(_chunks(3, fail_at=1), fake_record):
            pass

    with pytest.raises(ValueError):
        asyncio.run(run())
    assert fake_record.calls == [{"error_type": "ValueError", "error_message": "boom"}]


def test_stream_cancelled_is_an_abort(fake_record):
    async def run():
        stream = streams._StreamTelemetry(_chunks(100), fake_record)

        async def consume():
            async for _ in stream:
                await asyncio.sleep(0.01)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.03)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    # cancelled inside the consumer's own sleep (the usual case on a busy machine), the stream is
    # only dropped: its end comes from the finalizer thread (otel_llm/finalizer.py)
    gc.collect()
    assert finalizer.drain()
    assert fake_record.calls == [{"aborted": True}]


def test_stream_closed_early_is_an_abort(fake_record):
    async def run():
        stream = streams._StreamTelemetry(_chunks(10), fake_record)
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(run())
    assert fake_record.calls == [{"aborted": True}]


def test_a_failing_first_chunk_hook_does_not_stop_the_stream(fake_record):
    def boom():
        raise RuntimeError("injected")

    fake_record.on_first_chunk = boom

    async def run():
        return [c async for c in streams._StreamTelemetry(_chunks(3), fake_record)]

    assert asyncio.run(run()) == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]
    assert fake_record.calls == [{}]


def test_the_done_chunk_ends_the_record_before_it_is_sent(fake_record):
    async def done_stream():
        yield "data: 0\n\n"
        yield "data: [DONE]\n\n"
        assert fake_record.calls == [{}], "ended (and billed) before [DONE] left"

    async def run():
        return [c async for c in streams._StreamTelemetry(done_stream(), fake_record)]

    assert asyncio.run(run())[-1] == "data: [DONE]\n\n"
    assert fake_record.calls == [{}]


def test_a_collected_stream_ends_its_span_off_the_collecting_thread():
    """A stream wrapper the garbage collector takes is ended on the finalizer thread: the collecting
    thread may hold a lock the end needs (the SDK's metric reader held an instrument's lock when it
    collected one, recorded a metric on it from __del__ and hung the server)."""
    import gc
    import threading

    from otel_llm.vllm import streams

    lock, done, seen = threading.Lock(), threading.Event(), {}

    class Record:
        ended = False

        def end(self, **kwargs):
            seen["thread"] = threading.current_thread().name
            seen["got_lock"] = lock.acquire(timeout=10)
            if seen["got_lock"]:
                lock.release()
            seen["kwargs"] = kwargs
            done.set()

    with lock:  # what the collecting thread holds
        stream = streams._StreamTelemetry(None, Record())
        del stream
        gc.collect()
        assert not done.is_set()  # not ended inline
    assert done.wait(10)
    assert seen == {"thread": "otel-llm-finalizer", "got_lock": True, "kwargs": {"aborted": True}}


def test_current_span_ends_the_record_on_an_exception_and_lets_it_go_on(monkeypatch):
    calls = []
    monkeypatch.setattr(streams, "attach", lambda record: calls.append("attach") or "tokens")
    monkeypatch.setattr(streams, "detach", lambda tokens: calls.append(("detach", tokens)))
    record, error = FakeRecord(), ValueError("vLLM's")
    with pytest.raises(ValueError) as raised:
        with streams.current_span(record):
            raise error
    assert raised.value is error
    assert record.calls == [{"error_type": "ValueError", "error_message": "vLLM's"}]
    assert calls == ["attach", ("detach", "tokens")]


def test_a_failure_of_ours_in_current_span_never_fails_the_block(monkeypatch):
    def boom(*args):
        raise RuntimeError("ours")

    monkeypatch.setattr(streams, "attach", boom)
    monkeypatch.setattr(streams, "_end_with_exception", boom)
    record = FakeRecord()
    with streams.current_span(record):
        ran = True
    assert ran
    error = KeyError("vLLM's")
    with pytest.raises(KeyError) as raised:
        with streams.current_span(record):
            raise error
    assert raised.value is error and not record.ended


def test_later_chunks_pass_no_coroutine_of_ours(fake_record):
    """Per chunk after the first, the proxy's __anext__ hands out its async generator's own awaitable
    (no coroutine object of ours per chunk: the issue's per-chunk constant)."""
    import types

    async def run():
        stream = streams._StreamTelemetry(_chunks(3), fake_record)
        first = stream.__anext__()
        assert isinstance(first, types.CoroutineType)  # (the first chunk: the record made current)
        await first
        later = stream.__anext__()
        assert not isinstance(later, types.CoroutineType) and type(later).__name__ == "async_generator_asend"
        return [await later, *[c async for c in stream]]

    assert asyncio.run(run()) == ["data: 1\n\n", "data: 2\n\n"]
    assert fake_record.calls == [{}]


def test_async_for_steps_the_proxys_generator_itself(fake_record):
    """`async for` over the proxy (Starlette's StreamingResponse does) steps the proxy. After the first
    chunk (timed), a record its engine requests end (RequestTelemetry.end_with_engines) gets each later
    chunk from the inner generator's own awaitable: no coroutine or generator of ours, and the stream's
    end ends nothing (its engine requests do; a proxy dropped with its record still open ends it as they
    left it, on the finalizer thread). Any other record gets them from `_following`, and ends once at
    the stream's end, as AsyncLLM.generate's (`sse` False) does whatever its record; an empty stream
    ends with no error; a close after the first chunk is an abort."""
    inner = _chunks(3)
    engine_ended = FakeRecord(engines_end_it=True)

    async def run_engine_ended():
        stream = streams._StreamTelemetry(inner, engine_ended)
        assert aiter(stream) is stream
        first = await anext(stream)
        # (an awaitable not awaited: the inner generator does not step)
        assert stream._next == inner.__anext__ and type(stream.__anext__()).__name__ == "async_generator_asend"
        rest = [c async for c in stream]
        assert engine_ended.calls == [] and engine_ended.first_chunk == 1
        return [first, *rest]

    assert asyncio.run(run_engine_ended()) == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]
    gc.collect()
    assert finalizer.drain() and engine_ended.calls == [{"aborted": False}]  # (as its engine requests left it)

    async def run():
        stream = streams._StreamTelemetry(_chunks(3), fake_record)
        first = await anext(stream)
        following = stream._next.__self__
        assert type(following).__name__ == "async_generator" and following.ag_code is streams._following.__code__
        return [first, *[c async for c in stream]]

    assert asyncio.run(run()) == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]
    assert fake_record.calls == [{}] and fake_record.first_chunk == 1

    generated = FakeRecord(engines_end_it=True)  # AsyncLLM.generate's stream: its exception is its error

    async def run_generate():
        stream = streams._StreamTelemetry(_chunks(3, fail_at=2), generated, sse=False)
        await anext(stream)
        assert stream._next.__self__.ag_code is streams._following.__code__
        return [c async for c in stream]

    with pytest.raises(ValueError):
        asyncio.run(run_generate())
    assert generated.calls == [{"error_type": "ValueError", "error_message": "boom"}]

    empty = FakeRecord()

    async def run_empty():
        return [c async for c in streams._StreamTelemetry(_chunks(0), empty)]

    assert asyncio.run(run_empty()) == [] and empty.calls == [{}] and empty.first_chunk == 0

    closed = FakeRecord()

    async def run_closed():
        iterator = aiter(streams._StreamTelemetry(_chunks(10), closed))
        await anext(iterator)
        await iterator.aclose()

    asyncio.run(run_closed())
    assert closed.calls == [{"aborted": True}]


def test_the_finalizer_thread_starts_once_and_again_in_a_forked_child():
    """ensure_started (per stream) reads a flag; the thread starts once per process, and again in a
    forked child, where the parent's thread does not exist (the flag is cleared at the fork)."""
    import os

    from otel_llm import finalizer

    finalizer.ensure_started()
    thread = finalizer._thread
    assert finalizer._running and thread.is_alive()
    finalizer.ensure_started()
    assert finalizer._thread is thread and finalizer.drain(10)
    pid = os.fork()
    if pid == 0:  # the child: no finalizer thread until a stream asks for one, which then runs deferred ends
        code = 1
        try:
            if not finalizer._running and finalizer._thread is None:
                finalizer.ensure_started()
                code = 0 if finalizer._thread.is_alive() and finalizer.drain(10) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert finalizer._thread is thread and finalizer._running
