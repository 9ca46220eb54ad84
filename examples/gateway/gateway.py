"""A small OpenAI-compatible gateway in front of vLLM: API key -> tenant, W3C baggage, token metering,
and budgets enforced before a request reaches the engine (with GATEWAY_BUDGETS_URL: the URL of
`otel-llm budget-server`; a tenant over one of its budgets gets 429 with an OpenAI-style error and
Retry-After).

Run it under auto-instrumentation (see README.md); this file does no OpenTelemetry setup:

    OTEL_SERVICE_NAME=llm-gateway opentelemetry-instrument uvicorn gateway:app --app-dir examples/gateway

`python gateway.py hash-key KEY` prints the SHA-256 to put in the keys file.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import sys
import urllib.parse
from contextlib import asynccontextmanager

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import baggage, context, metrics, trace

from otel_llm import semconv

# Never forwarded: the client's credentials and trace context (the httpx instrumentation injects
# the gateway's own), hop-by-hop headers, and the headers vLLM would prefer over our baggage
# as tenant/scene (otel-llm's defaults), so a client cannot claim another tenant.
DROPPED_HEADERS = {
    "authorization",
    "traceparent",
    "tracestate",
    "baggage",
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "accept-encoding",
    "x-tenant-id",
    "x-scene",
    "x-cost-center",
}

log = logging.getLogger("gateway")
meter = metrics.get_meter("otel_llm.examples.gateway")
token_usage = semconv.create_instrument(meter, semconv.GATEWAY_TOKEN_USAGE)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_keys(path: str) -> list[tuple[bytes, str, str | None]]:
    with open(path) as f:
        entries = json.load(f)["keys"]
    return [(bytes.fromhex(e["sha256"]), e["tenant"], e.get("scene")) for e in entries]


@asynccontextmanager
async def lifespan(app: FastAPI):
    app.state.keys = load_keys(os.environ["GATEWAY_KEYS_FILE"])
    timeout = httpx.Timeout(float(os.environ.get("GATEWAY_UPSTREAM_TIMEOUT", "600")), connect=10.0)
    budgets_url = os.environ.get("GATEWAY_BUDGETS_URL")
    async with (
        httpx.AsyncClient(base_url=os.environ["GATEWAY_UPSTREAM_URL"], timeout=timeout) as client,
        httpx.AsyncClient(base_url=budgets_url or "http://unused", timeout=2.0) as budgets,
    ):
        app.state.client = client
        app.state.budgets = budgets if budgets_url else None
        yield


app = FastAPI(title="llm-gateway", lifespan=lifespan)


def authenticate(keys, authorization: str | None) -> tuple[str, str | None] | None:
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    digest = hashlib.sha256(key.strip().encode()).digest()
    found = None
    for stored, tenant, scene in keys:  # no early exit: same work for every key
        if hmac.compare_digest(digest, stored):
            found = (tenant, scene)
    return found


def error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


BUDGET_CHECK_PATH = "/v1/budgets/check"  # otel_llm/ops/budget_server.py


async def over_budget(budgets: httpx.AsyncClient | None, tenant: str, scene: str | None, span):
    """A 429 response when the budget server says the tenant (scene) is over a budget, else None.
    The budget server unreachable: the request goes on (fail open), logged."""
    if budgets is None:
        return None
    query = urllib.parse.urlencode({"tenant": tenant, **({"scene": scene} if scene else {})})
    try:
        response = await budgets.get(f"{BUDGET_CHECK_PATH}?{query}")
        response.raise_for_status()
        decision = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        log.warning("budget check failed (%s): request let through", type(exc).__name__)
        return None
    span.set_attribute(semconv.BUDGET_STATE, decision.get("state", ""))
    if decision.get("allowed", True):
        return None
    span.set_attribute(semconv.ERROR_TYPE, semconv.ERROR_BUDGET_EXCEEDED)
    over = [b for b in decision.get("budgets", []) if b.get("state") == semconv.BUDGET_STATE_OVER]
    what = "; ".join(f"{b['period']} {b['unit']} budget: used {b['used']:g} of {b['limit']:g}" for b in over)
    retry = decision.get("retry_after")
    body = {
        "error": {
            "message": f"Budget exceeded for this API key's tenant ({what}).",
            "type": "insufficient_quota",
            "param": None,
            "code": semconv.ERROR_BUDGET_EXCEEDED,
        }
    }
    return JSONResponse(body, status_code=429, headers={"retry-after": str(retry)} if retry else None)


def record_usage(usage, model, tenant: str, scene: str | None) -> None:
    """Add the response's `usage` to the counter; nothing when there is none."""
    if not isinstance(usage, dict):
        return
    attrs = {semconv.TENANT_ID: tenant}
    if scene:
        attrs[semconv.TENANT_SCENE] = scene
    if isinstance(model, str):
        attrs[semconv.GEN_AI_RESPONSE_MODEL] = model
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    for kind, value in (
        (semconv.TOKEN_TYPE_INPUT, usage.get("prompt_tokens")),
        (semconv.TOKEN_TYPE_CACHED_INPUT, cached),
        (semconv.TOKEN_TYPE_OUTPUT, usage.get("completion_tokens")),
    ):
        if isinstance(value, int):
            token_usage.add(value, {**attrs, semconv.GEN_AI_TOKEN_TYPE: kind})


class UsageScanner:
    """Finds the SSE `data:` event carrying a non-null `usage`, line by line, without buffering."""

    def __init__(self):
        self.tail = b""
        self.usage = self.model = None

    def feed(self, chunk: bytes) -> None:
        lines = (self.tail + chunk).split(b"\n")
        self.tail = lines.pop()  # an incomplete line waits for the next chunk
        for line in lines:
            if line.startswith(b"data:") and b'"usage"' in line:
                try:
                    event = json.loads(line[5:])
                except ValueError:
                    continue
                if isinstance(event, dict) and event.get("usage"):
                    self.usage, self.model = event["usage"], event.get("model")


class Passthrough(StreamingResponse):
    """Relays the upstream body unchanged, meters its usage event, and always closes the upstream
    response: at the end, on error, and when the client goes away (vLLM then sees the disconnect
    and aborts the request)."""

    def __init__(self, upstream: httpx.Response, tenant: str, scene: str | None):
        self.upstream, self.tenant, self.scene = upstream, tenant, scene
        self.scanner = UsageScanner()
        headers = {"content-type": upstream.headers.get("content-type", "text/event-stream")}
        super().__init__(self.relay(), status_code=upstream.status_code, headers=headers)

    async def relay(self):
        async for chunk in self.upstream.aiter_raw():
            self.scanner.feed(chunk)
            yield chunk

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # the close must run even when cancelled
                await self.body_iterator.aclose()
                await self.upstream.aclose()
            record_usage(self.scanner.usage, self.scanner.model, self.tenant, self.scene)


async def proxy(request: Request) -> Response:
    who = authenticate(request.app.state.keys, request.headers.get("authorization"))
    if who is None:
        return error(401, "Invalid or missing API key.", "authentication_error")
    tenant, scene = who
    span = trace.get_current_span()  # the FastAPI instrumentation's SERVER span
    span.set_attribute(semconv.TENANT_ID, tenant)
    if scene:
        span.set_attribute(semconv.TENANT_SCENE, scene)
    refused = await over_budget(request.app.state.budgets, tenant, scene, span)
    if refused is not None:
        return refused

    body = await request.body()
    try:
        payload = json.loads(body) if body else None
    except ValueError:
        payload = None  # upstream answers malformed JSON itself
    payload = payload if isinstance(payload, dict) else {}
    if isinstance(payload.get("model"), str):
        span.set_attribute(semconv.GEN_AI_REQUEST_MODEL, payload["model"])
    stream = payload.get("stream") is True

    headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED_HEADERS}
    headers["accept-encoding"] = "identity"  # relay and scan plain bytes
    if os.environ.get("GATEWAY_UPSTREAM_API_KEY"):
        headers["authorization"] = "Bearer " + os.environ["GATEWAY_UPSTREAM_API_KEY"]
    client: httpx.AsyncClient = request.app.state.client
    path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    upstream_request = client.build_request(request.method, path, content=body, headers=headers)

    # Tenant and scene as W3C baggage on the upstream call; the client's own baggage is dropped
    # (it is untrusted). The httpx instrumentation injects `baggage` beside `traceparent`.
    ctx = baggage.set_baggage(semconv.TENANT_ID, tenant, baggage.clear())
    if scene:
        ctx = baggage.set_baggage(semconv.TENANT_SCENE, scene, ctx)
    token = context.attach(ctx)
    try:
        upstream = await client.send(upstream_request, stream=stream)
    except httpx.HTTPError as exc:
        return error(502, f"Upstream request failed: {type(exc).__name__}", "upstream_error")
    finally:
        context.detach(token)

    if stream and upstream.status_code == 200:
        return Passthrough(upstream, tenant, scene)
    if stream:  # an error answered to a stream request is a plain body
        await upstream.aread()
        await upstream.aclose()
    if upstream.status_code == 200 and request.method == "POST":
        try:
            data = upstream.json()
        except ValueError:
            data = None
        if isinstance(data, dict):
            record_usage(data.get("usage"), data.get("model"), tenant, scene)
    content_type = upstream.headers.get("content-type", "application/json")
    return Response(upstream.content, status_code=upstream.status_code, headers={"content-type": content_type})


for _path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
    app.add_api_route(_path, proxy, methods=["POST"])
app.add_api_route("/v1/models", proxy, methods=["GET"])


def _quiet_http_spans(app: FastAPI) -> None:
    """Under `opentelemetry-instrument` every FastAPI app also gets an `http send` span per ASGI
    message: one per relayed chunk, 2,000 spans for a 2,000-token stream. Re-instrument this app
    without them. Without auto-instrumentation nothing happens here."""
    if not getattr(app, "_is_instrumented_by_opentelemetry", False):
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.uninstrument_app(app)
    app.middleware_stack = None  # uninstrument_app built it without OTel; rebuild on first request
    FastAPIInstrumentor.instrument_app(app, exclude_spans=["receive", "send"])


_quiet_http_spans(app)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "hash-key":
        key = sys.stdin.readline().strip() if sys.argv[2] == "-" else sys.argv[2]
        print(hash_key(key))
    else:
        sys.exit("usage: python gateway.py hash-key KEY   (KEY '-' reads it from stdin)")
