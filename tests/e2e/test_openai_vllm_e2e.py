"""The instrumented OpenAI client against the real instrumented vLLM CPU server: one trace from
the client span into the engine's queue/prefill/decode spans, token counts equal on both sides;
clients that leave a stream early. The server is paced (tiny_model.PACED_NETWORK) so that it sees
a client leave while the engine still generates."""

import asyncio

import openai
import pytest
from helpers import (
    Otel,
    Traceparent,
    abandon_stream,
    assert_server_tree,
    genai_spans,
    request_trace,
    start_server,
    until_engine_aborts,
)
from opentelemetry.trace import SpanKind, StatusCode

from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv
from otel_llm.config import ENV_SEMCONV_OPT_IN, GENAI_LATEST_EXPERIMENTAL

MESSAGES = [{"role": "user", "content": "Tell me about the sea"}]


@pytest.fixture(scope="module")
def server(receiver, tmp_path_factory):
    srv = start_server(
        receiver, tmp_path_factory, "openai-client", extra_args=["--enable-prompt-tokens-details"], paced=True
    )
    yield srv
    srv.stop()


@pytest.fixture
def otel():
    o = Otel(include_usage=True)
    yield o
    o.close()


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="sk-e2e-secret", max_retries=0) as c:
        yield c


def engine_trace(receiver, client_span):
    """The server side of a client span's trace, asserting it hangs under the client span."""
    trace_id = f"{client_span.context.trace_id:032x}"
    spans = request_trace(receiver, trace_id)
    http, genai, kids = assert_server_tree(spans, parent_span_id=f"{client_span.context.span_id:016x}")
    return genai


def client_span(otel):
    (span,) = [s for s in otel.finished() if s.kind == SpanKind.CLIENT]
    return span


def test_chat_one_trace_and_equal_tokens(otel, client, receiver, server):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0)
    span = client_span(otel)
    genai = engine_trace(receiver, span)
    for name in (
        semconv.GEN_AI_USAGE_INPUT_TOKENS,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS,
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
        semconv.GEN_AI_RESPONSE_ID,
        semconv.GEN_AI_RESPONSE_MODEL,
    ):
        assert span.attributes[name] == genai.attributes[name], name
    assert span.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == response.usage.completion_tokens == 12
    assert span.attributes[semconv.SERVER_PORT] == server.port
    assert genai.start_ns >= span.start_time and genai.end_ns <= span.end_time


def test_stream_with_include_usage_counts_what_the_engine_counted(otel, client, receiver):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=20, stream=True)
    chunks = list(stream)
    assert all(c.choices for c in chunks)  # the usage chunk we asked for is not shown to the caller
    span = client_span(otel)
    genai = engine_trace(receiver, span)
    assert (
        span.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS]
        == genai.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS]
        == 20
    )
    assert span.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == genai.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS]
    assert span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    # the user felt at least the engine's time to first token
    assert span.attributes[semconv.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] >= genai.attributes[semconv.VLLM_TTFT_SECONDS]


def test_latest_mode_inference_metrics_count_the_servers_usage(client, receiver, monkeypatch):
    """Under gen_ai_latest_experimental: the gen_ai.client.inference.* metrics, their token counts
    exactly what the server reported (a call's usage; a stream's usage chunk, hidden from the caller,
    checked against the engine span)."""
    monkeypatch.setenv(ENV_SEMCONV_OPT_IN, GENAI_LATEST_EXPERIMENTAL)
    latest = Otel(include_usage=True)
    try:
        response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0)
        chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=20, stream=True))
    finally:
        latest.close()
    assert all(c.choices for c in chunks)
    call, stream = sorted((s for s in latest.finished() if s.kind == SpanKind.CLIENT), key=lambda s: s.start_time)
    served = engine_trace(receiver, stream).attributes
    assert served[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 20
    usage = response.usage
    input_tokens = usage.prompt_tokens + served[semconv.GEN_AI_USAGE_INPUT_TOKENS]
    cached = usage.prompt_tokens_details.cached_tokens + served[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS]
    assert usage.completion_tokens == 12
    assert [
        call.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS],
        stream.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS],
    ] == [usage.prompt_tokens, served[semconv.GEN_AI_USAGE_INPUT_TOKENS]]
    attrs = {
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
        semconv.GEN_AI_PROVIDER_NAME: semconv.PROVIDER_OPENAI,
        semconv.GEN_AI_REQUEST_MODEL: MODEL_NAME,
        semconv.GEN_AI_RESPONSE_MODEL: response.model,
        semconv.SERVER_ADDRESS: call.attributes[semconv.SERVER_ADDRESS],
        semconv.SERVER_PORT: call.attributes[semconv.SERVER_PORT],
    }
    text = {**attrs, semconv.GEN_AI_TOKEN_MODALITY: semconv.TOKEN_MODALITY_TEXT}

    def counted(name):
        return [(dict(p.attributes), p.value) for p in latest.points(name)]

    def histogram(name):
        return [(dict(p.attributes), p.sum, p.count) for p in latest.points(name)]

    assert counted(semconv.CLIENT_USAGE_INPUT_TOKENS) == [(text, input_tokens)]
    assert counted(semconv.CLIENT_USAGE_OUTPUT_TOKENS) == [(text, 12 + 20)]
    assert counted(semconv.CLIENT_USAGE_CACHE_READ_INPUT_TOKENS) == ([(text, cached)] if cached else [])
    assert counted(semconv.CLIENT_USAGE_REASONING_OUTPUT_TOKENS) == []
    assert histogram(semconv.CLIENT_OPERATION_INPUT_TOKENS) == [(attrs, input_tokens, 2)]
    assert histogram(semconv.CLIENT_OPERATION_OUTPUT_TOKENS) == [(attrs, 12 + 20, 2)]
    assert [(dict(p.attributes), p.count) for p in latest.points(semconv.CLIENT_INFERENCE_DURATION)] == [(attrs, 2)]
    assert [p.count for p in latest.points(semconv.CLIENT_INFERENCE_TIME_TO_FIRST_CHUNK)] == [1]
    assert [p.count for p in latest.points(semconv.CLIENT_INFERENCE_TIME_PER_OUTPUT_CHUNK)] == [len(chunks) - 1]
    for v1_41 in (
        semconv.CLIENT_OPERATION_DURATION,
        semconv.CLIENT_TOKEN_USAGE,
        semconv.CLIENT_TIME_TO_FIRST_CHUNK,
        semconv.CLIENT_TIME_PER_OUTPUT_CHUNK,
    ):
        assert latest.points(v1_41) == [], v1_41


def test_async_legacy_completion_stream(otel, server, receiver):
    async def call():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
            stream = await c.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, stream=True)
            return [chunk async for chunk in stream]

    asyncio.run(call())
    span = client_span(otel)
    assert span.name == f"text_completion {MODEL_NAME}"
    genai = engine_trace(receiver, span)
    assert (
        span.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == genai.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 8
    )


def test_client_that_stops_early_is_one_trace_with_an_aborted_engine_span(otel, client, receiver, server):
    def leave():
        otel.spans.clear()
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
        )
        for index, _ in enumerate(stream):
            if index == 3:
                break
        stream.close()
        return client_span(otel)

    *ran_to_end, (span, _) = until_engine_aborts(server.url, leave)
    for early, _ in ran_to_end + [(span, True)]:  # the client saw it abandoned either way
        assert early.status.status_code == StatusCode.ERROR
        assert early.attributes[semconv.ERROR_TYPE] == semconv.ERROR_STREAM_ABANDONED
    trace_id = f"{span.context.trace_id:032x}"
    (genai,) = receiver.wait_for(lambda rx: genai_spans(rx.traces().get(trace_id, [])))
    assert genai.attributes[semconv.VLLM_ABORTED] is True
    assert 3 <= genai.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] < 400
    spans = request_trace(receiver, trace_id)
    (http,) = [s for s in spans if s.kind == "SERVER"]
    assert http.parent_span_id == f"{span.context.span_id:016x}"


def test_client_disconnect_mid_stream_yields_aborted_span(server, receiver):
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "write a long story"}],
        "max_tokens": 400,
        "ignore_eos": True,
    }
    *ran_to_end, left = abandon_stream(server.url, "/v1/chat/completions", body, lambda: Traceparent().headers())
    for attempt in ran_to_end:  # the engine finished it before it saw the client leave: no abort
        ended = receiver.wait_for(lambda rx, attempt=attempt: genai_spans(rx.traces().get(attempt.trace_id, [])))[0]
        assert ended.attributes.get(semconv.VLLM_ABORTED, False) is False
    genai = receiver.wait_for(lambda rx: genai_spans(rx.traces().get(left.trace_id, [])))[0]
    attrs = genai.attributes
    assert attrs[semconv.VLLM_ABORTED] is True
    assert attrs[semconv.ERROR_TYPE] == semconv.ERROR_CLIENT_ABORTED
    assert genai.status == "ERROR"
    assert attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == [semconv.FINISH_REASON_ABORT]
    # the tokens the engine really generated before the abort: at least those we read
    assert 3 <= attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] < 400
    assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] > 0
    spans = request_trace(receiver, left.trace_id)
    kids = sorted((s for s in spans if s.parent_span_id == genai.span_id), key=lambda s: s.start_ns)
    assert [k.name for k in kids] == list(semconv.PHASE_SPANS)
    assert kids[-1].end_ns <= genai.end_ns
