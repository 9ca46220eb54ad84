"""What vLLM knows about a request, on its span, its bill and the metrics, against what the real CPU
engine returned for the same request: its per-request `metrics` object (--enable-per-request-metrics,
in the response and on the usage chunk of a stream), the n-gram speculator's figures
(--per-request-spec-decode-metrics summary), and the session id (gen_ai.conversation.id) from the
body, the X-Session-ID header, or a header of OTEL_LLM_CONVERSATION_HEADERS."""

import json
import urllib.request

import pytest
from helpers import genai_spans, start_server

from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv
from otel_llm.billing import ledger

SPECULATOR = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
# a prompt that repeats itself: the n-gram speculator finds drafts in it
PROMPT = "a b c d a b c d a b c d a b c d"
CONVERSATION_HEADER = "x-conversation-id"
METRICS = []  # the `metrics` object of every response of the module


@pytest.fixture(scope="module")
def spool(tmp_path_factory):
    return tmp_path_factory.mktemp("usage")


@pytest.fixture(scope="module")
def vllm(receiver, tmp_path_factory, spool):
    srv = start_server(
        receiver,
        tmp_path_factory,
        "request-data",
        extra_args=(
            "--speculative-config",
            json.dumps(SPECULATOR),
            "--per-request-spec-decode-metrics",
            "summary",
            "--enable-per-request-metrics",
        ),
        env={"OTEL_LLM_USAGE_DIR": str(spool), "OTEL_LLM_CONVERSATION_HEADERS": CONVERSATION_HEADER},
    )
    yield srv
    srv.stop()


def post(vllm, path, body, headers=None, stream=False):
    request = urllib.request.Request(
        vllm.url + path,
        json.dumps({"model": MODEL_NAME, **body}).encode(),
        {"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        text = response.read().decode()
    if not stream:
        METRICS.append(json.loads(text)["metrics"])
        return json.loads(text)
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    METRICS.append(chunks[-1]["metrics"])
    return chunks


def span_of(receiver, response_id):
    def found(rx):
        spans = [
            s
            for s in genai_spans(rx.spans)
            if s.scope == "otel_llm.vllm" and s.attributes.get(semconv.GEN_AI_RESPONSE_ID) == response_id
        ]
        return spans[0] if spans else None

    return receiver.wait_for(found, 30)


def record_of(spool, response_id):
    bills = [
        r
        for r in ledger.read_spool(str(spool))
        if r.get(semconv.GEN_AI_RESPONSE_ID) == response_id
        and r.get(semconv.USAGE_KIND, semconv.USAGE_KIND_REQUEST) == semconv.USAGE_KIND_REQUEST
    ]
    assert len(bills) == 1, bills
    return bills[0]


def assert_metrics_object(attrs, metrics):
    """The span's engine timings are vLLM's `metrics` (milliseconds there, seconds here)."""
    assert attrs[semconv.VLLM_SCHEDULED_TTFT_SECONDS] == pytest.approx(
        metrics["time_to_first_token_ms"] / 1e3, rel=1e-9
    )
    assert attrs[semconv.VLLM_QUEUE_SECONDS] == pytest.approx(metrics["queue_time_ms"] / 1e3, rel=1e-9)
    assert attrs[semconv.VLLM_DECODE_SECONDS] == pytest.approx(metrics["generation_time_ms"] / 1e3, rel=1e-9)
    assert attrs[semconv.VLLM_TPOT_SECONDS] == pytest.approx(metrics["mean_itl_ms"] / 1e3, rel=1e-9)
    # n = 1: the engine's TTFT is the prefill phase; ours (from arrival) adds the queue and what came before it
    assert attrs[semconv.VLLM_PREFILL_SECONDS] == pytest.approx(attrs[semconv.VLLM_SCHEDULED_TTFT_SECONDS], rel=1e-9)
    assert (
        attrs[semconv.VLLM_TTFT_SECONDS]
        > attrs[semconv.VLLM_SCHEDULED_TTFT_SECONDS] + attrs[semconv.VLLM_QUEUE_SECONDS]
    )
    spec = metrics["speculative_decoding"]
    assert spec["num_draft_tokens"] > 0 and spec["num_accepted_draft_tokens"] > 0
    assert attrs[semconv.VLLM_SPEC_DRAFT_TOKENS] == spec["num_draft_tokens"]
    assert attrs[semconv.VLLM_SPEC_ACCEPTED_TOKENS] == spec["num_accepted_draft_tokens"]
    assert attrs[semconv.VLLM_SPEC_ACCEPTANCE_RATE] == pytest.approx(spec["draft_acceptance_rate"], rel=1e-12)
    assert attrs[semconv.VLLM_SPEC_ACCEPTANCE_LENGTH] == pytest.approx(spec["mean_acceptance_length"], rel=1e-12)


@pytest.fixture(scope="module")
def completion(vllm):
    return post(
        vllm,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "session_id": "conv-body"},
        headers={CONVERSATION_HEADER: "conv-from-header"},
    )


@pytest.fixture(scope="module")
def stream(vllm):
    chunks = post(
        vllm,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 30,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        headers={"X-Session-ID": "conv-stream"},
        stream=True,
    )
    return chunks


def test_the_span_has_vllm_metrics_object_and_the_speculator_figures(receiver, completion):
    attrs = span_of(receiver, completion["id"]).attributes
    assert_metrics_object(attrs, completion["metrics"])
    assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == completion["usage"]["completion_tokens"] == 40


def test_the_usage_chunk_keeps_its_metrics_and_the_span_agrees(receiver, stream):
    last = stream[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 30
    attrs = span_of(receiver, last["id"]).attributes
    assert_metrics_object(attrs, last["metrics"])
    assert attrs[semconv.GEN_AI_CONVERSATION_ID] == "conv-stream"


def test_vllms_session_id_is_the_conversation_before_a_configured_header(receiver, spool, completion):
    attrs = span_of(receiver, completion["id"]).attributes
    assert attrs[semconv.GEN_AI_CONVERSATION_ID] == "conv-body"
    record = record_of(spool, completion["id"])
    assert record[semconv.GEN_AI_CONVERSATION_ID] == "conv-body"
    assert record[semconv.VLLM_SPEC_DRAFT_TOKENS] == completion["metrics"]["speculative_decoding"]["num_draft_tokens"]
    assert (
        record[semconv.VLLM_SPEC_ACCEPTED_TOKENS]
        == completion["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"]
    )


def test_a_configured_header_names_the_conversation_without_a_session_id(vllm, receiver, spool):
    response = post(
        vllm, "/v1/completions", {"prompt": "hello", "max_tokens": 3}, headers={CONVERSATION_HEADER: "conv-header"}
    )
    assert span_of(receiver, response["id"]).attributes[semconv.GEN_AI_CONVERSATION_ID] == "conv-header"
    assert record_of(spool, response["id"])[semconv.GEN_AI_CONVERSATION_ID] == "conv-header"
    plain = post(vllm, "/v1/completions", {"prompt": "hello", "max_tokens": 3})
    assert semconv.GEN_AI_CONVERSATION_ID not in span_of(receiver, plain["id"]).attributes
    assert semconv.GEN_AI_CONVERSATION_ID not in record_of(spool, plain["id"])


def test_the_metrics_count_drafts_and_time_from_scheduling_by_model(receiver, completion, stream):
    """Every request of the module so far, to the token: the counters are what the responses said."""
    drafts = sum(m["speculative_decoding"]["num_draft_tokens"] for m in METRICS)
    accepted = sum(m["speculative_decoding"]["num_accepted_draft_tokens"] for m in METRICS)
    assert len(METRICS) == 4 and drafts > accepted > 0

    def totals(rx):
        seen = {
            semconv.SERVER_SPEC_DRAFT_TOKENS: 0,
            semconv.SERVER_SPEC_ACCEPTED_TOKENS: 0,
            semconv.SERVER_SCHEDULED_TIME_TO_FIRST_TOKEN: 0,
        }
        for p in rx.latest_metrics():
            if p.name in seen and p.attributes.get(semconv.GEN_AI_REQUEST_MODEL) == MODEL_NAME:
                seen[p.name] += p.count if p.kind == "histogram" else p.value
        return seen if seen[semconv.SERVER_SCHEDULED_TIME_TO_FIRST_TOKEN] >= len(METRICS) else None

    seen = receiver.wait_for(totals, 30)
    assert seen == {
        semconv.SERVER_SPEC_DRAFT_TOKENS: drafts,
        semconv.SERVER_SPEC_ACCEPTED_TOKENS: accepted,
        semconv.SERVER_SCHEDULED_TIME_TO_FIRST_TOKEN: len(METRICS),
    }


def test_the_report_bills_each_conversation(spool, completion, stream):
    """`otel-llm report --ledger --by session` over the server's spool: each conversation's tokens are
    its responses' usage."""
    import argparse
    import io
    import time

    from otel_llm.billing import report

    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    args = parser.parse_args(
        ["--ledger", str(spool), "--start", str(int(time.time()) - 3600), "--format", "json", "--by", "session"]
    )
    assert report.run(args, now=time.time() + 5, out=out, err=err) == 0, err.getvalue()
    rows = {row["session"]: row for row in json.loads(out.getvalue())["rows"]}
    assert rows["conv-body"]["tokens"][semconv.TOKEN_TYPE_OUTPUT] == completion["usage"]["completion_tokens"]
    assert rows["conv-body"]["tokens"][semconv.TOKEN_TYPE_INPUT] == completion["usage"]["prompt_tokens"]
    assert rows["conv-stream"]["tokens"][semconv.TOKEN_TYPE_OUTPUT] == stream[-1]["usage"]["completion_tokens"]
    assert rows["conv-stream"]["tokens"][semconv.TOKEN_TYPE_INPUT] == stream[-1]["usage"]["prompt_tokens"]
    assert rows["conv-header"]["requests"] == 1 and rows["-"]["requests"] == 1
    drafts = completion["metrics"]["speculative_decoding"]["num_draft_tokens"]
    assert rows["conv-body"]["tokens"]["draft_tokens"] == drafts
