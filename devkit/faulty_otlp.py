"""OTLP endpoints that misbehave, for the exporter-fault test and the reliability benchmark:
a black hole (accepts TCP connections, never reads nor answers), an OTLP/HTTP endpoint that answers
late or never (`FaultyOTLP`), and a port nobody listens on (`Refused`)."""

from __future__ import annotations

import socket
import threading
import time

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from devkit.devserver import free_port
from devkit.otlp_receiver import QuietHandler, QuietServer


class BlackHole:
    """Accepts TCP connections and never answers (nor reads)."""

    def __init__(self):
        self._sock = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._held.append(conn)

    def close(self):
        self._sock.close()
        for conn in self._held:
            conn.close()


class FaultyOTLP:
    """OTLP/HTTP endpoint: `slow` answers 200 after `delay` (0: a healthy collector that costs next
    to nothing, unlike one that decodes); `blackhole` reads a request and never answers until the
    mode changes. With `decode`, it records the (trace id, span name) of the spans it answered for."""

    def __init__(self, mode: str, delay: float = 0.0, decode: bool = True):
        self.mode, self.delay = mode, delay
        self.received: list[tuple[str, str]] = []
        self._release = threading.Event()
        outer = self

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if outer.mode == "blackhole":
                    outer._release.wait()  # until the mode changes: then close without an answer
                    self.close_connection = True
                    return
                time.sleep(outer.delay)
                if decode and self.path.endswith("/v1/traces"):
                    request = ExportTraceServiceRequest.FromString(body)
                    outer.received.extend(
                        (s.trace_id.hex(), s.name)
                        for rs in request.resource_spans
                        for ss in rs.scope_spans
                        for s in ss.spans
                    )
                self.answer_ok()

        self._server = QuietServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def set_mode(self, mode: str):
        self.mode = mode
        if mode != "blackhole":
            self._release.set()

    def close(self):
        self._release.set()
        self._server.shutdown()
        self._server.server_close()


class Refused:
    """An endpoint on a free port nobody listens on: every connection is refused."""

    def __init__(self):
        self.endpoint = f"http://127.0.0.1:{free_port()}"

    def close(self):
        pass
