"""`opentelemetry-instrument vllm serve` on the real vLLM CPU engine, OTLP to an in-test receiver."""

import json
import time
import urllib.request

import openai
import pytest
from helpers import (
    LONG_PROMPT,
    Traceparent,
    assert_phase_durations_match,
    assert_server_tree,
    assert_usage,
    genai_spans,
    request_trace,
    start_server,
)

from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv


@pytest.fixture(scope="module")
def server(receiver, tmp_path_factory):
    # gRPC (the SDK's default OTLP protocol, which the forked engine processes inherit), and a
    # Prometheus reader beside OTLP: our metrics then also appear on vLLM's own /metrics.
    srv = start_server(
        receiver,
        tmp_path_factory,
        "main",
        extra_args=["--enable-prompt-tokens-details"],
        grpc=True,
        env={"OTEL_METRICS_EXPORTER": "otlp,prometheus_vllm"},
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test-secret", max_retries=0)


def test_chat_trace_tree_attributes_and_usage(server, client, receiver, traceparent):
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=7,
        temperature=0,
        top_p=0.9,
        seed=42,
        extra_body={"ignore_eos": True, "top_k": 5},
        extra_headers=traceparent.headers(),
    )
    spans = request_trace(receiver, traceparent.trace_id)
    http, genai, kids = assert_server_tree(spans, parent_span_id=traceparent.span_id)
    assert http.trace_id == traceparent.trace_id
    assert genai.name == f"chat {MODEL_NAME}"
    attrs = genai.attributes
    assert attrs[semconv.GEN_AI_OPERATION_NAME] == semconv.OP_CHAT
    assert attrs[semconv.GEN_AI_PROVIDER_NAME] == semconv.PROVIDER_VLLM
    assert attrs[semconv.GEN_AI_REQUEST_MODEL] == MODEL_NAME
    assert attrs[semconv.GEN_AI_RESPONSE_MODEL] == response.model == MODEL_NAME
    assert attrs[semconv.GEN_AI_RESPONSE_ID] == response.id
    assert attrs[semconv.VLLM_REQUEST_ID] == response.id
    assert attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == [response.choices[0].finish_reason] == ["length"]
    assert attrs[semconv.GEN_AI_REQUEST_MAX_TOKENS] == 7
    assert attrs[semconv.GEN_AI_REQUEST_TEMPERATURE] == 0.0
    assert attrs[semconv.GEN_AI_REQUEST_TOP_P] == 0.9
    assert attrs[semconv.GEN_AI_REQUEST_TOP_K] == 5
    assert attrs[semconv.GEN_AI_REQUEST_SEED] == 42
    assert semconv.GEN_AI_REQUEST_STREAM not in attrs
    assert semconv.GEN_AI_REQUEST_CHOICE_COUNT not in attrs
    assert semconv.ERROR_TYPE not in attrs and genai.status == "UNSET"
    assert_usage(genai, response.usage)
    assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 7
    assert_phase_durations_match(genai, kids)
    assert attrs[semconv.VLLM_PREEMPTIONS] == 0
    # engine TTFT = queue + prefill + the hand-offs around them, within the span
    assert attrs[semconv.VLLM_TTFT_SECONDS] >= attrs[semconv.VLLM_PREFILL_SECONDS]
    assert attrs[semconv.VLLM_TTFT_SECONDS] <= genai.duration_s
    # TPOT = decode / (output tokens - 1), as vLLM defines it
    assert attrs[semconv.VLLM_TPOT_SECONDS] == pytest.approx(attrs[semconv.VLLM_DECODE_SECONDS] / 6)
    # the API key never leaves the server
    assert "sk-test-secret" not in repr(spans)


def test_streaming_completion_usage_and_wire_ttft(server, client, receiver, traceparent):
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="OpenTelemetry traces show",
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        extra_headers=traceparent.headers(),
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    spans = request_trace(receiver, traceparent.trace_id)
    _, genai, kids = assert_server_tree(spans, parent_span_id=traceparent.span_id)
    attrs = genai.attributes
    assert genai.name == f"text_completion {MODEL_NAME}"
    assert attrs[semconv.GEN_AI_REQUEST_STREAM] is True
    assert attrs[semconv.GEN_AI_RESPONSE_ID] == chunks[0].id
    assert attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ["length"]
    assert_usage(genai, usage)
    assert usage.completion_tokens == 12
    assert_phase_durations_match(genai, kids)
    wire_ttft = attrs[semconv.VLLM_STREAM_TTFT_SECONDS]
    # the first chunk leaves after the engine produced the first token, and before the end
    assert 0 < wire_ttft < genai.duration_s
    prefill_end = kids[1].end_ns
    assert genai.start_ns + wire_ttft * 1e9 >= prefill_end - 1_000


def test_n_greater_than_one(server, client, receiver, traceparent):
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "two answers"}],
        max_tokens=5,
        n=2,
        temperature=0.8,
        extra_body={"ignore_eos": True},
        extra_headers=traceparent.headers(),
    )
    spans = request_trace(receiver, traceparent.trace_id, phases=6)
    (genai,) = genai_spans(spans)
    attrs = genai.attributes
    assert attrs[semconv.GEN_AI_REQUEST_CHOICE_COUNT] == 2
    assert attrs[semconv.VLLM_ENGINE_REQUESTS] == 2
    assert sorted(attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS]) == ["length", "length"]
    assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == response.usage.prompt_tokens
    assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == response.usage.completion_tokens == 10
    phases = [s for s in spans if s.parent_span_id == genai.span_id]
    assert sorted(s.name for s in phases) == sorted(semconv.PHASE_SPANS * 2)
    # one queue/prefill/decode chain per engine request, told apart by its id
    assert len({s.attributes[semconv.VLLM_REQUEST_ID] for s in phases}) == 2
    # the request's latency, not the sum over its engine requests: phases that follow each other
    # inside the span, and decode from the first token of any choice to the last token of any
    queue, prefill, decode = (
        attrs[k] for k in (semconv.VLLM_QUEUE_SECONDS, semconv.VLLM_PREFILL_SECONDS, semconv.VLLM_DECODE_SECONDS)
    )
    assert queue + prefill + decode <= genai.duration_s
    decodes = [s for s in phases if s.name == semconv.SPAN_DECODE]
    union = (max(s.end_ns for s in decodes) - min(s.start_ns for s in decodes)) / 1e9
    assert abs(decode - union) < 2e-6
    assert semconv.VLLM_PHASE_SPANS_OMITTED not in attrs


def test_many_choices_make_a_bounded_number_of_phase_spans(server, client, receiver, traceparent):
    from otel_llm.vllm.request_facts import MAX_PHASE_SPAN_CHAINS

    n = MAX_PHASE_SPAN_CHAINS + 6
    client.completions.create(
        model=MODEL_NAME, prompt="many", max_tokens=2, n=n, temperature=0.8, extra_headers=traceparent.headers()
    )
    spans = request_trace(receiver, traceparent.trace_id, phases=3 * MAX_PHASE_SPAN_CHAINS)
    (genai,) = genai_spans(spans)
    assert genai.attributes[semconv.VLLM_ENGINE_REQUESTS] == n
    assert genai.attributes[semconv.VLLM_PHASE_SPANS_OMITTED] == n - MAX_PHASE_SPAN_CHAINS
    time.sleep(1)  # (any late phase span would be exported within the 200 ms batch delay)
    phases = [s for s in receiver.traces()[traceparent.trace_id] if s.parent_span_id == genai.span_id]
    assert len(phases) == 3 * MAX_PHASE_SPAN_CHAINS
    attrs = genai.attributes
    assert (
        attrs[semconv.VLLM_QUEUE_SECONDS] + attrs[semconv.VLLM_PREFILL_SECONDS] + attrs[semconv.VLLM_DECODE_SECONDS]
    ) <= genai.duration_s


def test_prefix_cache_hits_equal_usage_cached_tokens(server, client, receiver):
    results = []
    for _ in range(2):
        tp = Traceparent()
        response = client.completions.create(
            model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=4, extra_headers=tp.headers()
        )
        (genai,) = genai_spans(request_trace(receiver, tp.trace_id))
        assert_usage(genai, response.usage)
        results.append((response.usage, genai))
    first, second = results
    assert first[0].prompt_tokens > 300
    cached = second[0].prompt_tokens_details.cached_tokens
    assert cached > 0
    assert second[1].attributes[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == cached
    # input tokens include the cached ones
    assert second[1].attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == second[0].prompt_tokens


def _post(server, path, payload: bytes, headers):
    request = urllib.request.Request(
        server.url + path, data=payload, method="POST", headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize(
    "case, path, payload, status, span_name, error_type",
    [
        # rejected by FastAPI before a handler: the error type of the response body
        ("bad json", "/v1/chat/completions", b'{"model": "tiny-llama", "messages": [', 400, "chat", "Bad Request"),
        # the handler returns an error response: its type
        (
            "unknown model",
            "/v1/chat/completions",
            json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            404,
            "chat no-such-model",
            "NotFoundError",
        ),
        # the handler raises: the exception class (vLLM turns it into a 400 BadRequestError)
        (
            "prompt over max-model-len",
            "/v1/completions",
            json.dumps({"model": MODEL_NAME, "prompt": LONG_PROMPT * 3, "max_tokens": 4}).encode(),
            400,
            f"text_completion {MODEL_NAME}",
            "VLLMValidationError",
        ),
    ],
)
def test_rejections_yield_error_spans(server, receiver, case, path, payload, status, span_name, error_type):
    tp = Traceparent()
    code, body = _post(server, path, payload, tp.headers())
    assert code == status, body
    spans = receiver.wait_for(
        lambda rx: (lambda s: s if genai_spans(s) and any(x.kind == "SERVER" for x in s) else None)(
            rx.traces().get(tp.trace_id, [])
        )
    )
    (http,) = [s for s in spans if s.kind == "SERVER"]
    (genai,) = genai_spans(spans)
    assert genai.parent_span_id == http.span_id
    assert http.parent_span_id == tp.span_id
    assert genai.name == span_name
    assert genai.status == "ERROR"
    assert genai.attributes[semconv.ERROR_TYPE] == error_type
    # old or new HTTP semconv names, per OTEL_SEMCONV_STABILITY_OPT_IN
    assert http.attributes.get("http.response.status_code", http.attributes.get("http.status_code")) == status


def test_no_incoming_context_still_one_trace(server, client, receiver):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "no parent"}], max_tokens=3
    )

    def find(rx):
        for spans in rx.traces().values():
            ids = [s.attributes.get(semconv.GEN_AI_RESPONSE_ID) for s in genai_spans(spans)]
            if response.id in ids and len(spans) == 5:
                return spans
        return None

    spans = receiver.wait_for(find)
    http, _, _ = assert_server_tree(spans)
    assert http.parent_span_id == ""


def test_tenant_from_header_and_baggage_on_spans_and_metrics(server, client, receiver):
    sent = {"t-alpha": [0, 0], "t-beta": [0, 0]}
    trace_ids = []
    for tenant, headers in (
        ("t-alpha", {"x-tenant-id": "t-alpha", "x-scene": "search"}),
        ("t-alpha", {"x-tenant-id": "t-alpha", "x-scene": "search"}),
        ("t-beta", {"baggage": "tenant.id=t-beta,tenant.scene=chatbot"}),
    ):
        tp = Traceparent()
        response = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": f"hi from {tenant}"}],
            max_tokens=3,
            extra_headers=tp.headers(**headers),
        )
        sent[tenant][0] += response.usage.prompt_tokens
        sent[tenant][1] += response.usage.completion_tokens
        trace_ids.append((tenant, tp.trace_id))
    for tenant, trace_id in trace_ids:
        (genai,) = genai_spans(request_trace(receiver, trace_id))
        assert genai.attributes[semconv.TENANT_ID] == tenant
        assert genai.attributes[semconv.TENANT_SCENE] == ("search" if tenant == "t-alpha" else "chatbot")

    def tokens(rx):
        found = {}
        for p in rx.latest_metrics():
            if p.name == semconv.SERVER_TOKEN_USAGE and p.attributes.get(semconv.TENANT_ID) in sent:
                key = (p.attributes[semconv.TENANT_ID], p.attributes[semconv.GEN_AI_TOKEN_TYPE])
                found[key] = found.get(key, 0) + p.value
        expected = {}
        for tenant, (inp, out) in sent.items():
            expected[(tenant, semconv.TOKEN_TYPE_INPUT)] = inp
            expected[(tenant, semconv.TOKEN_TYPE_OUTPUT)] = out
        return found if all(found.get(k) == v for k, v in expected.items()) else None

    found = receiver.wait_for(tokens, timeout=20)
    assert found[("t-beta", semconv.TOKEN_TYPE_CACHED_INPUT)] == 0


def test_metrics_buckets_exemplars_and_resource(server, client, receiver):
    client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=4, extra_body={"ignore_eos": True}
    )
    expected_bounds = {
        semconv.SERVER_REQUEST_DURATION: semconv.DURATION_BUCKETS,
        semconv.SERVER_TIME_TO_FIRST_TOKEN: semconv.TTFT_BUCKETS,
        semconv.SERVER_TIME_PER_OUTPUT_TOKEN: semconv.TPOT_BUCKETS,
    }

    def histograms(rx):
        points = {p.name: p for p in rx.latest_metrics() if p.name in expected_bounds}
        return points if len(points) == len(expected_bounds) else None

    points = receiver.wait_for(histograms, timeout=20)
    for name, bounds in expected_bounds.items():
        assert points[name].bounds == tuple(bounds)
        assert points[name].unit == semconv.UNIT_SECONDS
        assert points[name].attributes[semconv.GEN_AI_PROVIDER_NAME] == semconv.PROVIDER_VLLM
    exemplar_traces = {
        e["trace_id"]
        for batch in receiver.metric_batches
        for p in batch
        if p.name == semconv.SERVER_REQUEST_DURATION
        for e in p.exemplars
    }
    assert exemplar_traces and exemplar_traces <= set(receiver.traces())
    resource = points[semconv.SERVER_REQUEST_DURATION].resource
    assert resource["service.name"] == semconv.SERVICE_NAME_DEFAULT
    assert resource[semconv.RESOURCE_SERVED_MODEL] == MODEL_NAME
    assert resource["service.instance.id"].endswith(f":{server.port}")
    assert resource["process.pid"] > 0


def test_engine_counters_match_ours_and_no_instrumentation_errors(server, client, receiver):
    """vLLM's own counters and ours agree to the token, over every request this server served."""
    time.sleep(2.5)  # one more metric export after the last request

    def ours():
        totals = {}
        for p in receiver.latest_metrics():
            if p.name == semconv.SERVER_TOKEN_USAGE:
                t = p.attributes[semconv.GEN_AI_TOKEN_TYPE]
                totals[t] = totals.get(t, 0) + p.value
        return totals

    with urllib.request.urlopen(server.url + "/metrics") as r:
        text = r.read().decode()

    def vllm_counter(name):
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")
        )

    totals = ours()
    assert totals[semconv.TOKEN_TYPE_OUTPUT] == vllm_counter("vllm:generation_tokens_total")
    assert totals[semconv.TOKEN_TYPE_CACHED_INPUT] == vllm_counter("vllm:prompt_tokens_cached_total")
    # the OTel Prometheus reader shares vLLM's /metrics: our counter is there, equal to OTLP's
    ours_on_metrics = text.count(semconv.prometheus_metric(semconv.SERVER_TOKEN_USAGE) + "{")
    assert ours_on_metrics > 0
    assert vllm_counter(semconv.prometheus_metric(semconv.SERVER_TOKEN_USAGE)) == sum(totals.values())
    # vLLM's startup spans from the forked engine core and the worker arrive too: the OTLP/gRPC
    # exporter inherited across fork still works there
    names = {s.name for s in receiver.spans}
    assert {"EngineCoreProc init", "Worker init", "Load weights"} <= names
    log = server.log_path.read_text(errors="replace")
    assert "otel-llm:" not in log, [line for line in log.splitlines() if "otel-llm:" in line]
    assert "Traceback" not in log


def test_no_content_leaves_without_the_opt_in(server, receiver):
    """This module's server runs without OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT: none of
    the spans its requests made (chats, streams, errors) carries a prompt or a completion."""
    genai = genai_spans(receiver.spans)
    assert len(genai) > 10
    for span in genai:
        assert semconv.GEN_AI_INPUT_MESSAGES not in span.attributes, span.name
        assert semconv.GEN_AI_OUTPUT_MESSAGES not in span.attributes, span.name
