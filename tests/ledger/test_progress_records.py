"""Progress records (kind "progress": a request's tokens so far, written while it runs; see
otel_llm/vllm/live.py) are never billed: every query of the ledger, over a spool and over the
collector's ClickHouse table, counts the bills alone, whether or not a progress record's bill came."""

import json

from otel_llm import semconv, usage
from otel_llm.billing import ledger

T0 = 1_796_169_600  # 2026-12-02T00:00:00Z
DAY = 86400


def record(key, end, output, tenant="acme", kind=None, input_tokens=10, cached=4):
    rec = {
        semconv.USAGE_ID: key,
        semconv.TENANT_ID: tenant,
        semconv.GEN_AI_REQUEST_MODEL: "m",
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
        semconv.SERVICE_INSTANCE_ID: "host:8000",
        semconv.GEN_AI_USAGE_INPUT_TOKENS: input_tokens,
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: cached,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: output,
        semconv.USAGE_TIME: int(end * 1e9),
    }
    if kind is not None:
        rec[semconv.USAGE_KIND] = kind
    return rec


PROGRESS = semconv.USAGE_KIND_PROGRESS
RECORDS = (
    # a long stream: two progress records, then its bill
    record("host:8000/a", T0 + 10, 40, kind=PROGRESS),
    record("host:8000/a", T0 + 15, 90, kind=PROGRESS),
    record("host:8000/a", T0 + 17, 100),
    # a bill that names its kind
    record("host:8000/b", T0 + 20, 5, tenant="beta", kind=semconv.USAGE_KIND_REQUEST),
    # still in flight (or its server died): progress only, no bill
    record("host:8000/c", T0 + 30, 70, tenant="gamma", kind=PROGRESS),
)


def spool_with_progress(directory):
    spool = usage.Spool(str(directory), fsync_interval_s=0)
    for rec in RECORDS:
        spool.write(json.dumps(rec).encode() + b"\n")
    spool.close()
    return directory


def answers(book: ledger.Ledger) -> dict:
    usage_rows = book.usage(T0, T0 + DAY, ["tenant"])
    return {
        "usage": {k: (r.tokens, r.requests) for k, r in usage_rows.items()},
        "records": sorted((r["key"], int(r["output"])) for r in book.records(T0, T0 + DAY)),
        "reconcile": {
            k: (int(v["output"]), int(v["requests"]))
            for k, v in book.reconcile_totals(T0, T0 + DAY, ["tenant"]).items()
        },
        "engines": book.engine_check(T0, T0 + DAY),
        "windows": book.windows(T0, T0 + DAY, ["engine_instance"]),
    }


EXPECTED = {
    "usage": {
        ("acme",): ({"input": 10, "cached_input": 4, "output": 100}, 1),
        ("beta",): ({"input": 10, "cached_input": 4, "output": 5}, 1),
    },
    "records": [("host:8000/a", 100), ("host:8000/b", 5)],
    "reconcile": {("acme",): (100, 1), ("beta",): (5, 1)},
    "engines": [],
    "windows": {},
}


def test_progress_records_are_never_billed(tmp_path):
    spool = spool_with_progress(tmp_path / "spool")
    assert answers(ledger.open_ledger(str(spool))) == EXPECTED
    assert [r[semconv.USAGE_ID] for r in ledger.read_spool(str(spool))] == ["host:8000/a", "host:8000/b"]
    assert len(ledger.read_spool(str(spool), kinds=(PROGRESS,))) == 3


def test_nor_over_the_collectors_table(tmp_path):
    assert answers(ledger.load_otel_logs(str(tmp_path / "session"), list(RECORDS))) == EXPECTED
