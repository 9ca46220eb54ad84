"""Offline vllm.LLM and AsyncLLM used directly get the same GenAI span and phases.

Runs the real engine in this test process, instrumented programmatically with in-memory
exporters (no opentelemetry-instrument)."""

import asyncio
import uuid

import pytest
from helpers import InMemoryOtel

from devkit.devserver import DEFAULT_MODEL_DIR, KV_CACHE_BYTES
from devkit.tiny_model import MODEL_NAME, build
from otel_llm import semconv
from otel_llm.vllm import VLLMInstrumentor


@pytest.fixture(scope="module")
def telemetry(tmp_path_factory):
    import os

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    otel = InMemoryOtel()
    instrumentor = VLLMInstrumentor()
    instrumentor.instrument(tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider)
    yield otel.spans, otel.reader
    instrumentor.uninstrument()


def _engine_kwargs():
    return dict(
        model=str(build(DEFAULT_MODEL_DIR)),
        served_model_name=MODEL_NAME,
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
    )


def _assert_offline_span(spans, genai, prompt_tokens, output_tokens):
    attrs = genai.attributes
    assert attrs[semconv.GEN_AI_OPERATION_NAME] == semconv.OP_TEXT_COMPLETION
    assert attrs[semconv.GEN_AI_PROVIDER_NAME] == semconv.PROVIDER_VLLM
    assert attrs[semconv.GEN_AI_REQUEST_MODEL] == MODEL_NAME
    assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == prompt_tokens
    assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == output_tokens
    assert attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    kids = sorted(
        (s for s in spans if s.parent and s.parent.span_id == genai.context.span_id), key=lambda s: s.start_time
    )
    assert [k.name for k in kids] == list(semconv.PHASE_SPANS)
    previous = genai.start_time
    for kid in kids:
        assert previous <= kid.start_time <= kid.end_time <= genai.end_time
        previous = kid.end_time
    for kid, key in zip(kids, (semconv.VLLM_QUEUE_SECONDS, semconv.VLLM_PREFILL_SECONDS, semconv.VLLM_DECODE_SECONDS)):
        assert abs((kid.end_time - kid.start_time) / 1e9 - attrs[key]) < 2e-6


def test_offline_llm_generate(telemetry):
    from vllm import LLM, SamplingParams

    exporter, _ = telemetry
    llm = LLM(**_engine_kwargs())  # vLLM defaults disable_log_stats=True; we keep stats on
    try:
        params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0)
        outputs = llm.generate(["hello world", "the quick brown fox jumps"], params)
    finally:
        llm.llm_engine.engine_core.shutdown()
    spans = exporter.get_finished_spans()
    genai = [s for s in spans if s.name == f"text_completion {MODEL_NAME}"]
    assert len(genai) == 2
    by_id = {s.attributes[semconv.VLLM_REQUEST_ID]: s for s in genai}
    for output in outputs:
        span = by_id[output.request_id]
        _assert_offline_span(spans, span, len(output.prompt_token_ids), len(output.outputs[0].token_ids))
        assert span.attributes[semconv.GEN_AI_REQUEST_MAX_TOKENS] == 5
        assert span.attributes[semconv.GEN_AI_REQUEST_TEMPERATURE] == 0.0


def test_async_llm_direct_with_stats_disabled(telemetry):
    """AsyncLLM with disable_log_stats=True: our stat-logger plugin keeps phase timing on."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    exporter, _ = telemetry
    exporter.clear()

    async def run():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**_engine_kwargs(), disable_log_stats=True))
        try:
            final = None
            request_id = str(uuid.uuid4())
            async for output in engine.generate(
                "tokens and traces", SamplingParams(max_tokens=6, ignore_eos=True), request_id
            ):
                final = output
            return final
        finally:
            engine.shutdown()

    final = asyncio.run(run())
    spans = exporter.get_finished_spans()
    (genai,) = [s for s in spans if s.name == f"text_completion {MODEL_NAME}"]
    _assert_offline_span(spans, genai, len(final.prompt_token_ids), len(final.outputs[0].token_ids))
    assert genai.attributes[semconv.VLLM_REQUEST_ID] == final.request_id
