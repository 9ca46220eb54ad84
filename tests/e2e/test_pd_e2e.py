"""Disaggregated prefill/decode on the real engine: two vLLM CPU servers with vLLM's ExampleConnector
(KV cache through shared storage; it starts and serves on the CPU backend), the test playing the
proxy: prefill leg first (`do_remote_decode`, max_tokens 1), then the decode leg with what the
prefill node returned. One trace, one span per node with its role, and one bill: the decode node's.
(What is checked is our side: roles, billing, phase names. Whether the decode node loaded the
prefill node's KV cache is the connector's business; with the tiny model it reported no hits.)"""

from __future__ import annotations

import json

import httpx
import pytest
from helpers import Traceparent, genai_spans

from devkit.devserver import VLLMServer, otlp_env
from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv
from otel_llm.billing import ledger

PROMPT = "hello there, how are you today? " * 8
TENANT = "pd-tenant"


@pytest.fixture(scope="module")
def pair(receiver, tmp_path_factory):
    store = tmp_path_factory.mktemp("kv-store")
    spool = tmp_path_factory.mktemp("usage")
    logs = tmp_path_factory.mktemp("logs")
    config = json.dumps(
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        }
    )
    servers = {}
    for role in ("prefill", "decode"):
        servers[role] = VLLMServer(
            env={
                **otlp_env(receiver.endpoint, service_name=f"vllm-{role}"),
                "OTEL_LLM_USAGE_DIR": str(spool / role),
                "VLLM_SERVER_DEV_MODE": "1",
            },  # /reset_prefix_cache
            extra_args=["--kv-transfer-config", config, "--enable-prompt-tokens-details"],
            log_path=logs / f"vllm-{role}.log",
        )
    try:
        for server in servers.values():
            server.start()
        yield servers, spool
    finally:
        for server in servers.values():
            server.stop()


def test_prefill_and_decode_legs_are_one_trace_billed_once(pair, receiver):
    servers, spool = pair
    tp = Traceparent()
    headers = tp.headers(**{"x-tenant-id": TENANT})
    prefill = httpx.post(
        servers["prefill"].url + "/v1/completions",
        headers=headers,
        timeout=120,
        json={
            "model": MODEL_NAME,
            "prompt": PROMPT,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        },
    )
    assert prefill.status_code == 200, prefill.text
    params = prefill.json().get("kv_transfer_params") or {"do_remote_prefill": True, "do_remote_decode": False}
    decode = httpx.post(
        servers["decode"].url + "/v1/completions",
        headers=headers,
        timeout=120,
        json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "kv_transfer_params": params},
    )
    assert decode.status_code == 200, decode.text
    usage = decode.json()["usage"]

    def both(rx):
        spans = genai_spans(rx.traces().get(tp.trace_id, []))
        return spans if len(spans) == 2 else None

    spans = {s.resource["service.name"]: s for s in receiver.wait_for(both, 30)}
    p, d = spans["vllm-prefill"], spans["vllm-decode"]
    assert p.attributes[semconv.VLLM_PD_ROLE] == semconv.PD_ROLE_PREFILL
    assert d.attributes[semconv.VLLM_PD_ROLE] == semconv.PD_ROLE_DECODE
    assert d.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == usage["prompt_tokens"]
    assert d.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == usage["completion_tokens"] == 5
    assert {p.attributes[semconv.TENANT_ID], d.attributes[semconv.TENANT_ID]} == {TENANT}
    trace = receiver.traces()[tp.trace_id]
    decode_phases = sorted((s for s in trace if s.parent_span_id == d.span_id), key=lambda s: s.start_ns)
    assert [s.name for s in decode_phases][0] == semconv.SPAN_KV_TRANSFER_WAIT

    # (the prefill leg ended before the decode leg was sent: a record of it would be in its spool)
    records = [
        r
        for r in ledger.read_spool(str(spool / "prefill")) + ledger.read_spool(str(spool / "decode"))
        if r.get(semconv.USAGE_TRACE_ID) == tp.trace_id
    ]
    assert len(records) == 1 and records[0][semconv.SERVICE_NAME] == "vllm-decode"
    assert records[0][semconv.GEN_AI_USAGE_INPUT_TOKENS] == usage["prompt_tokens"]
    assert records[0][semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 5

    def exported_by_both(rx):
        points = [p for p in rx.latest_metrics() if p.attributes.get(semconv.TENANT_ID) == TENANT]
        requests = {p.resource["service.name"] for p in points if p.name == semconv.SERVER_REQUESTS}
        tokens = [
            (p.resource["service.name"], p.value)
            for p in points
            if p.name == semconv.SERVER_TOKEN_USAGE
            and p.attributes[semconv.GEN_AI_TOKEN_TYPE] == semconv.TOKEN_TYPE_INPUT
        ]
        return tokens if requests == {"vllm-prefill", "vllm-decode"} and tokens else None

    # both nodes counted the request (each served a leg); the prompt is counted on the decode node only
    tokens = receiver.wait_for(exported_by_both, 30)
    assert tokens == [("vllm-decode", usage["prompt_tokens"])]


def test_a_prefix_hit_is_split_into_local_and_connector_tokens(pair, receiver):
    """One node as an ordinary server with its KV connector (kv_both: it saves every prompt's KV cache
    to the shared storage): a prompt computed, then hit in the local prefix cache, then, with the local
    cache reset, loaded by the connector. The span, the bill and the engine's record say which."""
    servers, spool = pair
    server = servers["prefill"]
    prompt = "the local or the external cache? " * 20

    def send():
        tp = Traceparent()
        response = httpx.post(
            server.url + "/v1/completions",
            headers=tp.headers(),
            timeout=120,
            json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2},
        )
        assert response.status_code == 200, response.text
        span = receiver.wait_for(lambda rx: genai_spans(rx.traces().get(tp.trace_id, [])) or None, 30)[0]
        return response.json()["usage"], span.attributes, tp.trace_id

    computed, local, external = send(), send(), None
    assert httpx.post(server.url + "/reset_prefix_cache", timeout=60).status_code == 200
    external = send()
    hit = local[0]["prompt_tokens_details"]["cached_tokens"]
    assert computed[0]["prompt_tokens_details"]["cached_tokens"] == 0 and hit > 0
    assert external[0]["prompt_tokens_details"]["cached_tokens"] == hit
    for usage, attrs, _ in (computed, local, external):
        assert attrs[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == usage["prompt_tokens_details"]["cached_tokens"]
    assert semconv.VLLM_EXTERNAL_CACHED_TOKENS not in computed[1]
    assert semconv.VLLM_EXTERNAL_CACHED_TOKENS not in local[1]
    assert external[1][semconv.VLLM_EXTERNAL_CACHED_TOKENS] == hit

    def bill_and_engine_record(trace_id):  # the engine core writes its records when it goes idle
        def both(_):
            kinds = {
                r.get(semconv.USAGE_KIND, semconv.USAGE_KIND_REQUEST): r
                for r in ledger.read_spool(str(spool / "prefill"), kinds=None)
                if r.get(semconv.USAGE_TRACE_ID) == trace_id
            }
            return kinds if set(kinds) == {semconv.USAGE_KIND_REQUEST, semconv.USAGE_KIND_ENGINE} else None

        return receiver.wait_for(both, 30).values()

    for (_, _, trace_id), expected in zip((computed, local, external), (0, 0, hit)):
        for record in bill_and_engine_record(trace_id):
            assert record.get(semconv.VLLM_EXTERNAL_CACHED_TOKENS, 0) == expected
