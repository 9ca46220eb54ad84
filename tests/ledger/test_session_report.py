"""`otel-llm report --ledger` per conversation (--by session) and the token breakdown columns
(cache_write_input, external_cached_input, reasoning_output, draft_tokens, accepted_tokens): summed
per bill like the token types, a record shipped twice counted once, shown only when some bill in
the window has one; from the spool and from the collector's ClickHouse table alike."""

import argparse
import io
import json

import pytest

from otel_llm import semconv
from otel_llm.billing import ledger, report

T0 = 1_796_169_600  # 2026-12-02T00:00:00Z
HOUR = 3600
DETAIL = dict(semconv.USAGE_DETAIL_TOKEN_FIELDS)  # record field -> report column


def record(key, tenant, session, end, input_tokens, cached, output, **details):
    """details: report column (cache_write_input, ..., draft_tokens) -> count."""
    fields = {column: field for field, column in DETAIL.items()}
    fields.update(draft_tokens=semconv.VLLM_SPEC_DRAFT_TOKENS, accepted_tokens=semconv.VLLM_SPEC_ACCEPTED_TOKENS)
    rec = {
        semconv.USAGE_ID: key,
        semconv.TENANT_ID: tenant,
        semconv.GEN_AI_REQUEST_MODEL: "m",
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
        semconv.GEN_AI_USAGE_INPUT_TOKENS: input_tokens,
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: cached,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: output,
        semconv.USAGE_TIME: int(end * 1e9),
        **{fields[c]: n for c, n in details.items()},
    }
    if session:
        rec[semconv.GEN_AI_CONVERSATION_ID] = session
    return rec


BREAKDOWNS = dict(cache_write_input=30, external_cached_input=10, reasoning_output=5)
RECORDS = [
    # hour 0: every breakdown, and speculative decoding
    record("b1", "acme", "conv-a", T0 + 10, 100, 40, 20, **BREAKDOWNS),
    record("b1", "acme", "conv-a", T0 + 10, 100, 40, 20, **BREAKDOWNS),  # shipped twice: billed once
    record("b3", "beta", "conv-b", T0 + 30, 10, 0, 1, draft_tokens=12, accepted_tokens=9),
    # hour 1: reasoning only
    record("b2", "acme", "conv-a", T0 + HOUR + 20, 50, 20, 10, reasoning_output=4),
    record("b4", "beta", "conv-b", T0 + HOUR + 40, 7, 0, 2),
    # hour 2: none; two requests outside any conversation, and acme re-using beta's conversation id
    record("b5", "acme", None, T0 + 2 * HOUR + 1, 1, 0, 1),
    record("b6", "beta", None, T0 + 2 * HOUR + 2, 3, 0, 3),
    record("b7", "acme", "conv-b", T0 + 2 * HOUR + 3, 2, 0, 2),
]
WHOLE = (T0, T0 + 3 * HOUR)


@pytest.fixture
def spool_dir(write_spool):
    return write_spool(RECORDS)


def sums(rows):
    return {k: (r.tokens, r.requests) for k, r in rows.items()}


def tokens(input_tokens, cached, output, **details):
    return {"input": input_tokens, "cached_input": cached, "output": output, **details}


BY_SESSION = {
    ("-",): (tokens(4, 0, 4), 2),
    ("conv-a",): (tokens(150, 60, 30, cache_write_input=30, external_cached_input=10, reasoning_output=9), 2),
    ("conv-b",): (tokens(19, 0, 5, draft_tokens=12, accepted_tokens=9), 3),
}
BY_TENANT_SESSION = {
    ("acme", "-"): (tokens(1, 0, 1), 1),
    ("acme", "conv-a"): BY_SESSION[("conv-a",)],
    ("acme", "conv-b"): (tokens(2, 0, 2), 1),
    ("beta", "-"): (tokens(3, 0, 3), 1),
    ("beta", "conv-b"): (tokens(17, 0, 3, draft_tokens=12, accepted_tokens=9), 2),
}


def test_a_conversation_is_billed_from_its_requests_once_each(spool_dir):
    source = ledger.open_ledger(str(spool_dir))
    assert sums(source.usage(*WHOLE, ["session"])) == BY_SESSION
    # one conversation id in two tenants is two conversations
    assert sums(source.usage(*WHOLE, ["tenant", "session"])) == BY_TENANT_SESSION


def test_the_otel_logs_table_gives_the_same_answer(spool_dir, tmp_path):
    table = ledger.load_otel_logs(str(tmp_path / "session"), ledger.read_spool(str(spool_dir)))
    assert sums(table.usage(*WHOLE, ["session"])) == BY_SESSION
    assert sums(table.usage(*WHOLE, ["tenant", "session"])) == BY_TENANT_SESSION
    assert sums(table.usage(T0 + HOUR, T0 + 2 * HOUR, ["session"])) == {
        ("conv-a",): (tokens(50, 20, 10, reasoning_output=4), 1),
        ("conv-b",): (tokens(7, 0, 2), 1),
    }


def run(*argv):
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    code = report.run(parser.parse_args(list(argv)), now=T0 + 3 * HOUR, out=out, err=err)
    assert code == 0, err.getvalue()
    return out.getvalue()


def window(spool_dir, start, end):
    return ("--ledger", str(spool_dir), "--start", str(start), "--end", str(end))


ALL_COLUMNS = [
    "input",
    "cached_input",
    "output",
    "cache_write_input",
    "external_cached_input",
    "reasoning_output",
    "draft_tokens",
    "accepted_tokens",
]


def test_breakdown_columns_in_json_csv_and_table(spool_dir):
    data = json.loads(run(*window(spool_dir, *WHOLE), "--by", "tenant,session", "--format", "json"))
    full = {k: dict.fromkeys(ALL_COLUMNS, 0) for k in BY_TENANT_SESSION}
    for k, (counts, _) in BY_TENANT_SESSION.items():
        full[k].update(counts)
    assert {(r["tenant"], r["session"]): (r["tokens"], r["requests"]) for r in data["rows"]} == {
        k: (full[k], requests) for k, (_, requests) in BY_TENANT_SESSION.items()
    }
    assert [list(r["tokens"]) for r in data["rows"]] == [ALL_COLUMNS] * len(BY_TENANT_SESSION)
    assert data["total"]["tokens"] == dict(zip(ALL_COLUMNS, [173, 60, 39, 30, 10, 9, 12, 9]))

    lines = run(*window(spool_dir, *WHOLE), "--by", "session", "--format", "csv").strip().splitlines()
    assert lines == [
        "session," + ",".join(ALL_COLUMNS),
        "-,4,0,4,0,0,0,0,0",
        "conv-a,150,60,30,30,10,9,0,0",
        "conv-b,19,0,5,0,0,0,12,9",
        "TOTAL,173,60,39,30,10,9,12,9",
    ]

    table = run(*window(spool_dir, *WHOLE), "--by", "session").splitlines()
    assert table[1].split() == ["session", *ALL_COLUMNS]
    assert table[-1].split() == ["TOTAL", "173", "60", "39", "30", "10", "9", "12", "9"]


def test_a_breakdown_shows_only_when_a_bill_in_the_window_has_it(spool_dir):
    # hour 1: reasoning tokens only
    hour1 = window(spool_dir, T0 + HOUR, T0 + 2 * HOUR)
    data = json.loads(run(*hour1, "--by", "session", "--format", "json"))
    assert [(r["session"], r["tokens"]) for r in data["rows"]] == [
        ("conv-a", tokens(50, 20, 10, reasoning_output=4)),
        ("conv-b", tokens(7, 0, 2, reasoning_output=0)),
    ]
    assert data["total"]["tokens"] == tokens(57, 20, 12, reasoning_output=4)
    assert run(*hour1, "--by", "session", "--format", "csv").strip().splitlines()[0] == (
        "session,input,cached_input,output,reasoning_output"
    )
    assert run(*hour1, "--by", "session").splitlines()[1].split() == [
        "session",
        "input",
        "cached_input",
        "output",
        "reasoning_output",
    ]

    # hour 2: none, so the report is what it was before breakdowns existed
    hour2 = window(spool_dir, T0 + 2 * HOUR, T0 + 3 * HOUR)
    data = json.loads(run(*hour2, "--by", "session", "--format", "json"))
    assert [(r["session"], r["tokens"], r["requests"]) for r in data["rows"]] == [
        ("-", tokens(4, 0, 4), 2),
        ("conv-b", tokens(2, 0, 2), 1),
    ]
    assert data["total"]["tokens"] == tokens(6, 0, 6)
    assert run(*hour2, "--by", "session", "--format", "csv").strip().splitlines() == [
        "session,input,cached_input,output",
        "-,4,0,4",
        "conv-b,2,0,2",
        "TOTAL,6,0,6",
    ]
    assert run(*hour2, "--by", "session").splitlines()[1].split() == ["session", "input", "cached_input", "output"]


def test_session_needs_the_ledger():
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    args = parser.parse_args(["--by", "tenant,session", "--prometheus", "http://127.0.0.1:9", "--range", "1h"])
    assert report.run(args, now=T0, out=out, err=err) == 2 and out.getvalue() == ""
    assert err.getvalue().startswith("otel-llm report: --by session needs --ledger")


def engine_record(key, engine_id, end, external):
    return {
        semconv.USAGE_ID: key,
        semconv.USAGE_KIND: semconv.USAGE_KIND_ENGINE,
        semconv.VLLM_ENGINE_REQUEST_ID: engine_id,
        semconv.USAGE_FRONTEND_BILLED: True,
        semconv.GEN_AI_USAGE_INPUT_TOKENS: 300,
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 256,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 2,
        semconv.USAGE_TIME: int(end * 1e9),
        **({semconv.VLLM_EXTERNAL_CACHED_TOKENS: external} if external else {}),
    }


def test_the_connectors_part_of_a_hit_comes_from_the_engine_where_the_bill_missed_it(write_spool):
    """A bill's external_cached_input is its API server's figure; where that record missed the engine's
    figures (they came after the final output), the engine records' sum; a P/D decode leg's stays its
    frontend's (the prefill node's hits, not the whole prompt its connector loaded)."""

    def bill(key, engine_id, external=0, pd_role=None):
        rec = record(
            key, "acme", None, T0 + 5, 300, 256, 2, **({"external_cached_input": external} if external else {})
        )
        rec[semconv.USAGE_ENGINE_REQUEST_IDS] = [engine_id]
        if pd_role:
            rec[semconv.VLLM_PD_ROLE] = pd_role
        return rec

    spool = write_spool(
        [
            bill("missed", "e1"),
            engine_record("eng/e1", "e1", T0 + 6, 256),
            bill("told", "e2", 256),
            engine_record("eng/e2", "e2", T0 + 6, 256),
            bill("local", "e3"),
            engine_record("eng/e3", "e3", T0 + 6, 0),
            bill("decode", "e4", 40, semconv.PD_ROLE_DECODE),
            engine_record("eng/e4", "e4", T0 + 6, 300),
        ]
    )
    rows = ledger.open_ledger(str(spool)).usage(*WHOLE, ["day"])
    (row,) = rows.values()
    assert row.requests == 4
    assert row.tokens["external_cached_input"] == 256 + 256 + 0 + 40
