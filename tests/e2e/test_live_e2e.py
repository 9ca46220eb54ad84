"""Live counting on the real vLLM CPU server (otel_llm/vllm/live.py): a long stream's tokens reach
the exported token counter (through the export process) and the usage spool (progress records)
while it runs; its bill, and the counter once it ended, equal the `usage` the client got; no
progress record is billed."""

import time

import openai
import pytest
from helpers import Traceparent, start_server

from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv
from otel_llm.billing import ledger

TENANT = "live-tenant"
MAX_TOKENS = 1000  # about 20 s on the paced model (its step is ~20 ms on the dev VM)
INTERVAL_S = 1


@pytest.fixture(scope="module")
def spool(tmp_path_factory):
    return tmp_path_factory.mktemp("usage")


@pytest.fixture(scope="module")
def vllm(receiver, tmp_path_factory, spool):
    srv = start_server(
        receiver,
        tmp_path_factory,
        "live",
        extra_args=["--max-model-len", "2048"],
        env={"OTEL_LLM_USAGE_DIR": str(spool), "OTEL_LLM_LIVE_INTERVAL": str(INTERVAL_S)},
        paced=True,
    )
    yield srv
    srv.stop()


def output_tokens(points) -> int | None:
    """The tenant's output tokens in one export of the counter (summed over its series), or None."""
    values = [
        p.value
        for p in points
        if p.name == semconv.SERVER_TOKEN_USAGE
        and p.attributes.get(semconv.TENANT_ID) == TENANT
        and p.attributes[semconv.GEN_AI_TOKEN_TYPE] == semconv.TOKEN_TYPE_OUTPUT
    ]
    return sum(values) if values else None


def progress_of(spool) -> list[dict]:
    return [
        r
        for r in ledger.read_spool(str(spool), kinds=(semconv.USAGE_KIND_PROGRESS,))
        if r.get(semconv.TENANT_ID) == TENANT
    ]


def test_a_long_stream_counts_while_it_runs_and_is_billed_its_usage(vllm, receiver, spool):
    started = time.time()
    client = openai.OpenAI(base_url=vllm.url + "/v1", api_key="sk-live", max_retries=0)
    tp = Traceparent()
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "tell me everything"}],
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        extra_headers=tp.headers(**{"x-tenant-id": TENANT}),
    )
    usage = None
    seen_in_counter = seen_in_spool = None  # what the client had read when each showed up
    read = 0
    next_look = time.monotonic()
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        read += 1
        if (seen_in_counter is None or seen_in_spool is None) and time.monotonic() >= next_look:
            next_look = time.monotonic() + 0.25
            if seen_in_counter is None and output_tokens(receiver.latest_metrics()):
                seen_in_counter = read
            if seen_in_spool is None and progress_of(spool):
                seen_in_spool = read
    print(
        f"\nstream: {time.time() - started:.1f} s, {read} chunks; the counter showed it after {seen_in_counter}, "
        f"the spool after {seen_in_spool}"
    )
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    # both showed up while the stream still had most of its chunks to go (first expected after ~1-3 s
    # of a ~20 s stream)
    assert seen_in_counter is not None and seen_in_spool is not None, (seen_in_counter, seen_in_spool, read)
    assert seen_in_counter < read and seen_in_spool < read

    # the counter's exports: partial counts while it ran (only live counting makes a value strictly
    # between 0 and the total: the request's own end adds it whole), then exactly its usage
    def final(rx):
        return output_tokens(rx.latest_metrics()) == usage.completion_tokens

    receiver.wait_for(final, 30)
    exported = [n for batch in list(receiver.metric_batches) if (n := output_tokens(batch)) is not None]
    partial = [n for n in exported if 0 < n < usage.completion_tokens]
    assert partial and partial == sorted(partial) and exported == sorted(exported)  # it only grew

    # the spool: cumulative progress records while it ran, then its bill, which is its usage
    api_server = (semconv.USAGE_KIND_PROGRESS, semconv.USAGE_KIND_REQUEST)  # (the engine core's records aside)
    everything = [r for r in ledger.read_spool(str(spool), kinds=api_server) if r.get(semconv.TENANT_ID) == TENANT]
    *progress, bill = everything
    assert len(progress) >= 2 and {r[semconv.USAGE_KIND] for r in progress} == {semconv.USAGE_KIND_PROGRESS}
    assert semconv.USAGE_KIND not in bill
    assert {r[semconv.USAGE_ID] for r in progress} == {bill[semconv.USAGE_ID]}
    outputs = [r[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] for r in progress]
    assert outputs == sorted(outputs) and 0 < outputs[0] and outputs[-1] < usage.completion_tokens
    assert all(r[semconv.GEN_AI_USAGE_INPUT_TOKENS] == usage.prompt_tokens for r in progress)
    times = [r[semconv.USAGE_TIME] for r in everything]
    assert times == sorted(times)
    gaps = [(b - a) / 1e9 for a, b in zip(times, times[1:-1])]
    assert all(gap >= INTERVAL_S * 0.9 for gap in gaps), gaps  # at most one per interval
    assert (bill[semconv.GEN_AI_USAGE_INPUT_TOKENS], bill[semconv.GEN_AI_USAGE_OUTPUT_TOKENS]) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )

    # the ledger bills it once, its usage, however many progress records it has
    rows = ledger.open_ledger(str(spool)).usage(started - 60, time.time() + 60, ["tenant"])
    assert {
        k: (r.tokens[semconv.TOKEN_TYPE_INPUT], r.tokens[semconv.TOKEN_TYPE_OUTPUT], r.requests)
        for k, r in rows.items()
    } == {(TENANT,): (usage.prompt_tokens, usage.completion_tokens, 1)}
