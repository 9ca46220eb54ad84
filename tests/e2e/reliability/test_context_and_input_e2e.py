"""Hardening on one real instrumented vLLM CPU server: what clients can put in a request.

- Malformed trace context and odd headers: a W3C-valid traceparent is honoured, an invalid one
  starts a fresh trace, and every request has exactly one GenAI span under its HTTP SERVER span.
- Secrets (API keys, cookies, custom headers, a key in the URL query) are never exported (spans,
  metrics, logs: OTLP logs are on here) nor written to the server's log.
- Malformed bodies: each a 4xx (never a 500) with one GenAI span in error.

Requests are sent once per group (module fixtures) and checked per case, so the module costs one
server start plus a few seconds.
"""

import json
import logging
import secrets
import socket

import httpx
import pytest
from helpers import assert_server_tree, genai_spans, request_trace, start_server

from devkit.otlp_receiver import Receiver
from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv

API_KEY = "sk-secret-" + secrets.token_hex(8)
WRONG_KEY = "sk-secret-wrong-" + secrets.token_hex(8)
BASIC_SECRET = "dXNlcjpodW50ZXIy" + secrets.token_hex(4)  # `Authorization: Basic ...`
COOKIE_SECRET = "sess-secret-" + secrets.token_hex(8)
HEADER_SECRET = "xkey-secret-" + secrets.token_hex(8)
QUERY_SECRET = "sk-secret-query-" + secrets.token_hex(8)
REJECTED_QUERY_SECRET = "sk-secret-query-rejected-" + secrets.token_hex(8)
SECRETS = {
    "API key": API_KEY,
    "rejected API key": WRONG_KEY,
    "rejected Basic credentials": BASIC_SECRET,
    "cookie": COOKIE_SECRET,
    "x-api-key header": HEADER_SECRET,
    "key in the URL query": QUERY_SECRET,
    "key in the URL query of a rejected request": REJECTED_QUERY_SECRET,
}
AUTH = ("authorization", f"Bearer {API_KEY}")


class RecordingReceiver(Receiver):
    """The OTLP receiver, also keeping every payload as it arrived: a secret is looked for in the
    bytes, wherever it would be (span, resource, event, metric point, log body or attribute)."""

    def __init__(self):
        super().__init__(grpc=False)
        self.payloads: list[tuple[str, bytes]] = []

    def _traces(self, body):
        self.payloads.append(("traces", body))
        super()._traces(body)

    def _metrics(self, body):
        self.payloads.append(("metrics", body))
        super()._metrics(body)

    def _logs(self, body):
        self.payloads.append(("logs", body))
        super()._logs(body)


@pytest.fixture(scope="module")
def receiver():
    with RecordingReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def server(receiver, tmp_path_factory):
    # OTLP/HTTP (the receiver takes logs over HTTP only); Python logging exported as OTLP logs.
    # vLLM imports model_hosting_container_standards, which sets the root logger and its handlers
    # (the OTLP one included) to ERROR unless SAGEMAKER_CONTAINER_LOG_LEVEL says otherwise: without
    # it only errors would be exported, and this test would look at almost nothing.
    srv = start_server(
        receiver,
        tmp_path_factory,
        "context",
        extra_args=["--api-key", API_KEY],
        env={
            "OTEL_LOGS_EXPORTER": "otlp",
            "OTEL_PYTHON_LOGGING_AUTO_INSTRUMENTATION_ENABLED": "true",
            "OTEL_BLRP_SCHEDULE_DELAY": "200",
            "SAGEMAKER_CONTAINER_LOG_LEVEL": "INFO",
        },
    )
    yield srv
    srv.stop()


def _bytes(value) -> bytes:
    return value if isinstance(value, bytes) else value.encode("latin-1")


def raw_post(server, path, headers, body: bytes):
    """One HTTP/1.1 request written byte for byte: httpx (h11) refuses to send some of the corpus
    (leading/trailing blanks, control bytes). Returns (status, body)."""
    lines = [
        f"POST {path} HTTP/1.1".encode(),
        f"Host: 127.0.0.1:{server.port}".encode(),
        b"Connection: close",
        b"Content-Type: application/json",
        b"Content-Length: %d" % len(body),
    ]
    lines += [_bytes(name) + b":" + _bytes(value) for name, value in headers]
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as sock:
        sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    head, _, payload = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), payload


def completion_body(prompt: str) -> bytes:
    return json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}).encode()


def spans_by_response_id(receiver, response_id, timeout=60.0):
    """The trace holding the GenAI span of this response, once its HTTP span and phases are in."""

    def find(rx):
        for spans in rx.traces().values():
            if any(s.attributes.get(semconv.GEN_AI_RESPONSE_ID) == response_id for s in genai_spans(spans)):
                if any(s.kind == "SERVER" for s in spans) and sum(s.name in semconv.PHASE_SPANS for s in spans) >= len(
                    semconv.PHASE_SPANS
                ):
                    return spans
        return None

    return receiver.wait_for(find, timeout)


def genai_spans_with_response_id(receiver, response_id):
    return [s for s in genai_spans(receiver.spans) if s.attributes.get(semconv.GEN_AI_RESPONSE_ID) == response_id]


# --- the malformed-context and header corpus ---------------------------------------------

# Outcomes: "given" (the trace and parent of the header), "fresh" (a new trace, no parent),
# "unsampled" (honoured: sampled flag off, so nothing is exported), 400 (the HTTP server refuses the
# bytes before any app code runs: no span needed, none can exist).
# Headers: (name, value) in order, `{t}` / `{s}` / `{T}` / `{S}` = this case's trace / span id (upper).
TP = "00-{t}-{s}-01"
CORPUS = [
    # traceparent
    ("valid", [("traceparent", TP)], "given", None),
    ("future version with extra fields", [("traceparent", "cc-{t}-{s}-01-what-the-future-holds")], "given", None),
    ("flags with unknown bits set", [("traceparent", "00-{t}-{s}-09")], "given", None),
    ("leading and trailing spaces", [("traceparent", "   " + TP + "   ")], "given", None),  # OWS, stripped
    ("leading tab", [("traceparent", "\t" + TP)], "given", None),
    ("not sampled", [("traceparent", "00-{t}-{s}-00")], "unsampled", None),
    ("version ff", [("traceparent", "ff-{t}-{s}-01")], "fresh", None),
    ("version 00 with an extra field", [("traceparent", TP + "-extra")], "fresh", None),
    ("all-zero trace id", [("traceparent", "00-" + "0" * 32 + "-{s}-01")], "fresh", None),
    ("all-zero span id", [("traceparent", "00-{t}-" + "0" * 16 + "-01")], "fresh", None),
    ("trace id 31 hex", [("traceparent", "00-{t31}-{s}-01")], "fresh", None),
    ("trace id 33 hex", [("traceparent", "00-{t}a-{s}-01")], "fresh", None),
    ("span id 15 hex", [("traceparent", "00-{t}-{s15}-01")], "fresh", None),
    ("uppercase hex", [("traceparent", "00-{T}-{S}-01")], "fresh", None),
    ("non-hex trace id", [("traceparent", "00-{t31}g-{s}-01")], "fresh", None),
    ("non-hex flags", [("traceparent", "00-{t}-{s}-zz")], "fresh", None),
    ("no flags", [("traceparent", "00-{t}-{s}")], "fresh", None),
    ("underscores", [("traceparent", "00_{t}_{s}_01")], "fresh", None),
    ("empty", [("traceparent", "")], "fresh", None),
    ("over 512 characters", [("traceparent", "cc-{t}-{s}-01-" + "x" * 520)], "fresh", None),
    # W3C's test suite expects a fresh trace for two traceparent headers; OTel Python's propagator
    # takes the first one (it reads the first value of a repeated header): pinned as it behaves.
    ("duplicated", [("traceparent", TP), ("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")], "given", None),
    # tracestate: never changes the trace (an invalid one is dropped whole)
    ("tracestate valid", [("traceparent", TP), ("tracestate", "vendor=v1,other@tenant=x")], "given", None),
    (
        "tracestate malformed members",
        [("traceparent", TP), ("tracestate", "=novalue,,key with space=1,x=")],
        "given",
        None,
    ),
    (
        "tracestate 40 members",
        [("traceparent", TP), ("tracestate", ",".join(f"k{i}=v" for i in range(40)))],
        "given",
        None,
    ),
    ("tracestate over 512 characters", [("traceparent", TP), ("tracestate", "a=" + "b" * 700)], "given", None),
    (
        "tracestate duplicated keys in two headers",
        [("traceparent", TP), ("tracestate", "a=1"), ("tracestate", "a=2")],
        "given",
        None,
    ),
    # baggage, with the tenant our attribution reads from it
    ("baggage malformed", [("traceparent", TP), ("baggage", ";;;,=,novalue,%%%")], "given", None),
    (
        "baggage malformed around a tenant",
        [("traceparent", TP), ("baggage", ";;;,=,tenant.id=t-ok,%%%")],
        "given",
        "t-ok",
    ),
    (
        "baggage over 8192 bytes",
        [("traceparent", TP), ("baggage", "tenant.id=t-big,pad=" + "p" * 8200)],
        "given",
        None,
    ),  # dropped whole by the propagator
    (
        "baggage percent-encoded UTF-8 tenant",
        [("traceparent", TP), ("baggage", "tenant.id=%E7%A7%9F%E6%88%B7-%C3%A9")],
        "given",
        "租户-é",
    ),
    (
        "baggage tenant with + and %20",
        [("traceparent", TP), ("baggage", "tenant.id=acme+corp%20eu")],
        "given",
        "acme corp eu",
    ),
    (
        "baggage tenant with an encoded newline",
        [("traceparent", TP), ("baggage", "tenant.id=a%0Ab")],
        "given",
        None,
    ),  # control character: refused
    ("baggage empty tenant", [("traceparent", TP), ("baggage", "tenant.id=")], "given", None),
    ("baggage tenant over 128 characters", [("traceparent", TP), ("baggage", "tenant.id=" + "t" * 200)], "given", None),
    ("baggage bad percent escape", [("traceparent", TP), ("baggage", "tenant.id=%ZZ")], "given", "%ZZ"),
    # OTel Python keeps W3C baggage properties in the value: the tenant is not `acme`
    (
        "baggage tenant with a property",
        [("traceparent", TP), ("baggage", "tenant.id=acme;prop=1")],
        "given",
        "acme;prop=1",
    ),
    (
        "header tenant wins over baggage",
        [("traceparent", TP), ("x-tenant-id", "t-header"), ("baggage", "tenant.id=t-baggage")],
        "given",
        "t-header",
    ),
    # odd headers
    ("obs-text byte in a header", [("traceparent", TP), ("x-odd", b"caf\xe9")], "given", None),
    ("8 KB header", [("traceparent", TP), ("x-padding", "p" * 8000)], "given", None),
    ("20 KB header", [("traceparent", TP), ("x-padding", "p" * 20000)], "given", None),
    # uvicorn's HTTP parser (httptools) answers these itself, 400 "Invalid HTTP request received.",
    # before any ASGI app (and so any instrumentation) runs: no span needed, none can exist
    ("control byte in a header", [("traceparent", TP), ("x-odd", b"a\x01b")], 400, None),
    ("NUL in traceparent", [("traceparent", b"00-\x00")], 400, None),
    ("space in a header name", [("traceparent", TP), ("x odd", "v")], 400, None),
]


class Case:
    def __init__(self, name, headers, expect, tenant):
        self.name, self.expect, self.tenant = name, expect, tenant
        self.trace_id, self.span_id = secrets.token_hex(16), secrets.token_hex(8)
        ids = {
            "t": self.trace_id,
            "s": self.span_id,
            "T": self.trace_id.upper(),
            "S": self.span_id.upper(),
            "t31": self.trace_id[:31],
            "s15": self.span_id[:15],
        }
        self.headers = [(n, v.format(**ids) if isinstance(v, str) else v) for n, v in headers]
        self.prompt = f"corpus case {name}"
        self.status = self.response = self.payload = None


@pytest.fixture(scope="module")
def corpus(server):
    cases = {}
    for name, headers, expect, tenant in CORPUS:
        case = cases[name] = Case(name, headers, expect, tenant)
        case.status, case.payload = raw_post(
            server, "/v1/completions", [AUTH, *case.headers], completion_body(case.prompt)
        )
        if case.status == 200:
            case.response = json.loads(case.payload)
    return cases


@pytest.mark.parametrize("name", [c[0] for c in CORPUS])
def test_context_corpus(corpus, receiver, name):
    case = corpus[name]
    if case.expect == 400:
        assert (case.status, case.payload) == (400, b"Invalid HTTP request received.")
        return
    assert case.status == 200
    response_id = case.response["id"]
    if case.expect == "unsampled":
        # spans leave the server in order: once a later request's are in, this one's would be too
        later = [c for c in corpus.values() if c.response and c.expect != "unsampled"][-1]
        spans_by_response_id(receiver, later.response["id"])
        assert case.trace_id not in receiver.traces()
        assert not genai_spans_with_response_id(receiver, response_id)
        return
    if case.expect == "given":
        spans = request_trace(receiver, case.trace_id)
        http, genai, _ = assert_server_tree(spans, parent_span_id=case.span_id)
    else:
        spans = spans_by_response_id(receiver, response_id)
        http, genai, _ = assert_server_tree(spans)
        assert http.parent_span_id == ""
        assert http.trace_id not in (case.trace_id, "1" * 32)
    assert genai.attributes[semconv.GEN_AI_RESPONSE_ID] == response_id
    # a completion's engine request is its response id plus the prompt's index
    assert genai.attributes[semconv.VLLM_REQUEST_ID] == f"{response_id}-0"
    assert genai.status == "UNSET"
    assert genai.attributes.get(semconv.TENANT_ID) == case.tenant
    assert len(genai_spans_with_response_id(receiver, response_id)) == 1


# --- malformed bodies ----------------------------------------------------------------------

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def _json(**fields) -> bytes:
    return json.dumps(fields).encode()


# (case, path, body, content type, status, error.type): FastAPI's schema / JSON rejections are
# "Bad Request" (span named by the operation only: no model read yet); the handler's own checks
# raise VLLMValidationError; an unknown model is vLLM's NotFoundError.
BODIES = [
    ("chat: not JSON", CHAT, b"hello", "application/json", 400, "Bad Request"),
    ("chat: empty body", CHAT, b"", "application/json", 400, "Bad Request"),
    ("chat: JSON array", CHAT, b"[1, 2]", "application/json", 400, "Bad Request"),
    ("chat: truncated JSON", CHAT, b'{"model": "tiny-llama", "messages": [', "application/json", 400, "Bad Request"),
    ("chat: missing messages", CHAT, _json(model=MODEL_NAME, max_tokens=2), "application/json", 400, "Bad Request"),
    (
        "chat: messages a string",
        CHAT,
        _json(model=MODEL_NAME, messages="hi", max_tokens=2),
        "application/json",
        400,
        "Bad Request",
    ),
    (
        "chat: temperature a string",
        CHAT,
        _json(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, temperature="hot"),
        "application/json",
        400,
        "Bad Request",
    ),
    (
        "chat: model a number",
        CHAT,
        _json(model=5, messages=MESSAGES, max_tokens=2),
        "application/json",
        400,
        "Bad Request",
    ),
    (
        "chat: text/plain",
        CHAT,
        _json(model=MODEL_NAME, messages=MESSAGES, max_tokens=2),
        "text/plain",
        400,
        "Bad Request",
    ),
    (
        "chat: negative max_tokens",
        CHAT,
        _json(model=MODEL_NAME, messages=MESSAGES, max_tokens=-1),
        "application/json",
        400,
        "VLLMValidationError",
    ),
    (
        "chat: n=0",
        CHAT,
        _json(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, n=0),
        "application/json",
        400,
        "VLLMValidationError",
    ),
    (
        "chat: max_tokens over max-model-len",
        CHAT,
        _json(model=MODEL_NAME, messages=MESSAGES, max_tokens=100000),
        "application/json",
        400,
        "VLLMValidationError",
    ),
    (
        "chat: unknown model",
        CHAT,
        _json(model="no-such-model", messages=MESSAGES, max_tokens=2),
        "application/json",
        404,
        "NotFoundError",
    ),
    # vLLM accepts these two: a missing model is the served one, a role is the chat template's business
    ("chat: missing model (accepted)", CHAT, _json(messages=MESSAGES, max_tokens=2), "application/json", 200, None),
    (
        "chat: invalid role (accepted)",
        CHAT,
        _json(model=MODEL_NAME, messages=[{"role": "wizard", "content": "hi"}], max_tokens=2),
        "application/json",
        200,
        None,
    ),
    (
        "completions: prompt an object",
        COMPLETIONS,
        _json(model=MODEL_NAME, prompt={"a": 1}, max_tokens=2),
        "application/json",
        400,
        "Bad Request",
    ),
    (
        "completions: truncated JSON",
        COMPLETIONS,
        b'{"model": "tiny-llama", "prompt": "a',
        "application/json",
        400,
        "Bad Request",
    ),
    (
        "completions: missing prompt",
        COMPLETIONS,
        _json(model=MODEL_NAME, max_tokens=2),
        "application/json",
        400,
        "VLLMValidationError",
    ),
    (
        "completions: negative temperature",
        COMPLETIONS,
        _json(model=MODEL_NAME, prompt="hi", max_tokens=2, temperature=-1),
        "application/json",
        400,
        "VLLMValidationError",
    ),
    (
        "completions: n=0",
        COMPLETIONS,
        _json(model=MODEL_NAME, prompt="hi", max_tokens=2, n=0),
        "application/json",
        400,
        "VLLMValidationError",
    ),
    (
        "completions: max_tokens over max-model-len",
        COMPLETIONS,
        _json(model=MODEL_NAME, prompt="hi", max_tokens=100000),
        "application/json",
        400,
        "VLLMValidationError",
    ),
]


@pytest.fixture(scope="module")
def bodies(server):
    sent = {}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for name, path, body, content_type, *_ in BODIES:
            trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
            r = client.post(
                path,
                content=body,
                headers={
                    "authorization": AUTH[1],
                    "content-type": content_type,
                    "traceparent": f"00-{trace_id}-{span_id}-01",
                },
            )
            sent[name] = (trace_id, span_id, r)
    return sent


@pytest.mark.parametrize("name, path, status, error_type", [(c[0], c[1], c[4], c[5]) for c in BODIES])
def test_malformed_bodies_are_4xx_with_an_error_span(bodies, receiver, name, path, status, error_type):
    trace_id, span_id, response = bodies[name]
    assert response.status_code < 500
    assert response.status_code == status, response.text
    operation = semconv.OP_CHAT if path == CHAT else semconv.OP_TEXT_COMPLETION
    if error_type is None:
        http, genai, _ = assert_server_tree(request_trace(receiver, trace_id), parent_span_id=span_id)
        assert genai.status == "UNSET" and semconv.ERROR_TYPE not in genai.attributes
        assert genai.attributes[semconv.GEN_AI_RESPONSE_ID] == response.json()["id"]
        return

    def complete(rx):  # (the HTTP span and the GenAI span leave the server by different processes)
        spans = rx.traces().get(trace_id, [])
        return spans if any(s.kind == "SERVER" for s in spans) and genai_spans(spans) else None

    spans = receiver.wait_for(complete, timeout=60)
    (http,) = [s for s in spans if s.kind == "SERVER"]
    assert http.parent_span_id == span_id
    assert http.attributes.get("http.response.status_code", http.attributes.get("http.status_code")) == status
    (genai,) = genai_spans(spans)
    assert genai.parent_span_id == http.span_id
    assert genai.name.split(" ")[0] == operation
    assert genai.status == "ERROR"
    assert genai.attributes[semconv.ERROR_TYPE] == error_type
    assert {s.name for s in spans} == {http.name, genai.name}  # rejected before the engine: no phases


# --- secrets -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secret_requests(server, receiver):
    """Requests carrying secrets; returns {case: (trace id, status)} once their spans are in."""
    body = completion_body("a request with secrets")
    sent = {}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for case, path, headers in (
            ("wrong key", COMPLETIONS, {"authorization": f"Bearer {WRONG_KEY}"}),
            ("basic credentials", COMPLETIONS, {"authorization": f"Basic {BASIC_SECRET}"}),
            ("no key", COMPLETIONS, {}),
            (
                "wrong key, key in the query",
                f"{COMPLETIONS}?api_key={REJECTED_QUERY_SECRET}",
                {"authorization": f"Bearer {WRONG_KEY}"},
            ),
            (
                "right key, cookie, custom header, key in the query",
                f"{COMPLETIONS}?api_key={QUERY_SECRET}&debug=1",
                {
                    "authorization": AUTH[1],
                    "cookie": f"session={COOKIE_SECRET}; theme=dark",
                    "x-api-key": HEADER_SECRET,
                },
            ),
        ):
            trace_id = secrets.token_hex(16)
            r = client.post(
                path,
                content=body,
                headers={
                    **headers,
                    "content-type": "application/json",
                    "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01",
                },
            )
            sent[case] = (trace_id, r.status_code)

    def complete(rx):
        traces = rx.traces()
        # and the last one's GenAI span: the export process sends in order, so a GenAI span of the
        # earlier (rejected) ones would be in by then
        last, _ = sent["right key, cookie, custom header, key in the query"]
        return all(any(s.kind == "SERVER" for s in traces.get(t, [])) for t, _ in sent.values()) and genai_spans(
            traces.get(last, [])
        )

    receiver.wait_for(complete, timeout=60)
    return sent


def test_api_key_is_enforced(secret_requests, receiver):
    statuses = {case: status for case, (_, status) in secret_requests.items()}
    assert statuses == {
        "wrong key": 401,
        "basic credentials": 401,
        "no key": 401,
        "wrong key, key in the query": 401,
        "right key, cookie, custom header, key in the query": 200,
    }
    traces = receiver.traces()
    for case, (trace_id, status) in secret_requests.items():
        spans = traces[trace_id]
        (http,) = [s for s in spans if s.kind == "SERVER"]
        assert http.attributes.get("http.response.status_code", http.attributes.get("http.status_code")) == status
        # vLLM's authentication middleware answers before any route: no GenAI span for a 401 (it
        # would have been exported before the last request's, which is in)
        assert len(genai_spans(spans)) == (1 if status == 200 else 0), case


def test_url_query_values_are_redacted_by_default(secret_requests, receiver, server):
    """The HTTP layer records the URL query: the instrumentation's `http.url` (old HTTP semconv,
    the default) holds the whole URL, `url.query` (new semconv) the raw query, and uvicorn's access
    log prints path and query. Our instrumentation of vLLM's app replaces every value with REDACTED
    in all three (OTEL_LLM_HTTP_REDACT_QUERY=false keeps them)."""
    traces = receiver.traces()
    expected = {
        "wrong key, key in the query": "api_key=REDACTED",
        "right key, cookie, custom header, key in the query": "api_key=REDACTED&debug=REDACTED",
    }
    for case, query in expected.items():
        (http,) = [s for s in traces[secret_requests[case][0]] if s.kind == "SERVER"]
        recorded = [http.attributes[k] for k in ("http.url", "url.query") if k in http.attributes]
        assert recorded, http.attributes
        if "http.url" in http.attributes:
            assert http.attributes["http.url"].endswith(f"{COMPLETIONS}?{query}")
        if "url.query" in http.attributes:
            assert http.attributes["url.query"] == query
        assert http.attributes.get("http.target", COMPLETIONS) == COMPLETIONS
    log = server.log_path.read_text(errors="replace")
    assert f'"POST {COMPLETIONS}?api_key=REDACTED&debug=REDACTED HTTP/1.1" 200' in log


def test_secrets_are_never_exported_nor_logged(secret_requests, corpus, bodies, receiver, server):
    # Flush: a request whose malformed tracestate makes the propagator log a warning (exported as
    # an OTLP log record); records leave in order, so once it is in, everything logged before is.
    marker = "flush-marker-" + secrets.token_hex(6)
    metric_batches = len(receiver.metric_batches)
    traceparent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
    status, _ = raw_post(
        server,
        COMPLETIONS,
        [AUTH, ("traceparent", traceparent), ("tracestate", f"{marker} !")],
        completion_body("flush"),
    )
    assert status == 200
    receiver.wait_for(
        lambda rx: any(kind == "logs" and marker.encode() in body for kind, body in rx.payloads), timeout=60
    )
    receiver.wait_for(lambda rx: len(rx.metric_batches) >= metric_batches + 2, timeout=60)
    assert receiver.logs and receiver.spans and receiver.metric_batches
    leaks = [
        (what, kind)
        for what, secret in SECRETS.items()
        for kind, body in list(receiver.payloads)
        if secret.encode() in body
    ]
    assert not leaks, leaks
    log = server.log_path.read_text(errors="replace")
    assert not [what for what, secret in SECRETS.items() if secret in log]
    assert f'"POST {COMPLETIONS} HTTP/1.1" 401' in log  # (the access log is on: requests are logged)


def test_query_redaction_hook_and_switch(monkeypatch):
    """The hook on a span's attributes, the access log filter, and OTEL_LLM_HTTP_REDACT_QUERY
    (in-process, no server)."""
    from fastapi import FastAPI
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    from otel_llm.config import Settings
    from otel_llm.vllm import http

    class Span:
        def __init__(self, attributes):
            self.attributes = dict(attributes)

        def is_recording(self):
            return True

        def set_attribute(self, key, value):
            self.attributes[key] = value

    span = Span(
        {
            "http.url": "http://h:1/v1/completions?api_key=sk-x&stream&a=b=c",
            "http.target": "/v1/completions",
            "url.query": "api_key=sk-x&stream&a=b=c",
            "url.path": "/v1/completions",
        }
    )
    http.redact_query_hook(span, {"query_string": b"api_key=sk-x&stream&a=b=c"})
    assert span.attributes == {
        "http.url": "http://h:1/v1/completions?api_key=REDACTED&REDACTED&a=REDACTED",
        "http.target": "/v1/completions",
        "url.query": "api_key=REDACTED&REDACTED&a=REDACTED",
        "url.path": "/v1/completions",
    }
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        "",
        0,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:1", "POST", "/v1/completions?api_key=sk-x", "1.1", 200),
        None,
    )
    assert http._AccessLogQueryFilter().filter(record)
    assert record.getMessage() == '127.0.0.1:1 - "POST /v1/completions?api_key=REDACTED HTTP/1.1" 200'

    calls = []
    monkeypatch.setattr(FastAPIInstrumentor, "instrument_app", lambda app, **kwargs: calls.append(kwargs))
    access_log = logging.getLogger("uvicorn.access")
    monkeypatch.setattr(access_log, "filters", [])
    for value, hook in ((None, http.redact_query_hook), ("false", None), ("true", http.redact_query_hook)):
        if value is None:
            monkeypatch.delenv("OTEL_LLM_HTTP_REDACT_QUERY", raising=False)
        else:
            monkeypatch.setenv("OTEL_LLM_HTTP_REDACT_QUERY", value)
        assert http.instrument_app(FastAPI(), Settings.from_env())
        assert calls[-1]["server_request_hook"] is hook, value
        assert any(isinstance(f, http._AccessLogQueryFilter) for f in access_log.filters) == (value != "false")
        access_log.filters.clear()
