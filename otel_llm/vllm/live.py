"""Live counting: a long request's tokens count while it runs, not only when it ends.

Every OTEL_LLM_LIVE_INTERVAL seconds one timer on the API server's event loop sweeps the requests
the engine holds. Each one in flight longer than the interval whose tokens changed since its last
sweep (RequestTelemetry.progress):

- writes a progress record to the usage spool (kind "progress": its cumulative tokens so far, the
  USAGE_ID its bill will have; the bill supersedes it, the ledger never bills it);
- adds the tokens generated since the last sweep to the token counter
  (otel_llm.server.token.usage): in this process, or as one message per sweep to the export
  process. The request's final Measurement then carries only the rest, so the counter's total for
  the request is its usage, and the counter only ever grows. (Tokens counted in flight stay in the
  series they were counted under: a request that then fails keeps them under its success labels.)

The sweep runs on the event loop, like the requests' own ends, so a request never ends halfway
through its sweep; only the finalizer thread (otel_llm/finalizer.py) ends requests elsewhere, and
`lock` orders that end after any progress record of the request. Cost: nothing per token; per
request, a dict insert and delete; per sweep, O(requests in flight) reads of vLLM's request state
and one spool line per request that changed. Requests shorter than the interval cost no sweep work.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time

from otel_llm.warn import failed, guarded


class LiveCounter:
    """The requests in flight of one API-server process, and the timer that sweeps them."""

    def __init__(self, interval_s: float, send_progress):
        """send_progress(list of (metric key, token deltas)): where a sweep's counter increments go."""
        self.interval_s = interval_s if math.isfinite(interval_s) and interval_s > 0 else 0.0
        self._send_progress = send_progress
        self._records: dict = {}  # RequestTelemetry -> None, while the engine holds its requests
        self._timer = None
        self._timer_loop = None
        # ends a request (RequestTelemetry.end) only between two of its progress records
        self.lock = threading.RLock()

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    def track(self, record) -> None:
        """A request reached the engine (on the event loop, or offline without one: then it counts
        when it ends)."""
        if self.interval_s <= 0:  # (not `enabled`: no property call per request)
            return
        self._records[record] = None
        loop = asyncio._get_running_loop()  # (None without one; C, as is everything here per request)
        if loop is None:
            return
        if self._timer is None or self._timer_loop is not loop:  # (a timer on another loop, closed or not)
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_loop = loop.call_later(self.interval_s, self._tick), loop

    def untrack(self, record) -> None:
        self._records.pop(record, None)

    def in_flight(self) -> int:
        return len(self._records)

    def _tick(self) -> None:
        """The timer (on the event loop): sweep, and again in an interval while requests are in flight
        (else the next request that reaches the engine starts it again)."""
        try:
            self._timer = None
            self.sweep()
            if self._records:
                self._timer = asyncio.get_running_loop().call_later(self.interval_s, self._tick)
        except Exception:  # noqa: BLE001 - live counting never breaks serving
            failed("counting the tokens of requests in flight")

    def sweep(self, now_ns: int | None = None) -> int:
        """Progress of every request in flight longer than the interval; returns how many changed."""
        now_ns = now_ns or time.time_ns()
        due = now_ns - int(self.interval_s * 1e9)
        increments = []
        for record in list(self._records):
            if record.start_ns > due:
                continue
            with self.lock:
                if record.ended:
                    continue
                increment = guarded("counting the tokens of a request in flight", record.progress, now_ns)
            if increment is not None:
                increments.append(increment)
        if increments:
            self._send_progress(increments)
        return len(increments)
