"""Process models and flags: spawned API servers, spawned engine, --disable-log-stats and
vLLM's own --otlp-traces-endpoint, all at once on one real server."""

import openai
import pytest
from helpers import (
    LONG_PROMPT,
    Traceparent,
    assert_server_tree,
    assert_usage,
    export_processes,
    request_trace,
    start_server,
)

from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv


@pytest.fixture(scope="module")
def server(receiver, tmp_path_factory):
    srv = start_server(
        receiver,
        tmp_path_factory,
        "spawn",
        extra_args=[
            "--api-server-count",
            "2",
            "--disable-log-stats",
            # vLLM's native tracing pointed at the same receiver: must not trace requests twice
            "--otlp-traces-endpoint",
            receiver.endpoint + "/v1/traces",
        ],
        env={"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
    )
    yield srv
    srv.stop()


def _one_request(url):
    tp = Traceparent()
    # a new connection each time, so that every API server gets to accept some
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
        response = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=3,
            extra_body={"ignore_eos": True},
            extra_headers=tp.headers(),
        )
    return tp, response


def test_every_api_server_traces_and_degrades_without_engine_events(server, receiver):
    from concurrent.futures import ThreadPoolExecutor

    pids = set()
    for _ in range(6):
        with ThreadPoolExecutor(8) as pool:  # concurrent connections spread over the API servers
            results = list(pool.map(_one_request, [server.url] * 8))
        for tp, response in results:
            spans = request_trace(receiver, tp.trace_id, phases=0)
            # With --api-server-count > 1 the launcher starts the engine core itself, with stats
            # off: no queue/schedule timestamps, so no phase spans; the rest is intact.
            _, genai, _ = assert_server_tree(spans, parent_span_id=tp.span_id, phases=())
            assert_usage(genai, response.usage)
            attrs = genai.attributes
            assert attrs[semconv.VLLM_PHASE_TIMING_UNAVAILABLE] is True
            assert semconv.VLLM_QUEUE_SECONDS not in attrs and semconv.VLLM_PREFILL_SECONDS not in attrs
            assert 0 < attrs[semconv.VLLM_DECODE_SECONDS] < genai.duration_s
            assert 0 < attrs[semconv.VLLM_TTFT_SECONDS] < genai.duration_s
            assert genai.resource["service.name"] == semconv.SERVICE_NAME_DEFAULT
            pids.add(genai.resource["process.pid"])
        if len(pids) == 2:
            break
    # both spawned API servers were instrumented (they inherit opentelemetry-instrument)
    assert len(pids) == 2
    # each with its own export process, whose spans carry the API server's resource
    assert sorted(export_processes(server).values()) == sorted(pids)


def test_native_llm_request_span_suppressed(server, receiver):
    names = {s.name for s in receiver.spans}
    assert "llm_request" not in names
    # vLLM's startup spans from the spawned engine core still arrive
    assert "EngineCoreProc init" in names


def test_one_clear_warning_per_api_server(server):
    lines = [line for line in server.log_path.read_text(errors="replace").splitlines() if "otel-llm:" in line]
    assert len(lines) == 2, lines
    assert all("--disable-log-stats" in line for line in lines)


def test_cached_tokens_without_prompt_tokens_details(server, receiver):
    """vLLM omits prompt_tokens_details without --enable-prompt-tokens-details; spans still count."""
    cached = []
    for _ in range(2):
        tp = Traceparent()
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            response = client.completions.create(
                model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=2, extra_headers=tp.headers()
            )
        assert response.usage.prompt_tokens_details is None
        (genai,) = [
            s for s in request_trace(receiver, tp.trace_id, phases=0) if semconv.GEN_AI_OPERATION_NAME in s.attributes
        ]
        assert genai.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == response.usage.prompt_tokens
        cached.append(genai.attributes[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS])
    # the second send hits the prefix cache of the shared engine, whichever API server took it
    assert 0 < cached[1] < response.usage.prompt_tokens
