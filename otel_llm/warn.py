"""The one warn-once helper: instrumentation logs a failure of its own once per cause, never raises
into the code it observes, and keeps serving.

`WarnOnce` is a set of causes already logged; `warn_once` is the process-wide one. Objects that may
exist several times in a process with independent warnings (a usage spool, a redactor) hold their own.
`guard` wraps our bookkeeping around vLLM's and openai's code: a failure is logged once, with its
traceback, and the call returns None.
"""

from __future__ import annotations

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


def failed(what: str, consequence: str = SERVED) -> None:
    """From an `except` block: log (once per `what`, with the traceback) that our `what` failed."""
    warn_once(("failed", what), "otel-llm: %s failed; %s", what, consequence, exc_info=True)


def guard(what: str, consequence: str = SERVED):
    """Decorator: the function never raises; its first failure is logged (failed()); returns None then."""

    def deco(fn):
        def guarded_call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception:  # noqa: BLE001 - instrumentation must never break what it observes
                failed(what, consequence)
                return None

        guarded_call.what = what
        guarded_call.wrapped = fn
        return guarded_call

    return deco


def guarded(what: str, fn, *args):
    """fn(*args), or None after failed(what) when it raised."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001
        failed(what)
        return None
