"""The OpenAI client instrumentation against recorded OpenAI exchanges, over real HTTP with the
real openai client (tests/openai/openai_replay.py). The real vLLM engine is in test_openai_vllm_e2e.py.
"""

import asyncio
import gc
import json
import time

import openai
import pytest
from helpers import Otel
from openai_replay import ReplayServer, response_json
from opentelemetry import baggage, context
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.trace import SpanKind, StatusCode

from otel_llm import semconv
from otel_llm.config import ENV_SEMCONV_OPT_IN, GENAI_LATEST_EXPERIMENTAL

API_KEY = "sk-test-secret-key-4f1d2a"
HELLO = [{"role": "user", "content": "Say this is a test"}]


@pytest.fixture
def otel(request, monkeypatch):
    """The instrumentation with v1.41 names, or (BOTH_MODES param True) gen_ai_latest_experimental's."""
    latest = getattr(request, "param", False)
    if latest:
        monkeypatch.setenv(ENV_SEMCONV_OPT_IN, GENAI_LATEST_EXPERIMENTAL)
    else:
        monkeypatch.delenv(ENV_SEMCONV_OPT_IN, raising=False)
    o = Otel()
    o.latest = latest
    yield o
    o.close()


# a test whose metric or usage names differ by mode runs in both
BOTH_MODES = pytest.mark.parametrize("otel", [False, True], ids=["v1_41", "latest"], indirect=True)
LATEST_TOKEN_METRICS = (
    semconv.CLIENT_USAGE_INPUT_TOKENS,
    semconv.CLIENT_USAGE_OUTPUT_TOKENS,
    semconv.CLIENT_USAGE_CACHE_READ_INPUT_TOKENS,
    semconv.CLIENT_USAGE_CACHE_WRITE_INPUT_TOKENS,
    semconv.CLIENT_USAGE_REASONING_OUTPUT_TOKENS,
    semconv.CLIENT_OPERATION_INPUT_TOKENS,
    semconv.CLIENT_OPERATION_OUTPUT_TOKENS,
)


def duration_points(otel, operation=semconv.OP_CHAT):
    """The calls' duration points under the mode's name; the other name has none."""
    used, unused = semconv.CLIENT_OPERATION_DURATION, semconv.CLIENT_INFERENCE_DURATION
    if otel.latest and operation != semconv.OP_EMBEDDINGS:
        used, unused = unused, used
    assert otel.points(unused) == []
    return otel.points(used)


def chunk_points(otel):
    """(time_to_first_chunk, time_per_output_chunk) points under the mode's names; the others have none."""
    v1_41 = (semconv.CLIENT_TIME_TO_FIRST_CHUNK, semconv.CLIENT_TIME_PER_OUTPUT_CHUNK)
    latest = (semconv.CLIENT_INFERENCE_TIME_TO_FIRST_CHUNK, semconv.CLIENT_INFERENCE_TIME_PER_OUTPUT_CHUNK)
    used, unused = (latest, v1_41) if otel.latest else (v1_41, latest)
    assert [otel.points(name) for name in unused] == [[], []]
    return tuple(otel.points(name) for name in used)


def assert_token_metrics(otel, attrs, input_tokens, output_tokens, cache_read=0, cache_write=0, reasoning=0, calls=1):
    """Exactly the token metrics of `calls` calls with these metric attributes, in the mode's names.
    input/output None: the calls received no such count (v1.41: nothing recorded; latest: 0, modality
    unknown, on the counter, and 0 on the per-operation histogram)."""
    if not otel.latest:
        assert [otel.points(name) for name in LATEST_TOKEN_METRICS] == [[]] * len(LATEST_TOKEN_METRICS)
        points = otel.points(semconv.CLIENT_TOKEN_USAGE)
        assert {
            p.attributes[semconv.GEN_AI_TOKEN_TYPE]: (dict(p.attributes), p.sum, p.count, tuple(p.explicit_bounds))
            for p in points
        } == {
            kind: ({**attrs, semconv.GEN_AI_TOKEN_TYPE: kind}, value, calls, semconv.TOKEN_BUCKETS)
            for kind, value in ((semconv.TOKEN_TYPE_INPUT, input_tokens), (semconv.TOKEN_TYPE_OUTPUT, output_tokens))
            if value is not None
        }
        return
    assert otel.points(semconv.CLIENT_TOKEN_USAGE) == []
    text = {**attrs, semconv.GEN_AI_TOKEN_MODALITY: semconv.TOKEN_MODALITY_TEXT}
    for counter, histogram, value in (
        (semconv.CLIENT_USAGE_INPUT_TOKENS, semconv.CLIENT_OPERATION_INPUT_TOKENS, input_tokens),
        (semconv.CLIENT_USAGE_OUTPUT_TOKENS, semconv.CLIENT_OPERATION_OUTPUT_TOKENS, output_tokens),
    ):
        modality = semconv.TOKEN_MODALITY_UNKNOWN if value is None else semconv.TOKEN_MODALITY_TEXT
        assert [(dict(p.attributes), p.value) for p in otel.points(counter)] == [
            ({**attrs, semconv.GEN_AI_TOKEN_MODALITY: modality}, value or 0)
        ], counter
        assert [(dict(p.attributes), p.sum, p.count, tuple(p.explicit_bounds)) for p in otel.points(histogram)] == [
            (attrs, value or 0, calls, semconv.TOKEN_BUCKETS)
        ], histogram
    for counter, value in (
        (semconv.CLIENT_USAGE_CACHE_READ_INPUT_TOKENS, cache_read),
        (semconv.CLIENT_USAGE_CACHE_WRITE_INPUT_TOKENS, cache_write),
        (semconv.CLIENT_USAGE_REASONING_OUTPUT_TOKENS, reasoning),
    ):
        assert [(dict(p.attributes), p.value) for p in otel.points(counter)] == ([(text, value)] if value else []), (
            counter
        )


def zero_breakdown(otel):
    """The span attributes of a response reporting 0 cached and 0 reasoning tokens: stated in v1.41
    mode, left out in latest mode (breakdowns only when non-zero)."""
    return (
        {}
        if otel.latest
        else {semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 0, semconv.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS: 0}
    )


@pytest.fixture(scope="module")
def replay():
    with ReplayServer() as server:
        yield server


@pytest.fixture
def server(replay):
    replay.reset()
    yield replay
    replay.reset()


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0) as c:
        yield c


def aclient(server):
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)


def base_attributes(server, model, operation=semconv.OP_CHAT):
    return {
        semconv.GEN_AI_OPERATION_NAME: operation,
        semconv.GEN_AI_PROVIDER_NAME: semconv.PROVIDER_OPENAI,
        semconv.GEN_AI_REQUEST_MODEL: model,
        semconv.SERVER_ADDRESS: "127.0.0.1",
        semconv.SERVER_PORT: server.port,
    }


def assert_traceparent_is(span, received):
    """The request carried exactly one traceparent, naming this span as the parent."""
    values = received.headers.get("traceparent")
    assert values is not None and len(values) == 1, values
    ctx = span.get_span_context()
    assert values[0].split("-")[1:3] == [f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"]


def assert_no_secret(otel):
    for span in otel.finished():
        assert API_KEY not in json.dumps(dict(span.attributes), default=str)
        for event in span.events:
            assert API_KEY not in json.dumps(dict(event.attributes), default=str)
    assert API_KEY not in otel.reader.get_metrics_data().to_json()


# --- non-streamed calls ------------------------------------------------------------------------


@BOTH_MODES
def test_chat_span_attributes_metrics_and_propagation(otel, server, client):
    server.play("test_chat_completion_extra_params.yaml")
    headers = {"x-caller": "kept"}
    result = client.chat.completions.create(
        model="gpt-4o-mini",
        messages=HELLO,
        max_tokens=50,
        seed=42,
        temperature=0.5,
        response_format={"type": "text"},
        service_tier="default",
        extra_headers=headers,
    )
    recorded = response_json("test_chat_completion_extra_params.yaml")
    assert result.id == recorded["id"]
    span = otel.only_span()
    assert span.name == "chat gpt-4o-mini"
    assert span.kind == SpanKind.CLIENT
    assert span.status.status_code == StatusCode.UNSET
    assert dict(span.attributes) == {
        **base_attributes(server, "gpt-4o-mini"),
        semconv.OPENAI_API_TYPE: semconv.OPENAI_API_TYPE_CHAT,
        semconv.GEN_AI_REQUEST_MAX_TOKENS: 50,
        semconv.GEN_AI_REQUEST_SEED: 42,
        semconv.GEN_AI_REQUEST_TEMPERATURE: 0.5,
        semconv.GEN_AI_OUTPUT_TYPE: "text",
        semconv.OPENAI_REQUEST_SERVICE_TIER: "default",
        semconv.GEN_AI_RESPONSE_ID: recorded["id"],
        semconv.GEN_AI_RESPONSE_MODEL: recorded["model"],
        semconv.GEN_AI_RESPONSE_FINISH_REASONS: ("stop",),
        semconv.GEN_AI_USAGE_INPUT_TOKENS: recorded["usage"]["prompt_tokens"],
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: recorded["usage"]["completion_tokens"],
        **zero_breakdown(otel),
        semconv.OPENAI_RESPONSE_SERVICE_TIER: "default",
        semconv.OPENAI_RESPONSE_SYSTEM_FINGERPRINT: recorded["system_fingerprint"],
    }
    # the caller's dict is not touched; the request carries our span as parent, once
    assert headers == {"x-caller": "kept"}
    received = server.received[-1]
    assert received.header("x-caller") == "kept"
    assert_traceparent_is(span, received)

    metric_attrs = {**base_attributes(server, "gpt-4o-mini"), semconv.GEN_AI_RESPONSE_MODEL: recorded["model"]}
    (duration,) = duration_points(otel)
    assert dict(duration.attributes) == metric_attrs
    assert duration.count == 1
    assert tuple(duration.explicit_bounds) == semconv.DURATION_BUCKETS
    assert abs(duration.sum - (span.end_time - span.start_time) / 1e9) < 0.01
    assert_token_metrics(otel, metric_attrs, recorded["usage"]["prompt_tokens"], recorded["usage"]["completion_tokens"])
    assert chunk_points(otel) == ([], [])  # streams only
    assert_no_secret(otel)


def test_async_chat_with_two_choices(otel, server):
    server.play("test_async_chat_completion_multiple_choices.yaml")

    async def call():
        async with aclient(server) as c:
            return await c.chat.completions.create(model="gpt-4o-mini", messages=HELLO, n=2)

    result = asyncio.run(call())
    span = otel.only_span()
    assert span.attributes[semconv.GEN_AI_REQUEST_CHOICE_COUNT] == 2
    assert span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop", "stop")
    assert span.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == result.usage.completion_tokens == 10
    assert_traceparent_is(span, server.received[-1])


@BOTH_MODES
def test_http_error_sets_error_type_on_span_and_metric(otel, server, client):
    server.play("test_chat_completion_404.yaml")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="this-model-does-not-exist", messages=HELLO)
    span = otel.only_span()
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes[semconv.ERROR_TYPE] == "404"
    assert [e.name for e in span.events] == ["exception"]
    # no usage came back: the span says so (the conventions ask for no 0 on the span)
    assert span.attributes[semconv.OTEL_LLM_USAGE_MISSING] is True
    assert semconv.GEN_AI_USAGE_INPUT_TOKENS not in span.attributes
    attrs = {**base_attributes(server, "this-model-does-not-exist"), semconv.ERROR_TYPE: "404"}
    (duration,) = duration_points(otel)
    assert dict(duration.attributes) == attrs
    # v1.41: no token metric; latest: 0 input and 0 output tokens of modality unknown
    assert_token_metrics(otel, attrs, None, None)


def test_connection_error_type_is_the_exception_class(otel):
    with openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key=API_KEY, max_retries=0) as c:
        with pytest.raises(openai.APIConnectionError):
            c.chat.completions.create(model="m", messages=HELLO)
    span = otel.only_span()
    assert span.attributes[semconv.ERROR_TYPE] == "APIConnectionError"
    assert span.attributes[semconv.SERVER_PORT] == 9


@BOTH_MODES
def test_cached_tokens_from_prompt_caching(otel, server, client):
    server.play("test_openai_prompt_caching.yaml")
    messages = json.loads(_request_body("test_openai_prompt_caching.yaml"))["messages"]
    first = client.chat.completions.create(model="gpt-4o-mini", messages=messages)
    second = client.chat.completions.create(model="gpt-4o-mini", messages=messages)
    spans = otel.finished()
    assert (first.usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens_details.cached_tokens) == (
        0,
        1024,
    )
    # the first call's 0 is stated in v1.41 mode only
    assert [s.attributes.get(semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS) for s in spans] == [
        None if otel.latest else 0,
        1024,
    ]
    assert spans[1].attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == second.usage.prompt_tokens
    assert first.model == second.model
    attrs = {**base_attributes(server, "gpt-4o-mini"), semconv.GEN_AI_RESPONSE_MODEL: first.model}
    assert_token_metrics(
        otel,
        attrs,
        first.usage.prompt_tokens + second.usage.prompt_tokens,
        first.usage.completion_tokens + second.usage.completion_tokens,
        cache_read=1024,
        calls=2,
    )


def chat_reply(usage: dict) -> dict:
    body = {
        "id": "chatcmpl-cw",
        "object": "chat.completion",
        "created": 1,
        "model": "some-provider-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": usage,
    }
    return {"status": 200, "headers": {"content-type": "application/json"}, "body": json.dumps(body).encode()}


@BOTH_MODES
@pytest.mark.parametrize("field", ["cache_write_tokens", "cache_creation_tokens"])
def test_cache_write_tokens_of_an_openai_compatible_provider(otel, server, client, field):
    """v1.41 mode names them gen_ai.usage.cache_creation.input_tokens, latest mode
    gen_ai.usage.cache_write.input_tokens (and counts them); a count that is not an int is ignored."""
    usage = {
        "prompt_tokens": 30,
        "completion_tokens": 3,
        "total_tokens": 33,
        "prompt_tokens_details": {"cached_tokens": 0, field: 20},
    }
    server.queue.append(chat_reply(usage))
    server.queue.append(chat_reply({**usage, "prompt_tokens_details": {field: "many"}}))
    server.queue.append(chat_reply({**usage, "prompt_tokens_details": {field: 0}}))
    for _ in range(3):
        client.chat.completions.create(model="m", messages=HELLO)
    spans = otel.finished()
    name, other = semconv.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS, semconv.GEN_AI_USAGE_CACHE_WRITE_INPUT_TOKENS
    if otel.latest:
        name, other = other, name
    assert [(s.attributes.get(name), s.attributes.get(other)) for s in spans] == [
        (20, None),
        (None, None),
        (None, None),
    ]
    attrs = {**base_attributes(server, "m"), semconv.GEN_AI_RESPONSE_MODEL: "some-provider-model"}
    assert_token_metrics(otel, attrs, 90, 9, cache_write=20, calls=3)


def test_the_mode_is_read_once_at_instrument_time(monkeypatch, server, client):
    monkeypatch.setenv(ENV_SEMCONV_OPT_IN, f"http, {GENAI_LATEST_EXPERIMENTAL}")
    otel = Otel()
    try:
        monkeypatch.delenv(ENV_SEMCONV_OPT_IN)
        server.play("test_chat_completion_with_content.yaml")
        client.chat.completions.create(model="gpt-4o-mini", messages=HELLO)
        assert [p.count for p in otel.points(semconv.CLIENT_INFERENCE_DURATION)] == [1]
        assert otel.points(semconv.CLIENT_OPERATION_DURATION) == otel.points(semconv.CLIENT_TOKEN_USAGE) == []
    finally:
        otel.close()


def test_legacy_completions(otel, server, client):
    name = "TestCompletionsFinishReasons.test_completions_sets_top_level_finish_reasons.yaml"
    server.play(name)
    result = client.completions.create(model="davinci-002", prompt="Tell me a joke about opentelemetry")
    span = otel.finished()[0]
    assert span.name == "text_completion davinci-002"
    assert semconv.OPENAI_API_TYPE not in span.attributes
    assert span.attributes[semconv.GEN_AI_OPERATION_NAME] == semconv.OP_TEXT_COMPLETION
    assert span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    assert span.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == result.usage.prompt_tokens == 8
    assert span.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == result.usage.completion_tokens == 16
    assert semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS not in span.attributes  # not in the response


@BOTH_MODES
def test_legacy_completions_stream(otel, server, client):
    name = "TestCompletionsFinishReasons.test_completions_streaming_sets_top_level_finish_reasons.yaml"
    server.play(name)
    chunks = list(client.completions.create(model="davinci-002", prompt="Tell me a joke", stream=True))
    span = otel.only_span()
    assert span.attributes[semconv.OTEL_LLM_STREAM_CHUNKS] == len(chunks) == len(response_json(name))
    assert span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    assert span.attributes[semconv.OTEL_LLM_USAGE_MISSING] is True
    assert span.status.status_code == StatusCode.UNSET
    attrs = {
        **base_attributes(server, "davinci-002", semconv.OP_TEXT_COMPLETION),
        semconv.GEN_AI_RESPONSE_MODEL: chunks[0].model,
    }
    assert [dict(p.attributes) for p in duration_points(otel)] == [attrs]
    assert_token_metrics(otel, attrs, None, None)  # the stream carried no usage


@BOTH_MODES
def test_embeddings(otel, server, client):
    server.play("test_embeddings_with_dimensions.yaml")
    result = client.embeddings.create(
        model="text-embedding-3-small",
        dimensions=512,
        encoding_format="float",
        input="This is a test for embeddings with dimensions",
    )
    span = otel.only_span()
    assert span.name == "embeddings text-embedding-3-small"
    assert dict(span.attributes) == {
        **base_attributes(server, "text-embedding-3-small", semconv.OP_EMBEDDINGS),
        semconv.GEN_AI_REQUEST_ENCODING_FORMATS: ("float",),
        semconv.GEN_AI_RESPONSE_MODEL: result.model,
        semconv.GEN_AI_USAGE_INPUT_TOKENS: 8,
        semconv.GEN_AI_EMBEDDINGS_DIMENSION_COUNT: 512,
    }
    attrs = {
        **base_attributes(server, "text-embedding-3-small", semconv.OP_EMBEDDINGS),
        semconv.GEN_AI_RESPONSE_MODEL: result.model,
    }
    # not inference: gen_ai.client.operation.duration in either mode
    assert [dict(p.attributes) for p in duration_points(otel, semconv.OP_EMBEDDINGS)] == [attrs]
    if otel.latest:  # the inference.usage.* metrics are for inference: the tokens are on the span only
        assert [otel.points(name) for name in (semconv.CLIENT_TOKEN_USAGE, *LATEST_TOKEN_METRICS)] == [[]] * (
            1 + len(LATEST_TOKEN_METRICS)
        )
    else:
        assert [(p.attributes[semconv.GEN_AI_TOKEN_TYPE], p.sum) for p in otel.points(semconv.CLIENT_TOKEN_USAGE)] == [
            ("input", 8)
        ]


def test_async_embeddings_error(otel, server):
    server.play("test_async_embeddings_error_handling.yaml")

    async def call():
        async with aclient(server) as c:
            await c.embeddings.create(model="text-embedding-3-small", input="x")

    with pytest.raises(openai.NotFoundError):
        asyncio.run(call())
    assert otel.only_span().attributes[semconv.ERROR_TYPE] == "404"


@BOTH_MODES
def test_responses_api(otel, server, client):
    server.play("test_responses_create_basic[content_mode0].yaml")
    result = client.responses.create(
        model="gpt-4o-mini", input="Say this is a test", instructions="You are a helpful assistant."
    )
    span = otel.only_span()
    assert span.name == "chat gpt-4o-mini"
    assert span.attributes[semconv.OPENAI_API_TYPE] == semconv.OPENAI_API_TYPE_RESPONSES
    assert span.attributes[semconv.GEN_AI_RESPONSE_ID] == result.id
    assert span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)  # status completed
    assert span.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == result.usage.input_tokens == 22
    assert span.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == result.usage.output_tokens == 6
    assert result.usage.input_tokens_details.cached_tokens == result.usage.output_tokens_details.reasoning_tokens == 0
    breakdown = {
        k: v
        for k, v in span.attributes.items()
        if k in (semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, semconv.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS)
    }
    assert breakdown == zero_breakdown(otel)
    attrs = {**base_attributes(server, "gpt-4o-mini"), semconv.GEN_AI_RESPONSE_MODEL: result.model}
    assert [dict(p.attributes) for p in duration_points(otel)] == [attrs]  # the Responses API is inference
    assert_token_metrics(otel, attrs, 22, 6)


@BOTH_MODES
def test_responses_reasoning_tokens_and_max_output_tokens(otel, server, client):
    name = "test_responses_create_reports_reasoning_tokens[content_mode0].yaml"
    server.play(name)
    result = client.responses.create(model="gpt-5.4", input="transpose", max_output_tokens=300)
    span = otel.only_span()
    assert span.attributes[semconv.GEN_AI_REQUEST_MAX_TOKENS] == 300
    assert (
        span.attributes[semconv.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS]
        == result.usage.output_tokens_details.reasoning_tokens
        == 9
    )
    # cached: 0, stated in v1.41 mode only
    assert span.attributes.get(semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS) == (None if otel.latest else 0)
    attrs = {**base_attributes(server, "gpt-5.4"), semconv.GEN_AI_RESPONSE_MODEL: result.model}
    # the reasoning counter (latest) counts its 9, the cache_read counter has no point
    assert_token_metrics(otel, attrs, 44, 288, reasoning=9)


def test_responses_error(otel, server, client):
    server.play("test_responses_create_api_error[content_mode0].yaml")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="this-model-does-not-exist", input="Hello")
    assert otel.only_span().attributes[semconv.ERROR_TYPE] == "400"


@pytest.mark.parametrize(
    "name",
    [
        "test_responses_create_streaming[content_mode0].yaml",
        "test_responses_create_streaming_iteration[content_mode0].yaml",
    ],
)
def test_responses_stream(otel, server, client, name):
    server.play(name)
    events = list(client.responses.create(model="gpt-4o-mini", input="Say this is a test", stream=True))
    completed = [e for e in events if e.type == "response.completed"][0].response
    deltas = [e for e in events if e.type.endswith(".delta")]
    span = otel.only_span()
    assert span.attributes[semconv.GEN_AI_RESPONSE_ID] == completed.id
    assert span.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == completed.usage.output_tokens
    assert span.attributes[semconv.OTEL_LLM_STREAM_CHUNKS] == len(deltas) > 0
    assert span.attributes[semconv.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] > 0


def test_with_raw_response(otel, server, client):
    server.play("test_chat_completion_with_content.yaml")
    raw = client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=HELLO)
    assert raw.http_response.status_code == 200
    parsed = raw.parse()
    span = otel.only_span()
    assert span.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == parsed.usage.completion_tokens
    assert_traceparent_is(span, server.received[-1])


def test_with_streaming_response(otel, server, client):
    server.play("test_chat_completion_with_content.yaml")
    with client.chat.completions.with_streaming_response.create(model="gpt-4o-mini", messages=HELLO) as response:
        assert response.parse().id == response_json("test_chat_completion_with_content.yaml")["id"]
    span = otel.only_span()
    assert span.status.status_code == StatusCode.UNSET
    assert span.attributes[semconv.OTEL_LLM_USAGE_MISSING] is True  # the body was the caller's to read


# --- streams ------------------------------------------------------------------------------------


@BOTH_MODES
def test_stream_exhausted(otel, server, client):
    name = "test_chat_completion_streaming.yaml"
    server.play(name)
    recorded = response_json(name)
    stream = client.chat.completions.create(
        model="gpt-4", messages=HELLO, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert len(chunks) == len(recorded)
    span = otel.only_span()
    usage = recorded[-1]["usage"]
    assert span.attributes[semconv.GEN_AI_REQUEST_STREAM] is True
    assert span.attributes[semconv.GEN_AI_RESPONSE_ID] == recorded[0]["id"]
    assert span.attributes[semconv.GEN_AI_RESPONSE_MODEL] == recorded[0]["model"]
    assert span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert span.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == usage["prompt_tokens"]
    assert span.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == usage["completion_tokens"]
    assert span.attributes[semconv.OTEL_LLM_STREAM_CHUNKS] == len(chunks)
    ttfc = span.attributes[semconv.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK]
    assert 0 < ttfc < (span.end_time - span.start_time) / 1e9
    attrs = {**base_attributes(server, "gpt-4"), semconv.GEN_AI_RESPONSE_MODEL: recorded[0]["model"]}
    (first,), (per_chunk,) = chunk_points(otel)
    assert first.count == 1 and abs(first.sum - ttfc) < 1e-6
    assert tuple(first.explicit_bounds) == semconv.DURATION_BUCKETS
    # one record per chunk after the first (semconv), not one mean per stream
    assert per_chunk.count == len(chunks) - 1 > 1
    assert 0 <= per_chunk.sum < (span.end_time - span.start_time) / 1e9 - ttfc
    assert tuple(per_chunk.explicit_bounds) == semconv.CHUNK_BUCKETS
    assert dict(first.attributes) == dict(per_chunk.attributes) == attrs
    assert [dict(p.attributes) for p in duration_points(otel)] == [attrs]
    assert_token_metrics(otel, attrs, usage["prompt_tokens"], usage["completion_tokens"])


def test_async_stream_exhausted(otel, server):
    server.play("test_async_chat_completion_streaming.yaml")

    async def call():
        async with aclient(server) as c:
            stream = await c.chat.completions.create(
                model="gpt-4", messages=HELLO, stream=True, stream_options={"include_usage": True}
            )
            return [chunk async for chunk in stream]

    chunks = asyncio.run(call())
    span = otel.only_span()
    assert span.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == chunks[-1].usage.completion_tokens
    assert span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert_traceparent_is(span, server.received[-1])


def test_stream_of_two_choices(otel, server, client):
    server.play("test_chat_completion_multiple_choices_streaming.yaml")
    chunks = list(
        client.chat.completions.create(
            model="gpt-4o-mini", messages=HELLO, n=2, stream=True, stream_options={"include_usage": True}
        )
    )
    span = otel.only_span()
    reasons = {c.index: c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason}
    assert span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == (reasons[0], reasons[1])
    assert span.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == chunks[-1].usage.completion_tokens


@BOTH_MODES
def test_stream_without_usage_records_no_token_metric_or_zero_of_unknown_modality(otel, server, client):
    server.play("test_chat_completion_streaming_not_complete.yaml")
    chunks = list(client.chat.completions.create(model="gpt-4", messages=HELLO, stream=True))
    span = otel.only_span()
    assert span.attributes[semconv.OTEL_LLM_USAGE_MISSING] is True
    assert semconv.GEN_AI_USAGE_INPUT_TOKENS not in span.attributes
    attrs = {**base_attributes(server, "gpt-4"), semconv.GEN_AI_RESPONSE_MODEL: chunks[0].model}
    assert_token_metrics(otel, attrs, None, None)


def _abandoned(span, reasons=("error",)):
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes[semconv.ERROR_TYPE] == semconv.ERROR_STREAM_ABANDONED
    assert span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == reasons


@BOTH_MODES
def test_stream_break_then_close(otel, server, client):
    server.play("test_chat_completion_streaming.yaml")
    stream = client.chat.completions.create(model="gpt-4", messages=HELLO, stream=True)
    for index, _ in enumerate(stream):
        if index == 1:
            break
    assert otel.finished() == []  # still open: the caller may go on reading
    stream.close()
    stream.close()
    span = otel.only_span()
    _abandoned(span)
    assert span.attributes[semconv.OTEL_LLM_STREAM_CHUNKS] == 2
    (duration,) = duration_points(otel)
    assert duration.count == 1 and duration.attributes[semconv.ERROR_TYPE] == semconv.ERROR_STREAM_ABANDONED
    # abandoned before its usage: v1.41 records no tokens, latest 0 of modality unknown, with the error.type
    assert_token_metrics(otel, dict(duration.attributes), None, None)
    assert (
        duration.attributes[semconv.GEN_AI_RESPONSE_MODEL]
        == response_json("test_chat_completion_streaming.yaml")[0]["model"]
    )


def test_stream_context_manager_exit_early(otel, server, client):
    server.play("test_chat_completion_with_context_manager_streaming.yaml")
    with client.chat.completions.create(model="gpt-4o-mini", messages=HELLO, stream=True) as stream:
        next(stream)
        next(stream)
    _abandoned(otel.only_span())


def test_stream_read_to_the_last_finish_reason_is_not_abandoned(otel, server, client):
    server.play("test_chat_completion_streaming.yaml")
    with client.chat.completions.create(
        model="gpt-4", messages=HELLO, stream=True, stream_options={"include_usage": True}
    ) as stream:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                break  # the usage trailer is never read
    span = otel.only_span()
    assert span.status.status_code == StatusCode.UNSET
    assert span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)


def test_stream_garbage_collected(otel, server, client):
    server.play("test_chat_completion_streaming.yaml")
    stream = client.chat.completions.create(model="gpt-4", messages=HELLO, stream=True)
    next(stream)
    del stream
    gc.collect()
    # ended on the finalizer thread, not inside __del__ (otel_llm/finalizer.py)
    deadline = time.monotonic() + 30
    while not otel.finished() and time.monotonic() < deadline:
        time.sleep(0.01)
    span = otel.only_span()
    _abandoned(span)
    assert span.status.description == "stream garbage-collected before its end"


def test_stream_helper_exhausted_and_exited_early(otel, server, client):
    server.play("test_chat_completion_streaming.yaml", times=2)
    with client.chat.completions.stream(
        model="gpt-4", messages=HELLO, stream_options={"include_usage": True}
    ) as stream:
        final = stream.get_final_completion()
    span = otel.only_span()
    assert span.status.status_code == StatusCode.UNSET
    assert span.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == final.usage.completion_tokens
    otel.spans.clear()
    with client.chat.completions.stream(model="gpt-4", messages=HELLO) as stream:
        for index, _event in enumerate(stream):
            if index == 2:
                break
    span = otel.only_span()  # ended at the `with` exit (stream still referenced: not by GC)
    _abandoned(span)
    assert stream is not None


def test_async_stream_helper_exit_early(otel, server):
    server.play("test_async_chat_completion_streaming.yaml")

    async def call():
        async with aclient(server) as c:
            async with c.chat.completions.stream(model="gpt-4", messages=HELLO) as stream:
                async for _event in stream:
                    break
            return stream

    stream = asyncio.run(call())
    _abandoned(otel.only_span())
    assert stream is not None


def test_exception_mid_stream(otel, server, client):
    server.play("test_chat_completion_streaming.yaml")
    server.cut_after_events = 3
    server.event_delay = 0.001
    stream = client.chat.completions.create(model="gpt-4", messages=HELLO, stream=True)
    with pytest.raises(Exception) as raised:
        for _ in stream:
            pass
    span = otel.only_span()
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes[semconv.ERROR_TYPE] == type(raised.value).__qualname__
    assert span.attributes[semconv.OTEL_LLM_STREAM_CHUNKS] == 3
    assert span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("error",)


@BOTH_MODES
def test_async_stream_cancelled(otel, server):
    server.play("test_async_chat_completion_streaming.yaml")
    server.event_delay = 0.2
    got = []

    async def consume(c):
        stream = await c.chat.completions.create(model="gpt-4", messages=HELLO, stream=True)
        async for chunk in stream:
            got.append(chunk)

    async def main():
        async with aclient(server) as c:
            task = asyncio.create_task(consume(c))
            while not got:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    span = otel.only_span()
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes[semconv.ERROR_TYPE] == "CancelledError"
    assert span.attributes[semconv.OTEL_LLM_STREAM_CHUNKS] == len(got)
    attrs = {
        **base_attributes(server, "gpt-4"),
        semconv.GEN_AI_RESPONSE_MODEL: got[0].model,
        semconv.ERROR_TYPE: "CancelledError",
    }
    assert [dict(p.attributes) for p in duration_points(otel)] == [attrs]
    assert_token_metrics(otel, attrs, None, None)


@BOTH_MODES
def test_a_stream_that_fails_after_its_usage_records_the_usage(otel, server, client):
    """The usage chunk arrived, then the stream failed: the tokens it reported are recorded (both modes),
    on points that carry the error.type."""
    usage = {
        "prompt_tokens": 12,
        "completion_tokens": 2,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {"reasoning_tokens": 1},
    }
    chunks = [
        {
            "id": "c1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "gpt-4-0613",
            "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}],
        },
        {
            "id": "c1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "gpt-4-0613",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        },
        {
            "id": "c1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "gpt-4-0613",
            "choices": [],
            "usage": usage,
        },
        {"error": {"message": "upstream went away"}},
    ]
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    server.queue.append({"status": 200, "headers": {"content-type": "text/event-stream"}, "body": body})
    got = []
    with pytest.raises(openai.APIError):
        for chunk in client.chat.completions.create(
            model="gpt-4", messages=HELLO, stream=True, stream_options={"include_usage": True}
        ):
            got.append(chunk)
    assert got[-1].usage.prompt_tokens == 12
    span = otel.only_span()
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes[semconv.ERROR_TYPE] == "APIError"
    assert span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert {k: v for k, v in span.attributes.items() if k.startswith("gen_ai.usage.")} == {
        semconv.GEN_AI_USAGE_INPUT_TOKENS: 12,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 2,
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 4,
        semconv.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS: 1,
    }
    assert semconv.OTEL_LLM_USAGE_MISSING not in span.attributes
    attrs = {
        **base_attributes(server, "gpt-4"),
        semconv.GEN_AI_RESPONSE_MODEL: "gpt-4-0613",
        semconv.ERROR_TYPE: "APIError",
    }
    assert [dict(p.attributes) for p in duration_points(otel)] == [attrs]
    assert_token_metrics(otel, attrs, 12, 2, cache_read=4, reasoning=1)


# --- include_usage, propagation, content, safety ------------------------------------------------


def test_include_usage_option_adds_usage_and_hides_its_chunk(server, client):
    otel = Otel(include_usage=True)
    try:
        name = "test_chat_completion_streaming.yaml"
        server.play(name, times=2)
        options = {"continuous_usage_stats": False}
        chunks = list(
            client.chat.completions.create(model="gpt-4", messages=HELLO, stream=True, stream_options=options)
        )
        assert options == {"continuous_usage_stats": False}
        assert server.received[-1].json()["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
        recorded = response_json(name)
        assert len(chunks) == len(recorded) - 1 and all(c.choices for c in chunks)
        span = otel.only_span()
        assert span.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == recorded[-1]["usage"]["completion_tokens"]
        # an explicit choice of the caller is kept
        list(
            client.chat.completions.create(
                model="gpt-4", messages=HELLO, stream=True, stream_options={"include_usage": False}
            )
        )
        assert server.received[-1].json()["stream_options"] == {"include_usage": False}
    finally:
        otel.close()


def test_include_usage_is_off_by_default(otel, server, client):
    server.play("test_chat_completion_streaming_not_complete.yaml")
    list(client.chat.completions.create(model="gpt-4", messages=HELLO, stream=True))
    assert "stream_options" not in server.received[-1].json()


def test_baggage_goes_out_with_the_trace_context(otel, server, client):
    server.play("test_chat_completion_with_content.yaml")
    token = context.attach(baggage.set_baggage(semconv.TENANT_ID, "acme"))
    try:
        client.chat.completions.create(model="gpt-4o-mini", messages=HELLO)
    finally:
        context.detach(token)
    assert server.received[-1].headers["baggage"] == [f"{semconv.TENANT_ID}=acme"]


def test_parent_is_the_current_span(otel, server, client):
    server.play("test_chat_completion_with_content.yaml")
    tracer = otel.tracer_provider.get_tracer("app")
    with tracer.start_as_current_span("handler") as parent:
        client.chat.completions.create(model="gpt-4o-mini", messages=HELLO)
    child = [s for s in otel.finished() if s.name.startswith("chat")][0]
    assert child.parent.span_id == parent.get_span_context().span_id
    assert child.context.trace_id == parent.get_span_context().trace_id


def test_a_callers_traceparent_is_respected(otel, server, client):
    server.play("test_chat_completion_with_content.yaml")
    theirs = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    client.chat.completions.create(model="gpt-4o-mini", messages=HELLO, extra_headers={"TraceParent": theirs})
    assert server.received[-1].headers["traceparent"] == [theirs]


@pytest.mark.parametrize("sync", [True, False])
def test_with_httpx_instrumentation_context_goes_out_once(otel, server, sync):
    from opentelemetry.instrumentation.httpx import HTTPX2ClientInstrumentor

    HTTPX2ClientInstrumentor().instrument(tracer_provider=otel.tracer_provider)
    try:
        server.play("test_chat_completion_with_content.yaml")
        if sync:
            with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0) as c:
                c.chat.completions.create(model="gpt-4o-mini", messages=HELLO)
        else:

            async def call():
                async with aclient(server) as c:
                    await c.chat.completions.create(model="gpt-4o-mini", messages=HELLO)

            asyncio.run(call())
    finally:
        HTTPX2ClientInstrumentor().uninstrument()
    spans = {s.kind: s for s in otel.finished()}
    genai, http = spans[SpanKind.CLIENT], None
    http_spans = [s for s in otel.finished() if s.name == "POST"]
    assert len(http_spans) == 1, [s.name for s in otel.finished()]
    http = http_spans[0]
    genai = [s for s in otel.finished() if s.name == "chat gpt-4o-mini"][0]
    assert http.parent.span_id == genai.context.span_id
    assert_traceparent_is(http, server.received[-1])


def test_content_is_not_captured_by_default(otel, server, client):
    server.play("test_chat_completion_with_content.yaml")
    client.chat.completions.create(model="gpt-4o-mini", messages=HELLO)
    attributes = otel.only_span().attributes
    assert semconv.GEN_AI_INPUT_MESSAGES not in attributes
    assert semconv.GEN_AI_OUTPUT_MESSAGES not in attributes
    assert "Say this is a test" not in json.dumps(dict(attributes))


def test_content_capture_opt_in_env(monkeypatch, server, client):
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "span_only")
    otel = Otel()
    try:
        name = "test_chat_completion_tool_calls_with_content.yaml"
        server.play(name)
        request = json.loads(_request_body(name))
        result = client.chat.completions.create(
            model="gpt-4o-mini", messages=request["messages"], tools=request["tools"]
        )
        span = otel.only_span()
        assert json.loads(span.attributes[semconv.GEN_AI_INPUT_MESSAGES]) == [
            {"role": "system", "parts": [{"type": "text", "content": "You're a helpful assistant."}]},
            {
                "role": "user",
                "parts": [{"type": "text", "content": "What's the weather in Seattle and San Francisco today?"}],
            },
        ]
        calls = result.choices[0].message.tool_calls
        assert json.loads(span.attributes[semconv.GEN_AI_OUTPUT_MESSAGES]) == [
            {
                "role": "assistant",
                "finish_reason": "tool_calls",
                "parts": [
                    {"type": "tool_call", "id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                    for c in calls
                ],
            }
        ]
        otel.spans.clear()
        server.queue.clear()  # the cassette's second exchange is not used here
        server.play("test_chat_completion_streaming.yaml")
        chunks = list(client.chat.completions.create(model="gpt-4", messages=HELLO, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert json.loads(otel.only_span().attributes[semconv.GEN_AI_OUTPUT_MESSAGES]) == [
            {"role": "assistant", "parts": [{"type": "text", "content": text}], "finish_reason": "stop"}
        ]
        assert_no_secret(otel)
    finally:
        otel.close()


def test_suppressed_instrumentation_makes_no_span(otel, server, client):
    server.play("test_chat_completion_with_content.yaml")
    with suppress_instrumentation():
        client.chat.completions.create(model="gpt-4o-mini", messages=HELLO)
    assert otel.finished() == []


def test_uninstrument_restores_openai(server, client):
    import wrapt
    from openai.resources.chat.completions import completions

    def wrapped(cls):
        return isinstance(vars(cls)["create"], wrapt.FunctionWrapper)

    otel = Otel()
    try:
        assert wrapped(completions.Completions) and wrapped(completions.AsyncCompletions)
    finally:
        otel.close()
    assert not wrapped(completions.Completions) and not wrapped(completions.AsyncCompletions)
    server.play("test_chat_completion_with_content.yaml")
    client.chat.completions.create(model="gpt-4o-mini", messages=HELLO)
    assert otel.finished() == []
    assert "traceparent" not in server.received[-1].headers


def test_a_failing_instrumentation_never_breaks_the_call(otel, server, client, monkeypatch):
    from otel_llm.openai import telemetry

    def broken(self, chunk):
        raise RuntimeError("bug in otel-llm")

    from otel_llm import warn

    monkeypatch.setattr(telemetry.Invocation, "on_chunk", broken)
    monkeypatch.setattr(telemetry.Invocation, "end_with_response", broken)
    server.play("test_chat_completion_streaming.yaml")
    server.play("test_chat_completion_with_content.yaml")
    before = warn.failures().get("openai stream chunk", 0)
    chunks = list(client.chat.completions.create(model="gpt-4", messages=HELLO, stream=True))
    assert len(chunks) == len(response_json("test_chat_completion_streaming.yaml"))
    assert warn.failures()["openai stream chunk"] - before == len(chunks)  # counted, each one
    assert client.chat.completions.create(model="gpt-4o-mini", messages=HELLO).choices
    assert len(otel.finished()) == 2  # each span still ended once


def _request_body(cassette):
    import yaml
    from openai_replay import CASSETTES

    return yaml.safe_load((CASSETTES / cassette).read_text())["interactions"][0]["request"]["body"]


def test_a_wrapped_method_calling_another_makes_one_span(otel, server, client):
    from openai.resources.chat.completions import completions

    def parse_via_create(self, **kwargs):  # an openai helper built on create, as older releases had
        return self.create(**kwargs)

    wrapped_parse = vars(completions.Completions)["parse"]
    inner = wrapped_parse.__wrapped__
    try:
        wrapped_parse.__wrapped__ = parse_via_create
    except (AttributeError, TypeError):
        pytest.skip("wrapt does not allow swapping the wrapped function")
    try:
        server.play("test_chat_completion_with_content.yaml")
        client.chat.completions.parse(model="gpt-4o-mini", messages=HELLO)
    finally:
        wrapped_parse.__wrapped__ = inner
    assert len(otel.finished()) == 1


def test_captured_content_is_redacted_and_counted(monkeypatch, server, client):
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "span_only")
    otel = Otel()
    try:
        server.play("test_chat_completion_with_content.yaml")
        said = (
            "I am jane.doe@example.com, card 4111 1111 1111 1111, phone +1 415 555 2671; "
            "not a card: 4111 1111 1111 1112"
        )
        client.chat.completions.create(
            model="gpt-4o-mini",
            messages=[
                {"role": "user", "content": said},
                {"role": "tool", "tool_call_id": "call_1", "content": "reach me at ops@example.org"},
            ],
        )
        span = otel.only_span()
        assert json.loads(span.attributes[semconv.GEN_AI_INPUT_MESSAGES]) == [
            {
                "role": "user",
                "parts": [
                    {
                        "type": "text",
                        "content": (
                            "I am <EMAIL>, card <PAYMENT_CARD>, phone <PHONE>; not a card: 4111 1111 1111 1112"
                        ),
                    }
                ],
            },
            {
                "role": "tool",
                "parts": [{"type": "tool_call_response", "id": "call_1", "response": "reach me at <EMAIL>"}],
            },
        ]
        assert "example.com" not in json.dumps(dict(span.attributes))
        counted = {p.attributes[semconv.REDACTION_RULE]: p.value for p in otel.points(semconv.REDACTIONS)}
        assert counted == {
            semconv.REDACTION_RULE_EMAIL: 2,
            semconv.REDACTION_RULE_PAYMENT_CARD: 1,
            semconv.REDACTION_RULE_PHONE: 1,
        }
    finally:
        otel.close()


# --- error text is redacted: a provider's error can echo the key, the model name or the prompt ----

LEAKED_KEY = "sk-proj-" + "Q7r2Lx9Vt4Mz8Kp3Hw6Nc1Bd"


def assert_key_nowhere(otel, key=LEAKED_KEY):
    """Not in any span's name, attributes, status or events, nor in any metric point."""
    for span in otel.finished():
        exported = json.dumps(
            [
                span.name,
                dict(span.attributes),
                span.status.description,
                [(e.name, dict(e.attributes)) for e in span.events],
            ],
            default=str,
        )
        assert key not in exported and key[-8:] not in exported, exported
    assert key[-8:] not in otel.reader.get_metrics_data().to_json()


def error_reply(status: int, message: str) -> dict:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": None}})
    return {"status": status, "headers": {"content-type": "application/json"}, "body": body.encode()}


def test_an_error_body_echoing_the_key_is_redacted_in_status_and_exception_event(otel, server, client):
    server.queue.append(error_reply(401, f"Incorrect API key provided: {LEAKED_KEY}. Find yours at ..."))
    with pytest.raises(openai.AuthenticationError) as raised:
        client.chat.completions.create(model="gpt-4o-mini", messages=HELLO)
    assert LEAKED_KEY in str(raised.value)  # the caller's exception is left as it is
    span = otel.only_span()
    assert span.attributes[semconv.ERROR_TYPE] == "401"
    assert "<SECRET>" in span.status.description
    (event,) = span.events
    assert event.name == "exception"
    assert event.attributes["exception.type"] == "openai.AuthenticationError"
    assert "Incorrect API key provided: <SECRET>" in event.attributes["exception.message"]
    assert "<SECRET>" in event.attributes["exception.stacktrace"]
    assert "AuthenticationError" in event.attributes["exception.stacktrace"]
    assert_key_nowhere(otel)


@BOTH_MODES
def test_a_key_passed_as_the_model_is_redacted_on_the_span_and_metrics_when_the_call_fails(otel, server, client):
    server.queue.append(error_reply(404, f"The model `{LEAKED_KEY}` does not exist"))
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=LEAKED_KEY, messages=HELLO)
    span = otel.only_span()
    assert span.name == "chat <SECRET>"
    assert span.attributes[semconv.GEN_AI_REQUEST_MODEL] == "<SECRET>"
    (duration,) = duration_points(otel)
    assert duration.attributes[semconv.GEN_AI_REQUEST_MODEL] == "<SECRET>"
    # latest mode's zero-token points carry the redacted model too
    assert_token_metrics(otel, dict(duration.attributes), None, None)
    assert_key_nowhere(otel)


def test_a_stream_error_event_echoing_the_key_is_redacted(otel, server, client):
    events = (
        b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4","choices":'
        b'[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
        b'data: {"error": {"message": "upstream rejected key ' + LEAKED_KEY.encode() + b'"}}\n\n'
    )
    server.queue.append({"status": 200, "headers": {"content-type": "text/event-stream"}, "body": events})
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(model="gpt-4", messages=HELLO, stream=True):
            pass
    span = otel.only_span()
    assert span.status.status_code == StatusCode.ERROR
    assert "<SECRET>" in span.status.description
    assert_key_nowhere(otel)


def test_async_error_is_redacted(otel, server):
    server.queue.append(error_reply(400, f"bad request for {LEAKED_KEY}"))

    async def call():
        async with aclient(server) as c:
            await c.chat.completions.create(model="gpt-4o-mini", messages=HELLO)

    with pytest.raises(openai.BadRequestError):
        asyncio.run(call())
    assert "<SECRET>" in otel.only_span().status.description
    assert_key_nowhere(otel)


def test_stop_sequences_are_redacted(otel, server, client):
    server.play("test_chat_completion_with_content.yaml")
    client.chat.completions.create(model="gpt-4o-mini", messages=HELLO, stop=["\n", LEAKED_KEY])
    assert otel.only_span().attributes[semconv.GEN_AI_REQUEST_STOP_SEQUENCES] == ("\n", "<SECRET>")
    assert_key_nowhere(otel)


def test_error_text_is_redacted_before_it_is_cut_and_read_within_a_bound():
    from otel_llm.redaction import MAX_ERROR_TEXT, redacted_error

    text = "x " * (MAX_ERROR_TEXT // 2 - 10) + LEAKED_KEY + " tail"
    assert len(text) > MAX_ERROR_TEXT and text.index(LEAKED_KEY) < MAX_ERROR_TEXT < text.index(" tail")
    out = redacted_error(text)
    assert LEAKED_KEY[:12] not in out and out.endswith("…")  # the word cut at the bound is dropped whole
    end = redacted_error(LEAKED_KEY + " y" * MAX_ERROR_TEXT, keep_end=True)
    assert "sk-" not in end and LEAKED_KEY[-8:] not in end
    assert redacted_error(f"short {LEAKED_KEY}") == "short <SECRET>"
