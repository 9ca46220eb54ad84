"""A small in-process OTLP/HTTP (protobuf) receiver: the demo's and the tests' collector.

It accepts /v1/traces, /v1/metrics and /v1/logs, decodes them with the official protobuf bindings and
keeps plain Python records, and every request body as received (`bodies`: the bytes sent, after
the HTTP content encoding; over gRPC, the request as the server library parsed and re-serialised it),
for tests that search everything exported for what must not be there. Not a production collector:
use otelcol-contrib for that.
"""

from __future__ import annotations

import gzip
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

SPAN_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
STATUS_CODES = {0: "UNSET", 1: "OK", 2: "ERROR"}


def any_value(value) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def attributes(kvs) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


@dataclass(frozen=True)
class Link:
    trace_id: str
    span_id: str


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status: str
    status_message: str
    resource: dict[str, Any]
    scope: str
    events: list[dict] = field(default_factory=list)
    links: list["Link"] = field(default_factory=list)
    # each event's time (Unix ns), in the order of `events`; not compared (a recorded exception is
    # stamped when it happens)
    event_times: list[int] = field(default_factory=list, compare=False)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


@dataclass
class LogRecord:
    event_name: str
    time_ns: int
    trace_id: str
    span_id: str
    attributes: dict[str, Any]
    resource: dict[str, Any] = field(default_factory=dict)
    scope: str = ""


@dataclass
class MetricPoint:
    name: str
    unit: str
    kind: str  # histogram | sum | gauge
    attributes: dict[str, Any]
    value: float | None = None  # sum / gauge
    count: int | None = None  # histogram
    total: float | None = None
    bounds: tuple[float, ...] = ()
    bucket_counts: tuple[int, ...] = ()
    exemplars: list[dict] = field(default_factory=list)
    resource: dict[str, Any] = field(default_factory=dict)


class QuietHandler(BaseHTTPRequestHandler):
    """An OTLP/HTTP request handler that logs nothing; `answer_ok` sends the empty 200 a collector
    answers an accepted export with."""

    def answer_ok(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class QuietServer(ThreadingHTTPServer):
    """A threading HTTP server that says nothing when a client leaves mid-request (an exporter timing
    out on a slow endpoint, a server killed while it exported); any other error is printed as usual."""

    daemon_threads = True

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class Receiver:
    """OTLP over HTTP (`endpoint`) and, optionally, gRPC (`grpc_endpoint`)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, grpc: bool = True):
        self.spans: list[Span] = []
        self.metric_batches: list[list[MetricPoint]] = []
        self.logs: list[LogRecord] = []
        # (signal: traces | metrics | logs, the request's body as received), in arrival order
        self.bodies: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(QuietHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                signal = self.path.rstrip("/").rpartition("/")[2]
                receiver._keep(signal, body)
                if signal == "traces":
                    receiver._traces(body)
                elif signal == "metrics":
                    receiver._metrics(body)
                elif signal == "logs":
                    receiver._logs(body)
                self.answer_ok()

        self._server = QuietServer((host, port), Handler)
        self.port = self._server.server_address[1]
        self.endpoint = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._grpc_server = self._make_grpc_server(host) if grpc else None

    def _make_grpc_server(self, host: str):
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        receiver = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802
                receiver._traces(receiver._keep("traces", request.SerializeToString()))
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):  # noqa: N802
                receiver._metrics(receiver._keep("metrics", request.SerializeToString()))
                return metrics_service_pb2.ExportMetricsServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
        grpc_port = server.add_insecure_port(f"{host}:0")
        self.grpc_endpoint = f"http://{host}:{grpc_port}"
        return server

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self) -> "Receiver":
        self._thread.start()
        if self._grpc_server is not None:
            self._grpc_server.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._grpc_server is not None:
            self._grpc_server.stop(grace=None)

    def _keep(self, signal: str, body: bytes) -> bytes:
        with self._lock:
            self.bodies.append((signal, body))
        return body

    def _traces(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        spans = []
        for rs in request.resource_spans:
            resource = attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        Span(
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            name=s.name,
                            kind=SPAN_KINDS.get(s.kind, str(s.kind)),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes=attributes(s.attributes),
                            status=STATUS_CODES.get(s.status.code, str(s.status.code)),
                            status_message=s.status.message,
                            resource=resource,
                            scope=ss.scope.name,
                            events=[{"name": e.name, "attributes": attributes(e.attributes)} for e in s.events],
                            event_times=[e.time_unix_nano for e in s.events],
                            links=[Link(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        )
                    )
        with self._lock:
            self.spans.extend(spans)

    def _metrics(self, body: bytes) -> None:
        request = ExportMetricsServiceRequest.FromString(body)
        points = []
        for rm in request.resource_metrics:
            resource = attributes(rm.resource.attributes)
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    if kind == "histogram":
                        for p in m.histogram.data_points:
                            points.append(
                                MetricPoint(
                                    m.name,
                                    m.unit,
                                    "histogram",
                                    attributes(p.attributes),
                                    count=p.count,
                                    total=p.sum,
                                    bounds=tuple(p.explicit_bounds),
                                    bucket_counts=tuple(p.bucket_counts),
                                    exemplars=[
                                        {
                                            "trace_id": e.trace_id.hex(),
                                            "span_id": e.span_id.hex(),
                                            "value": e.as_double or e.as_int,
                                        }
                                        for e in p.exemplars
                                    ],
                                    resource=resource,
                                )
                            )
                    elif kind in ("sum", "gauge"):
                        for p in getattr(m, kind).data_points:
                            value = p.as_double if p.WhichOneof("value") == "as_double" else p.as_int
                            points.append(
                                MetricPoint(
                                    m.name,
                                    m.unit,
                                    kind,
                                    attributes(p.attributes),
                                    value=value,
                                    exemplars=[
                                        {"trace_id": e.trace_id.hex(), "span_id": e.span_id.hex()} for e in p.exemplars
                                    ],
                                    resource=resource,
                                )
                            )
        with self._lock:
            self.metric_batches.append(points)

    def _logs(self, body: bytes) -> None:
        request = ExportLogsServiceRequest.FromString(body)
        records = []
        for rl in request.resource_logs:
            resource = attributes(rl.resource.attributes)
            for sl in rl.scope_logs:
                for r in sl.log_records:
                    records.append(
                        LogRecord(
                            event_name=r.event_name,
                            time_ns=r.time_unix_nano,
                            trace_id=r.trace_id.hex(),
                            span_id=r.span_id.hex(),
                            attributes=attributes(r.attributes),
                            resource=resource,
                            scope=sl.scope.name,
                        )
                    )
        with self._lock:
            self.logs.extend(records)

    # --- queries -------------------------------------------------------------------------
    def traces(self) -> dict[str, list[Span]]:
        with self._lock:
            spans = list(self.spans)
        out: dict[str, list[Span]] = {}
        for s in spans:
            out.setdefault(s.trace_id, []).append(s)
        return out

    def wait_for(self, predicate, timeout: float = 30.0, interval: float = 0.1):
        """Poll until predicate(self) is truthy; return its value (or raise TimeoutError)."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate(self)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError("OTLP receiver: condition not met in time")
            time.sleep(interval)

    def latest_metrics(self) -> list[MetricPoint]:
        """Points of the newest export per (metric, attributes): cumulative temporality."""
        with self._lock:
            batches = list(self.metric_batches)
        latest: dict[tuple, MetricPoint] = {}
        for batch in batches:
            for p in batch:
                key = (
                    p.name,
                    tuple(sorted((k, str(v)) for k, v in p.attributes.items())),
                    p.resource.get("process.pid"),
                )
                latest[key] = p
        return list(latest.values())


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Receive OTLP/HTTP and print counts.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4318)
    args = parser.parse_args(argv)
    receiver = Receiver(args.host, args.port, grpc=False).start()
    print(f"OTLP/HTTP receiver on {receiver.endpoint}", flush=True)
    try:
        while True:
            time.sleep(10)
            with receiver._lock:
                print(f"{len(receiver.spans)} spans, {len(receiver.metric_batches)} metric exports", flush=True)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
