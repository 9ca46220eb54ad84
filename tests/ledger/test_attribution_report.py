"""`otel-llm report --ledger` below the tenant: --by api_key,user, --by hour, and --top N ranked by
tokens or cost, from the spool and from the collector's ClickHouse table alike."""

import argparse
import io
import json

import pytest

from otel_llm import semconv
from otel_llm.billing import ledger, report

T0 = 1_796_169_600  # 2026-12-02T00:00:00Z
HOUR = 3600


def record(key, api_key, user, end, input_tokens, output, model="m"):
    rec = {
        semconv.USAGE_ID: key,
        semconv.TENANT_ID: "acme",
        semconv.GEN_AI_REQUEST_MODEL: model,
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
        semconv.GEN_AI_USAGE_INPUT_TOKENS: input_tokens,
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 0,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: output,
        semconv.USAGE_TIME: int(end * 1e9),
    }
    if api_key:
        rec[semconv.API_KEY_ID] = api_key
    if user:
        rec[semconv.USER_ID] = user
    return rec


RECORDS = [
    record("r1", "prod", "alice", T0 + 10, 100, 10),
    record("r1", "prod", "alice", T0 + 10, 100, 10),  # shipped twice: billed once
    record("r2", "prod", "bob", T0 + HOUR + 5, 20, 2),
    record("r3", "batch", "alice", T0 + HOUR + 59 * 60, 300, 30, model="big"),
    record("r4", "batch", None, T0 + 2 * HOUR, 1, 1),  # no user: `-`
    record("r5", None, "carol", T0 + 2 * HOUR + 1, 5, 5),  # a key the map does not name (or none)
]


@pytest.fixture
def spool_dir(write_spool):
    return write_spool(RECORDS)


def tokens(rows):
    return {
        k: (r.tokens[semconv.TOKEN_TYPE_INPUT], r.tokens[semconv.TOKEN_TYPE_OUTPUT], r.requests)
        for k, r in rows.items()
    }


def test_keys_users_and_hours_are_told_apart(spool_dir):
    source = ledger.open_ledger(str(spool_dir))
    assert tokens(source.usage(T0, T0 + 3 * HOUR, ["api_key", "user"])) == {
        ("-", "carol"): (5, 5, 1),
        ("batch", "-"): (1, 1, 1),
        ("batch", "alice"): (300, 30, 1),
        ("prod", "alice"): (100, 10, 1),
        ("prod", "bob"): (20, 2, 1),
    }
    # the UTC hour the record ended in (59:00 past the hour is still that hour; 02:00:00 the next)
    assert tokens(source.usage(T0, T0 + 3 * HOUR, ["hour"])) == {
        ("2026-12-02T00",): (100, 10, 1),
        ("2026-12-02T01",): (320, 32, 2),
        ("2026-12-02T02",): (6, 6, 2),
    }


def test_the_otel_logs_table_gives_the_same_answer(spool_dir, tmp_path):
    table = ledger.load_otel_logs(str(tmp_path / "session"), ledger.read_spool(str(spool_dir)))
    spool = ledger.open_ledger(str(spool_dir))
    for by in (["api_key", "user"], ["user", "hour"], ["tenant", "api_key"]):
        assert tokens(table.usage(T0, T0 + 3 * HOUR, by)) == tokens(spool.usage(T0, T0 + 3 * HOUR, by))


def run(*argv):
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    code = report.run(parser.parse_args(list(argv)), now=T0 + 3 * HOUR, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_top_ranks_by_tokens_or_by_cost_and_sums_the_rest(spool_dir, tmp_path):
    window = ("--ledger", str(spool_dir), "--start", str(T0), "--end", str(T0 + 3 * HOUR))
    code, out, err = run(*window, "--by", "user", "--top", "2", "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert [(r["user"], r["tokens"]["input"] + r["tokens"]["output"], r["requests"]) for r in data["rows"]] == [
        ("alice", 440, 2),
        ("bob", 22, 1),
        ("(2 others)", 12, 2),
    ]
    assert data["total"]["tokens"] == {"input": 426, "cached_input": 0, "output": 48}  # all rows still
    # by cost: output of model m is priced so high that bob's 2 output tokens outweigh alice's big-model ones
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"models": {"m": {"input": 0, "output": 1000}, "big": {"input": 0, "output": 1}}}))
    code, out, err = run(
        *window, "--by", "api_key,model", "--top", "1", "--rank", "cost", "--prices", str(prices), "--format", "csv"
    )
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith("api_key,model,input,cached_input,output,cost")
    assert [line.split(",")[:2] for line in lines[1:]] == [["prod", "m"], ["(3 others)", ""], ["TOTAL", ""]]
    assert lines[1].split(",")[5] == f"{12 * 1000 / 1e6:.6f}"
    # the table keeps the rank order too
    code, out, err = run(*window, "--by", "api_key", "--top", "1")
    assert code == 0, err
    assert [line.split()[0] for line in out.splitlines()[2:4]] == ["batch", "(2"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (("--top", "0"), "--top 0: give a number of rows"),
        (("--top", "3", "--rank", "cost"), "--rank cost needs --prices or --costs"),
        (("--by", "api_key", "--prometheus", "http://127.0.0.1:9"), "--by api_key needs --ledger"),
        (("--by", "hour", "--prometheus", "http://127.0.0.1:9"), "--by hour needs --ledger"),
    ],
)
def test_bad_top_and_by_are_one_line_errors(spool_dir, argv, message):
    ledger_args = () if "--prometheus" in argv else ("--ledger", str(spool_dir))
    code, out, err = run(*ledger_args, "--range", "1h", *argv)
    assert code == 2 and out == ""
    assert err.startswith("otel-llm report: " + message) and err.count("\n") == 1
