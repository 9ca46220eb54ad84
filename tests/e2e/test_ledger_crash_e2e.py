"""`kill -9` of the whole `vllm serve` process tree under load, then a restart on the same spool
directory: every response a client received complete has exactly one usage record with the
tokens it reported, and no record is counted twice."""

import json
import os
import signal
import threading
import time
from collections import Counter

import httpx
import openai
import pytest
from helpers import start_server

from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv
from otel_llm.billing import ledger, report

THREADS = 6
KILL_AFTER = 40  # completed responses before the kill


def _load(url: str, tenant: str, stop: threading.Event, completed: list, lock: threading.Lock, index: int):
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-crash", max_retries=0, timeout=30)
    headers = {"x-tenant-id": tenant}
    n = 0
    while not stop.is_set():
        n += 1
        try:
            if (index + n) % 2:
                r = client.chat.completions.create(
                    model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8, extra_headers=headers
                )
                done = (r.id, r.usage.prompt_tokens, r.usage.completion_tokens)
            else:
                chunks = list(
                    client.chat.completions.create(
                        model=MODEL_NAME,
                        messages=[{"role": "user", "content": "stream"}],
                        max_tokens=24,
                        stream=True,
                        stream_options={"include_usage": True},
                        extra_headers=headers,
                    )
                )
                done = (chunks[0].id, chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens)
        except (openai.APIError, httpx.HTTPError):
            continue  # the server died mid-request: not a completed response
        with lock:
            completed.append((tenant, *done))


def _run_load(url, tenant, until):
    stop, lock, completed = threading.Event(), threading.Lock(), []
    threads = [
        threading.Thread(target=_load, args=(url, tenant, stop, completed, lock, i), daemon=True)
        for i in range(THREADS)
    ]
    for t in threads:
        t.start()
    until(completed, lock)
    return stop, threads, completed, lock


@pytest.fixture(scope="module")
def crash(receiver, tmp_path_factory):
    spool = tmp_path_factory.mktemp("usage")
    env = {"OTEL_LLM_USAGE_DIR": str(spool)}
    first = start_server(receiver, tmp_path_factory, "crash-1", env=env)
    killed_with_in_flight = []

    def kill_under_load(completed, lock):
        deadline = time.monotonic() + 120
        while len(completed) < KILL_AFTER:
            assert time.monotonic() < deadline, "load never completed enough requests"
            time.sleep(0.02)
        os.killpg(first.process.pid, signal.SIGKILL)  # the API server, engine core and workers at once
        killed_with_in_flight.append(True)

    stop, threads, completed, lock = _run_load(first.url, "before-crash", kill_under_load)
    first.process.wait(30)
    stop.set()
    for t in threads:
        t.join(60)
    with lock:
        before = list(completed)
    files_before = sorted(p.name for p in spool.iterdir())

    # the restarted server samples no trace at all: bills do not depend on trace sampling
    second = start_server(receiver, tmp_path_factory, "crash-2", env={**env, "OTEL_TRACES_SAMPLER": "always_off"})
    try:

        def a_few(completed, lock):
            while len(completed) < 12:
                time.sleep(0.02)

        stop, threads, completed, lock = _run_load(second.url, "after-restart", a_few)
        stop.set()
        for t in threads:
            t.join(60)
    finally:
        second.stop()
    return spool, before, list(completed), files_before


def _raw_lines(spool):
    lines = []
    for path in sorted(spool.glob("usage-*.jsonl")):
        for line in path.read_bytes().splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                pass  # a torn last line (never one of a completed response)
    return lines


def _bills_and_engine_records(records):
    bills = [r for r in records if r.get(semconv.USAGE_KIND, semconv.USAGE_KIND_REQUEST) == semconv.USAGE_KIND_REQUEST]
    engine = [r for r in records if r.get(semconv.USAGE_KIND) == semconv.USAGE_KIND_ENGINE]
    return bills, engine


def test_every_completed_response_survives_a_kill_9_once(crash):
    spool, before, after, files_before = crash
    assert len(before) >= KILL_AFTER
    records = _raw_lines(spool)
    # (a request the load kept in flight past OTEL_LLM_LIVE_INTERVAL also has progress records: never billed)
    keys = Counter(r[semconv.USAGE_ID] for r in records if r.get(semconv.USAGE_KIND) != semconv.USAGE_KIND_PROGRESS)
    assert max(keys.values()) == 1, "a record was written twice"
    records, _ = _bills_and_engine_records(records)
    by_response = Counter(r.get(semconv.GEN_AI_RESPONSE_ID) for r in records)
    by_id = {r.get(semconv.GEN_AI_RESPONSE_ID): r for r in records}
    for tenant, response_id, prompt, completion in before + after:
        assert by_response[response_id] == 1, f"completed response {response_id} has {by_response[response_id]} records"
        record = by_id[response_id]
        assert record[semconv.TENANT_ID] == tenant
        assert (record[semconv.GEN_AI_USAGE_INPUT_TOKENS], record[semconv.GEN_AI_USAGE_OUTPUT_TOKENS]) == (
            prompt,
            completion,
        )
    # the restarted server wrote new files next to the killed one's, which it left untouched
    assert set(files_before) < {p.name for p in spool.glob("usage-*.jsonl")}


def test_the_ledger_report_after_the_crash_counts_each_request_once(crash):
    """One bill per request: the API server's record, or, where the kill took it before it wrote one,
    the engine core's record of the request (with the tenant the API server handed the engine)."""
    spool, before, after, _ = crash
    bills, engine = _bills_and_engine_records(_raw_lines(spool))
    listed = Counter(i for bill in bills for i in bill[semconv.USAGE_ENGINE_REQUEST_IDS])
    assert max(listed.values()) == 1
    orphans = [r for r in engine if r[semconv.VLLM_ENGINE_REQUEST_ID] not in listed]
    assert all(r[semconv.USAGE_FRONTEND_BILLED] is True for r in engine)
    rows = ledger.open_ledger(str(spool)).usage(time.time() - 3600, time.time() + 60, ["tenant"])
    for tenant in ("before-crash", "after-restart"):
        mine = [r for r in bills + orphans if r[semconv.TENANT_ID] == tenant]
        row = rows[(tenant,)]
        assert row.requests == len(mine)
        assert row.tokens[semconv.TOKEN_TYPE_OUTPUT] == sum(r[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] for r in mine)
        assert row.tokens[semconv.TOKEN_TYPE_INPUT] == sum(r[semconv.GEN_AI_USAGE_INPUT_TOKENS] for r in mine)
    assert sum(row.requests for row in rows.values()) == len(bills) + len(orphans)
    # requests the kill cut short may have records too (the engine had generated for them), and
    # completed ones are a subset of the records
    assert rows[("after-restart",)].requests >= len(after)
    assert report.UNSET not in {k[0] for k in rows}
