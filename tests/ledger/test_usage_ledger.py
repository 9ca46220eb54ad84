"""The usage ledger without a server: the spool's files, rotation, faults (unwritable directory,
disk full, a write torn by a full disk), fsync batching and fork; the SQL over spool files in
chDB (de-duplication, window edges, days in UTC, unset tenants); exports and reconcile's
instance matching; every error a user can cause is one clear line."""

import errno
import json
import logging
import os
import threading
import time

import pytest

from otel_llm import semconv, usage
from otel_llm.billing import exports, ledger, reconcile
from otel_llm.billing.promql import ReportError

DAY = 86400
T0 = 1_796_169_600  # 2026-12-02T00:00:00Z


def record(key, tenant="acme", end=T0 + 100.0, input_tokens=10, cached=4, output=5, **extra):
    return {
        semconv.USAGE_ID: key,
        semconv.TENANT_ID: tenant,
        semconv.GEN_AI_REQUEST_MODEL: "m",
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
        semconv.GEN_AI_USAGE_INPUT_TOKENS: input_tokens,
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: cached,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: output,
        semconv.USAGE_TIME: int(end * 1e9),
        **extra,
    }


def line(rec) -> bytes:
    return json.dumps(rec).encode() + b"\n"


def files(directory):
    return sorted(p for p in directory.glob(usage.SPOOL_PREFIX + "*" + usage.SPOOL_SUFFIX))


# --- spool ------------------------------------------------------------------------------------


def test_spool_appends_whole_lines_to_a_file_of_this_process(tmp_path):
    spool = usage.Spool(str(tmp_path), fsync_interval_s=0)
    assert spool.write(line(record("a"))) and spool.write(line(record("b")))
    (path,) = files(tmp_path)
    assert f"-{os.getpid()}-" in path.name
    assert [r[semconv.USAGE_ID] for r in ledger.read_spool(str(tmp_path))] == ["a", "b"]
    spool.close()


def test_a_spool_line_is_compact_utf8_json_whatever_the_values():
    rec = record("i/1", tenant="café\u2028", duration=1e-05, big=1e16, ids=("a", "b"))
    out = usage.json_line(rec)
    assert out.endswith(b"\n") and out.count(b"\n") == 1 and b": " not in out and b", " not in out
    assert "café".encode() in out  # UTF-8, not \u escapes
    assert json.loads(out) == {**rec, "ids": ["a", "b"]}

    class Label(str):  # a value msgspec's encoder does not take: the stdlib's writes it
        pass

    assert json.loads(usage.json_line({"tenant.id": Label("acme")})) == {"tenant.id": "acme"}
    assert json.loads(usage.json_line({"d": float("nan")})) == {"d": None}  # valid JSON, not NaN
    with pytest.raises(TypeError):  # neither takes it: the ledger counts the drop (test_the_ledger_counts_...)
        usage.json_line({"x": object()})


def test_spool_rotates_by_size_and_by_age_and_loses_nothing(tmp_path):
    spool = usage.Spool(str(tmp_path), max_bytes=300, fsync_interval_s=0)
    for i in range(10):
        spool.write(line(record(f"k{i}")))
    assert len(files(tmp_path)) >= 3
    aged = usage.Spool(str(tmp_path / "aged"), max_age_s=0, fsync_interval_s=0)
    for i in range(3):
        aged.write(line(record(f"a{i}")))
    assert len(files(tmp_path / "aged")) == 3
    assert sorted(r[semconv.USAGE_ID] for r in ledger.read_spool(str(tmp_path))) == [f"k{i}" for i in range(10)]


def test_an_unwritable_directory_drops_records_with_one_warning_and_recovers(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    drops = []
    spool = usage.Spool(str(blocker / "usage"), fsync_interval_s=0, on_drop=drops.append)
    with caplog.at_level(logging.WARNING, logger="otel_llm"):
        assert not spool.write(line(record("a")))
        assert not spool.write(line(record("b")))  # within the retry pause: no new open attempt
    assert drops == ["open", "open"]
    assert len([r for r in caplog.records if "usage record dropped" in r.message]) == 1
    blocker.unlink()
    spool.RETRY_OPEN_S = 0
    assert spool.write(line(record("c")))
    assert [r[semconv.USAGE_ID] for r in ledger.read_spool(str(blocker / "usage"))] == ["c"]


def test_a_full_disk_drops_and_a_torn_line_does_not_swallow_the_next(tmp_path, monkeypatch):
    drops = []
    spool = usage.Spool(str(tmp_path), fsync_interval_s=0, on_drop=drops.append)
    spool.write(line(record("before")))
    real_write = os.write
    state = {"calls": 0}

    def full_after_half(fd, data):
        state["calls"] += 1
        if state["calls"] == 1:
            return real_write(fd, data[: len(data) // 2])  # the disk fills mid-line
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(usage.os, "write", full_after_half)
    assert not spool.write(line(record("torn")))
    assert not spool.write(line(record("dropped")))
    monkeypatch.setattr(usage.os, "write", real_write)
    assert spool.write(line(record("after")))
    assert drops == [semconv.DROP_DISK_FULL, semconv.DROP_DISK_FULL]
    assert [r[semconv.USAGE_ID] for r in ledger.read_spool(str(tmp_path))] == ["before", "after"]


def test_fsync_is_batched_and_only_when_something_was_written(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(usage.os, "fsync", lambda fd: synced.append(fd))
    spool = usage.Spool(str(tmp_path), fsync_interval_s=0)
    spool.write(line(record("a")))
    spool.write(line(record("b")))
    spool.sync()
    spool.sync()
    assert len(synced) == 1


def test_the_fsync_thread_syncs_within_its_interval(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(usage.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    spool = usage.Spool(str(tmp_path), fsync_interval_s=0.05)
    spool.write(line(record("a")))
    deadline = time.monotonic() + 30
    while not synced:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    spool.close()


def test_a_forked_child_writes_its_own_file(tmp_path):
    spool = usage.Spool(str(tmp_path), fsync_interval_s=0)
    spool.write(line(record("parent")))
    pid = os.fork()
    if pid == 0:  # the child
        try:
            spool.write(line(record("child")))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert len(files(tmp_path)) == 2
    assert sorted(r[semconv.USAGE_ID] for r in ledger.read_spool(str(tmp_path))) == ["child", "parent"]


def test_the_ledger_counts_dropped_records_by_reason(tmp_path, memory_otel):
    reader = memory_otel.reader
    meter = memory_otel.meter_provider.get_meter("t")
    blocker = tmp_path / "file"
    blocker.write_text("")
    writer = usage.UsageLedger(meter, directory=str(blocker / "x"), events=False, instance="h:1", service="vllm")
    writer.write(record("a"), T0 * 10**9, None)
    points = [
        p
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == semconv.USAGE_RECORDS_DROPPED
        for p in m.data.data_points
    ]
    assert [(p.value, dict(p.attributes)) for p in points] == [(1, {semconv.ERROR_TYPE: semconv.DROP_OPEN})]
    assert writer.key("req-1") == "h:1/req-1"


# --- reading ------------------------------------------------------------------------------------


@pytest.fixture
def spool_dir(tmp_path):
    spool = usage.Spool(str(tmp_path), fsync_interval_s=0)
    for rec in (
        record("a", "acme", T0 + 10),
        record("a", "acme", T0 + 10),  # the same record twice (a re-shipped spool)
        record("b", "acme", T0 + DAY + 5, output=7),  # the next UTC day
        record("c", "beta", T0 + 20, cached=0),
        record("d", None, T0 + 30),  # no tenant
        record("e", "acme", T0 - 1),  # before the window
        record("f", "acme", T0 + 2 * DAY),  # at the window's end: excluded
    ):
        spool.write(line({k: v for k, v in rec.items() if v is not None}))
    (tmp_path / "usage-torn.jsonl").write_bytes(b'{"otel_llm.usage.id": "g", "tenant.id": "ac')
    return tmp_path


def test_the_spool_report_deduplicates_and_respects_the_window_and_utc_days(spool_dir):
    rows = ledger.open_ledger(str(spool_dir)).usage(T0, T0 + 2 * DAY, ["tenant", "day"])
    assert {k: (r.tokens, r.requests) for k, r in rows.items()} == {
        ("-", "2026-12-02"): ({"input": 10, "cached_input": 4, "output": 5}, 1),
        ("acme", "2026-12-02"): ({"input": 10, "cached_input": 4, "output": 5}, 1),
        ("acme", "2026-12-03"): ({"input": 10, "cached_input": 4, "output": 7}, 1),
        ("beta", "2026-12-02"): ({"input": 10, "cached_input": 0, "output": 5}, 1),
    }


def test_the_otel_logs_table_gives_the_same_answer(spool_dir, tmp_path):
    table = ledger.load_otel_logs(str(tmp_path / "session"), ledger.read_spool(str(spool_dir)))
    spool = ledger.open_ledger(str(spool_dir))
    for by in (["tenant"], ["tenant", "day"], ["model", "operation"]):
        got = {k: (r.tokens, r.requests) for k, r in table.usage(T0, T0 + 2 * DAY, by).items()}
        assert got == {k: (r.tokens, r.requests) for k, r in spool.usage(T0, T0 + 2 * DAY, by).items()}


@pytest.mark.parametrize(
    "where,message",
    [
        ("/no/such/dir", "no such directory"),
        ("postgres://db/x", "use a spool directory"),
        ("clickhouse:///otel", "expected clickhouse://HOST:PORT/DATABASE"),
        ("clickhouse://127.0.0.1:9/otel?table=x;drop", "table must be a plain"),
    ],
)
def test_bad_ledger_locations_are_clear_errors(where, message):
    with pytest.raises(ReportError, match=message):
        ledger.open_ledger(where)


def test_an_empty_spool_directory_says_what_is_missing(tmp_path):
    with pytest.raises(ReportError, match="no usage-"):
        ledger.open_ledger(str(tmp_path))


def test_an_unreachable_clickhouse_is_one_line():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ReportError, match=f"cannot reach ClickHouse at 127.0.0.1:{port}"):
        ledger.open_ledger(f"clickhouse://127.0.0.1:{port}/otel", timeout=5).usage(T0, T0 + DAY, ["tenant"])


# --- export and reconcile helpers ----------------------------------------------------------------------


def test_stripe_identifiers_stay_within_stripes_limit_and_are_stable():
    short = exports.stripe_identifier("host:8000/chatcmpl-1", "output")
    assert short == "host:8000/chatcmpl-1:output"
    long_key = "a-very-long-host-name-" * 5 + ":8000/chatcmpl-0123456789abcdef-01234567"
    ident = exports.stripe_identifier(long_key, "output")
    assert len(ident) <= exports.STRIPE_IDENTIFIER_MAX
    assert ident == exports.stripe_identifier(long_key, "output")
    assert ident != exports.stripe_identifier(long_key, "input")


def test_tenants_without_a_customer_are_left_out_and_named(spool_dir):
    records = ledger.open_ledger(str(spool_dir)).records(T0, T0 + 2 * DAY)
    text, missing = exports.render(records, "lago", {"acme": "sub_acme"})
    events = [json.loads(x)["event"] for x in text.splitlines()]
    assert {e["external_subscription_id"] for e in events} == {"sub_acme"}
    assert {e["transaction_id"] for e in events} == {"a", "b"}
    assert missing == {"beta", "-"}
    assert events[0]["properties"]["uncached_input_tokens"] == 6
    stripe, _ = exports.render(records, "stripe", {"acme": "cus_acme"})
    meters = {
        (e["identifier"].rsplit(":", 1)[0], e["event_name"]): int(e["payload"]["value"])
        for e in map(json.loads, stripe.splitlines())
    }
    first = events[0]["properties"]
    assert (
        meters[("a", "llm_uncached_input_tokens")]
        == first["uncached_input_tokens"]
        == meters[("a", "llm_input_tokens")] - meters.get(("a", "llm_cached_input_tokens"), 0)
    )


def test_customer_files_are_checked(tmp_path):
    bad = tmp_path / "customers.json"
    bad.write_text('{"customers": {"acme": 3}}')
    with pytest.raises(ReportError, match="expected"):
        exports.load_customers(str(bad))


def test_reconcile_matches_instances_by_name_then_by_unique_port():
    mapping = reconcile._match_instances(
        {"vm:8000", "vm:8001", "a:9000", "b:9000"}, {"vm:8000", "127.0.0.1:8001", "10.0.0.1:9000", "10.0.0.2:9000"}
    )
    assert mapping == {"vm:8000": "vm:8000", "vm:8001": "127.0.0.1:8001"}


def test_the_report_says_how_many_torn_lines_it_skipped(spool_dir):
    import argparse
    import io

    from otel_llm.billing import report

    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    args = parser.parse_args(
        ["--ledger", str(spool_dir), "--start", str(T0), "--end", str(T0 + DAY), "--by", "tenant", "--format", "json"]
    )
    out, err = io.StringIO(), io.StringIO()
    assert report.run(args, now=T0 + 2 * DAY, out=out, err=err) == 0
    assert "warning: 1 unreadable line(s)" in err.getvalue()
    assert json.loads(out.getvalue())["total"]["tokens"] == {"input": 30, "cached_input": 8, "output": 15}


def test_rotated_files_are_synced_and_closed_by_the_fsync_thread_not_the_request(tmp_path, monkeypatch):
    real_fsync, synced_in = os.fsync, []
    monkeypatch.setattr(
        usage.os, "fsync", lambda fd: (synced_in.append(threading.current_thread().name), real_fsync(fd))
    )
    fds_before = len(os.listdir("/proc/self/fd"))
    spool = usage.Spool(str(tmp_path), max_bytes=200, fsync_interval_s=0.02)
    for i in range(12):
        spool.write(line(record(f"k{i}")))
    assert len(files(tmp_path)) >= 4
    assert set(synced_in) <= {"otel-llm-usage-fsync"}  # nothing on the writing thread
    deadline = time.monotonic() + 30
    while spool._retired or len(os.listdir("/proc/self/fd")) > fds_before + 1:
        assert time.monotonic() < deadline, "rotated files were never closed"
        time.sleep(0.01)
    spool.close()
    assert len(os.listdir("/proc/self/fd")) == fds_before
    assert len(ledger.read_spool(str(tmp_path))) == 12


def test_budgets_and_prices_read_the_ledger_too(spool_dir, tmp_path):
    import argparse
    import io

    from otel_llm.billing import report
    from otel_llm.ops import budget_view

    budgets = tmp_path / "budgets.json"
    budgets.write_text(
        json.dumps({"budgets": [{"tenant": "acme", "tokens_per_day": 16}, {"tenant": "beta", "tokens_per_day": 10}]})
    )
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"models": {"*": {"input": 1.0, "cached_input": 0.5, "output": 2.0}}}))
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)

    def run(*argv):
        out, err = io.StringIO(), io.StringIO()
        code = budget_view.run_report(
            parser.parse_args(["--ledger", str(spool_dir), "--format", "json", *argv]),
            now=T0 + 2 * DAY,
            out=out,
            err=err,
        )
        return code, json.loads(out.getvalue())

    code, view = run("--budgets", str(budgets), "--start", str(T0), "--end", str(T0 + DAY))
    assert code == 1  # one budget is over; each tenant used 10 input + 5 output tokens that day
    assert [(b["tenant"], b["used"], b["state"]) for b in view["budgets"]] == [
        ("acme", 15, "near"),
        ("beta", 15, "over"),
    ]
    code, priced = run("--prices", str(prices), "--start", str(T0), "--end", str(T0 + 2 * DAY), "--by", "tenant")
    assert code == 0
    acme = next(r for r in priced["rows"] if r["tenant"] == "acme")
    # 20 input of which 8 cached, 12 output: (12 x 1.0 + 8 x 0.5 + 12 x 2.0) per million
    assert acme["cost"] == pytest.approx(40 / 1e6) and acme["requests"] == 2
