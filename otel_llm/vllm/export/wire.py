"""The export process's wire format: what one request exports, as it crosses the socket from the API
server (otel_llm/vllm/export/channel.py) to the export process (otel_llm/vllm/export/process.py), one
`marshal`led message of plain values. The named tuples say what each position holds: the API server
builds them by name and `Outbox.parts` makes them plain tuples (marshal takes no other), the export
process reads them by name again."""

from __future__ import annotations

from typing import NamedTuple

# message kinds (the first element of each message); REPORT goes back: what the flush lost; PROGRESS: a
# live sweep's token counter increments (otel_llm/vllm/live.py); BATCH: messages held and sent together
CONFIG, REQUEST, BYE, REPORT, PROGRESS, BATCH = "config", "request", "bye", "report", "progress", "batch"
# frame header: one byte; a message larger than one frame goes as first .. last
FIRST, LAST = 1, 2
WHOLE = FIRST | LAST
# the ASGI instrumentation's HTTP server histograms (attributes of its OpenTelemetryMiddleware) whose values
# the API server hands over (otel_llm/vllm/http.py); the export process records them
HTTP_HISTOGRAMS = (
    "duration_histogram_old",
    "duration_histogram_new",
    "server_response_size_histogram",
    "server_response_body_size_histogram",
    "server_request_size_histogram",
    "server_request_body_size_histogram",
)


class SpanRecord(NamedTuple):
    """A finished span (the SDK's ReadableSpan's fields, as plain values)."""

    name: str
    trace_id: int
    span_id: int
    trace_flags: int
    trace_state: str  # W3C tracestate header
    parent_span_id: int  # 0: a root span
    parent_is_remote: bool
    parent_trace_flags: int
    kind: int  # SpanKind value
    start_ns: int
    end_ns: int
    attributes: dict
    status: tuple | None  # (StatusCode value, description)
    links: list  # (trace_id, span_id, flags, trace state, is_remote, attributes) each
    events: list  # (name, attributes, timestamp) each


class Part(NamedTuple):
    """One request's telemetry in a message (a message carries an HTTP request's, and the requests' it held)."""

    spans: list  # SpanRecord each
    measurement: tuple | None  # request_metrics.Measurement
    usage_event: tuple | None  # (attributes, timestamp)
    exemplar: tuple | None  # (trace_id, span_id, flags) of the request's span
    scope: tuple | None  # (name, version, schema_url, attributes) of another instrumentation; None: ours
    http_metrics: tuple | None  # (meter scope, [(instrument, value, attributes)])
    http_replay: tuple | None  # ReplayRecord: an HTTP request on the replayed path, its server span among it
    # a GenAI request's span handed over unended, and the facts its end is built from (request_facts.py):
    # (SpanRecord as it was, sampled, RequestFacts, its start attributes' values when they were not made:
    # RequestInfo.start_values)
    request: tuple | None = None


class ReplayRecord(NamedTuple):
    """One HTTP request on the replayed path (otel_llm/vllm/export/http.py): its server span's fields, of
    which the export process makes its SpanRecord (kind SERVER, no links; only where sampled), and what
    it runs the maintained middleware again on (`HttpReplay`) to make the span's HTTP attributes and
    status and the HTTP metrics."""

    meter_scope: tuple  # (name, version, schema_url) of the middleware's meter
    redacts: bool  # the query-redaction hook runs
    name: str
    trace_id: int
    span_id: int
    trace_flags: int
    trace_state: str  # W3C tracestate header
    parent_span_id: int  # 0: a root span
    parent_is_remote: bool
    parent_trace_flags: int
    sampled: bool
    start_ns: int
    end_ns: int
    attributes: dict  # set on the span in the API server (an exception's status and event aside: none)
    status: tuple | None  # (StatusCode value, description) set in the API server
    events: list  # (name, attributes, timestamp) each, recorded in the API server
    route_attributes: dict  # (http.route) of the span's name
    scope: tuple | dict  # the ASGI connection scope's values in `SCOPE_KEYS` order (a dict where one is missing)
    headers: list  # the request's headers (without credentials unless request headers are captured)
    route: str | None  # the route template the router matched
    start: tuple | None  # (status, headers, whether the span's status was set after the response start)
    duration_s: float


# the ASGI HTTP connection scope's keys (the spec's), which the maintained middleware reads
SCOPE_KEYS = (
    "type",
    "asgi",
    "http_version",
    "method",
    "scheme",
    "path",
    "raw_path",
    "query_string",
    "root_path",
    "client",
    "server",
)


class Outbox:
    """What one request exports: finished spans, its metric Measurement, its usage event; and what
    the requests nested in it handed over to go with it (`adopted`: the GenAI telemetry of the
    requests under an HTTP server span), so that one message carries one HTTP request.
    `http_metrics`: the HTTP server metrics' values of an HTTP request ((meter scope, [(instrument,
    value, attributes)]), otel_llm/vllm/http.py), recorded by the export process; `http_replay`: what
    the export process needs to make an HTTP request's span attributes and metrics with the
    maintained middleware (`ReplayRecord`); `held`: not handed over when its
    span ends (an HTTP server span, until its metrics are in: http.py `release`)."""

    __slots__ = (
        "spans",
        "measurement",
        "usage_event",
        "exemplar",
        "scope",
        "adopted",
        "http_metrics",
        "http_replay",
        "request",
        "held",
    )

    def __init__(self, scope: tuple | None = None):
        self.spans: list[tuple] = []
        self.measurement: tuple | None = None
        self.usage_event: tuple | None = None
        self.exemplar: tuple | None = None  # (trace_id, span_id, flags) of the request's span
        self.scope = scope  # (name, version, schema_url, attributes) of another instrumentation; None: ours
        self.adopted: list[tuple] = []
        self.http_metrics: tuple | None = None
        self.http_replay: tuple | None = None
        self.request: tuple | None = None
        self.held = False

    def empty(self) -> bool:
        return (
            not self.spans
            and self.measurement is None
            and self.usage_event is None
            and not self.adopted
            and self.http_metrics is None
            and self.http_replay is None
            and self.request is None
        )

    def parts(self) -> list[tuple]:
        """This request's Part and the parts it adopted, as the plain tuples marshal carries (marshal
        takes no named tuple: one would send the message down the slow path, `plain`)."""
        return [
            (
                list(map(tuple, self.spans)),
                self.measurement,
                self.usage_event,
                self.exemplar,
                self.scope,
                self.http_metrics,
                self.http_replay,  # (a plain tuple: export/http.py `ReplayingMiddleware._replay_record`)
                self.request,
            ),
            *self.adopted,
        ]

    def message(self) -> tuple:
        return REQUEST, self.parts()


def plain(message: tuple) -> tuple:
    """A request message with its attributes cleaned as the SDK cleans them (a value of a type the
    SDK does not take is dropped) and every value of a subclass (a str or int enum) made its base
    type, which marshal takes."""
    from opentelemetry.attributes import BoundedAttributes

    from otel_llm.vllm.request_facts import CAPTURED

    def clean(attributes) -> dict:
        return dict(BoundedAttributes(attributes=attributes))

    kind, parts = message
    if kind != REQUEST:  # (a live sweep's increments: label values and counts)
        return _base_types(message)
    plain = []
    for spans, measurement, usage_event, exemplar, scope, http_metrics, http_replay, request in parts:
        spans = [
            (
                *s[:11],
                clean(s[11]),
                s[12],
                [(*link[:5], clean(link[5])) for link in s[13]],
                [(name, clean(attrs), ts) for name, attrs, ts in s[14]],
            )
            for s in spans
        ]
        if usage_event is not None:
            usage_event = (clean(usage_event[0]), *usage_event[1:])
        if scope is not None and scope[3]:
            scope = (*scope[:3], clean(scope[3]))
        if http_metrics is not None:
            meter_scope, records = http_metrics
            http_metrics = (meter_scope, [(name, value, clean(attributes)) for name, value, attributes in records])
        if http_replay is not None:  # (its server span's attributes and events)
            replay = ReplayRecord(*http_replay)
            http_replay = tuple(
                replay._replace(
                    attributes=clean(replay.attributes),
                    events=[(name, clean(attrs), ts) for name, attrs, ts in replay.events],
                )
            )
        if request is not None:  # (its span's attributes and the content captured, cleaned)
            record, sampled, facts, start_values = request
            record = (*record[:11], clean(record[11]), *record[12:])
            captured = facts[CAPTURED]
            if captured:
                facts = (*facts[:CAPTURED], clean(captured), *facts[CAPTURED + 1 :])
            request = (record, sampled, facts, start_values)
        plain.append((spans, measurement, usage_event, exemplar, scope, http_metrics, http_replay, request))
    return _base_types((kind, plain))


def _base_types(value):
    if value is None or type(value) in (str, int, float, bool, bytes):
        return value
    if isinstance(value, dict):
        return {_base_types(k): _base_types(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_base_types(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    for base in (bool, str, int, float, bytes):
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    return repr(value)
