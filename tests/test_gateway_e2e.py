"""The example gateway (examples/gateway) under `opentelemetry-instrument uvicorn`, in front of the
instrumented vLLM CPU server: one trace across both, tenant via baggage, metering equal to vLLM's."""

import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest
from conftest import Traceparent, start_server
from helpers import LONG_PROMPT, assert_server_tree, assert_usage, genai_spans

from otel_llm import semconv
from otel_llm.devserver import bin_path, free_port, otlp_env
from otel_llm.tiny_model import MODEL_NAME

ROOT = Path(__file__).resolve().parent.parent
GATEWAY = semconv.GATEWAY_SERVICE_NAME
VLLM = semconv.SERVICE_NAME_DEFAULT
CHAT = "/v1/chat/completions"

# random per run, so finding one in the telemetry cannot be a coincidence
KEYS = {name: f"sk-{name}-{secrets.token_hex(12)}" for name in ("acme", "globex", "initech")}
TENANTS = {"acme": "support", "globex": "batch", "initech": "demo"}  # tenant -> scene
WRONG_KEY = f"sk-wrong-{secrets.token_hex(12)}"
UPSTREAM_KEY = f"sk-upstream-{secrets.token_hex(12)}"
MAX_MODEL_LEN = 2048
LONG_STREAM_TOKENS = 1900

# tokens every successful response reported, per (tenant, token type): what metering must show
LEDGER = Counter()


def book(tenant, usage):
    if not isinstance(usage, dict):
        usage = usage.model_dump()
    LEDGER[(tenant, semconv.TOKEN_TYPE_INPUT)] += usage["prompt_tokens"]
    LEDGER[(tenant, semconv.TOKEN_TYPE_OUTPUT)] += usage["completion_tokens"]
    LEDGER[(tenant, semconv.TOKEN_TYPE_CACHED_INPUT)] += (usage.get("prompt_tokens_details") or {}).get(
        "cached_tokens") or 0


@pytest.fixture(scope="module")
def vllm(receiver, tmp_path_factory):
    # --api-key: vLLM answers 401 unless the gateway swaps the client's key for its own.
    # --max-model-len 2048 (the tiny model's limit; overrides the default 512): a long stream to
    # abandon, since on a busy 2-core machine the first chunks can reach the client late.
    srv = start_server(receiver, tmp_path_factory, "gateway-upstream",
                       extra_args=["--enable-prompt-tokens-details", "--api-key", UPSTREAM_KEY,
                                   "--max-model-len", str(MAX_MODEL_LEN)])
    yield srv
    srv.stop()


class Gateway:
    def __init__(self, process, port, log_path):
        self.process, self.port, self.log_path = process, port, log_path
        self.url = f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def gateway(vllm, receiver, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("gateway")
    keys = workdir / "keys.json"
    keys.write_text(json.dumps({"keys": [
        {"sha256": hashlib.sha256(KEYS[t].encode()).hexdigest(), "tenant": t, "scene": s} for t, s in TENANTS.items()
    ]}))
    port = free_port()
    log_path = workdir / "gateway.log"
    env = {**os.environ, **otlp_env(receiver.endpoint, service_name=GATEWAY),
           "GATEWAY_UPSTREAM_URL": vllm.url, "GATEWAY_KEYS_FILE": str(keys), "GATEWAY_UPSTREAM_API_KEY": UPSTREAM_KEY}
    command = [bin_path("opentelemetry-instrument"), bin_path("uvicorn"), "gateway:app",
               "--app-dir", str(ROOT / "examples" / "gateway"), "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            pytest.fail(f"gateway exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"gateway not listening after 60 s:\n{log_path.read_text()}")
            time.sleep(0.2)
    yield Gateway(process, port, log_path)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def service(span):
    return span.resource.get("service.name")


def gateway_trace(receiver, trace_id, upstream=True, phases=3, timeout=30.0):
    """Wait until the trace has the gateway's SERVER span and, when upstream, its CLIENT span, vLLM's
    SERVER span, the GenAI span and `phases` phase spans."""

    def complete(rx):
        spans = rx.traces().get(trace_id, [])
        kinds = {(service(s), s.kind) for s in spans}
        if (GATEWAY, "SERVER") not in kinds:
            return None
        if upstream and not ({(GATEWAY, "CLIENT"), (VLLM, "SERVER")} <= kinds and genai_spans(spans)
                             and len([s for s in spans if s.name in semconv.PHASE_SPANS]) >= phases):
            return None
        return spans

    return receiver.wait_for(complete, timeout)


def assert_gateway_tree(spans, traceparent, vllm, tenant, path=CHAT):
    """gateway SERVER -> gateway httpx CLIENT -> vLLM SERVER -> GenAI -> phases, nothing else but the
    FastAPI instrumentation's per-message spans. Returns (server, client, vLLM http, genai)."""
    gw = [s for s in spans if service(s) == GATEWAY]
    upstream = [s for s in spans if service(s) == VLLM]
    assert len(gw) + len(upstream) == len(spans), {service(s) for s in spans}
    (server,) = [s for s in gw if s.kind == "SERVER"]
    (client,) = [s for s in gw if s.kind == "CLIENT"]
    assert server.name == f"POST {path}"
    assert server.parent_span_id == traceparent.span_id
    assert client.parent_span_id == server.span_id
    assert client.name == "POST"
    assert client.attributes.get("url.full", client.attributes.get("http.url")) == vllm.url + path
    assert client.attributes.get("http.response.status_code", client.attributes.get("http.status_code")) == 200
    assert server.start_ns <= client.start_ns <= client.end_ns <= server.end_ns
    # opentelemetry-instrumentation-fastapi's `http receive` / `http send` spans (no env var turns
    # them off under auto-instrumentation); nothing else from the gateway
    for s in gw:
        if s not in (server, client):
            assert s.kind == "INTERNAL" and s.parent_span_id == server.span_id, s
            assert s.name in (f"POST {path} http receive", f"POST {path} http send"), s.name
    http, genai, _ = assert_server_tree(upstream, parent_span_id=client.span_id)
    assert http.name == f"POST {path}"
    for span in (server, genai):  # the gateway's own attribute, and vLLM's from the baggage
        assert span.attributes[semconv.TENANT_ID] == tenant
        assert span.attributes[semconv.TENANT_SCENE] == TENANTS[tenant]
    return server, client, http, genai


def sse_events(text):
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def test_chat_is_one_trace_with_tenant_from_baggage(vllm, gateway, receiver, traceparent):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEYS["acme"], max_retries=0)
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hello through the gateway"}], max_tokens=6,
        extra_body={"ignore_eos": True}, extra_headers=traceparent.headers(),
    )
    book("acme", response.usage)
    assert response.usage.completion_tokens == 6
    spans = gateway_trace(receiver, traceparent.trace_id)
    assert {s.trace_id for s in spans} == {traceparent.trace_id}
    server, _, _, genai = assert_gateway_tree(spans, traceparent, vllm, "acme")
    assert server.attributes[semconv.GEN_AI_REQUEST_MODEL] == MODEL_NAME
    assert genai.name == f"chat {MODEL_NAME}"
    assert genai.attributes[semconv.GEN_AI_RESPONSE_ID] == response.id
    assert_usage(genai, response.usage)


def test_streaming_passthrough(vllm, gateway, receiver, traceparent):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "stream it"}], "max_tokens": 8,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        via_gateway = http.post(gateway.url + CHAT, json=body,
                                headers=traceparent.headers(authorization=f"Bearer {KEYS['acme']}"))
        direct = http.post(vllm.url + CHAT, json=body, headers={"authorization": f"Bearer {UPSTREAM_KEY}"})
    assert via_gateway.status_code == direct.status_code == 200
    assert via_gateway.headers["content-type"] == direct.headers["content-type"]
    assert via_gateway.headers["content-type"].startswith("text/event-stream")
    events, direct_events = sse_events(via_gateway.text), sse_events(direct.text)
    assert events[-1] == direct_events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {json.loads(e)["object"] for e in direct_events[:-1]} == {
        "chat.completion.chunk"}
    # the usage event comes last, alone, as vLLM sent it
    assert [c.get("usage") is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["completion_tokens"] == 8
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    book("acme", usage)
    spans = gateway_trace(receiver, traceparent.trace_id)
    _, _, _, genai = assert_gateway_tree(spans, traceparent, vllm, "acme")
    assert genai.attributes[semconv.GEN_AI_REQUEST_STREAM] is True
    assert genai.attributes[semconv.GEN_AI_RESPONSE_ID] == chunks[0]["id"]
    assert genai.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == usage["prompt_tokens"]
    assert genai.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == usage["completion_tokens"]


def test_completions_prefix_cache_metered_as_cached_input(vllm, gateway, receiver):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEYS["acme"], max_retries=0)
    usages = []
    for _ in range(2):
        tp = Traceparent()
        response = client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=4,
                                             extra_body={"ignore_eos": True}, extra_headers=tp.headers())
        spans = gateway_trace(receiver, tp.trace_id)
        _, _, _, genai = assert_gateway_tree(spans, tp, vllm, "acme", path="/v1/completions")
        assert genai.name == f"text_completion {MODEL_NAME}"
        assert_usage(genai, response.usage)
        book("acme", response.usage)
        usages.append(response.usage)
    # the second send hits vLLM's prefix cache: cached_input > 0 reaches the gateway's counter too
    assert usages[1].prompt_tokens_details.cached_tokens > 0


def test_client_cannot_claim_another_tenant(vllm, gateway, receiver, traceparent):
    headers = traceparent.headers(**{"authorization": f"Bearer {KEYS['acme']}", "x-tenant-id": "globex",
                                     "x-scene": "spoofed", "baggage": "tenant.id=globex,tenant.scene=spoofed"})
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "I am globex"}], "max_tokens": 3}
    response = httpx.post(gateway.url + CHAT, json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    book("acme", response.json()["usage"])
    assert_gateway_tree(gateway_trace(receiver, traceparent.trace_id), traceparent, vllm, "acme")


@pytest.mark.parametrize("authorization", [f"Bearer {WRONG_KEY}", None, WRONG_KEY],
                         ids=["unknown-key", "no-header", "no-bearer-scheme"])
def test_bad_key_is_401_without_upstream_call(gateway, receiver, authorization):
    tp = Traceparent()
    headers = tp.headers(**({"authorization": authorization} if authorization else {}))
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "let me in"}], "max_tokens": 3}
    response = httpx.post(gateway.url + CHAT, json=body, headers=headers, timeout=30)
    assert response.status_code == 401
    assert response.json() == {"error": {"message": "Invalid or missing API key.", "type": "authentication_error",
                                         "code": 401}}
    gateway_trace(receiver, tp.trace_id, upstream=False)
    time.sleep(1.0)  # anything from an upstream call would have been exported by now
    spans = receiver.traces()[tp.trace_id]
    assert {service(s) for s in spans} == {GATEWAY}
    assert not [s for s in spans if s.kind == "CLIENT"] and not genai_spans(spans)
    (server,) = [s for s in spans if s.kind == "SERVER"]
    assert server.parent_span_id == tp.span_id
    assert semconv.TENANT_ID not in server.attributes
    assert server.attributes.get("http.response.status_code", server.attributes.get("http.status_code")) == 401


def stop_after_two_chunks(vllm, gateway, receiver):
    """Stream a long answer through the gateway, read 2 chunks, close. Returns the GenAI span."""
    tp = Traceparent()
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEYS["globex"], max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "a very long story"}],
        max_tokens=LONG_STREAM_TOKENS, stream=True, extra_body={"ignore_eos": True}, extra_headers=tp.headers(),
    )
    read = [chunk for _, chunk in zip(range(2), stream)]
    stream.close()
    assert len(read) == 2
    spans = gateway_trace(receiver, tp.trace_id)
    _, _, _, genai = assert_gateway_tree(spans, tp, vllm, "globex")  # one trace, aborted or not
    assert genai.attributes[semconv.GEN_AI_RESPONSE_ID] == read[0].id
    return genai


def test_client_stopping_early_aborts_vllm_request_in_same_trace(vllm, gateway, receiver):
    # Up to 3 tries: on this machine's loopback (64 KiB MTU, 2 busy cores) a TCP stream whose reader
    # fell behind can stall for seconds; if the first chunks reach the client only after vLLM has
    # generated everything, there is nothing left to abort. A gateway that does not release the
    # upstream stream when its client leaves fails every try.
    tries = []
    for _ in range(3):
        genai = stop_after_two_chunks(vllm, gateway, receiver)
        tries.append(genai.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS])
        if genai.attributes.get(semconv.VLLM_ABORTED):
            break
    else:
        pytest.fail(f"vLLM never saw the client leave: output tokens per try {tries}")
    attrs = genai.attributes
    assert attrs[semconv.VLLM_ABORTED] is True
    assert attrs[semconv.ERROR_TYPE] == semconv.ERROR_CLIENT_ABORTED
    assert genai.status == "ERROR"
    assert attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == [semconv.FINISH_REASON_ABORT]
    # the gateway released the upstream stream when its client left: vLLM stopped generating
    assert 1 <= attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] < LONG_STREAM_TOKENS


def test_app_example_against_gateway(gateway):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
           "APP_BASE_URL": gateway.url + "/v1", "APP_API_KEY": KEYS["initech"]}
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "app" / "app.py"), "all"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["call"] for line in lines] == ["chat", "stream", "stop-early"]
    chat, stream, stop_early = lines
    assert chat["response_id"].startswith("chatcmpl-") and chat["chunks"] == 0
    assert stream["response_id"].startswith("chatcmpl-") and stream["chunks"] >= 2
    assert stop_early["response_id"].startswith("chatcmpl-") and stop_early["chunks"] == 2
    assert stop_early["usage"] is None
    for line in (chat, stream):
        assert 1 <= line["usage"]["completion_tokens"] <= 32
        book("initech", line["usage"])  # stop-early has no usage: the gateway counts nothing for it


def _sums(receiver, name, tenants):
    found = Counter()
    for p in receiver.latest_metrics():
        if p.name == name and p.attributes.get(semconv.TENANT_ID) in tenants:
            found[(p.attributes[semconv.TENANT_ID], p.attributes[semconv.GEN_AI_TOKEN_TYPE])] += p.value
    return found


def test_gateway_metering_equals_usage_and_vllm(gateway, receiver):
    assert LEDGER[("acme", semconv.TOKEN_TYPE_CACHED_INPUT)] > 0
    assert LEDGER[("acme", semconv.TOKEN_TYPE_OUTPUT)] == 6 + 8 + 4 + 4 + 3
    assert LEDGER[("initech", semconv.TOKEN_TYPE_OUTPUT)] > 0

    def agreed(rx):
        ours = _sums(rx, semconv.GATEWAY_TOKEN_USAGE, TENANTS)
        vllms = _sums(rx, semconv.SERVER_TOKEN_USAGE, ["acme"])
        keys = set(LEDGER) | set(ours)
        if all(ours[k] == LEDGER[k] for k in keys) and all(
                vllms[k] == LEDGER[k] for k in LEDGER if k[0] == "acme"):
            return ours
        return None

    try:
        ours = receiver.wait_for(agreed, timeout=20)
    except TimeoutError:
        pytest.fail(f"ledger {dict(LEDGER)}\ngateway {_sums(receiver, semconv.GATEWAY_TOKEN_USAGE, TENANTS)}\n"
                    f"vllm {_sums(receiver, semconv.SERVER_TOKEN_USAGE, TENANTS)}")
    # globex's streams (the early stops) carried no usage event: nothing metered for them
    assert not [k for k in ours if k[0] == "globex"]
    points = [p for p in receiver.latest_metrics() if p.name == semconv.GATEWAY_TOKEN_USAGE]
    for p in points:
        assert p.kind == "sum" and p.unit == semconv.UNIT_TOKEN
        assert p.resource["service.name"] == GATEWAY
        assert p.attributes[semconv.GEN_AI_RESPONSE_MODEL] == MODEL_NAME
        assert p.attributes[semconv.TENANT_SCENE] == TENANTS[p.attributes[semconv.TENANT_ID]]
        assert set(p.attributes) == {semconv.TENANT_ID, semconv.TENANT_SCENE, semconv.GEN_AI_RESPONSE_MODEL,
                                     semconv.GEN_AI_TOKEN_TYPE}


def test_no_api_key_in_telemetry_or_gateway_log(gateway, receiver):
    exported = repr(receiver.spans) + repr(receiver.metric_batches)
    assert any(service(s) == GATEWAY for s in receiver.spans)
    for secret in [*KEYS.values(), WRONG_KEY, UPSTREAM_KEY, "Bearer"]:
        assert secret not in exported, secret
    log = gateway.log_path.read_text(errors="replace")
    for secret in [*KEYS.values(), WRONG_KEY, UPSTREAM_KEY]:
        assert secret not in log
    assert "Traceback" not in log, log
