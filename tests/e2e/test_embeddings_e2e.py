"""/v1/embeddings on the tiny model served as a pooling model (`--runner pooling --convert embed`)."""

import openai
import pytest
from helpers import Traceparent, genai_spans, request_trace, start_server

from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv


@pytest.fixture(scope="module")
def server(receiver, tmp_path_factory):
    srv = start_server(receiver, tmp_path_factory, "embed", extra_args=["--runner", "pooling", "--convert", "embed"])
    yield srv
    srv.stop()


def test_embeddings_span_and_usage(server, receiver):
    tp = Traceparent()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    response = client.embeddings.create(
        model=MODEL_NAME, input=["hello world", "a second, longer input text"], extra_headers=tp.headers()
    )
    assert len(response.data) == 2
    spans = request_trace(receiver, tp.trace_id, phases=4)
    (genai,) = genai_spans(spans)
    assert genai.name == f"embeddings {MODEL_NAME}"
    attrs = genai.attributes
    assert attrs[semconv.GEN_AI_OPERATION_NAME] == semconv.OP_EMBEDDINGS
    assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == response.usage.prompt_tokens
    assert semconv.GEN_AI_USAGE_OUTPUT_TOKENS not in attrs
    assert semconv.GEN_AI_RESPONSE_FINISH_REASONS not in attrs
    assert attrs[semconv.VLLM_ENGINE_REQUESTS] == 2
    # one queue/prefill chain per input; pooling has no decode
    kids = [s for s in spans if s.parent_span_id == genai.span_id]
    assert sorted(k.name for k in kids) == sorted([semconv.SPAN_QUEUE, semconv.SPAN_PREFILL] * 2)
    (http,) = [s for s in spans if s.kind == "SERVER"]
    assert genai.parent_span_id == http.span_id and http.parent_span_id == tp.span_id
    for kid in kids:
        assert genai.start_ns <= kid.start_ns <= kid.end_ns <= genai.end_ns
