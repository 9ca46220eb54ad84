"""What each request cost the engine, on the real vLLM CPU engine (otel_llm/vllm/engine_cost.py).

One server runs a lone request, an n=2 pair, two prompts of 40 and 400 tokens admitted into one
step (the engine paused while both queue), and a mixed workload of three tenants (streams, an
abandoned stream, n=2, prefix-cache hits, a 4xx, an idle gap); after it stops, its records must
conserve time exactly (requests' compute + idle = the engine's wall time, in integer nanoseconds)
and KV memory (block-seconds within the pool's capacity x time), and join its API server's bills
one to one. A second server with a KV pool of 6 blocks must preempt; a client that is not vLLM's
OpenAI server, driving the engine core directly, still gets records with its tenant and trace.
"""

import argparse
import io
import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx
import openai
import pytest
from helpers import LONG_PROMPT, Traceparent, abandon_stream, genai_spans, request_trace, start_server, wait_engine_idle

from devkit.devserver import bin_path
from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv
from otel_llm.billing import ledger, report
from otel_llm.config import ENV_ENGINE_COST_WINDOW, ENV_USAGE_DIR

HERE = Path(__file__).resolve().parent
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}  # vLLM's /pause and /resume: both prompts queue, then run in one step
ABORTED: list[str] = []  # trace ids of the stream the mixed workload abandoned and the engine aborted


def _records(spool) -> dict[str, list[dict]]:
    kinds = defaultdict(list)
    for record in ledger.read_spool(str(spool), kinds=None):
        kinds[record.get(semconv.USAGE_KIND, semconv.USAGE_KIND_REQUEST)].append(record)
    return kinds


def _engine_rows(spool) -> dict[str, dict]:
    return {r[semconv.VLLM_ENGINE_REQUEST_ID]: r for r in _records(spool)[semconv.USAGE_KIND_ENGINE]}


def _bill_of(spool, trace_id: str) -> dict:
    (bill,) = [r for r in _records(spool)[semconv.USAGE_KIND_REQUEST] if r.get(semconv.USAGE_TRACE_ID) == trace_id]
    return bill


def _wait_rows(spool, engine_ids, timeout=30.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        rows = _engine_rows(spool)
        if all(i in rows for i in engine_ids):
            return [rows[i] for i in engine_ids]
        assert time.monotonic() < deadline, f"no engine records for {engine_ids}"
        time.sleep(0.05)


def assert_conserved(records: dict[str, list[dict]]) -> None:
    """Windows tile the engine's wall time, busy + idle = wall exactly, the requests' compute adds up
    to the busy time exactly, and their block-nanoseconds stay within the pool."""
    windows = sorted(records[semconv.USAGE_KIND_ENGINE_WINDOW], key=lambda w: w[semconv.USAGE_TIME])
    assert windows
    for before, after in zip(windows, windows[1:]):
        assert after[semconv.ENGINE_WINDOW_START] == before[semconv.USAGE_TIME]
    capacity = windows[0][semconv.ENGINE_KV_CAPACITY_BLOCKS]
    for w in windows:
        wall = w[semconv.USAGE_TIME] - w[semconv.ENGINE_WINDOW_START]
        assert w[semconv.ENGINE_BUSY_NS] + w[semconv.ENGINE_IDLE_NS] == wall
        assert 0 <= w[semconv.ENGINE_KV_BLOCK_NS] <= capacity * wall
    rows = records[semconv.USAGE_KIND_ENGINE]
    busy = sum(w[semconv.ENGINE_BUSY_NS] for w in windows)
    assert sum(r[semconv.COST_COMPUTE_NS] for r in rows) == busy
    wall = windows[-1][semconv.USAGE_TIME] - windows[0][semconv.ENGINE_WINDOW_START]
    assert busy + sum(w[semconv.ENGINE_IDLE_NS] for w in windows) == wall
    assert sum(r[semconv.COST_KV_BLOCK_NS] for r in rows) == sum(w[semconv.ENGINE_KV_BLOCK_NS] for w in windows)
    assert sum(r[semconv.COST_KV_BLOCK_NS] for r in rows) <= capacity * wall


@pytest.fixture(scope="module")
def spool(tmp_path_factory):
    return tmp_path_factory.mktemp("cost-spool")


@pytest.fixture(scope="module")
def vllm(receiver, tmp_path_factory, spool):
    # paced (and 2048 tokens long): a stream the client leaves is aborted while the engine still generates
    srv = start_server(
        receiver,
        tmp_path_factory,
        "engine-cost",
        extra_args=["--max-model-len", "2048"],
        env={ENV_USAGE_DIR: str(spool), ENV_ENGINE_COST_WINDOW: "1", **DEV_MODE},
        paced=True,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(vllm):
    return openai.OpenAI(base_url=vllm.url + "/v1", api_key="sk-cost", max_retries=0, timeout=120)


def test_a_request_alone_is_charged_its_prefill_and_decode_and_no_more(vllm, client, spool, receiver):
    wait_engine_idle(vllm.url)
    time.sleep(1.2)  # idle long enough to close a window: idle time must not reach the request
    tp = Traceparent()
    client.completions.create(
        model=MODEL_NAME,
        prompt=LONG_PROMPT,
        max_tokens=150,
        extra_headers=tp.headers(),
        extra_body={"ignore_eos": True},
    )
    genai = genai_spans(request_trace(receiver, tp.trace_id))[0]
    bill = _bill_of(spool, tp.trace_id)
    (row,) = _wait_rows(spool, bill[semconv.USAGE_ENGINE_REQUEST_IDS])
    phases = genai.attributes[semconv.VLLM_PREFILL_SECONDS] + genai.attributes[semconv.VLLM_DECODE_SECONDS]
    compute = row[semconv.COST_COMPUTE_NS] / 1e9
    # it ran alone: every step was its own; the steps end before the API server sees the last token
    assert 0.5 * phases <= compute <= row[semconv.USAGE_DURATION]
    assert 0 < row[semconv.COST_PREFILL_COMPUTE_NS] < row[semconv.COST_COMPUTE_NS]
    # the prompt (no prefix-cache hit on a fresh server) and every generated token but the last
    assert row[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == 0
    assert row[semconv.COST_SCHEDULED_TOKENS] == bill[semconv.GEN_AI_USAGE_INPUT_TOKENS] + 150 - 1
    assert row[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == bill[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 150
    assert row[semconv.USAGE_TRACE_ID] == tp.trace_id and row[semconv.USAGE_SPAN_ID] == genai.span_id
    assert row[semconv.USAGE_FRONTEND_BILLED] is True and row[semconv.VLLM_PREEMPTIONS] == 0
    assert row[semconv.COST_KV_BLOCK_NS] > 0
    # the engine's figures came back on the request's final output: the span carries the record's
    for name in (
        semconv.COST_COMPUTE_NS,
        semconv.COST_PREFILL_COMPUTE_NS,
        semconv.COST_KV_BLOCK_NS,
        semconv.COST_KV_HIT_BLOCK_NS,
        semconv.COST_PREEMPTED_NS,
        semconv.COST_SCHEDULED_TOKENS,
    ):
        assert genai.attributes[name] == row[name], name


def test_two_requests_sent_together_share_their_steps(vllm, client, spool):
    tp = Traceparent()
    client.completions.create(
        model=MODEL_NAME,
        prompt="two of a kind",
        max_tokens=120,
        n=2,
        extra_headers=tp.headers(),
        extra_body={"ignore_eos": True},
    )
    bill = _bill_of(spool, tp.trace_id)
    a, b = _wait_rows(spool, bill[semconv.USAGE_ENGINE_REQUEST_IDS])
    # both children run every step together (one may join a step late: "about half each")
    assert abs(a[semconv.COST_COMPUTE_NS] - b[semconv.COST_COMPUTE_NS]) <= 0.25 * (
        a[semconv.COST_COMPUTE_NS] + b[semconv.COST_COMPUTE_NS]
    )
    assert (
        a[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] + b[semconv.GEN_AI_USAGE_OUTPUT_TOKENS]
        == bill[semconv.GEN_AI_USAGE_OUTPUT_TOKENS]
        == 240
    )


def _pause(vllm) -> None:
    httpx.post(vllm.url + "/pause", params={"mode": "keep"}, timeout=30).raise_for_status()


def _resume(vllm) -> None:
    httpx.post(vllm.url + "/resume", timeout=30).raise_for_status()


def _one_step_pair(vllm, client, spool, settle: float) -> dict[str, dict]:
    """40 and 400 prompt tokens (tenants short and long), sent while the engine is paused, so that
    both queue and the resumed engine computes both prompts in its first step: their engine records."""
    wait_engine_idle(vllm.url)
    _pause(vllm)
    traces = {}

    def send(tenant: str, tokens: int) -> None:
        tp = Traceparent()
        traces[tenant] = tp.trace_id
        client.completions.create(
            model=MODEL_NAME,
            prompt=[7 + i % 50 for i in range(tokens)],
            max_tokens=1,
            extra_headers=tp.headers(**{"x-tenant-id": tenant}),
        )

    threads = [threading.Thread(target=send, args=args) for args in (("short", 40), ("long", 400))]
    try:
        for t in threads:
            t.start()
        time.sleep(settle)  # for both to reach the engine's queue (checked below: one step finished both)
    finally:
        _resume(vllm)
    for t in threads:
        t.join(120)
    rows = {}
    for tenant, trace_id in traces.items():
        bill = _bill_of(spool, trace_id)
        assert bill[semconv.TENANT_ID] == tenant
        (rows[tenant],) = _wait_rows(spool, bill[semconv.USAGE_ENGINE_REQUEST_IDS])
    return rows


def test_ten_times_the_prompt_in_one_batch_is_charged_ten_times_the_prefill(vllm, client, spool):
    for settle in (1, 2, 4, 8, 16):
        rows = _one_step_pair(vllm, client, spool, settle)
        # max_tokens=1: a request ends in the step that computed its prompt; one step ended both
        if rows["short"][semconv.USAGE_TIME] == rows["long"][semconv.USAGE_TIME]:
            break
    else:
        pytest.fail("the paused engine never admitted both prompts into one step")
    short, long = rows["short"][semconv.COST_PREFILL_COMPUTE_NS], rows["long"][semconv.COST_PREFILL_COMPUTE_NS]
    # one step computed both prompts: 440 tokens, split 40 : 400 (to the nanosecond's rounding)
    assert abs(long - 10 * short) <= 10
    assert rows["long"][semconv.COST_KV_BLOCK_NS] > rows["short"][semconv.COST_KV_BLOCK_NS]


def test_mixed_workload(vllm, client, spool):
    """Three tenants: plain, streamed, n=2, prefix-cache hits, a 4xx, a stream abandoned, an idle gap."""
    for i, tenant in enumerate(("t-a", "t-b", "t-c")):
        headers = {"x-tenant-id": tenant}
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": LONG_PROMPT}],
            max_tokens=10 + i,
            extra_headers=headers,
        )
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": LONG_PROMPT}],
            max_tokens=10 + i,
            extra_headers=headers,
        )  # a prefix-cache hit
        stream = client.completions.create(
            model=MODEL_NAME,
            prompt=f"stream {i}",
            max_tokens=30,
            stream=True,
            extra_headers=headers,
            extra_body={"ignore_eos": True},
        )
        for _ in stream:
            pass
        client.completions.create(model=MODEL_NAME, prompt=f"pair {i}", max_tokens=5, n=2, extra_headers=headers)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt="x", max_tokens=5, extra_headers=headers)
    body = {"model": MODEL_NAME, "prompt": "leave early", "max_tokens": 1900, "ignore_eos": True}
    attempts = abandon_stream(
        vllm.url, "/v1/completions", body, lambda: Traceparent().headers(**{"x-tenant-id": "t-a"})
    )
    ABORTED.extend(a.trace_id for a in attempts if a.aborted)
    time.sleep(1.5)  # an idle gap
    client.completions.create(model=MODEL_NAME, prompt="after the gap", max_tokens=5)
    wait_engine_idle(vllm.url)


@pytest.fixture(scope="module")
def stopped(vllm, spool):
    """The server stopped (its engine wrote its last window); the spool's records by kind."""
    wait_engine_idle(vllm.url)
    vllm.stop()
    return _records(spool)


def test_busy_shares_plus_idle_equal_the_engines_wall_time(stopped):
    assert_conserved(stopped)


def test_every_bill_joins_its_engine_records_one_to_one(stopped, spool):
    """The ledger's bills carry the engine's token counts. The API server's record of a request the
    client left may hold fewer: the engine's outputs in flight when vLLM dropped it are never read."""
    engine = {r[semconv.VLLM_ENGINE_REQUEST_ID]: r for r in stopped[semconv.USAGE_KIND_ENGINE]}
    listed = [i for bill in stopped[semconv.USAGE_KIND_REQUEST] for i in bill[semconv.USAGE_ENGINE_REQUEST_IDS]]
    assert len(listed) == len(set(listed)) == len(engine) and set(listed) == set(engine)
    assert all(r[semconv.USAGE_FRONTEND_BILLED] is True for r in engine.values())
    times = [r[semconv.USAGE_TIME] / 1e9 for kind in stopped.values() for r in kind]
    billed = {b["key"]: b for b in ledger.open_ledger(str(spool)).records(min(times) - 1, max(times) + 1)}
    for bill in stopped[semconv.USAGE_KIND_REQUEST]:
        rows = [engine[i] for i in bill[semconv.USAGE_ENGINE_REQUEST_IDS]]
        output = sum(r[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] for r in rows)
        cached = rows[0][semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS]
        joined = billed[bill[semconv.USAGE_ID]]
        assert (int(joined["input"]), int(joined["cached_input"]), int(joined["output"])) == (
            rows[0][semconv.GEN_AI_USAGE_INPUT_TOKENS],
            cached,
            output,
        )
        assert rows[0][semconv.GEN_AI_USAGE_INPUT_TOKENS] == bill[semconv.GEN_AI_USAGE_INPUT_TOKENS]
        if bill[semconv.REQUEST_OUTCOME] == semconv.OUTCOME_ABORTED:
            assert bill[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] <= output
            assert bill[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] in (0, cached)
        else:
            assert bill[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == output
            assert bill[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == cached
            assert all(r[semconv.REQUEST_OUTCOME] == semconv.OUTCOME_FINISHED for r in rows)
        assert all(r[semconv.USAGE_TRACE_ID] == bill[semconv.USAGE_TRACE_ID] for r in rows)
    hits = [r for r in engine.values() if r[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] > 0]
    assert len(hits) >= 3 and all(r[semconv.COST_KV_HIT_BLOCK_NS] > 0 for r in hits)
    (aborted,) = ABORTED
    (row,) = [r for r in engine.values() if r[semconv.USAGE_TRACE_ID] == aborted]
    assert row[semconv.REQUEST_OUTCOME] == semconv.OUTCOME_ABORTED
    assert row[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == [semconv.FINISH_REASON_ABORT]
    assert 0 < row[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] < 1900


def test_the_cost_report_equals_a_hand_computation_from_the_records(stopped, spool, tmp_path):
    """usd_per_hour: 3.6 (0.001 a second), by compute share, idle as a row: each tenant's cost is its
    requests' compute seconds x 0.001, and tenants + idle = the engine's wall time x 0.001."""
    (tmp_path / "costs.yaml").write_text("usd_per_hour: 3.6\n")
    windows = stopped[semconv.USAGE_KIND_ENGINE_WINDOW]
    start = min(w[semconv.ENGINE_WINDOW_START] for w in windows) / 1e9 - 1
    end = max(w[semconv.USAGE_TIME] for w in windows) / 1e9 + 1
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    code = report.run(
        parser.parse_args(
            [
                "--ledger",
                str(spool),
                "--start",
                str(start),
                "--end",
                str(end),
                "--by",
                "tenant",
                "--costs",
                str(tmp_path / "costs.yaml"),
                "--format",
                "json",
            ]
        ),
        now=end + 60,
        out=out,
        err=err,
    )
    assert code == 0, err.getvalue()
    rows = {r["tenant"]: r for r in json.loads(out.getvalue())["rows"]}
    engine = {r[semconv.VLLM_ENGINE_REQUEST_ID]: r for r in stopped[semconv.USAGE_KIND_ENGINE]}
    compute = defaultdict(int)
    for bill in stopped[semconv.USAGE_KIND_REQUEST]:
        compute[bill.get(semconv.TENANT_ID, "-")] += sum(
            engine[i][semconv.COST_COMPUTE_NS] for i in bill[semconv.USAGE_ENGINE_REQUEST_IDS]
        )
    wall = sum(w[semconv.USAGE_TIME] - w[semconv.ENGINE_WINDOW_START] for w in windows)
    assert set(rows) == {*compute, "idle"}
    for tenant, ns in compute.items():
        assert rows[tenant]["compute_seconds"] == pytest.approx(ns / 1e9, rel=1e-12)
        assert rows[tenant]["cost"] == pytest.approx(ns / 1e9 * 0.001, rel=1e-9)
    assert rows["idle"]["cost"] == pytest.approx((wall - sum(compute.values())) / 1e9 * 0.001, rel=1e-9)
    assert sum(r["cost"] for r in rows.values()) == pytest.approx(wall / 1e9 * 0.001, rel=1e-9)


# --- preemption: a KV pool of 6 blocks of 128 tokens for 4 requests that grow to 4 blocks each --------


def test_a_tiny_kv_pool_preempts_and_the_records_and_spans_show_it(receiver, tmp_path_factory):
    spool = tmp_path_factory.mktemp("preempt-spool")
    srv = start_server(
        receiver,
        tmp_path_factory,
        "preempt",
        extra_args=["--num-gpu-blocks-override", "6"],
        env={ENV_USAGE_DIR: str(spool), ENV_ENGINE_COST_WINDOW: "1"},
    )
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-cost", max_retries=0, timeout=300)

        def send(tenant: str, prompts: int, prompt_tokens: int, max_tokens: int) -> None:
            client.completions.create(
                model=MODEL_NAME,
                prompt=[[9 + i % 40 for i in range(prompt_tokens)]] * prompts,
                max_tokens=max_tokens,
                extra_body={"ignore_eos": True},
                extra_headers={"x-tenant-id": tenant},
            )

        # the long prompts in one request: vLLM hands the engine all four at once, so they hold the pool
        # together (four requests of their own once reached the API server one after another: no preemption)
        jobs = [("long", 4, 250, 250), ("short", 1, 10, 10)]
        threads = [threading.Thread(target=send, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        wait_engine_idle(srv.url)
    finally:
        srv.stop()
    records = _records(spool)
    assert_conserved(records)
    bills = {
        engine_id: r for r in records[semconv.USAGE_KIND_REQUEST] for engine_id in r[semconv.USAGE_ENGINE_REQUEST_IDS]
    }
    rows = records[semconv.USAGE_KIND_ENGINE]
    assert len(rows) == 5
    preempted = [r for r in rows if r[semconv.VLLM_PREEMPTIONS] > 0]
    assert preempted and all(r[semconv.COST_PREEMPTED_NS] > 0 for r in preempted)
    by_trace = {}
    for row in rows:
        by_trace.setdefault(row[semconv.USAGE_TRACE_ID], []).append(row)
    for trace_id, trace_rows in by_trace.items():  # one span event per preemption, at its time, with its wait
        (span,) = receiver.wait_for(lambda rx, t=trace_id: genai_spans(rx.traces().get(t, [])) or None, 30)
        events = [(e, t) for e, t in zip(span.events, span.event_times) if e["name"] == semconv.EVENT_PREEMPTED]
        assert (
            len(events)
            == sum(r[semconv.VLLM_PREEMPTIONS] for r in trace_rows)
            == span.attributes[semconv.VLLM_PREEMPTIONS]
        )
        assert (
            sum(e["attributes"][semconv.COST_PREEMPTED_NS] for e, _ in events)
            == sum(r[semconv.COST_PREEMPTED_NS] for r in trace_rows)
            == span.attributes.get(semconv.COST_PREEMPTED_NS, 0)
        )
        assert all(span.start_ns <= t <= span.end_ns for _, t in events)
    tenants = {
        r[semconv.VLLM_ENGINE_REQUEST_ID]: bills[r[semconv.VLLM_ENGINE_REQUEST_ID]][semconv.TENANT_ID] for r in rows
    }
    # every request computes its prompt but its prefix-cache hit, and its output; a preempted one may
    # compute again what the cache no longer holds
    for r in rows:
        computed = (
            r[semconv.GEN_AI_USAGE_INPUT_TOKENS]
            - r[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS]
            + r[semconv.GEN_AI_USAGE_OUTPUT_TOKENS]
            - 1
        )
        assert r[semconv.COST_SCHEDULED_TOKENS] >= computed
    longest_short = max(
        r[semconv.COST_KV_BLOCK_NS] for r in rows if tenants[r[semconv.VLLM_ENGINE_REQUEST_ID]] == "short"
    )
    assert all(
        r[semconv.COST_KV_BLOCK_NS] > longest_short
        for r in rows
        if tenants[r[semconv.VLLM_ENGINE_REQUEST_ID]] == "long"
    )


# --- a frontend otel-llm cannot see: vLLM's engine-core client, driven by a script --------------------


def test_a_request_straight_to_the_engine_core_gets_its_record(tmp_path):
    spool = tmp_path / "spool"
    tp = Traceparent()
    env = {
        **os.environ,
        ENV_USAGE_DIR: str(spool),
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_SERVICE_NAME": "direct-engine",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    from devkit.devserver import DEFAULT_MODEL_DIR, KV_CACHE_BYTES
    from devkit.tiny_model import build

    out = subprocess.run(
        [
            bin_path("opentelemetry-instrument"),
            sys.executable,
            str(HERE / "engine_client.py"),
            str(build(DEFAULT_MODEL_DIR)),
            "3",
            str(KV_CACHE_BYTES),
            tp.header,
            "tenant.id=acme,tenant.scene=batch",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = {r["id"]: r for r in (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))}
    records = _records(spool)
    assert not records[semconv.USAGE_KIND_REQUEST]  # no API server, no bill from one
    rows = {r[semconv.VLLM_ENGINE_REQUEST_ID]: r for r in records[semconv.USAGE_KIND_ENGINE]}
    assert set(rows) == set(seen) == {"direct-0", "direct-1", "direct-2"}
    for rid, row in rows.items():
        assert row[semconv.USAGE_FRONTEND_BILLED] is False
        assert row[semconv.GEN_AI_USAGE_INPUT_TOKENS] == seen[rid]["prompt"]
        assert row[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == seen[rid]["output"]
        assert row[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == [seen[rid]["finish"]] == ["length"]
        assert row[semconv.TENANT_ID] == "acme" and row[semconv.TENANT_SCENE] == "batch"
        assert row[semconv.USAGE_TRACE_ID] == tp.trace_id and row[semconv.SERVICE_NAME] == "direct-engine"
        assert row[semconv.COST_COMPUTE_NS] > 0 and row[semconv.COST_KV_BLOCK_NS] > 0
    assert_conserved(records)
