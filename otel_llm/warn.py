"""The one warn-once helper: instrumentation logs a failure of its own once per cause, never raises
into the code it observes, and keeps serving.

`WarnOnce` is a set of causes already logged; `warn_once` is the process-wide one. Objects that may
exist several times in a process with independent warnings (a usage spool, a redactor) hold their own.
`guard` wraps our bookkeeping around vLLM's and openai's code: a failure is logged once, with its
traceback, and the call returns None (or its fallback).

Entry points: every function of ours that another library calls (the deferred spans and tracer
handed to the FastAPI instrumentation, its request hooks, uvicorn's access-log filter, vLLM's
stat-logger plugin, metric callbacks) is guarded with a fallback the caller can go on with, and
carries the mark `entry` (with `what`), by which tests and tools find it (`entry_points`):

- `entry(what, fallback=...)`: a wrapper, for what runs at most a few times per request;
- `inline_entry(what)`: only the mark, for a hot method that guards itself (its first statement is
  `try:`, its handler `except Exception:` calls `failed(...)` and returns the fallback): a wrapper's
  call would cost ~0.1 us a call, the span setters run dozens of times per request.
  tests/names/test_entry_points.py checks that shape, and that every such method is marked.

`failed` counts every failure per `what` (`failures()`: otel_llm.instrumentation.failures, by
otel_llm.failure.point, registered by the vLLM layer's Telemetry).
"""

from __future__ import annotations

import inspect
import logging
import threading

_log = logging.getLogger("otel_llm")

SERVED = "the request is served, its telemetry may be incomplete"


class WarnOnce:
    def __init__(self, logger: logging.Logger = _log):
        self._logger = logger
        self._seen: set = set()
        self._lock = threading.Lock()

    def __call__(self, key, message: str, *args, exc_info: bool = False, level: int = logging.WARNING) -> bool:
        """Log `message % args` the first time `key` is seen; True when it was logged."""
        if key in self._seen:
            return False
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
        self._logger.log(level, message, *args, exc_info=exc_info)
        return True


warn_once = WarnOnce()
# what -> how many times it failed in this process (a failure is rare: a plain dict, under the GIL;
# two threads failing at the same point at once may count one)
_failures: dict[str, int] = {}


def failed(what: str, consequence: str = SERVED) -> None:
    """From an `except` block: count that our `what` failed, and log it (once per `what`, with the
    traceback)."""
    _failures[what] = _failures.get(what, 0) + 1
    warn_once(("failed", what), "otel-llm: %s failed; %s", what, consequence, exc_info=True)


def failures() -> dict[str, int]:
    """How many times each `what` failed in this process so far."""
    return dict(_failures)


def guard(what: str, consequence: str = SERVED, fallback=None):
    """Decorator: the function never raises; its first failure is logged (failed()); it returns
    `fallback` (None) then."""

    def deco(fn):
        def guarded_call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception:  # noqa: BLE001 - instrumentation must never break what it observes
                failed(what, consequence)
                return fallback

        guarded_call.what = what
        guarded_call.wrapped = fn
        guarded_call.__name__, guarded_call.__qualname__ = fn.__name__, fn.__qualname__
        guarded_call.__module__, guarded_call.__doc__ = fn.__module__, fn.__doc__
        return guarded_call

    return deco


ENTRY_WRAPPER, ENTRY_INLINE = "wrapper", "inline"


def entry(what: str, consequence: str = SERVED, fallback=None):
    """Decorator for a function of ours that another library calls: guard() with the value its
    caller goes on with (a span that records nothing, False for a log filter, ...), marked."""

    def deco(fn):
        guarded_call = guard(what, consequence, fallback)(fn)
        guarded_call.entry = ENTRY_WRAPPER
        guarded_call.fallback = fallback
        return guarded_call

    return deco


def inline_entry(what: str):
    """Marks a function of ours that another library calls and that guards itself: its first
    statement is a `try` whose `except Exception` handler calls failed(`what`) and returns its
    fallback (the form for hot methods; see the module's docstring)."""

    def deco(fn):
        target = inspect.unwrap(fn)  # a @contextmanager's generator function
        for marked in {fn, target}:
            marked.what = what
            marked.entry = ENTRY_INLINE
        return fn

    return deco


def entry_points(module) -> list[tuple[str, object]]:
    """(qualified name, function) of every marked entry point `module` defines: its functions and
    its classes' methods and property getters."""
    found = []

    def visit(name: str, value) -> None:
        if isinstance(value, property):
            value = value.fget
        elif isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if getattr(value, "entry", None) in (ENTRY_WRAPPER, ENTRY_INLINE):
            found.append((name, value))

    for name, value in vars(module).items():
        if getattr(value, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(value):
            for attribute, member in vars(value).items():
                visit(f"{value.__qualname__}.{attribute}", member)
        else:
            visit(name, value)
    return found


def guarded(what: str, fn, *args):
    """fn(*args), or None after failed(what) when it raised."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001
        failed(what)
        return None
