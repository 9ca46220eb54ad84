"""A local HTTP server that answers with recorded OpenAI API exchanges
(tests/fixtures/openai_cassettes: a copy of shared/openai_cassettes, provenance in its README).

The real openai client talks to it over real HTTP; it records what it received (headers, bodies),
so tests can check the trace context, include_usage and that no secret went where it should not.
Fault injection the real API cannot be made to produce on demand: a delay between SSE events
(cancellation mid-stream) and a connection cut mid-stream.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

CASSETTES = Path(__file__).resolve().parents[1] / "fixtures" / "openai_cassettes"
_PASSED_HEADERS = ("content-type", "content-encoding", "x-request-id")


def load(name: str) -> list[dict]:
    """The interactions of one cassette, each {"status", "headers", "body": bytes}."""
    data = yaml.safe_load((CASSETTES / name).read_text())
    result = []
    for interaction in data["interactions"]:
        response = interaction["response"]
        body = response["body"]["string"]
        headers = {k.lower(): v[0] for k, v in response["headers"].items() if k.lower() in _PASSED_HEADERS}
        result.append(
            {
                "status": response["status"]["code"],
                "headers": headers,
                "body": body if isinstance(body, bytes) else body.encode(),
            }
        )
    return result


class Received:
    def __init__(self, path: str, headers: dict[str, list[str]], body: bytes):
        self.path = path
        self.headers = headers  # lower-case name -> every value received
        self.body = body

    def json(self) -> dict:
        return json.loads(self.body)

    def header(self, name: str) -> str | None:
        values = self.headers.get(name.lower())
        return values[0] if values else None


class ReplayServer:
    def __init__(self):
        self.queue: list[dict] = []
        self.received: list[Received] = []
        self.event_delay = 0.0  # seconds between SSE events
        self.cut_after_events: int | None = None  # drop the connection after N SSE events
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                headers: dict[str, list[str]] = {}
                for name, value in self.headers.items():
                    headers.setdefault(name.lower(), []).append(value)
                with server._lock:
                    server.received.append(Received(self.path, headers, body))
                    reply = server.queue.pop(0) if server.queue else None
                if reply is None:
                    self._send(500, {"content-type": "application/json"}, b'{"error": {"message": "no reply queued"}}')
                    return
                self._send(reply["status"], reply["headers"], reply["body"])

            do_GET = do_POST

            def _send(self, status, headers, body: bytes):
                sse = headers.get("content-type", "").startswith("text/event-stream")
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                if not sse or (server.event_delay == 0 and server.cut_after_events is None):
                    self.send_header("content-length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                events = [e + b"\n\n" for e in body.split(b"\n\n") if e.strip()]
                for index, event in enumerate(events):
                    if server.cut_after_events is not None and index >= server.cut_after_events:
                        self.close_connection = True  # no terminating chunk: a truncated body
                        return
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()
                    time.sleep(server.event_delay)
                self.wfile.write(b"0\r\n\r\n")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def play(self, cassette: str, *, times: int = 1) -> "ReplayServer":
        """Queue the cassette's responses (in order), `times` over."""
        self.queue.extend(load(cassette) * times)
        return self

    def reset(self) -> None:
        self.queue.clear()
        self.received.clear()
        self.event_delay = 0.0
        self.cut_after_events = None

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def response_json(cassette: str, index: int = 0):
    """The recorded response body: a dict, or for an SSE stream the list of its data events."""
    import gzip

    raw = load(cassette)[index]["body"]
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    text = raw.decode()
    if text.lstrip().startswith("data:") or text.lstrip().startswith("event:"):
        events = []
        for block in text.split("\n\n"):
            for line in block.splitlines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    events.append(json.loads(line[5:]))
        return events
    return json.loads(text)
