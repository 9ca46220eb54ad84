"""Where the default setup's API-server CPU goes, per piece, without a profiler's inflation.

`server_overhead.py --part api --breakdown` wraps the pieces below (sync functions and methods of the
request path) with a thread-CPU accumulator while the default setup's measured requests run, and prints
each piece's CPU per request. cProfile charges every Python call several times its cost (2-3x here),
which hides where the time really goes when it is spread over many small calls; this adds one
thread_time_ns pair per wrapped call (about 0.3 us, included in each figure). Figures include nested
pieces: `RequestTelemetry._end` contains `_write_usage`, which contains `UsageLedger.write`.
"""

from __future__ import annotations

import functools
import importlib
import time

# (module, qualified name, what it is): the request path's pieces, in the order of a request
PIECES = (
    ("otel_llm.vllm.export.http", "ReplayingMiddleware._begin", "HTTP span: start (context, URL, sampler)"),
    ("otel_llm.vllm.export.deferred", "DeferredTracer.start_root_span", "  its DeferredSpan (a new trace)"),
    ("otel_llm.vllm.wrappers", "_request_info", "request info (fields, caller)"),
    ("otel_llm.vllm.attribution", "Attribution.request_caller", "  caller (tenant headers, baggage)"),
    ("otel_llm.vllm.request_telemetry", "RequestTelemetry.__init__", "GenAI span: start"),
    ("otel_llm.vllm.export.deferred", "DeferredTracer.start_request_span", "  its DeferredSpan"),
    ("otel_llm.vllm.wrappers", "_attach", "engine request attached (traceparent, baggage)"),
    ("otel_llm.vllm.request_telemetry", "RequestTelemetry.on_engine_finished", "engine finish hook"),
    ("otel_llm.vllm.request_telemetry", "RequestTelemetry._end", "GenAI span: end (all below)"),
    ("otel_llm.vllm.contract", "read_engine_request", "  read vLLM's request states (each)"),
    ("otel_llm.vllm.request_telemetry", "RequestTelemetry._write_usage", "  usage record"),
    ("otel_llm.usage", "UsageLedger.write", "    spool line and usage event"),
    ("otel_llm.vllm.request_telemetry", "RequestTelemetry._metric", "  metric key (label guards)"),
    ("otel_llm.vllm.export.sink", "ExportProcessSink.finish_request", "  span and facts handed over"),
    ("otel_llm.vllm.export.http", "ReplayingMiddleware._finish", "HTTP span: end and hand-over"),
    ("otel_llm.vllm.export.channel", "ExportChannel.send", "  the message to the export process"),
)


class Breakdown:
    """Accumulates thread CPU per piece under `bucket` (None: not counting); wraps on install(),
    unwraps on uninstall()."""

    def __init__(self):
        self.bucket: str | None = None
        self.totals: dict[tuple[str, str], int] = {}
        self.missing: list[str] = []
        self._undo: list[tuple] = []

    def install(self) -> None:
        for module_name, qualname, _ in PIECES:
            try:
                owner = importlib.import_module(module_name)
                *path, attr = qualname.split(".")
                for part in path:
                    owner = getattr(owner, part)
                original = owner.__dict__[attr]
            except (ImportError, AttributeError, KeyError):
                self.missing.append(f"{module_name}:{qualname}")
                continue
            setattr(owner, attr, self._timed(qualname, original))
            self._undo.append((owner, attr, original))

    def uninstall(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()

    def _timed(self, key: str, fn):
        totals, clock = self.totals, time.thread_time_ns

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            bucket = self.bucket
            if bucket is None:
                return fn(*args, **kwargs)
            started = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[bucket, key] = totals.get((bucket, key), 0) + clock() - started

        return timed

    def report(self, bucket: str, requests: int) -> None:
        print(f"  {bucket}: CPU per request of each piece (us; thread CPU, nested pieces included)")
        for _, qualname, what in PIECES:
            if (bucket, qualname) in self.totals:
                print(f"    {what:50} {self.totals[bucket, qualname] / requests / 1e3:7.1f}  {qualname}")
        for name in self.missing:
            print(f"    (not found, not measured: {name})")
