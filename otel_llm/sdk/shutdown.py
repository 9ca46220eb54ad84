"""A bounded telemetry shutdown for `opentelemetry-instrument`ed processes.

The SDK flushes at exit with its own atexit hooks, one provider after another and without an
overall bound: `BatchSpanProcessor.shutdown()` waits up to 30 s for its worker (which exports
the whole queue batch after batch, each export retrying with backoff for up to
`OTEL_EXPORTER_OTLP_TIMEOUT`, 10 s), then the `MeterProvider` up to 30 s more. With the
collector down a `vllm serve` took 38 s to stop after SIGTERM, past Kubernetes' 30 s grace
period, after which SIGKILL loses everything that was still queued.

`BoundedShutdown` replaces those hooks with one that shuts all providers down concurrently and
returns after at most `OTEL_LLM_SHUTDOWN_TIMEOUT` seconds (default 10; `0` keeps the SDK's own,
unbounded hooks). Shortly before the bound it shuts the exporters down, which stops their
retries (the SDK's own shutdown signal) and closes their connections; an export stuck on a
connection that never answers is abandoned (the SDK's threads are daemons). When telemetry was
lost it logs one warning with how many spans, log records and metric points were not exported.
With a healthy exporter nothing changes: everything is flushed, as before.

Counting uses `AccountedExporter`, a small delegating wrapper: the span and log processors get it
through the configurator's own `export_span_processor` / `export_log_record_processor` knobs;
the periodic metric reader, which has no such knob, gets it by a guarded attribute swap.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from otel_llm.config import ENV_SHUTDOWN_TIMEOUT
from otel_llm.sdk import internals

_log = logging.getLogger("otel_llm.sdk.shutdown")

DROPPED_MESSAGE = "otel-llm: telemetry dropped at shutdown"


def _size(batch: Any) -> int:
    """Items in one export: spans or log records (a sequence), or metric data points."""
    resource_metrics = getattr(batch, "resource_metrics", None)
    if resource_metrics is not None:
        return sum(
            len(getattr(m.data, "data_points", ()) or ())
            for rm in resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
        )
    try:
        return len(batch)
    except TypeError:
        return 0


class AccountedExporter:
    """Delegates to an exporter and, once shutdown has begun, counts the items it did not export:
    those of failed exports and those of an export still in flight."""

    def __init__(self, exporter):
        self._exporter = exporter
        self._counting = False
        self._failed = 0
        self._in_flight = 0
        self._closed = False
        self._reinit()
        if hasattr(os, "register_at_fork"):
            weak = weakref.WeakMethod(self._reinit)
            os.register_at_fork(after_in_child=lambda: (m := weak()) and m())

    def _reinit(self):
        # a lock held by another thread at fork would never be released in the child
        self._lock = threading.Lock()
        self._in_flight = 0

    def start_counting(self) -> None:
        with self._lock:
            self._counting, self._failed = True, 0

    def not_exported(self) -> int:
        with self._lock:
            return self._failed + self._in_flight

    def export(self, batch, *args, **kwargs):
        n = _size(batch)
        with self._lock:
            if self._closed:  # after abort(): drop at once, without a warning per batch
                if self._counting:
                    self._failed += n
                return _failure(self._exporter)
            self._in_flight += n
        ok = False
        try:
            result = self._exporter.export(batch, *args, **kwargs)
            ok = getattr(result, "name", None) == "SUCCESS"
            return result
        finally:
            with self._lock:
                self._in_flight -= n
                if not ok and self._counting:
                    self._failed += n

    def shutdown(self, timeout_millis: float | None = None, **kwargs):
        """Once: the processor's own call after `abort()` must not make the exporter warn."""
        if self._closed:
            return None
        self._closed = True
        try:
            params = inspect.signature(self._exporter.shutdown).parameters
        except (TypeError, ValueError):
            params = {}
        any_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        call = {k: v for k, v in kwargs.items() if any_kw or k in params}
        if timeout_millis is not None and (any_kw or "timeout_millis" in params):
            call["timeout_millis"] = max(0.0, timeout_millis)
        return self._exporter.shutdown(**call)

    def abort(self) -> None:
        """Stop retrying and close connections now (the exporter's own shutdown)."""
        try:
            self.shutdown(timeout_millis=0)
        except Exception:  # noqa: BLE001 - best effort on the way out
            _log.debug("otel-llm: exporter shutdown failed", exc_info=True)

    def force_flush(self, timeout_millis: float = 30_000) -> bool:
        flush = getattr(self._exporter, "force_flush", None)
        return flush(timeout_millis=timeout_millis) if flush is not None else True

    def __getattr__(self, name):  # everything else: the wrapped exporter's
        try:
            exporter = self.__dict__["_exporter"]
        except KeyError:
            raise AttributeError(name) from None
        return getattr(exporter, name)


def _failure(exporter):
    """The FAILURE result of the exporter's kind (callers ignore it, but keep the type)."""
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    LogRecordExporter, LogRecordExportResult = internals.log_record_export_types()
    for base, result in (
        (SpanExporter, SpanExportResult),
        (LogRecordExporter, LogRecordExportResult),
        (MetricExporter, MetricExportResult),
    ):
        if isinstance(exporter, base):
            return result.FAILURE
    return None


def span_processor_factory(exporter):
    """For the configurator's `export_span_processor`: the SDK's default, accounted."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    return BatchSpanProcessor(AccountedExporter(exporter))


def log_record_processor_factory(exporter):
    """For the configurator's `export_log_record_processor`: the SDK's default, accounted."""
    return internals.batch_log_record_processor(AccountedExporter(exporter))


def _processors(read: Callable[[Any], tuple], provider) -> tuple:
    """What `read` (an otel_llm.sdk.internals function) finds in the provider; () without a
    provider, or where this SDK keeps no such thing."""
    if provider is None:
        return ()
    try:
        return tuple(read(provider) or ())
    except (AttributeError, TypeError):
        return ()


class _Signal:
    """What one signal has left unexported at the end: queued, failed, in flight."""

    def __init__(self, processors: Iterable):
        self.queues: list[Callable[[], int]] = []
        self.exporters: list[AccountedExporter] = []
        for processor in processors:
            queue = internals.batch_processor_queue(processor)
            exporter = internals.batch_processor_exporter(processor)
            if queue is not None:
                self.queues.append(lambda q=queue: len(q))
            if isinstance(exporter, AccountedExporter):
                self.exporters.append(exporter)

    def dropped(self) -> int:
        return sum(q() for q in self.queues) + sum(e.not_exported() for e in self.exporters)


class BoundedShutdown:
    """Shuts the tracer, meter and logger providers down within `timeout_s` (one atexit hook), and
    alongside them whatever joined (`join_shutdown`: the vLLM export process)."""

    def __init__(self, timeout_s: float, tracer_provider=None, meter_provider=None, logger_provider=None):
        self.timeout_s = timeout_s
        self.participants: list[Callable[[float], Any]] = []
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.logger_provider = logger_provider
        self._done = False
        accounted = (self._account_metric_reader(r) for r in _processors(internals.metric_readers, meter_provider))
        self.metric_exporters = [e for e in accounted if e is not None]

    @classmethod
    def from_globals(cls, timeout_s: float) -> "BoundedShutdown":
        from opentelemetry import metrics, trace

        def sdk(provider, is_sdk: Callable[[Any], bool]):
            return provider if is_sdk(provider) else None

        return cls(
            timeout_s,
            sdk(trace.get_tracer_provider(), internals.is_sdk_tracer_provider),
            sdk(metrics.get_meter_provider(), internals.is_sdk_meter_provider),
            sdk(internals.global_logger_provider(), internals.is_sdk_logger_provider),
        )

    def _providers(self) -> list:
        return [p for p in (self.tracer_provider, self.meter_provider, self.logger_provider) if p is not None]

    @staticmethod
    def _account_metric_reader(reader) -> AccountedExporter | None:
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        exporter = internals.reader_exporter(reader)
        if not isinstance(reader, PeriodicExportingMetricReader) or exporter is None:
            return None
        if not isinstance(exporter, AccountedExporter):
            exporter = AccountedExporter(exporter)
            internals.set_reader_exporter(reader, exporter)  # no knob for the reader's exporter; guarded above
        return exporter

    def install(self) -> "BoundedShutdown":
        """Take the providers' own atexit hooks over (they are bound methods: unregister works)."""
        for provider in self._providers():
            internals.unregister_exit_hook(provider)
        atexit.register(self.run)
        return self

    def _spans(self) -> _Signal:
        return _Signal(_processors(internals.span_processors, self.tracer_provider))

    def _logs(self) -> _Signal:
        return _Signal(_processors(internals.log_record_processors, self.logger_provider))

    def run(self, warn: bool = True) -> dict | None:
        """Shut everything down within the bound; one warning if telemetry was lost (with what the
        participants report lost). Returns what was not exported ({"spans", "log_records",
        "metric_points", "complete", "seconds"}); warn=False: only returns it (the export process
        reports to its server)."""
        if self._done:
            return None
        self._done = True
        start = time.monotonic()
        # a little early, for thread wake-ups on a busy machine and for the report
        deadline = start + self.timeout_s - min(0.25, 0.05 * self.timeout_s)
        # near the end, stop the exporters: time for the processors to count what is left
        abort_at = deadline - min(1.0, 0.2 * self.timeout_s)
        spans, logs = self._spans(), self._logs()
        exporters = [*spans.exporters, *logs.exporters, *self.metric_exporters]
        for exporter in exporters:
            exporter.start_counting()

        threads = []
        for provider in self._providers():
            if internals.provider_shut_down(provider):  # already shut down by its owner
                continue
            if provider is self.meter_provider:

                def call(p=provider):
                    return p.shutdown(timeout_millis=max(0.0, abort_at - time.monotonic()) * 1e3)
            else:
                call = provider.shutdown
            thread = threading.Thread(target=_quietly, args=(call,), name="otel-llm-shutdown", daemon=True)
            thread.start()
            threads.append(thread)

        reports: list[dict] = []  # what the participants lost
        for close in self.participants:  # each gets the time left to the bound

            def participate(c=close):
                reports.append(c(max(0.0, deadline - time.monotonic())) or {})

            thread = threading.Thread(target=_quietly, args=(participate,), name="otel-llm-shutdown", daemon=True)
            thread.start()
            threads.append(thread)

        _join(threads, abort_at)
        aborted = any(t.is_alive() for t in threads)
        if aborted:
            for exporter in exporters:
                exporter.abort()
            _join(threads, deadline)
        complete = not aborted and not any(t.is_alive() for t in threads)
        report = {
            "spans": spans.dropped(),
            "log_records": logs.dropped(),
            "metric_points": sum(e.not_exported() for e in self.metric_exporters),
            "complete": complete,
            "seconds": time.monotonic() - start,
        }
        for other in list(reports):
            for key in ("spans", "log_records", "metric_points"):
                report[key] += other.get(key, 0)
            report["complete"] = report["complete"] and other.get("complete", True)
        complete = report["complete"]
        lost = report["spans"] or report["log_records"] or report["metric_points"]
        if warn and (lost or not complete):
            _log.warning(
                "%s: %d spans, %d log records, %d metric points not exported (%s; took %.1f s of %s=%g)",
                DROPPED_MESSAGE,
                report["spans"],
                report["log_records"],
                report["metric_points"],
                "flush abandoned at the bound" if not complete else "the exporter failed",
                report["seconds"],
                ENV_SHUTDOWN_TIMEOUT,
                self.timeout_s,
            )
        return report


def _quietly(call: Callable[[], Any]) -> None:
    try:
        call()
    except Exception:  # noqa: BLE001 - a failing provider must not stop the others
        _log.debug("otel-llm: provider shutdown failed", exc_info=True)


def _join(threads, until: float) -> None:
    for thread in threads:
        thread.join(max(0.0, until - time.monotonic()))


_installed: BoundedShutdown | None = None


def install_bounded_shutdown(timeout_s: float) -> BoundedShutdown:
    """After the SDK is configured: bound its shutdown (OTEL_LLM_SHUTDOWN_TIMEOUT)."""
    global _installed
    from otel_llm import ensure_log_handler

    ensure_log_handler()  # the warning comes at exit: our logger must have a handler by then
    _installed = BoundedShutdown.from_globals(timeout_s).install()
    return _installed


def join_shutdown(close: Callable[[float], Any]) -> bool:
    """Have `close(seconds_left)` run alongside the bounded shutdown of this process's providers.
    False when none is installed (the caller registers its own exit hook)."""
    if _installed is None:
        return False
    _installed.participants.append(close)
    return True


def leave_shutdown(close: Callable[[float], Any]) -> None:
    """Undo join_shutdown (uninstrument closed it already)."""
    if _installed is not None and close in _installed.participants:
        _installed.participants.remove(close)
