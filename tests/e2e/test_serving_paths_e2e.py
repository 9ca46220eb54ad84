"""Every way vLLM serves a request over HTTP: one GenAI span and one usage record per logical request.

Two real servers: the tiny model (Responses API, beam search, chat batch, /inference/v1/generate,
generative scoring, Anthropic messages) and the tiny model as a cross-encoder (classify, score,
rerank, pooling). Tokens are compared with the `usage` vLLM itself returns.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from helpers import Traceparent, children, genai_spans, request_trace, start_server

from devkit.devserver import VLLMServer, otlp_env
from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv
from otel_llm.billing import ledger

MESSAGES = [{"role": "user", "content": "hello there, how are you today?"}]


@pytest.fixture(scope="module")
def spool(tmp_path_factory):
    return tmp_path_factory.mktemp("usage")


@pytest.fixture(scope="module")
def server(receiver, tmp_path_factory, spool):
    srv = start_server(
        receiver,
        tmp_path_factory,
        "paths",
        extra_args=["--enable-scale-out"],
        env={"OTEL_LLM_USAGE_DIR": str(spool), "VLLM_ENABLE_RESPONSES_API_STORE": "1"},
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def scorer(receiver, tmp_path_factory, spool):
    log = tmp_path_factory.mktemp("logs") / "vllm-scorer.log"
    srv = VLLMServer(env={**otlp_env(receiver.endpoint), "OTEL_LLM_USAGE_DIR": str(spool)}, log_path=log, scorer=True)
    srv.start()
    yield srv
    srv.stop()


def post(srv, path, body, tp: Traceparent, tenant="acme"):
    response = httpx.post(srv.url + path, json=body, headers=tp.headers(**{"x-tenant-id": tenant}), timeout=120)
    return response


def one_genai_span(receiver, tp: Traceparent, phases: int):
    """The trace's single GenAI span, a child of the HTTP server span, after all `phases` arrived."""
    spans = request_trace(receiver, tp.trace_id, phases=phases)
    time.sleep(0.5)  # a second GenAI span of the same request would have been exported with the first
    spans = receiver.traces()[tp.trace_id]
    (genai,) = genai_spans(spans)
    (http,) = [s for s in spans if s.kind == "SERVER"]
    assert genai.parent_span_id == http.span_id and http.parent_span_id == tp.span_id
    assert genai.attributes[semconv.TENANT_ID] == "acme"
    return genai, spans


def usage_records(spool, trace_id, count=1, timeout=10.0):
    """The usage records of one trace, once `count` of them are in the spool."""
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in ledger.read_spool(str(spool)) if r.get(semconv.USAGE_TRACE_ID) == trace_id]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def assert_billed_once(spool, tp, input_tokens, output_tokens, operation):
    records = usage_records(spool, tp.trace_id)
    assert len(records) == 1, records
    (record,) = records
    assert record[semconv.GEN_AI_USAGE_INPUT_TOKENS] == input_tokens
    assert record[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == output_tokens
    assert record[semconv.GEN_AI_OPERATION_NAME] == operation
    assert record[semconv.TENANT_ID] == "acme"


# --- Responses API ----------------------------------------------------------------------------


def test_responses_api_is_one_chat_span_with_the_usage_vllm_returns(server, receiver, spool):
    tp = Traceparent()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    response = client.responses.create(
        model=MODEL_NAME, input="hello there", max_output_tokens=8, extra_headers=tp.headers(**{"x-tenant-id": "acme"})
    )
    genai, spans = one_genai_span(receiver, tp, phases=3)
    attrs = genai.attributes
    assert genai.name == f"chat {MODEL_NAME}"
    assert attrs[semconv.GEN_AI_OPERATION_NAME] == semconv.OP_CHAT
    assert attrs[semconv.OPENAI_API_TYPE] == semconv.OPENAI_API_TYPE_RESPONSES
    assert attrs[semconv.GEN_AI_REQUEST_MAX_TOKENS] == 8
    assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == response.usage.input_tokens
    assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == response.usage.output_tokens == 8
    assert [k.name for k in children(spans, genai)] == list(semconv.PHASE_SPANS)
    assert_billed_once(spool, tp, response.usage.input_tokens, 8, semconv.OP_CHAT)


def test_responses_api_stream_is_one_span(server, receiver, spool):
    tp = Traceparent()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    stream = client.responses.create(
        model=MODEL_NAME,
        input="hello there",
        max_output_tokens=6,
        stream=True,
        extra_headers=tp.headers(**{"x-tenant-id": "acme"}),
    )
    final = [event for event in stream if event.type == "response.completed"][-1].response
    genai, _ = one_genai_span(receiver, tp, phases=3)
    assert genai.attributes[semconv.GEN_AI_REQUEST_STREAM] is True
    assert genai.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == final.usage.input_tokens
    assert genai.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == final.usage.output_tokens == 6
    assert_billed_once(spool, tp, final.usage.input_tokens, 6, semconv.OP_CHAT)


def test_background_response_is_its_own_span_linked_to_the_request(server, receiver, spool):
    tp = Traceparent()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    queued = client.responses.create(
        model=MODEL_NAME,
        input="hello there",
        max_output_tokens=5,
        background=True,
        store=True,
        extra_headers=tp.headers(**{"x-tenant-id": "acme"}),
    )
    deadline = time.monotonic() + 60
    done = client.responses.retrieve(queued.id)
    while done.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
        done = client.responses.retrieve(queued.id)
    assert done.status == "incomplete" and done.usage.output_tokens == 5

    def background(rx):
        for spans in rx.traces().values():
            for span in genai_spans(spans):
                if (
                    any(link.trace_id == tp.trace_id for link in span.links)
                    and semconv.GEN_AI_USAGE_INPUT_TOKENS in span.attributes
                ):
                    return span
        return None

    later = receiver.wait_for(background, 30)
    (front,) = genai_spans(receiver.traces()[tp.trace_id])
    assert later.trace_id != tp.trace_id and later.links[0].span_id == front.span_id
    assert later.attributes[semconv.OPENAI_API_TYPE] == semconv.OPENAI_API_TYPE_RESPONSES
    assert later.attributes[semconv.TENANT_ID] == "acme"
    assert later.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == done.usage.input_tokens
    assert later.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 5
    # the request that queued it reached no engine: no tokens, no bill; the background work is billed once
    assert semconv.GEN_AI_USAGE_INPUT_TOKENS not in front.attributes
    assert usage_records(spool, tp.trace_id, timeout=1) == []
    records = usage_records(spool, later.trace_id)
    assert [(r[semconv.GEN_AI_USAGE_INPUT_TOKENS], r[semconv.GEN_AI_USAGE_OUTPUT_TOKENS]) for r in records] == [
        (done.usage.input_tokens, 5)
    ]


# --- beam search --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_beam_search_is_one_span_billed_as_vllm_reports_it(server, receiver, spool, path):
    tp = Traceparent()
    body = {"model": MODEL_NAME, "max_tokens": 4, "n": 2, "use_beam_search": True, "ignore_eos": True}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": "hello there, how are you today?"})
    response = post(server, path, body, tp)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    genai, _ = one_genai_span(receiver, tp, phases=3)
    attrs = genai.attributes
    # the prompt once, output = the tokens of the returned beams (engine requests: beams x steps)
    assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == usage["prompt_tokens"]
    assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == usage["completion_tokens"] == 8
    assert attrs[semconv.VLLM_ENGINE_REQUESTS] > 2
    operation = semconv.OP_CHAT if "chat" in path else semconv.OP_TEXT_COMPLETION
    assert_billed_once(spool, tp, usage["prompt_tokens"], 8, operation)


def test_beam_search_stream_is_billed_as_vllm_reports_it(server, receiver, spool):
    tp = Traceparent()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"use_beam_search": True, "n": 2, "ignore_eos": True},
            extra_headers=tp.headers(**{"x-tenant-id": "acme"}),
        )
    )
    usage = chunks[-1].usage
    genai, _ = one_genai_span(receiver, tp, phases=3)
    assert genai.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == usage.prompt_tokens
    assert genai.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == usage.completion_tokens == 6
    assert_billed_once(spool, tp, usage.prompt_tokens, 6, semconv.OP_CHAT)


# --- routes without a handler hook -----------------------------------------------------------


def test_chat_batch_is_one_span_for_all_its_conversations(server, receiver, spool):
    tp = Traceparent()
    body = {
        "model": MODEL_NAME,
        "messages": [MESSAGES, [{"role": "user", "content": "bye"}]],
        "max_tokens": 4,
        "ignore_eos": True,
        "temperature": 0.5,
    }
    response = post(server, "/v1/chat/completions/batch", body, tp)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    genai, spans = one_genai_span(receiver, tp, phases=6)
    attrs = genai.attributes
    assert genai.name == f"chat {MODEL_NAME}"
    assert attrs[semconv.GEN_AI_REQUEST_MODEL] == MODEL_NAME
    assert attrs[semconv.GEN_AI_REQUEST_MAX_TOKENS] == 4
    assert attrs[semconv.GEN_AI_REQUEST_TEMPERATURE] == 0.5
    assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == usage["prompt_tokens"]
    assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == usage["completion_tokens"] == 8
    assert attrs[semconv.VLLM_ENGINE_REQUESTS] == 2
    assert attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ["length", "length"]
    assert len(children(spans, genai)) == 6
    assert_billed_once(spool, tp, usage["prompt_tokens"], 8, semconv.OP_CHAT)


def test_token_in_token_out_generate_is_one_span(server, receiver, spool):
    tp = Traceparent()
    body = {
        "model": MODEL_NAME,
        "token_ids": [7, 8, 9, 10, 11],
        "sampling_params": {"max_tokens": 3, "ignore_eos": True},
    }
    response = post(server, "/inference/v1/generate", body, tp)
    assert response.status_code == 200, response.text
    genai, _ = one_genai_span(receiver, tp, phases=3)
    attrs = genai.attributes
    assert attrs[semconv.GEN_AI_OPERATION_NAME] == semconv.OP_TEXT_COMPLETION
    assert attrs[semconv.GEN_AI_REQUEST_MAX_TOKENS] == 3
    assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == 5
    assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    assert_billed_once(spool, tp, 5, 3, semconv.OP_TEXT_COMPLETION)


def test_generative_scoring_is_one_span(server, receiver, spool):
    tp = Traceparent()
    body = {"model": MODEL_NAME, "query": "hello there", "items": ["bye", "how are you"], "label_token_ids": [5, 6]}
    response = post(server, "/generative_scoring", body, tp)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    genai, _ = one_genai_span(receiver, tp, phases=6)
    attrs = genai.attributes
    assert attrs[semconv.GEN_AI_OPERATION_NAME] == semconv.OP_GENERATIVE_SCORING
    assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == usage["prompt_tokens"]
    assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == usage["completion_tokens"]
    assert_billed_once(spool, tp, usage["prompt_tokens"], usage["completion_tokens"], semconv.OP_GENERATIVE_SCORING)


def test_route_error_without_engine_is_one_error_span(server, receiver, spool):
    tp = Traceparent()
    response = post(
        server,
        "/inference/v1/generate",
        {"model": "nope", "token_ids": [1, 2], "sampling_params": {"max_tokens": 2}},
        tp,
    )
    assert response.status_code == 404, response.text
    spans = receiver.wait_for(lambda rx: genai_spans(rx.traces().get(tp.trace_id, [])) or None, 30)
    time.sleep(0.5)
    (genai,) = genai_spans(receiver.traces()[tp.trace_id])
    assert genai.status == "ERROR" and genai.attributes[semconv.TENANT_ID] == "acme"
    assert genai.attributes[semconv.GEN_AI_OPERATION_NAME] == semconv.OP_TEXT_COMPLETION
    assert genai.attributes[semconv.ERROR_TYPE]
    assert spans and usage_records(spool, tp.trace_id, timeout=1) == []


@pytest.mark.parametrize(
    "body,status", [({"model": MODEL_NAME}, 400), ({"model": "nope", "messages": MESSAGES, "max_tokens": 4}, 404)]
)
def test_anthropic_messages_errors_get_an_error_span(server, receiver, body, status):
    tp = Traceparent()
    response = post(server, "/v1/messages", body, tp)
    assert response.status_code == status, response.text
    receiver.wait_for(lambda rx: genai_spans(rx.traces().get(tp.trace_id, [])) or None, 30)
    time.sleep(0.5)
    (genai,) = genai_spans(receiver.traces()[tp.trace_id])
    assert genai.status == "ERROR"
    assert genai.attributes[semconv.GEN_AI_OPERATION_NAME] == semconv.OP_CHAT
    assert genai.attributes[semconv.TENANT_ID] == "acme"


def test_anthropic_messages_is_one_chat_span(server, receiver, spool):
    tp = Traceparent()
    response = post(server, "/v1/messages", {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4}, tp)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    genai, _ = one_genai_span(receiver, tp, phases=3)
    assert genai.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == usage["input_tokens"]
    assert genai.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == usage["output_tokens"]
    assert_billed_once(spool, tp, usage["input_tokens"], usage["output_tokens"], semconv.OP_CHAT)


# --- pooling endpoints (the cross-encoder) ------------------------------------------------------


@pytest.mark.parametrize(
    "path,operation,body,engine_requests",
    [
        ("/classify", semconv.OP_CLASSIFY, {"input": ["hello there", "bye"]}, 2),
        ("/score", semconv.OP_SCORE, {"text_1": "hello there", "text_2": ["bye", "how are you"]}, 2),
        ("/v1/score", semconv.OP_SCORE, {"queries": "hello there", "documents": ["bye", "how are you", "hi"]}, 3),
        ("/rerank", semconv.OP_RERANK, {"query": "hello there", "documents": ["bye", "how are you"]}, 2),
        ("/v1/rerank", semconv.OP_RERANK, {"query": "hello there", "documents": ["bye", "how are you"]}, 2),
        ("/pooling", semconv.OP_POOLING, {"input": "hello there"}, 1),
    ],
)
def test_pooling_endpoint_is_one_span_with_its_prompt_tokens(
    scorer, receiver, spool, path, operation, body, engine_requests
):
    tp = Traceparent()
    response = post(scorer, path, {"model": MODEL_NAME, **body}, tp)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    genai, spans = one_genai_span(receiver, tp, phases=2 * engine_requests)
    attrs = genai.attributes
    assert genai.name == f"{operation} {MODEL_NAME}"
    assert attrs[semconv.GEN_AI_OPERATION_NAME] == operation
    assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == usage["prompt_tokens"]
    assert semconv.GEN_AI_USAGE_OUTPUT_TOKENS not in attrs
    assert semconv.GEN_AI_RESPONSE_FINISH_REASONS not in attrs
    assert attrs.get(semconv.VLLM_ENGINE_REQUESTS, 1) == engine_requests
    assert sorted(k.name for k in children(spans, genai)) == sorted(
        [semconv.SPAN_QUEUE, semconv.SPAN_PREFILL] * engine_requests
    )
    assert_billed_once(spool, tp, usage["prompt_tokens"], 0, operation)


def test_pooling_endpoint_error_is_one_error_span(scorer, receiver):
    tp = Traceparent()
    response = post(scorer, "/classify", {"model": "nope", "input": "hello"}, tp)
    assert response.status_code == 404, response.text
    receiver.wait_for(lambda rx: genai_spans(rx.traces().get(tp.trace_id, [])) or None, 30)
    time.sleep(0.5)
    (genai,) = genai_spans(receiver.traces()[tp.trace_id])
    assert genai.status == "ERROR" and genai.attributes[semconv.GEN_AI_OPERATION_NAME] == semconv.OP_CLASSIFY


# --- disaggregated prefill/decode: the role logic on the real engine ----------------------------
# No KV connector is configured here: vLLM passes each request's kv_transfer_params to the engine
# and its output processor (a decode leg reports the prefill node's cache hits) all the same.


def test_prefill_leg_is_traced_but_never_billed(server, receiver, spool):
    tp = Traceparent()
    body = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    response = post(server, "/v1/chat/completions", body, tp)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    genai, _ = one_genai_span(receiver, tp, phases=3)
    assert genai.attributes[semconv.VLLM_PD_ROLE] == semconv.PD_ROLE_PREFILL
    assert genai.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == usage["prompt_tokens"]
    # the decode node bills the logical request: no record here, however long one waits
    assert usage_records(spool, tp.trace_id, timeout=2) == []


def test_decode_leg_is_billed_once_with_the_prefill_nodes_cache_hits(server, receiver, spool):
    tp = Traceparent()
    body = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "max_tokens": 4,
        "ignore_eos": True,
        "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False, "remote_prefill_cached_tokens": 5},
    }
    response = post(server, "/v1/chat/completions", body, tp)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    spans = request_trace(receiver, tp.trace_id, phases=2)
    (genai,) = genai_spans(spans)
    attrs = genai.attributes
    assert attrs[semconv.VLLM_PD_ROLE] == semconv.PD_ROLE_DECODE
    assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == usage["prompt_tokens"]
    assert attrs[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == 5  # the P side's hits, not the transfer
    assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 4
    # queueing and the wait for the KV cache are one interval in vLLM's events: named for both
    assert [k.name for k in children(spans, genai)] == [
        semconv.SPAN_KV_TRANSFER_WAIT,
        semconv.SPAN_PREFILL,
        semconv.SPAN_DECODE,
    ]
    (record,) = usage_records(spool, tp.trace_id)
    assert record[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == 5
    assert record[semconv.VLLM_EXTERNAL_CACHED_TOKENS] == 5
    assert record[semconv.GEN_AI_USAGE_INPUT_TOKENS] == usage["prompt_tokens"]


# --- metrics: one logical request counted once ----------------------------------------------------


@pytest.mark.parametrize(
    "which,path,body",
    [
        (
            "server",
            "/v1/chat/completions/batch",
            {"messages": [MESSAGES, [{"role": "user", "content": "bye"}]], "max_tokens": 3, "ignore_eos": True},
        ),
        (
            "server",
            "/v1/completions",
            {"prompt": "hello there", "max_tokens": 3, "n": 2, "use_beam_search": True, "ignore_eos": True},
        ),
        ("scorer", "/rerank", {"query": "hello there", "documents": ["bye", "how are you", "hi"]}),
    ],
)
def test_metrics_count_the_logical_request_once(request, receiver, which, path, body):
    srv = request.getfixturevalue(which)
    tenant = f"metrics-{path.strip('/').replace('/', '-')}"
    tp = Traceparent()
    response = post(srv, path, {"model": MODEL_NAME, **body}, tp, tenant=tenant)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    expected = {semconv.SERVER_REQUESTS: 1, semconv.TOKEN_TYPE_INPUT: usage["prompt_tokens"]}
    if usage.get("completion_tokens"):
        expected[semconv.TOKEN_TYPE_OUTPUT] = usage["completion_tokens"]

    def counted(rx):
        found = {}
        for p in rx.latest_metrics():
            if p.attributes.get(semconv.TENANT_ID) != tenant:
                continue
            if p.name == semconv.SERVER_REQUESTS:
                found[p.name] = found.get(p.name, 0) + p.value
            elif p.name == semconv.SERVER_TOKEN_USAGE:
                kind = p.attributes[semconv.GEN_AI_TOKEN_TYPE]
                found[kind] = found.get(kind, 0) + p.value
        return found if all(k in found for k in expected) else None

    found = receiver.wait_for(counted, 30)
    assert {k: found[k] for k in expected} == expected
