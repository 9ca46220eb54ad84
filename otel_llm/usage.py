"""The billing ledger's writing side: one usage record per request that reached the engine.

A record is written when the request ends (finished, aborted by the client, or failed after the
engine accepted it), before its span ends, whether or not the trace is sampled. (A request running
longer than OTEL_LLM_LIVE_INTERVAL also gets progress records, its tokens so far, in the spool
only: `write_progress`, otel_llm/vllm/live.py; never billed.) It goes to

- the spool (`OTEL_LLM_USAGE_DIR`): each process appends JSON lines to its own file,
  `usage-<host>-<pid>-<start ms>-<seq>.jsonl`, with one `os.write` per record. Once `write`
  returns the line is the kernel's, so a SIGKILL of the server loses nothing written; a
  machine crash (power, kernel) loses what was not yet fsynced: a background thread fsyncs
  every `OTEL_LLM_USAGE_FSYNC_INTERVAL` seconds (default 1) when something was written.
  Files rotate by size and age; readers take every `usage-*.jsonl` and skip a torn last line.
- OTLP (`OTEL_LLM_USAGE_EVENTS=true` and an SDK LoggerProvider, e.g. OTEL_LOGS_EXPORTER=otlp):
  the same fields as the attributes of a log record with event name `otel_llm.usage`.

Nothing here may fail or slow a request: every error becomes one warning and a count in
`otel_llm.usage.records.dropped`.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import socket
import threading
import time
from typing import Any

import msgspec

from otel_llm import semconv
from otel_llm.warn import WarnOnce

_log = logging.getLogger(__name__)

SPOOL_PREFIX = "usage-"
SPOOL_SUFFIX = ".jsonl"


class _SpoolFiles:
    """What both spool writers share: the directory, rotation limits, fsync interval, drop callback
    and the file names (`usage-<host>-<pid>-<start ms>-<tag><seq>.jsonl`)."""

    RETRY_OPEN_S = 10.0

    def __init__(
        self,
        directory: str,
        *,
        max_bytes: int = 64 << 20,
        max_age_s: float = 3600.0,
        fsync_interval_s: float = 1.0,
        on_drop=None,
    ):
        self.directory = directory
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.fsync_interval_s = fsync_interval_s
        self.on_drop = on_drop or (lambda reason: None)
        self._seq = 0
        self._init_writer()

    def _init_writer(self) -> None:
        """The writer's own state (each subclass's)."""

    def _next_path(self, tag: str = "") -> str:
        os.makedirs(self.directory, exist_ok=True)
        self._seq += 1
        name = (
            f"{SPOOL_PREFIX}{_safe_host()}-{os.getpid()}-{int(time.time() * 1000)}-{tag}{self._seq:04d}{SPOOL_SUFFIX}"
        )
        return os.path.join(self.directory, name)


class Spool(_SpoolFiles):
    """Append-only JSON-lines files in one directory, one file at a time per process."""

    def _init_writer(self) -> None:
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid = 0
        self._path: str | None = None
        self._size = 0
        self._opened_at = 0.0
        self._dirty = False
        self._torn = False  # the last write stopped inside a line: the next one starts a new line
        self._failed_open_at: float | None = None
        self._warn = WarnOnce(_log)  # per spool: one warning per cause
        self._fsync_thread: threading.Thread | None = None
        self._retired: list[int] = []  # rotated files the fsync thread syncs and closes
        self._stop = threading.Event()
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        """A forked child (vLLM's engine core) gets its own file, lock and fsync thread: the parent's
        lock may have been held by another thread at the fork."""
        self._lock = threading.Lock()
        self._fd, self._path, self._fsync_thread, self._retired, self._dirty = None, None, None, [], False

    @property
    def path(self) -> str | None:
        return self._path

    def write(self, line: bytes) -> bool:
        """Append one line (ending in a newline). False when it was dropped."""
        with self._lock:
            try:
                fd = self._fd  # (an open file that needs no rotation, without _file's frame)
                if fd is None or self._size >= self.max_bytes or time.monotonic() - self._opened_at >= self.max_age_s:
                    fd = self._file()
            except OSError as exc:
                self._drop(semconv.DROP_OPEN, f"cannot open a usage spool file in {self.directory}: {exc}")
                return False
            data = b"\n" + line if self._torn else line
            try:
                written = os.write(fd, data)
                while written < len(data):  # short write: the disk filled up mid-line
                    self._torn = True
                    written += os.write(fd, data[written:])
            except OSError as exc:
                what = semconv.DROP_DISK_FULL if exc.errno == errno.ENOSPC else semconv.DROP_WRITE
                self._drop(what, f"cannot write the usage spool {self._path}: {exc}")
                return False
            self._torn = False
            self._size += written
            self._dirty = True
            return True

    def _file(self) -> int:
        now = time.monotonic()
        if self._fd is not None and (self._size >= self.max_bytes or now - self._opened_at >= self.max_age_s):
            self._close_file()
        if self._fd is None:
            if self._failed_open_at is not None and now - self._failed_open_at < self.RETRY_OPEN_S:
                raise OSError(errno.EAGAIN, "opening failed moments ago; retrying later")
            try:
                self._open(now)
            except OSError:
                self._failed_open_at = now
                raise
            self._failed_open_at = None
        return self._fd

    def _open(self, now: float) -> None:
        self._pid = os.getpid()
        path = self._next_path()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        self._path, self._size, self._opened_at, self._torn = path, 0, now, False
        self._start_fsync_thread()

    def _close_file(self, *, now: bool = False) -> None:
        """Rotation hands the old file to the fsync thread (a request never waits for fsync);
        close() and a spool without the thread fsync and close it here."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        self._dirty = False
        if now or self._fsync_thread is None:
            _fsync_and_close(fd)
        else:
            self._retired.append(fd)

    def _start_fsync_thread(self) -> None:
        if self._fsync_thread is not None or self.fsync_interval_s <= 0:
            return
        self._fsync_thread = threading.Thread(target=self._fsync_loop, name="otel-llm-usage-fsync", daemon=True)
        self._fsync_thread.start()

    def _fsync_loop(self) -> None:
        pid = os.getpid()
        while not self._stop.wait(self.fsync_interval_s) and os.getpid() == pid:
            self.sync()

    def sync(self) -> None:
        """fsync what was written since the last sync (the background thread calls this)."""
        with self._lock:
            retired, self._retired = self._retired, []
            if not self._dirty or self._fd is None or self._pid != os.getpid():
                fd = None
            else:
                fd = self._fd
                self._dirty = False
        for old in retired:
            _fsync_and_close(old)
        if fd is None:
            return
        try:
            os.fsync(fd)  # outside the lock: a request never waits for the disk
        except OSError as exc:
            self._warn_once(
                "fsync",
                f"otel-llm: fsync of the usage spool failed ({exc}); records are written "
                "but a machine crash may lose the last seconds of them",
            )

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._pid == os.getpid():
                self._close_file(now=True)
                retired, self._retired = self._retired, []
                for fd in retired:
                    _fsync_and_close(fd)

    def _drop(self, reason: str, message: str) -> None:
        self._warn_once(
            reason,
            f"otel-llm: usage record dropped: {message}. Requests are served; further "
            f"drops are counted in {semconv.USAGE_RECORDS_DROPPED}.",
        )
        self.on_drop(reason)

    def _warn_once(self, key: str, message: str) -> None:
        self._warn(key, "%s", message)


def _fsync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError:
        pass
    os.close(fd)


def _safe_host() -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname()) or "host"


_encode = msgspec.json.Encoder().encode


def json_line(record: dict) -> bytes:
    """A spool line: compact JSON, UTF-8, newline-terminated. msgspec's encoder (a tenth of json.dumps's
    CPU for a usage record, per request in the API server and the engine core); a value it does not
    take (a str subclass) goes through json.dumps. (Floats are written in their shortest form either
    way: 1e-05 by one, 0.00001 by the other; NaN as null by msgspec.)"""
    try:
        return _encode(record) + b"\n"
    except Exception:  # noqa: BLE001 - the stdlib's encoder, or its error for the caller
        return json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def emit_event(logger, fields: dict[str, Any], end_ns: int, context=None) -> None:
    """A usage record as an OTLP log event (the API server's logger, or the export process's)."""
    logger.emit(
        timestamp=end_ns, observed_timestamp=end_ns, context=context, event_name=semconv.USAGE_EVENT, attributes=fields
    )


class UsageLedger:
    """Writes each record to the spool and/or as an OTLP log event. Never raises."""

    def __init__(
        self,
        meter,
        *,
        directory: str | None,
        events: bool,
        instance: str,
        service: str,
        fsync_interval_s: float = 1.0,
        max_bytes: int = 64 << 20,
        max_age_s: float = 3600.0,
        event_logger=None,
    ):
        self.instance = instance
        self.service = service
        self._dropped = semconv.create_instrument(meter, semconv.USAGE_RECORDS_DROPPED)
        self.spool = (
            Spool(
                directory,
                max_bytes=max_bytes,
                max_age_s=max_age_s,
                fsync_interval_s=fsync_interval_s,
                on_drop=self.count_drop,
            )
            if directory
            else None
        )
        # event_logger: where events go instead of the global LoggerProvider (the export process)
        self._event_logger = (event_logger or _event_logger()) if events else None
        self._warn = WarnOnce(_log)
        if self.spool is not None:
            atexit.register(self.spool.close)
        self.enabled = self.spool is not None or self._event_logger is not None  # (read per request: no property)

    def count_drop(self, reason: str) -> None:
        try:
            self._dropped.add(1, {semconv.ERROR_TYPE: reason})
        except Exception:  # noqa: BLE001
            pass

    def key(self, engine_request_id: str) -> str:
        return f"{self.instance}/{engine_request_id}"

    def write(self, fields: dict[str, Any], end_ns: int, span_context, context=None, event: bool = True) -> None:
        """A request's usage record: a line in the spool, and (`event`) the OTLP usage event."""
        try:
            if self.spool is not None:  # (one frame per request: the line is made here)
                line = dict(fields)
                line[semconv.USAGE_TIME] = end_ns
                if span_context is not None and span_context[5]:  # (sdk/internals.py SPAN_CONTEXT_FIELDS: is_valid)
                    line[semconv.USAGE_TRACE_ID] = format(span_context[0], "032x")
                    line[semconv.USAGE_SPAN_ID] = format(span_context[1], "016x")
                try:  # (json_line's, without its frame: its fallback for a value msgspec does not take)
                    data = _encode(line) + b"\n"
                except Exception:  # noqa: BLE001
                    data = json_line(line)
                self.spool.write(data)
            if event and self._event_logger is not None:  # (emit_event's call, here)
                self._event_logger.emit(
                    timestamp=end_ns,
                    observed_timestamp=end_ns,
                    context=context,
                    event_name=semconv.USAGE_EVENT,
                    attributes=fields,
                )
        except Exception:  # noqa: BLE001 - a usage record never breaks serving
            self.count_drop(semconv.DROP_ERROR)
            self._warn("record", "otel-llm: writing a usage record failed", exc_info=True)

    def write_progress(self, fields: dict[str, Any], time_ns: int, span_context) -> None:
        """A progress record of a request in flight (otel_llm/vllm/live.py): to the spool only; the
        request's OTLP usage event is its bill."""
        self.write(fields, time_ns, span_context, event=False)

    def close(self) -> None:
        if self.spool is not None:
            self.spool.close()


def _event_logger():
    """The global OTel logger, or None (with one info line) when no SDK LoggerProvider is set."""
    from otel_llm.sdk import internals

    provider = internals.global_logger_provider()
    if internals.is_api_logger_provider(provider):  # the API's no-op/proxy
        _log.warning(
            "otel-llm: OTEL_LLM_USAGE_EVENTS is on but no OTel LoggerProvider is configured "
            "(set OTEL_LOGS_EXPORTER=otlp); usage events are not sent"
        )
        return None
    from otel_llm import __version__

    return provider.get_logger(semconv.USAGE_EVENT, __version__)


class EngineSpool(_SpoolFiles):
    """The engine core's spool file: written by the engine's main thread alone, with no lock (the
    engine-core loop is the GPU's critical path and shares nothing with other threads). A
    background thread fsyncs the current file through a descriptor of its own every
    `fsync_interval_s` (fsync flushes the file, whichever descriptor asks); the only state it
    shares is the path and a write counter, each assigned whole under the GIL.

    Same name scheme and rotation as `Spool`, so readers take its lines with the API server's."""

    def _init_writer(self) -> None:
        self._fd: int | None = None
        self.path: str | None = None
        self._size = 0
        self._opened_at = 0.0
        self._writes = 0  # read by the fsync thread
        self._failed_open_at: float | None = None
        self._warn = WarnOnce(_log)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def write(self, data: bytes) -> bool:
        """Append whole lines with one os.write. False when they were dropped."""
        try:
            fd = self._file()
            written = os.write(fd, data)
            while written < len(data):
                written += os.write(fd, data[written:])
        except OSError as exc:
            reason = (
                semconv.DROP_DISK_FULL
                if exc.errno == errno.ENOSPC
                else (semconv.DROP_OPEN if self._fd is None else semconv.DROP_WRITE)
            )
            self._warn(
                reason,
                "otel-llm: engine usage records dropped (%s in %s). The engine serves on; further "
                "drops are counted in %s.",
                exc,
                self.directory,
                semconv.USAGE_RECORDS_DROPPED,
            )
            self.on_drop(reason)
            return False
        self._size += written
        self._writes += 1
        return True

    def _file(self) -> int:
        now = time.monotonic()
        if self._fd is not None and (self._size >= self.max_bytes or now - self._opened_at >= self.max_age_s):
            os.close(self._fd)  # the fsync thread syncs the old file once more when it sees the new path
            self._fd = None
        if self._fd is None:
            if self._failed_open_at is not None and now - self._failed_open_at < self.RETRY_OPEN_S:
                raise OSError(errno.EAGAIN, "opening failed moments ago; retrying later")
            try:
                path = self._next_path("e")
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
            except OSError:
                self._failed_open_at = now
                raise
            self._failed_open_at = None
            self.path, self._size, self._opened_at = path, 0, now
            if self._thread is None and self.fsync_interval_s > 0:
                self._thread = threading.Thread(target=self._fsync_loop, name="otel-llm-engine-fsync", daemon=True)
                self._thread.start()
        return self._fd

    def _fsync_loop(self) -> None:
        path, fd, synced = None, None, 0
        while True:
            stopping = self._stop.wait(self.fsync_interval_s)
            writes, current = self._writes, self.path
            if fd is not None and (writes != synced or current != path):
                _fsync(fd)
                if current != path:
                    os.close(fd)
                    fd = None
            synced = writes
            if current is not None and current != path:
                path = current
                try:
                    fd = os.open(path, os.O_RDONLY)
                    _fsync(fd)
                except OSError:
                    fd = None
            if stopping:
                if fd is not None:
                    _fsync_and_close(fd)
                return

    def close(self) -> None:
        """Flush to disk and close (the engine's main thread, at shutdown)."""
        self._stop.set()
        fd, self._fd = self._fd, None
        if fd is not None:
            _fsync_and_close(fd)


def _fsync(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError:
        pass
