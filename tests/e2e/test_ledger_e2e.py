"""The usage ledger on the real vLLM CPU server: 120 tenants (more than the metric label cap) with
non-stream and streamed calls (with and without include_usage), n=2, prefix-cache hits, aborted
streams and 4xx. The ledger must hold exactly one record per request that reached the engine, and
its report must equal, per tenant, the usage every completed response carried (the engine's span
for calls whose client saw no usage), for every tenant; the same SQL must give the same answer
over the collector's ClickHouse table (in chDB); reconcile must agree with vLLM's counters; the
OTLP usage events must carry the same records; exports must be idempotent."""

import argparse
import io
import json
import secrets
import shutil
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import openai
import pytest
from helpers import LONG_PROMPT, abandon_stream, start_server

from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv
from otel_llm.billing import exports, ledger, reconcile, report

TENANTS = [f"tenant-{i:03d}" for i in range(120)]
ABORTING = {TENANTS[5], TENANTS[11]}
TYPES = (semconv.TOKEN_TYPE_INPUT, semconv.TOKEN_TYPE_CACHED_INPUT, semconv.TOKEN_TYPE_OUTPUT)
SPOOL_ONLY = (semconv.USAGE_TIME, semconv.USAGE_TRACE_ID, semconv.USAGE_SPAN_ID)


@pytest.fixture(scope="module")
def spool(tmp_path_factory):
    return tmp_path_factory.mktemp("usage")


@pytest.fixture(scope="module")
def vllm(receiver, tmp_path_factory, spool):
    # --max-model-len 2048: a stream long enough to be abandoned while the engine still generates
    srv = start_server(
        receiver,
        tmp_path_factory,
        "ledger",
        extra_args=["--enable-prompt-tokens-details", "--max-model-len", "2048"],
        env={"OTEL_LLM_USAGE_DIR": str(spool), "OTEL_LLM_USAGE_EVENTS": "true", "OTEL_LOGS_EXPORTER": "otlp"},
        paced=True,
    )
    yield srv
    srv.stop()


def _traceparent():
    trace_id = secrets.token_hex(16)
    return trace_id, {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}


@pytest.fixture(scope="module")
def traffic(vllm, prometheus, spool):
    """Sends the workload; returns what each client saw (usage, or None), per trace id."""
    started = time.time()
    client = openai.OpenAI(base_url=vllm.url + "/v1", api_key="sk-ledger", max_retries=0)
    chat = [{"role": "user", "content": "hello"}]

    def usage_of(u):
        details = u.prompt_tokens_details
        return {
            semconv.TOKEN_TYPE_INPUT: u.prompt_tokens,
            semconv.TOKEN_TYPE_OUTPUT: u.completion_tokens,
            semconv.TOKEN_TYPE_CACHED_INPUT: (details.cached_tokens if details else 0) or 0,
        }

    def one(index, tenant):
        calls = []  # (trace id, usage or None, response id or None)
        kind = index % 6
        headers = {"x-tenant-id": tenant, "x-scene": f"scene-{index % 3}", "x-cost-center": f"cc-{index % 4}"}
        trace_id, tp = _traceparent()
        h = {**headers, **tp}
        if kind in (0, 5):
            r = client.chat.completions.create(model=MODEL_NAME, messages=chat, max_tokens=5, extra_headers=h)
            calls.append((trace_id, usage_of(r.usage), r.id))
        elif kind == 1:
            chunks = list(
                client.chat.completions.create(
                    model=MODEL_NAME,
                    messages=chat,
                    max_tokens=6,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_headers=h,
                )
            )
            calls.append((trace_id, usage_of(chunks[-1].usage), chunks[0].id))
        elif kind == 2:
            chunks = list(
                client.chat.completions.create(
                    model=MODEL_NAME, messages=chat, max_tokens=6, stream=True, extra_headers=h
                )
            )
            calls.append((trace_id, None, chunks[0].id))
        elif kind == 3:
            r = client.completions.create(model=MODEL_NAME, prompt="two choices", max_tokens=4, n=2, extra_headers=h)
            calls.append((trace_id, usage_of(r.usage), r.id))
        elif kind == 4:
            prompt = f"{tenant} " + LONG_PROMPT
            for attempt in range(2):  # the second one hits the prefix cache
                if attempt:
                    trace_id, tp = _traceparent()
                r = client.completions.create(
                    model=MODEL_NAME, prompt=prompt, max_tokens=3, extra_headers={**headers, **tp}
                )
                calls.append((trace_id, usage_of(r.usage), r.id))
        if kind == 5:  # a 4xx never reaches the engine: no record
            with pytest.raises(openai.NotFoundError):
                client.chat.completions.create(model="no-such-model", messages=chat, extra_headers=headers)
        return tenant, calls

    def abandon(tenant):
        """Stops reading a long stream: billed with what the engine generated. Streams the engine
        ran to the end before it saw the client leave are billed as finished (see abandon_stream)."""
        body = {"model": MODEL_NAME, "messages": chat, "max_tokens": 1900, "ignore_eos": True}
        attempts = abandon_stream(
            vllm.url, "/v1/chat/completions", body, lambda: {"x-tenant-id": tenant, **_traceparent()[1]}
        )
        engine_aborted.update((a.trace_id, a.aborted) for a in attempts)
        return tenant, [(a.trace_id, None, None) for a in attempts]

    engine_aborted = {}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda item: one(*item), enumerate(TENANTS)))
    results += [abandon(tenant) for tenant in sorted(ABORTING)]
    calls = {
        trace_id: SimpleNamespace(tenant=tenant, usage=usage, response_id=rid)
        for tenant, items in results
        for trace_id, usage, rid in items
    }
    assert sum(1 for c in calls.values() if c.usage and c.usage[semconv.TOKEN_TYPE_CACHED_INPUT]) >= 20
    time.sleep(3)  # two scrapes after the last request
    return SimpleNamespace(
        calls=calls, started=started, ended=time.time() + 1, spool=spool, engine_aborted=engine_aborted
    )


def genai_span(receiver, trace_id):
    def found(rx):
        spans = [s for s in rx.traces().get(trace_id, []) if semconv.GEN_AI_OPERATION_NAME in s.attributes]
        return spans[0] if spans else None

    return receiver.wait_for(found, 30)


@pytest.fixture(scope="module")
def records(traffic, spool):
    """The API server's records, once every call of the traffic has one: a stream the client left is billed
    when vLLM aborts its engine request, which on a busy machine may come after the traffic returned (every
    test here reads the spool again, and would see a record this list lacks)."""
    deadline = time.monotonic() + 60
    while True:
        rows = ledger.read_spool(str(spool))
        if set(traffic.calls) <= {r.get(semconv.USAGE_TRACE_ID) for r in rows} or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def engine_record(spool, trace_id, timeout=30.0) -> dict:
    """The engine core's record of the one engine request of a trace."""
    deadline = time.monotonic() + timeout
    while True:
        rows = [
            r
            for r in ledger.read_spool(str(spool), kinds=(semconv.USAGE_KIND_ENGINE,))
            if r.get(semconv.USAGE_TRACE_ID) == trace_id
        ]
        if rows:
            (row,) = rows
            return row
        assert time.monotonic() < deadline, f"no engine record for trace {trace_id}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def expected(traffic, receiver, spool):
    """Per tenant: usage the responses carried, or the engine span's figures where the client saw none;
    for a stream the engine aborted, what its engine computed (the span's figures are what the API
    server read of it: no more than that)."""
    totals = Counter()
    for trace_id, call in traffic.calls.items():
        usage = call.usage
        if usage is None:
            attrs = genai_span(receiver, trace_id).attributes
            usage = {
                semconv.TOKEN_TYPE_INPUT: attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS],
                semconv.TOKEN_TYPE_CACHED_INPUT: attrs[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS],
                semconv.TOKEN_TYPE_OUTPUT: attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS],
            }
        if traffic.engine_aborted.get(trace_id):
            row = engine_record(spool, trace_id)
            assert row[semconv.GEN_AI_USAGE_INPUT_TOKENS] == usage[semconv.TOKEN_TYPE_INPUT]
            for token_type, field in (
                (semconv.TOKEN_TYPE_CACHED_INPUT, semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS),
                (semconv.TOKEN_TYPE_OUTPUT, semconv.GEN_AI_USAGE_OUTPUT_TOKENS),
            ):
                assert usage[token_type] <= row[field]
                usage[token_type] = row[field]
        for token_type in TYPES:
            totals[(call.tenant, token_type)] += usage[token_type]
    return totals


def run_cli(module, command, *argv, now=None):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    module.add_arguments(sub.add_parser(command))
    args = parser.parse_args([command, *argv])
    out, err = io.StringIO(), io.StringIO()
    code = module.run(args, now=now or time.time(), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def window(traffic):
    return ["--start", str(int(traffic.started) - 60), "--end", str(int(traffic.ended) + 1)]


def ledger_report(where, traffic, by="tenant"):
    code, out, err = run_cli(report, "report", "--ledger", where, "--by", by, "--format", "json", *window(traffic))
    assert code == 0, err
    return json.loads(out)


def test_one_record_per_request_that_reached_the_engine(traffic, records):
    keys = [r[semconv.USAGE_ID] for r in records]
    assert len(keys) == len(set(keys)) == len(traffic.calls)
    by_trace = {r[semconv.USAGE_TRACE_ID]: r for r in records}
    assert set(by_trace) == set(traffic.calls)
    for trace_id, call in traffic.calls.items():
        record = by_trace[trace_id]
        assert record[semconv.TENANT_ID] == call.tenant
        if call.response_id is not None:
            assert record[semconv.GEN_AI_RESPONSE_ID] == call.response_id
    # the 4xx calls (unknown model) left no record
    assert {r[semconv.GEN_AI_REQUEST_MODEL] for r in records} == {MODEL_NAME}


def test_records_carry_full_fields_and_the_span_they_belong_to(traffic, records, receiver, vllm):
    for record in records:
        span = genai_span(receiver, record[semconv.USAGE_TRACE_ID])
        assert record[semconv.USAGE_SPAN_ID] == span.span_id
        instance = span.resource[semconv.SERVICE_INSTANCE_ID]
        assert record[semconv.SERVICE_INSTANCE_ID] == instance
        assert record[semconv.USAGE_ID] == f"{instance}/" + record[semconv.USAGE_ID].split("/", 1)[1]
        assert record[semconv.SERVICE_NAME] == semconv.SERVICE_NAME_DEFAULT
        assert record[semconv.GEN_AI_RESPONSE_MODEL] == MODEL_NAME
        assert record[semconv.VLLM_REQUEST_ID] == span.attributes[semconv.VLLM_REQUEST_ID]
        assert record[semconv.GEN_AI_OPERATION_NAME] == span.attributes[semconv.GEN_AI_OPERATION_NAME]
        for field in (
            semconv.GEN_AI_USAGE_INPUT_TOKENS,
            semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
            semconv.GEN_AI_USAGE_OUTPUT_TOKENS,
            semconv.TENANT_SCENE,
            semconv.TENANT_COST_CENTER,
        ):
            assert record.get(field) == span.attributes.get(field), field
        assert record[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS]
        assert abs(record[semconv.USAGE_TIME] - span.end_ns) < 1_000_000  # written as the span ended
        aborted = span.attributes.get(semconv.VLLM_ABORTED, False)
        assert record[semconv.REQUEST_OUTCOME] == (semconv.OUTCOME_ABORTED if aborted else semconv.OUTCOME_FINISHED)
        # abandoned streams: the outcome the engine's own counters gave
        assert aborted == traffic.engine_aborted.get(record[semconv.USAGE_TRACE_ID], False)
    outcomes = Counter(r[semconv.REQUEST_OUTCOME] for r in records)
    assert outcomes[semconv.OUTCOME_ABORTED] == len(ABORTING)
    assert Counter(r[semconv.GEN_AI_REQUEST_CHOICE_COUNT] for r in records)[2] == 20


def test_ledger_report_bills_every_tenant_exactly(traffic, expected, records):
    rows = ledger_report(str(traffic.spool), traffic)["rows"]
    assert [r["tenant"] for r in rows] == TENANTS  # all 120: no cap, no "other"
    written = Counter()  # the prefix-cache writes vLLM's request states told (a breakdown of input)
    for record in records:
        written[record.get(semconv.TENANT_ID)] += record.get(semconv.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS, 0)
    assert sum(written.values()) > 0
    for row in rows:
        assert row["tokens"] == {
            **{t: expected[(row["tenant"], t)] for t in TYPES},
            "cache_write_input": written[row["tenant"]],
        }, row["tenant"]
    aborted = [r for r in rows if r["tenant"] in ABORTING]
    assert all(r["tokens"][semconv.TOKEN_TYPE_OUTPUT] > 5 for r in aborted)


def test_otlp_usage_events_are_the_same_records(traffic, records, receiver):
    def all_events(rx):
        events = [r for r in rx.logs if r.event_name == semconv.USAGE_EVENT]
        return events if len(events) >= len(records) else None

    events = {e.attributes[semconv.USAGE_ID]: e for e in receiver.wait_for(all_events, 30)}
    assert len(events) == len(records)
    for record in records:
        event = events[record[semconv.USAGE_ID]]
        assert event.attributes == {k: v for k, v in record.items() if k not in SPOOL_ONLY}
        assert event.time_ns == record[semconv.USAGE_TIME]
        assert (event.trace_id, event.span_id) == (record[semconv.USAGE_TRACE_ID], record[semconv.USAGE_SPAN_ID])


def test_clickhouse_table_gives_the_same_report_and_counts_a_reshipped_spool_once(traffic, records, tmp_path):
    # one snapshot of the whole spool, every kind of record, as the collector ships it: the engine
    # cores' records are joined to the bills (an aborted stream's output tokens the API server did not
    # read), and one that lands between two reads of the live spool would be in one report only
    # (taken after `records`: every call of the traffic has its record by then)
    snapshot = shutil.copytree(traffic.spool, tmp_path / "spool")
    shipped = ledger.read_spool(str(snapshot), kinds=None)
    kinds = {r.get(semconv.USAGE_KIND, semconv.USAGE_KIND_REQUEST) for r in shipped}
    assert kinds >= {semconv.USAGE_KIND_REQUEST, semconv.USAGE_KIND_ENGINE}
    session = str(tmp_path / "chdb")
    executor = ledger.ChdbExecutor(session)
    executor.execute("CREATE DATABASE IF NOT EXISTS otel")
    executor.execute(ledger.otel_logs_ddl("otel", "otel_logs"))
    for _ in range(2):  # shipped twice (filelog replay, or filelog and OTLP both on)
        executor.execute(ledger.insert_records_sql(shipped, "otel.otel_logs"))
    assert executor.rows("SELECT count() AS n FROM otel.otel_logs")[0]["n"] in (2 * len(shipped), str(2 * len(shipped)))
    where = f"chdb://{session}?table=otel.otel_logs"
    for by in ("tenant", "tenant,scene,cost_center,model,day"):
        assert ledger_report(where, traffic, by) == ledger_report(str(snapshot), traffic, by)


def test_reconcile_matches_vllm_counters(traffic, prometheus, records):
    code, out, err = run_cli(
        reconcile,
        "reconcile",
        "--ledger",
        str(traffic.spool),
        "--prometheus",
        prometheus.url,
        "--format",
        "json",
        *window(traffic),
    )
    assert out, err
    rows = json.loads(out)["rows"]
    assert code == 0, out + err
    assert len(rows) == 3 and {r["state"] for r in rows} == {"ok"}
    input_row = next(r for r in rows if r["tokens"] == semconv.TOKEN_TYPE_INPUT)
    n2_prompts = sum(
        r[semconv.GEN_AI_USAGE_INPUT_TOKENS] for r in records if r[semconv.GEN_AI_REQUEST_CHOICE_COUNT] == 2
    )
    assert input_row["explained"] == n2_prompts > 0
    assert input_row["engine"] == input_row["ledger"] + n2_prompts


def test_reconcile_flags_a_lost_record(traffic, prometheus, records, tmp_path):
    lost = tmp_path / "lost"
    lost.mkdir()
    kept = [r for r in records if r[semconv.USAGE_ID] != records[0][semconv.USAGE_ID]]
    (lost / "usage-test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    code, out, err = run_cli(
        reconcile, "reconcile", "--ledger", str(lost), "--prometheus", prometheus.url, "--by", "model", *window(traffic)
    )
    assert code == 1, out + err
    assert "MISMATCH" in out


def test_exports_are_idempotent_and_add_up(traffic, records, expected, tmp_path):
    rows = ledger.open_ledger(str(traffic.spool)).records(traffic.started - 60, traffic.ended + 1)
    lago, missing = exports.render(rows, "lago", {})
    events = [json.loads(line)["event"] for line in lago.splitlines()]
    assert not missing and len(events) == len(records)
    assert {e["transaction_id"] for e in events} == {r[semconv.USAGE_ID] for r in records}
    stripe, _ = exports.render(rows, "stripe", {t: f"cus_{t}" for t in TENANTS})
    summed = Counter()
    for line in stripe.splitlines():
        event = json.loads(line)
        token_type = event["event_name"].removeprefix("llm_").removesuffix("_tokens")
        customer = event["payload"]["stripe_customer_id"].removeprefix("cus_")
        summed[(customer, token_type)] += int(event["payload"]["value"])
        assert len(event["identifier"]) <= exports.STRIPE_IDENTIFIER_MAX
    uncached = Counter(
        {
            (tenant, "uncached_input"): expected[(tenant, semconv.TOKEN_TYPE_INPUT)]
            - expected[(tenant, semconv.TOKEN_TYPE_CACHED_INPUT)]
            for tenant in TENANTS
        }
    )
    assert summed == +(expected + uncached)
    again, _ = exports.render(
        ledger.open_ledger(str(traffic.spool)).records(traffic.started - 60, traffic.ended + 1),
        "stripe",
        {t: f"cus_{t}" for t in TENANTS},
    )
    assert again == stripe  # a re-run sends the same identifiers
    csv_rows = exports.render(rows, "csv", {})[0].splitlines()
    assert len(csv_rows) == len(records) + 1


def test_the_metrics_cap_tenants_while_the_ledger_names_them_all(traffic, receiver, records):
    def token_points(rx):
        points = [p for p in rx.latest_metrics() if p.name == semconv.SERVER_TOKEN_USAGE]
        total = sum(p.value for p in points if p.attributes[semconv.GEN_AI_TOKEN_TYPE] == semconv.TOKEN_TYPE_OUTPUT)
        return points if total == sum(r[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] for r in records) else None

    points = receiver.wait_for(token_points, 30)
    tenants = {p.attributes[semconv.TENANT_ID] for p in points}
    assert semconv.LABEL_OTHER in tenants and len(tenants) == 51  # the first 50 keep their name
    assert {r[semconv.TENANT_ID] for r in records} == set(TENANTS)
