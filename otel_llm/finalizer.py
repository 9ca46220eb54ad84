"""Ends the telemetry of objects the garbage collector takes (streams dropped without being closed)
from one daemon thread, never inside `__del__`.

A finalizer runs in whichever thread happens to collect the garbage, at any allocation, with
whatever locks that thread holds. Seen in the fault-injection suite: the SDK's metric reader thread
collected a dropped stream wrapper while it held an instrument's lock; ending the span there
recorded a metric on that instrument, the reader thread waited on itself, and every request of the
server then hung behind that lock. So `__del__` only puts the work on a `queue.SimpleQueue`, whose
`put` is documented as safe in `__del__` methods, and this thread does it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading

from otel_llm.warn import failed

_log = logging.getLogger("otel_llm")

_pending: queue.SimpleQueue = queue.SimpleQueue()
_thread: threading.Thread | None = None
_start_lock = threading.Lock()
# the thread runs in this process: a plain flag read per stream (Thread.is_alive is three Python calls),
# cleared when the thread stops and in a forked child (where the thread does not exist)
_running = False


def _forked() -> None:
    global _running, _thread
    _running, _thread = False, None


os.register_at_fork(after_in_child=_forked)


def ensure_started() -> None:
    """Called where an object that may need finalizing is made (not in `__del__`): starts the
    thread once per process (again in a forked child, where it does not exist)."""
    global _thread, _running
    if _running:
        return
    with _start_lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="otel-llm-finalizer", daemon=True)
            _thread.start()
        _running = True


def defer(fn, *args, **kwargs) -> None:
    """From `__del__`: run fn(*args, **kwargs) on the finalizer thread."""
    _pending.put((fn, args, kwargs))


def drain(timeout: float = 10.0) -> bool:
    """Wait until everything deferred so far has run (tests; a shutdown that wants the ends)."""
    ensure_started()
    done = threading.Event()
    _pending.put((done.set, (), {}))
    return done.wait(timeout)


def _run() -> None:
    global _running
    try:
        while True:
            fn, args, kwargs = _pending.get()
            try:
                fn(*args, **kwargs)
            except Exception:  # noqa: BLE001 - one failed end must not stop the others
                failed("ending the telemetry of a collected stream")
    finally:  # (a BaseException stopped it: the next stream starts another)
        _running = False
