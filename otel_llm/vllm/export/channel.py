"""Telemetry off the API server's hot path: the API-server side.

With `opentelemetry-instrument` (our configurator, exporters named in OTEL_*_EXPORTER), a
request's GenAI span and its phase spans are not SDK spans in the API server. A request keeps
what it will export in plain Python values: a `DeferredSpan` per span (ids from the user's
sampler and id generator, at the moment the SDK would have made them), the request's metric
`Measurement` and its usage event. When the request ends they go, as one message through a
non-blocking Unix socket, to a child process (otel_llm/vllm/export/process.py) that
builds the SDK's `ReadableSpan`s, records the metrics and sends everything with the exporters
the user configured, with the API server's resource. The API server pays for the values and
a share of one `send`; the SDK's span objects, attribute validation, metric aggregation and OTLP
encoding run in the other process.

On the event loop's thread a message is held until the loop's timer, HOLD_S later, or until HELD_MAX
are held, and the held ones go in one packet: one `marshal` call and one system call for all of
them, run while their code is in the CPU's caches (`ExportChannel.flush`). Telemetry waits at most
HOLD_S more (the export process reads every 20 ms and batches for its exporters anyway); a process
killed without its shutdown loses what it held, as the SDK's batch processor does. Usage records
never wait: the spool line is written before the response ends (otel_llm/usage.py).

The socket buffer is the bounded queue: when it is full (the export process is stalled) or the
export process is gone, the request's telemetry is dropped and counted in
`otel_llm.export.dropped` (`error.type`: queue_full, exporter_down); a request never waits. A
dead export process is restarted, with a backoff, by the next request that finds it gone. A
forked child (vLLM's engine core) drops its inherited socket and would start its own; a
spawned API server (`--api-server-count N`) is instrumented on its own and has its own.
"""

from __future__ import annotations

import fcntl
import logging
import marshal
import os
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
import weakref
from asyncio import _get_running_loop  # (None without one; C)
from typing import Any

from otel_llm import semconv
from otel_llm.sdk import internals
from otel_llm.vllm.export.wire import BATCH, BYE, CONFIG, FIRST, LAST, PROGRESS, WHOLE, plain
from otel_llm.warn import WarnOnce, entry, failed, inline_entry

_log = logging.getLogger("otel_llm.vllm")

SOCKET_BUFFER = 4 << 20  # asked for; the kernel caps it (net.core.wmem_max)
RESTART_BACKOFF_S = (1.0, 30.0)
# a message sent on an event loop's thread waits at most this long for the loop's next ones, or until
# this many are held, and they go together (ExportChannel.send)
HOLD_S = 0.05
HELD_MAX = 32
_AUTO_INSTRUMENTATION_DIR = os.path.join("opentelemetry", "instrumentation", "auto_instrumentation")


def plan(settings, tracer_provider, explicit_providers: bool) -> dict[str, Any] | None:
    """What the export process takes over here, or None (the SDK exports in this process): only
    where our configurator set the SDK up from the environment alone, so that the export process
    can make the same exporters from the same environment."""
    from otel_llm.sdk import distro

    if not settings.export_process or explicit_providers or not distro.configured_from_environment():
        return None
    if not internals.is_sdk_tracer_provider(tracer_provider) or not hasattr(tracer_provider, "sampler"):
        return None
    if internals.tracer_provider_disabled(tracer_provider):  # OTEL_SDK_DISABLED: the SDK's tracers make no spans
        return None
    from opentelemetry.sdk.metrics.export import MetricReader

    # a metric reader (Prometheus) serves from this process: such metrics stay here
    _, metric_exporters, _ = internals.exporters_from_environment(metrics=True)
    metrics = not any(issubclass(cls, MetricReader) for cls in metric_exporters.values())
    events = settings.usage_events and internals.is_sdk_logger_provider(internals.global_logger_provider())
    resource = tracer_provider.resource
    return {
        "traces": True,
        "metrics": metrics,
        "usage_events": events,
        "resource": dict(resource.attributes),
        "schema_url": resource.schema_url or None,
    }


_WHOLE_HEADER = bytes((WHOLE,))


class ExportChannel:
    """The socket to this process's export process, which it starts, supervises and restarts."""

    def __init__(self, config: dict[str, Any], on_drop, shutdown_timeout_s: float | None):
        self._config = config
        self._on_drop = on_drop
        self._shutdown_timeout_s = shutdown_timeout_s
        self._lock = threading.Lock()
        self._warn = WarnOnce(_log)
        self._sock: socket.socket | None = None
        self._process: subprocess.Popen | None = None
        self._owner = os.getpid()
        self._started_at = 0.0
        self._retry_at = 0.0
        self._backoff = RESTART_BACKOFF_S[0]
        self._frame = 64 << 10
        self.buffer_size = 0  # the socket's send buffer, as the kernel granted it
        self._closed = False
        self.sent = 0
        self.dropped = 0
        self._held: list[tuple] = []  # messages sent on an event loop's thread, not yet flushed
        self._flush_loop = None  # the loop whose timer flushes them
        weak = weakref.WeakMethod(self._after_fork)  # a closed channel is not kept alive for forks
        os.register_at_fork(after_in_child=lambda: (method := weak()) and method())

    @entry("ExportChannel._after_fork")
    def _after_fork(self) -> None:
        # the parent's socket and process are the parent's; this process starts its own if it sends
        self._lock = threading.Lock()
        if self._sock is not None:
            try:
                self._sock.detach()  # not close(): shutdown semantics are the parent's
            except OSError:
                pass
        self._sock, self._process, self._owner = None, None, os.getpid()
        self._retry_at = 0.0
        self._held, self._flush_loop = [], None

    @property
    def process(self) -> subprocess.Popen | None:
        return self._process

    def backlog(self) -> int:
        """Bytes sent to the export process that it has not read yet (0 without one; held messages
        are not sent yet: `flush`)."""
        sock = self._sock
        if sock is None:
            return 0
        try:
            return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        except OSError:
            return 0

    def start(self) -> bool:
        """Start the export process now (else the first request does). Never raises."""
        with self._lock:
            try:
                return self._ensure_started()
            except Exception as exc:  # noqa: BLE001 - requests retry after the backoff
                return self._start_failed(exc)

    def _start_failed(self, exc) -> bool:
        self._warn(
            "start",
            "otel-llm: cannot start the telemetry export process (%s); request telemetry is dropped and counted in %s",
            exc,
            semconv.EXPORT_DROPPED,
        )
        self._retry_at = time.monotonic() + RESTART_BACKOFF_S[1]
        return False

    @inline_entry("ExportChannel.send")
    def send(self, message: tuple) -> bool:
        """Hand one message over, never blocking. On a thread that runs an event loop it is held, with
        that loop's next ones, until a timer of the loop sends them in one packet (HOLD_S later, or
        sooner when HELD_MAX are held): True then. Elsewhere it goes now (with any held ones): False
        when it was dropped (and counted), or when it failed (counted in
        otel_llm.instrumentation.failures)."""
        try:
            held = self._held
            held.append(message)
            if len(held) < HELD_MAX:
                loop = _get_running_loop()
                if loop is not None and self._flush_loop is None:  # the first one held: this loop's timer sends it
                    self._flush_loop = loop
                    loop.call_later(HOLD_S, self.flush)
                # (a timer on another loop may never run: that loop's messages go now, with this one)
                if loop is not None and loop is self._flush_loop:
                    return True
            return self.flush()
        except Exception:  # noqa: BLE001
            failed("ExportChannel.send")
            return False

    @entry("ExportChannel.flush", fallback=False)
    def flush(self) -> bool:
        """Send the held messages, in one packet (one marshal and one system call for all of them:
        per message, that is a fraction of what its own would cost the request that sends it). False
        when they were dropped (each counted), or failed."""
        with self._lock:
            self._flush_loop = None
            held = self._held
            count = len(held)
            if not count:
                return True
            batch = held[:count]
            del held[:count]  # (not a new list: another thread may be appending to this one)
            message = batch[0] if count == 1 else (BATCH, batch)
            try:
                data = marshal.dumps(message)
            except ValueError:  # a value marshal does not take: the attributes, made plain
                data = marshal.dumps(plain(message) if count == 1 else (BATCH, [plain(m) for m in batch]))
            try:
                started = self._sock is not None or self._ensure_started()
            except OSError as exc:
                self._lost(exc)
                started = False
            if not started:
                return self._drop(semconv.EXPORT_DROP_EXPORTER_DOWN, count)
            try:
                if len(data) < self._frame:  # (_send_frames' first case, without its frame)
                    self._sock.sendmsg((_WHOLE_HEADER, data))
                else:
                    self._send_frames(data)
            except BlockingIOError:
                return self._drop(semconv.EXPORT_DROP_QUEUE_FULL, count)
            except OSError as exc:  # EPIPE, ECONNRESET: the export process is gone
                self._lost(exc)
                return self._drop(semconv.EXPORT_DROP_EXPORTER_DOWN, count)
            self.sent += count
            return True

    def send_progress(self, increments: list[tuple]) -> bool:
        """One live sweep's token counter increments: [(metric key, (input, cached input, output))]."""
        return self.send((PROGRESS, increments))

    def _send_frames(self, data: bytes) -> None:
        """One packet per frame, its header byte and its part of `data` gathered by the kernel (no copy
        of the message made here to put the byte in front)."""
        frame, sock = self._frame, self._sock
        if len(data) < frame:
            sock.sendmsg((_WHOLE_HEADER, data))
            return
        view = memoryview(data)
        parts = range(0, len(data), frame - 1)
        for i in parts:
            flags = (FIRST if i == 0 else 0) | (LAST if i + frame - 1 >= len(data) else 0)
            sock.sendmsg((bytes((flags,)), view[i : i + frame - 1]))

    def _drop(self, reason: str, count: int = 1) -> bool:
        self.dropped += count
        if reason == semconv.EXPORT_DROP_QUEUE_FULL:
            self._warn(
                "full",
                "otel-llm: the export process does not keep up; request telemetry is dropped (counted in %s)",
                semconv.EXPORT_DROPPED,
            )
        try:
            for _ in range(count):
                self._on_drop(reason)
        except Exception:  # noqa: BLE001
            pass
        return False

    def _lost(self, exc) -> None:
        code = self._process.poll() if self._process is not None else None
        self._warn(
            "lost",
            "otel-llm: the telemetry export process is gone (%s, exit code %s); it is restarted, "
            "telemetry in between is dropped and counted in %s",
            exc,
            code,
            semconv.EXPORT_DROPPED,
        )
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        if time.monotonic() - self._started_at > 60:  # it lived a minute: back to the shortest wait
            self._backoff = RESTART_BACKOFF_S[0]
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, RESTART_BACKOFF_S[1])

    def _ensure_started(self) -> bool:
        if self._owner != os.getpid():
            self._after_fork()
        if self._sock is not None:
            return True
        if self._closed or time.monotonic() < self._retry_at:
            return False
        if self._process is not None:
            self._process.poll()  # reap the old one
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            for sock, option in ((parent, socket.SO_SNDBUF), (child, socket.SO_RCVBUF)):
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
            # the largest message one send takes whole, with room for the kernel's own bookkeeping
            self.buffer_size = parent.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            self._frame = max(4096, self.buffer_size // 2 - 1024)
            self._process = subprocess.Popen(
                [sys.executable, "-m", "otel_llm.vllm.export.process", str(child.fileno())],
                pass_fds=(child.fileno(),),
                env=child_environment(os.environ),
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )
        except OSError as exc:
            parent.close()
            return self._start_failed(exc)
        finally:
            child.close()
        try:
            parent.sendall(_WHOLE_HEADER + marshal.dumps((CONFIG, {**self._config, "frame": self._frame})))
        except OSError:
            parent.close()
            self._started_at = time.monotonic()
            raise
        parent.setblocking(False)
        self._sock, self._started_at = parent, time.monotonic()
        return True

    def close(self, timeout_s: float | None = None) -> dict | None:
        """Tell the export process to flush within `timeout_s` and exit; wait for it. Returns what
        its flush could not export (shutdown.BoundedShutdown's report), or None. Once."""
        if self._owner == os.getpid():
            self.flush()
        with self._lock:
            if self._closed or self._owner != os.getpid():
                return None
            self._closed = True
            sock, process, self._sock = self._sock, self._process, None
        if sock is None or process is None:
            return None
        timeout = timeout_s if timeout_s is not None else (self._shutdown_timeout_s or 30.0)
        deadline = time.monotonic() + timeout
        report = {"complete": False}
        try:
            sock.settimeout(max(0.05, timeout))
            # the export process flushes a little within the bound: time to hear its report
            sock.send(_WHOLE_HEADER + marshal.dumps((BYE, max(0.0, timeout - min(0.5, 0.1 * timeout)))))
            data = sock.recv(self._frame + 1)
            if data:
                kind, report = marshal.loads(data[1:])
        except (OSError, ValueError, EOFError, TypeError):
            pass
        finally:
            sock.close()
        try:
            process.wait(max(0.05, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass  # it ends on its own within its bound
        return report


def child_environment(environ) -> dict[str, str]:
    """The export process's environment: the server's (its OTEL_* settings), without
    opentelemetry-instrument's sitecustomize, so the export process is not instrumented itself."""
    env = dict(environ)
    path = [
        p
        for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and not p.rstrip(os.sep).endswith(_AUTO_INSTRUMENTATION_DIR)
    ]
    if path:
        env["PYTHONPATH"] = os.pathsep.join(path)
    else:
        env.pop("PYTHONPATH", None)
    return env
