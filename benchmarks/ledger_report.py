"""The billing report at fleet scale: the usage ledger against Prometheus, on the same traffic.

What it builds (under .cache/bench-ledger/, reused while the parameters are unchanged):

- `table-<params>/`: a chDB session directory holding the collector ClickHouse exporter's
  `otel_logs` table (`ledger.otel_logs_ddl()`), filled with ClickHouse SQL (`INSERT ... SELECT
  ... FROM numbers(N)`) with N usage records as the collector stores them (`ledger.insert_records_sql`:
  end time as Timestamp, trace context in TraceId/SpanId, every other record field a
  LogAttributes string). Default: 10,000,000 rows over 30 days, 5,000 tenants (log-uniform
  sizes: the largest has ~8% of the requests, the 50 largest ~46%), 10 models each served by 2 of
  6 instances, 6 scenes, 20 cost centers, chat / text_completion / embeddings, 97% finished, 2%
  aborted, 1% errors; 1% of the rows repeat an earlier record (same `otel_llm.usage.id`, same
  fields: a re-shipped spool), so the report must de-duplicate.
- `spool-<params>/`: the first 1,000,000 of those rows (same 1% duplicates) written as real spool
  files by `otel_llm.usage.UsageLedger.write` (the product's writer: same field names and
  types, 64 MiB rotation).
- `prom-<params>/`: a Prometheus TSDB (`promtool tsdb create-blocks-from openmetrics`) holding
  `otel_llm_server_token_usage_total` for the same traffic as the exporter would have exposed it
  and Prometheus scraped it every 15 s: the labels of `request_facts._record_metrics` (operation, provider,
  request/response model, tenant, scene, cost center, token type) plus job/instance, with the
  tenant label capped as LabelGuard does (the 50 largest tenants keep theirs, the rest are
  "other": the best case for Prometheus). Only `--prom-hours` of the 30 days, ending at 23:00 of
  the last day (inside one 24 h block): a whole day at 15 s is ~180 million samples, more than
  this machine can turn into a TSDB in a few minutes.

What it measures, each report in a fresh subprocess (`python -m otel_llm.cli report ...`; wall
time including interpreter start, and that process's own peak RSS from GNU time), 3 runs each:

- `report --ledger chdb://TABLE --range 30d --by tenant,model,day` and `--by tenant`, totals
  checked against an independent SQL sum over the distinct keys of the stored rows;
- `report --ledger SPOOL_DIR --range 30d --by tenant` (MB/s and records/s of the spool path),
  checked the same way over the files' JSON;
- `report --prometheus URL` over the last hour and the last two hours of that window (alternated,
  one Prometheus serving the built TSDB), next to `report --ledger` over the same window; the 50
  labelled tenants must get the same totals from both, and "other" the sum of the rest. The
  30-day Prometheus figures are an extrapolation (a straight line in samples through the two
  windows), printed as an ESTIMATE.

A "noise" line gives the CPU other processes used meanwhile: figures from a busy machine are not
comparable.

    python benchmarks/ledger_report.py [--records 10000000] [--prom-hours 2] [--skip-prometheus]
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from otel_llm import semconv  # noqa: E402
from otel_llm.billing.promql import TOKEN_METRIC  # noqa: E402

CACHE = ROOT / ".cache" / "bench-ledger"
DAY = 86400
SCRAPE_S = 15
LABEL_LIMIT = 50  # Settings.label_limit default
MODELS = (
    "llama-3.1-8b-instruct",
    "llama-3.1-70b-instruct",
    "qwen2.5-7b-instruct",
    "qwen2.5-32b-instruct",
    "qwen2.5-coder-32b",
    "mistral-small-24b",
    "gemma-2-27b",
    "deepseek-r1-distill-32b",
    "phi-4",
    "bge-m3",
)
EMBEDDING_MODEL = "bge-m3"
SCENES = ("chat", "search", "agent", "summarize", "code-assist", "support")
INSTANCES = 6
COST_CENTERS = 20


# --- the traffic: every field of record r (0 <= r < unique) as ClickHouse SQL ----------------------


def _u(i: int, seed: int) -> str:
    """A uniform [0, 1) draw, the i-th of record r."""
    return f"(cityHash64(r, {seed}, {i}) / 18446744073709551616.)"


def _hex(i: int, seed: int, on: str = "r") -> str:
    return f"leftPad(lower(hex(cityHash64({on}, {seed}, {i}))), 16, '0')"


def records_sql(p: dict, offset: int = 0, limit: int | None = None) -> str:
    """One row per stored record: rows [offset, offset+limit) of p['records'], of which the last
    p['duplicates'] repeat an earlier record (same r, so the same fields and key)."""
    seed, tenants = p["seed"], p["tenants"]
    unique = p["records"] - p["duplicates"]
    start_ns = int(p["end"] - p["days"] * DAY) * 10**9
    span_ns = p["days"] * DAY * 10**9
    limit = p["records"] - offset if limit is None else limit
    models = "[" + ", ".join(f"'{m}'" for m in MODELS) + "]"
    scenes = "[" + ", ".join(f"'{s}'" for s in SCENES) + "]"
    u = lambda i: _u(i, seed)  # noqa: E731
    return f"""
SELECT
  r,
  toUInt32(least(floor(exp(log({tenants} + 1) * {u(1)})), {tenants})) - 1 AS k,
  'tenant-' || leftPad(toString(k), 4, '0') AS tenant,
  if({u(2)} < 0.85, cityHash64(k, {seed}, 'primary'), cityHash64(k, {seed}, 'secondary')) % {len(MODELS)} AS m,
  {models}[m + 1] AS model,
  'vllm-' || toString((m + if({u(3)} < 0.5, 0, 2 + m % 3)) % {INSTANCES}) AS instance,
  {scenes}[1 + if({u(4)} < 0.7, k % {len(SCENES)}, (k * 7 + 1) % {len(SCENES)})] AS scene,
  'cc-' || toString(100 + k % {COST_CENTERS}) AS cost_center,
  multiIf(model = '{EMBEDDING_MODEL}', 'embeddings', {u(5)} < 0.95, 'chat', 'text_completion') AS operation,
  multiIf({u(6)} < 0.97, 'finished', {u(6)} < 0.99, 'aborted', 'error') AS outcome,
  multiIf(outcome = 'aborted', '{semconv.ERROR_CLIENT_ABORTED}', outcome = 'error', 'EngineGenerateError', '') AS error_type,
  toUInt64(floor(exp(log(8000) * {u(7)}))) + 7 AS input_tokens,
  if({u(8)} < 0.4, toUInt64(floor(input_tokens * {u(9)})), 0) AS cached_tokens,
  if(operation = 'embeddings', 0,
     toUInt64(floor(exp(log(2000) * {u(10)}) * if(outcome = 'finished', 1, {u(11)})))) AS output_tokens,
  round(0.02 + input_tokens * 0.00004 + output_tokens * 0.012 + {u(12)} * 0.3, 6) AS duration,
  {start_ns} + cityHash64(r, {seed}, 13) % {span_ns} AS time_ns,
  multiIf(operation = 'chat', 'chatcmpl-', operation = 'embeddings', 'embd-', 'cmpl-')
    || {_hex(14, seed)} || {_hex(15, seed)} AS request_id,
  instance || '/' || request_id || '-' || substring({_hex(16, seed)}, 1, 8) AS key,
  if(operation = 'embeddings', '', multiIf(outcome = 'aborted', '["abort"]', outcome = 'error', '["error"]',
     {u(17)} < 0.8, '["stop"]', '["length"]')) AS finish_reasons,
  {_hex(18, seed)} || {_hex(19, seed)} AS trace_id,
  {_hex(20, seed)} AS span_id
FROM (SELECT if(number < {unique}, number, cityHash64(number, {seed}, 99) % {unique}) AS r
      FROM numbers({offset}, {limit}))"""


# the record's fields in the order RequestTelemetry._write_usage builds them: (field, column, type)
FIELDS = (
    (semconv.USAGE_ID, "key", str),
    (semconv.USAGE_SCHEMA_VERSION, str(semconv.USAGE_SCHEMA), int),
    (semconv.SERVICE_NAME, "'vllm'", str),
    (semconv.SERVICE_INSTANCE_ID, "instance", str),
    (semconv.VLLM_REQUEST_ID, "request_id", str),
    (semconv.GEN_AI_OPERATION_NAME, "operation", str),
    (semconv.REQUEST_OUTCOME, "outcome", str),
    (semconv.USAGE_DURATION, "duration", float),
    (semconv.GEN_AI_USAGE_INPUT_TOKENS, "input_tokens", int),
    (semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, "cached_tokens", int),
    (semconv.GEN_AI_USAGE_OUTPUT_TOKENS, "output_tokens", int),
    (semconv.GEN_AI_REQUEST_CHOICE_COUNT, "1", int),
    (semconv.GEN_AI_REQUEST_MODEL, "model", str),
    (semconv.GEN_AI_RESPONSE_MODEL, "model", str),
    (semconv.GEN_AI_RESPONSE_ID, "request_id", str),
    (semconv.TENANT_ID, "tenant", str),
    (semconv.TENANT_SCENE, "scene", str),
    (semconv.TENANT_COST_CENTER, "cost_center", str),
    (semconv.ERROR_TYPE, "error_type", str),  # only when not empty
    (semconv.GEN_AI_RESPONSE_FINISH_REASONS, "finish_reasons", list),  # only when not empty
)


def _log_attributes_sql() -> str:
    """LogAttributes as the collector stores the record: every field a string, empty ones absent."""
    pairs = ", ".join(f"'{field}', toString({column})" for field, column, _ in FIELDS)
    return f"mapFilter((k, v) -> v != '', map({pairs}))"


# --- steps run in their own subprocess (chDB holds a session directory per process) ---------------


def step_build_table(directory: str, p: dict) -> None:
    from chdb import session

    from otel_llm.billing import ledger

    s = session.Session(directory)
    s.query("DROP TABLE IF EXISTS otel_logs")
    s.query(ledger.otel_logs_ddl())
    started = time.time()
    s.query(
        f"INSERT INTO otel_logs (Timestamp, TraceId, SpanId, ServiceName, LogAttributes) "
        f"SELECT fromUnixTimestamp64Nano(toInt64(time_ns), 'UTC'), trace_id, span_id, 'vllm', "
        f"{_log_attributes_sql()} FROM ({records_sql(p)}) "
        f"SETTINGS max_insert_threads = 2, max_memory_usage = 8000000000"
    )
    inserted = time.time()
    # a table that has been there a while: its parts merged (the collector inserts small batches)
    s.query("OPTIMIZE TABLE otel_logs FINAL")
    stats = s.query(
        "SELECT count(), sum(rows), sum(bytes_on_disk), sum(data_uncompressed_bytes) FROM system.parts "
        "WHERE database = 'default' AND table = 'otel_logs' AND active",
        "JSONCompact",
    )
    parts, rows, disk, raw = json.loads(stats.bytes())["data"][0]
    s.close()
    print(
        json.dumps(
            {
                "insert_s": inserted - started,
                "optimize_s": time.time() - inserted,
                "parts": int(parts),
                "rows": int(rows),
                "disk_bytes": int(disk),
                "uncompressed_bytes": int(raw),
                "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    )


def step_build_spool(directory: str, p: dict) -> None:
    """The records written as spool files by the product's own writer."""
    from types import SimpleNamespace

    import chdb
    from opentelemetry.metrics import NoOpMeter

    from otel_llm.usage import UsageLedger

    writer = UsageLedger(
        NoOpMeter("bench"), directory=directory, events=False, instance="vllm-0", service="vllm", fsync_interval_s=1.0
    )
    columns = ", ".join(column for _, column, _ in FIELDS) + ", time_ns, trace_id, span_id"
    converters = [(field, kind) for field, _, kind in FIELDS]
    write_s = 0.0
    chunk = 100_000
    for offset in range(0, p["records"], chunk):
        text = (
            chdb.query(
                f"SELECT {columns} FROM ({records_sql(p, offset, min(chunk, p['records'] - offset))})",
                "TabSeparatedRaw",
            )
            .bytes()
            .decode()
        )
        for line in text.splitlines():
            values = line.split("\t")
            fields = {}
            for (field, kind), value in zip(converters, values):
                if kind is str:
                    if value:
                        fields[field] = value
                elif kind is list:
                    if value:
                        fields[field] = json.loads(value)
                else:
                    fields[field] = kind(value)
            end_ns, trace_id, span_id = values[-3:]
            context = SimpleNamespace(is_valid=True, trace_id=int(trace_id, 16), span_id=int(span_id, 16))
            started = time.perf_counter()
            writer.write(fields, int(end_ns), context)
            write_s += time.perf_counter() - started
    writer.close()
    files = list(Path(directory).glob("usage-*.jsonl"))
    print(
        json.dumps(
            {
                "write_us_per_record": write_s / p["records"] * 1e6,
                "files": len(files),
                "bytes": sum(f.stat().st_size for f in files),
            }
        )
    )


def _distinct_totals_sql(rows_sql: str) -> str:
    return (
        f"SELECT tenant, sum(input) AS input, sum(cached_input) AS cached_input, sum(output) AS output, "
        f"count() AS requests, uniqExact(key) AS keys FROM (SELECT DISTINCT * FROM ({rows_sql})) "
        f"GROUP BY tenant"
    )


def step_check_table(directory: str, start: float, end: float) -> None:
    """Per tenant: token sums and request count over the distinct stored records (independent of
    ledger.py's SQL: DISTINCT over whole records instead of GROUP BY key + any())."""
    from chdb import session

    a = lambda f: f"LogAttributes['{f}']"  # noqa: E731
    rows_sql = (
        f"SELECT {a(semconv.USAGE_ID)} AS key, {a(semconv.TENANT_ID)} AS tenant, "
        f"toUInt64({a(semconv.GEN_AI_USAGE_INPUT_TOKENS)}) AS input, "
        f"toUInt64({a(semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS)}) AS cached_input, "
        f"toUInt64({a(semconv.GEN_AI_USAGE_OUTPUT_TOKENS)}) AS output, Timestamp "
        f"FROM otel_logs WHERE Timestamp >= fromUnixTimestamp64Nano({int(start * 1e9)}, 'UTC') "
        f"AND Timestamp < fromUnixTimestamp64Nano({int(end * 1e9)}, 'UTC')"
    )
    s = session.Session(directory)
    result = s.query(_distinct_totals_sql(rows_sql), "JSON")
    total = s.query("SELECT count() FROM otel_logs", "JSON")
    s.close()
    print(
        json.dumps(
            {
                "tenants": json.loads(result.bytes())["data"],
                "stored_rows": int(json.loads(total.bytes())["data"][0]["count()"]),
            }
        )
    )


def step_check_spool(directory: str, start: float, end: float) -> None:
    """The same over the spool files, each line parsed with JSONExtract (not ledger.py's file() schema)."""
    import chdb

    pattern = os.path.join(os.path.abspath(directory), "usage-*.jsonl")
    j = lambda f, t: f"JSONExtract(line, '{f}', '{t}')"  # noqa: E731
    rows_sql = (
        f"SELECT {j(semconv.USAGE_ID, 'String')} AS key, {j(semconv.TENANT_ID, 'String')} AS tenant, "
        f"{j(semconv.GEN_AI_USAGE_INPUT_TOKENS, 'UInt64')} AS input, "
        f"{j(semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, 'UInt64')} AS cached_input, "
        f"{j(semconv.GEN_AI_USAGE_OUTPUT_TOKENS, 'UInt64')} AS output, "
        f"{j(semconv.USAGE_TIME, 'UInt64')} AS t "
        f"FROM file('{pattern}', 'LineAsString', 'line String') "
        f"WHERE t >= {int(start * 1e9)} AND t < {int(end * 1e9)}"
    )
    result = chdb.query(_distinct_totals_sql(rows_sql), "JSON")
    print(json.dumps({"tenants": json.loads(result.bytes())["data"]}))


def step_openmetrics(directory: str, out_path: str, start: float, end: float, month_start: float) -> None:
    """otel_llm_server_token_usage_total of the records ended in [start, end) as Prometheus would have
    scraped it every SCRAPE_S seconds from the exporter (cumulative per series, one sample per
    scrape from the series' first scrape on), written as OpenMetrics for promtool."""
    from chdb import session

    a = lambda f: f"LogAttributes['{f}']"  # noqa: E731
    window = lambda lo, hi: (
        f"Timestamp >= fromUnixTimestamp64Nano({int(lo * 1e9)}, 'UTC') "  # noqa: E731
        f"AND Timestamp < fromUnixTimestamp64Nano({int(hi * 1e9)}, 'UTC')"
    )
    records = lambda lo, hi: (
        f"SELECT DISTINCT {a(semconv.USAGE_ID)} AS key, {a(semconv.TENANT_ID)} AS tenant, "
        f"{a(semconv.TENANT_SCENE)} AS scene, {a(semconv.TENANT_COST_CENTER)} AS cost_center, "
        f"{a(semconv.GEN_AI_REQUEST_MODEL)} AS model, {a(semconv.GEN_AI_OPERATION_NAME)} AS operation, "
        f"{a(semconv.SERVICE_INSTANCE_ID)} AS instance, {a(semconv.REQUEST_OUTCOME)} AS outcome, "
        f"toUInt64({a(semconv.GEN_AI_USAGE_INPUT_TOKENS)}) AS i, "
        f"toUInt64({a(semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS)}) AS c, "
        f"toUInt64({a(semconv.GEN_AI_USAGE_OUTPUT_TOKENS)}) AS o, Timestamp "
        f"FROM otel_logs WHERE {window(lo, hi)}"
    )
    # LabelGuard keeps the first 50 tenants a process sees; here: the 50 largest of the 30 days
    top = (
        f"SELECT {a(semconv.TENANT_ID)} FROM otel_logs GROUP BY {a(semconv.TENANT_ID)} "
        f"ORDER BY count() DESC LIMIT {LABEL_LIMIT}"
    )
    labels = (
        f"if(tenant IN ({top}), tenant, '{semconv.LABEL_OTHER}') AS t, scene, cost_center, model, "
        f"if(outcome = 'finished', model, '') AS response_model, operation, instance"
    )
    sql = (
        f"SELECT {labels}, type, "
        f"intDiv(toUnixTimestamp64Nano(Timestamp) - {int(start * 1e9)}, {SCRAPE_S * 10**9}) + 1 AS step, "
        f"sum(tokens) FROM ({records(start, end)}) "
        f"ARRAY JOIN ['input', 'cached_input', 'output'] AS type, [i, c, o] AS tokens "
        f"GROUP BY t, scene, cost_center, model, response_model, operation, instance, type, step "
        f"ORDER BY t, scene, cost_center, model, response_model, operation, instance, type, step"
    )
    # the whole month as Prometheus would hold it (not built): each series from its first scrape on,
    # 3 token types per label set; and the samples of the last day (the largest day-long query)
    scrapes = lambda lo: f"intDiv({int(end)} - greatest(toUnixTimestamp(first), {int(lo)}), {SCRAPE_S})"  # noqa: E731
    month_sql = (
        f"SELECT 3 * count() AS series, 3 * sum({scrapes(month_start)}) AS samples, "
        f"3 * sum(if(first < {int(end - DAY)}, {DAY // SCRAPE_S}, {scrapes(end - DAY)})) AS last_day "
        f"FROM (SELECT {labels}, min(Timestamp) AS first FROM ({records(month_start, end)}) "
        f"GROUP BY t, scene, cost_center, model, response_model, operation, instance)"
    )
    s = session.Session(directory)
    text = s.query(sql, "TabSeparatedRaw").bytes().decode()
    month = json.loads(s.query(month_sql, "JSON").bytes())["data"][0]
    s.close()
    steps = int((end - start) // SCRAPE_S)
    series = samples = half_series = half_samples = 0  # half: the samples in (start + (end - start) / 2, end]
    with open(out_path, "w") as out:
        out.write(f"# TYPE {TOKEN_METRIC.removesuffix('_total')} counter\n")

        def flush(labels: str, increments: dict[int, int]) -> None:
            nonlocal series, samples, half_series, half_samples
            total, lines, first = 0, [], min(increments)
            for step in range(first, steps + 1):
                total += increments.get(step, 0)
                lines.append(f"{TOKEN_METRIC}{{{labels}}} {total} {int(start) + step * SCRAPE_S}\n")
            out.writelines(lines)
            series += 1
            samples += len(lines)
            half_series += 1  # every series has its last sample at `end`, in the second half
            half_samples += steps - max(first, steps // 2 + 1) + 1

        current, increments = None, {}
        for line in text.splitlines():
            tenant, scene, cc, model, response_model, operation, instance, token_type, step, tokens = line.split("\t")
            labels = (
                f'gen_ai_operation_name="{operation}",gen_ai_provider_name="vllm",'
                f'gen_ai_request_model="{model}",'
                + (f'gen_ai_response_model="{response_model}",' if response_model else "")
                + f'gen_ai_token_type="{token_type}",instance="{instance}",job="vllm",'
                f'tenant_cost_center="{cc}",tenant_id="{tenant}",tenant_scene="{scene}"'
            )
            if labels != current:
                if current is not None:
                    flush(current, increments)
                current, increments = labels, {}
            increments[int(step)] = increments.get(int(step), 0) + int(tokens)
        if current is not None:
            flush(current, increments)
        out.write("# EOF\n")
    print(
        json.dumps(
            {
                "series": series,
                "samples": samples,
                "bytes": os.path.getsize(out_path),
                "half_series": half_series,
                "half_samples": half_samples,
                "month_series": int(month["series"]),
                "month_samples": int(month["samples"]),
                "last_day_samples": int(month["last_day"]),
            }
        )
    )


STEPS = {
    "build-table": step_build_table,
    "build-spool": step_build_spool,
    "check-table": step_check_table,
    "check-spool": step_check_spool,
    "openmetrics": step_openmetrics,
}


def run_step(name: str, *args) -> dict:
    """A step in a fresh interpreter; its last stdout line is JSON."""
    command = [sys.executable, __file__, "--step", name, json.dumps(args)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"step {name} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# --- measuring a report ---------------------------------------------------------------------------


def measure(argv: list[str], out_path: Path, timeout: float = 900) -> dict:
    """Runs `otel-llm report ARGV` in a fresh process: wall seconds, that process's peak RSS, output.

    The peak comes from GNU time (`/usr/bin/time -f %M`), not from our own wait4(): a child
    started by vfork+exec from this (large) process would inherit our RSS as its high-water mark."""
    command = [sys.executable, "-m", "otel_llm.cli", "report", *argv]
    with (
        open(out_path, "wb") as out,
        tempfile.TemporaryFile() as err,
        tempfile.NamedTemporaryFile("r", suffix=".time") as rss,
    ):
        started = time.perf_counter()
        process = subprocess.Popen(
            ["/usr/bin/time", "-o", rss.name, "-f", "%M %U %S", *command], stdout=out, stderr=err, cwd=ROOT
        )
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        wall = time.perf_counter() - started
        err.seek(0)
        stderr = err.read().decode(errors="replace")
        fields = rss.read().split()[-3:]
    peak_kib, user_s, sys_s = (float(f) for f in fields)
    result = {
        "wall_s": wall,
        "peak_mib": peak_kib / 1024,
        "cpu_s": user_s + sys_s,
        "rc": process.returncode,
        "stderr": stderr[-2000:],
    }
    if process.returncode == 0 and "--help" not in argv:
        result["json"] = json.loads(out_path.read_text())
    return result


def measure_n(argv: list[str], out_path: Path, repeat: int) -> dict:
    """`repeat` runs of the same report: median wall (with min and max) and median peak RSS."""
    return _summary([measure(argv, out_path) for _ in range(repeat)])


def _summary(runs: list[dict]) -> dict:
    failed = [r for r in runs if r["rc"] != 0]
    result = dict(failed[0] if failed else runs[-1])
    walls = sorted(r["wall_s"] for r in runs)
    result.update(
        wall_s=statistics.median(walls),
        wall_min=walls[0],
        wall_max=walls[-1],
        peak_mib=statistics.median(r["peak_mib"] for r in runs),
        runs=len(runs),
        cpu_s=statistics.median(r["cpu_s"] for r in runs),
    )
    if "prometheus_peak_mib" in runs[0]:
        result["prometheus_peak_mib"] = max(r["prometheus_peak_mib"] for r in runs)
        result["prometheus_cpu_s"] = statistics.median(r["prometheus_cpu_s"] for r in runs)
    return result


def _walls(r: dict) -> str:
    return f"{r['wall_s']:.2f} s ({r['wall_min']:.2f}-{r['wall_max']:.2f})"


def tenant_totals(report: dict) -> dict[str, dict]:
    """Per tenant: tokens by type and requests, added up over the report's rows."""
    totals: dict[str, dict] = {}
    for row in report["rows"]:
        entry = totals.setdefault(row["tenant"], {"input": 0, "cached_input": 0, "output": 0, "requests": 0})
        for token_type, value in row["tokens"].items():
            entry[token_type] += value
        entry["requests"] += row.get("requests", 0)
    return totals


def compare(report_totals: dict[str, dict], check: dict, with_requests: bool = True) -> str:
    expected = {
        row["tenant"]: {
            "input": int(row["input"]),
            "cached_input": int(row["cached_input"]),
            "output": int(row["output"]),
            "requests": int(row["requests"]),
        }
        for row in check["tenants"]
    }
    duplicate_keys = [row["tenant"] for row in check["tenants"] if int(row["keys"]) != int(row["requests"])]
    if duplicate_keys:
        return f"FAIL: one key with different fields in tenants {duplicate_keys[:3]} (generator bug)"
    fields = ("input", "cached_input", "output") + (("requests",) if with_requests else ())
    wrong = [
        t
        for t in expected.keys() | report_totals.keys()
        if any(expected.get(t, {}).get(f, 0) != report_totals.get(t, {}).get(f, 0) for f in fields)
    ]
    if wrong:
        return f"FAIL: {len(wrong)} tenants differ, e.g. {wrong[:3]}"
    grand = {f: sum(e[f] for e in expected.values()) for f in fields}
    return f"ok ({len(expected)} tenants, " + ", ".join(f"{f} {v:,}" for f, v in grand.items()) + ")"


# --- Prometheus -----------------------------------------------------------------------------------


def process_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def build_prometheus(table_dir: Path, prom_dir: Path, start: float, end: float, month_start: float) -> dict:
    info_path = prom_dir / "built.json"
    if info_path.exists():
        return json.loads(info_path.read_text())
    shutil.rmtree(prom_dir, ignore_errors=True)
    (prom_dir / "data").mkdir(parents=True)
    text_path = prom_dir / "series.om"
    t0 = time.perf_counter()
    info = run_step("openmetrics", str(table_dir), str(text_path), start, end, month_start)
    t1 = time.perf_counter()
    result = subprocess.run(
        [
            "promtool",
            "tsdb",
            "create-blocks-from",
            "openmetrics",
            "--max-block-duration=24h",
            str(text_path),
            str(prom_dir / "data"),
        ],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"promtool failed:\n{result.stderr[-3000:]}")
    t2 = time.perf_counter()
    text_path.unlink()
    info.update(
        openmetrics_s=t1 - t0,
        promtool_s=t2 - t1,
        tsdb_bytes=sum(f.stat().st_size for f in (prom_dir / "data").rglob("*") if f.is_file()),
    )
    info_path.write_text(json.dumps(info))
    return info


def prometheus_reports(
    prom_dir: Path, windows: dict[str, tuple[int, float]], by: str, out_dir: Path, repeat: int
) -> dict[str, dict]:
    """`report --prometheus` over each window (name -> (minutes, end)), alternated, against one
    Prometheus serving the built TSDB; with the server's CPU seconds and peak RSS."""
    from devkit.devserver import PrometheusServer

    workdir = Path(tempfile.mkdtemp(prefix="prom-", dir=prom_dir))
    # the built TSDB, used in place; no compaction (min = max block duration), no retention cut
    (workdir / "data").symlink_to(prom_dir / "data")
    server = PrometheusServer([], workdir, scrape_interval="1h")
    server.command += [
        "--storage.tsdb.retention.time=100y",
        "--storage.tsdb.min-block-duration=2h",
        "--storage.tsdb.max-block-duration=2h",
    ]
    runs: dict[str, list[dict]] = {name: [] for name in windows}
    try:
        server.start(timeout=120)
        for index in range(repeat):
            for name in list(windows) if index % 2 == 0 else list(reversed(windows)):
                minutes, end = windows[name]
                argv = [
                    "--prometheus",
                    server.url,
                    "--range",
                    f"{minutes}m",
                    "--end",
                    str(int(end)),
                    "--by",
                    by,
                    "--format",
                    "json",
                    "--timeout",
                    "600",
                ]
                cpu0 = process_cpu_seconds(server.process.pid)
                result = measure(argv, out_dir / f"prom-{minutes}.json")
                result["prometheus_cpu_s"] = process_cpu_seconds(server.process.pid) - cpu0
                status = Path(f"/proc/{server.process.pid}/status").read_text()
                result["prometheus_peak_mib"] = int(status.split("VmHWM:")[1].split()[0]) / 1024
                runs[name].append(result)
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return {name: _summary(results) for name, results in runs.items()}


# --- main -----------------------------------------------------------------------------------------


def _params_dir(kind: str, params: dict) -> Path:
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    return CACHE / f"{kind}-{digest}"


def _built(directory: Path, params: dict) -> dict | None:
    path = directory / "params.json"
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("params") == params:
            return saved
    return None


def _cpu_of_others() -> float:
    """CPU seconds used on the machine so far by everything but this process and its children."""
    busy = sum(int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]) - sum(
        int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[4:6]
    )  # all but idle, iowait
    own = sum(
        getattr(resource.getrusage(who), f)
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for f in ("ru_utime", "ru_stime")
    )
    return busy / os.sysconf("SC_CLK_TCK") - own


def _dir_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=10_000_000, help="rows in otel_logs (default %(default)s)")
    parser.add_argument("--tenants", type=int, default=5000)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--end", default="2026-12-01", help="end of the 30 days, UTC (default %(default)s)")
    parser.add_argument("--duplicates", type=float, default=0.01, help="share of re-shipped rows")
    parser.add_argument("--spool-records", type=int, default=1_000_000)
    parser.add_argument("--prom-hours", type=int, default=2, help="hours of the traffic put into Prometheus")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each report (median, min and max shown)")
    parser.add_argument("--skip-prometheus", action="store_true")
    parser.add_argument("--skip-spool", action="store_true")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("step_args", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        STEPS[args.step](*json.loads(args.step_args))
        return 0

    from otel_llm.billing.rows import parse_time

    end = parse_time(args.end)
    params = {
        "records": args.records,
        "duplicates": round(args.records * args.duplicates),
        "tenants": args.tenants,
        "days": args.days,
        "end": end,
        "seed": 1,
    }
    spool_params = {**params, "records": args.spool_records, "duplicates": round(args.spool_records * args.duplicates)}
    start = end - args.days * DAY
    iso = lambda ts: dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    CACHE.mkdir(parents=True, exist_ok=True)
    out_dir = Path(tempfile.mkdtemp(prefix="reports-", dir=CACHE))
    others0 = _cpu_of_others()
    results: dict[str, dict] = {}

    # 1. the otel_logs table
    table_dir = _params_dir("table", params)
    built = _built(table_dir, params)
    if built is None:
        print(
            f"building otel_logs: {args.records:,} rows ({params['duplicates']:,} duplicates), {args.tenants:,} "
            f"tenants, {args.days} days to {iso(end)} in {table_dir} ...",
            flush=True,
        )
        shutil.rmtree(table_dir, ignore_errors=True)
        table_dir.mkdir(parents=True)
        t0 = time.perf_counter()
        info = run_step("build-table", str(table_dir), params)
        info["build_s"] = time.perf_counter() - t0
        built = {"params": params, "info": info}
        (table_dir / "params.json").write_text(json.dumps(built))
    else:
        print(f"reusing otel_logs in {table_dir}", flush=True)
    info = built["info"]
    print(
        f"  otel_logs: {info['rows']:,} rows in {info['parts']} parts, {info['disk_bytes'] / 2**20:,.0f} MiB on "
        f"disk ({info['uncompressed_bytes'] / 2**20:,.0f} MiB uncompressed); built in {info['build_s']:.0f} s "
        f"(insert {info['insert_s']:.0f} s, merge {info['optimize_s']:.0f} s, peak {info['peak_mib']:,.0f} MiB)",
        flush=True,
    )

    # 2. ledger reports over the table, 30 days
    print("checking the table: distinct records per tenant ...", flush=True)
    check = run_step("check-table", str(table_dir), start, end)
    ledger_url = f"chdb://{table_dir}"
    for by in ("tenant,model,day", "tenant"):
        print(f"report --ledger chdb://... --range {args.days}d --by {by} ...", flush=True)
        r = measure_n(
            [
                "--ledger",
                ledger_url,
                "--range",
                f"{args.days}d",
                "--end",
                str(int(end)),
                "--by",
                by,
                "--format",
                "json",
            ],
            out_dir / f"ledger-{by}.json",
            args.repeat,
        )
        r["check"] = compare(tenant_totals(r["json"]), check) if r["rc"] == 0 else f"FAIL rc={r['rc']}: {r['stderr']}"
        r["rows"] = len(r["json"]["rows"]) if r["rc"] == 0 else 0
        results[f"ledger table, {args.days}d, --by {by}"] = r
        print(f"  {_walls(r)}, {r['peak_mib']:,.0f} MiB, {r['rows']:,} rows; totals {r['check']}", flush=True)

    # 3. the spool path
    spool_dir = prom_dir = None
    if not args.skip_spool:
        spool_dir = _params_dir("spool", spool_params)
        built_spool = _built(spool_dir, spool_params)
        if built_spool is None:
            print(
                f"writing {args.spool_records:,} records as spool files with UsageLedger.write in {spool_dir} ...",
                flush=True,
            )
            shutil.rmtree(spool_dir, ignore_errors=True)
            spool_dir.mkdir(parents=True)
            t0 = time.perf_counter()
            spool_info = run_step("build-spool", str(spool_dir), spool_params)
            spool_info["build_s"] = time.perf_counter() - t0
            built_spool = {"params": spool_params, "info": spool_info}
            (spool_dir / "params.json").write_text(json.dumps(built_spool))
        spool_info = built_spool["info"]
        print(
            f"  spool: {spool_info['files']} files, {spool_info['bytes'] / 2**20:,.0f} MiB "
            f"({spool_info['bytes'] / args.spool_records:.0f} bytes/record), written in {spool_info['build_s']:.0f} s "
            f"(UsageLedger.write {spool_info['write_us_per_record']:.1f} us/record of it)",
            flush=True,
        )
        spool_check = run_step("check-spool", str(spool_dir), start, end)
        print(f"report --ledger SPOOL_DIR --range {args.days}d --by tenant ...", flush=True)
        r = measure_n(
            [
                "--ledger",
                str(spool_dir),
                "--range",
                f"{args.days}d",
                "--end",
                str(int(end)),
                "--by",
                "tenant",
                "--format",
                "json",
            ],
            out_dir / "spool-tenant.json",
            args.repeat,
        )
        r["check"] = (
            compare(tenant_totals(r["json"]), spool_check) if r["rc"] == 0 else f"FAIL rc={r['rc']}: {r['stderr']}"
        )
        r["rows"] = len(r["json"]["rows"]) if r["rc"] == 0 else 0
        r["mb_s"] = spool_info["bytes"] / 1e6 / r["wall_s"]
        r["records_s"] = args.spool_records / r["wall_s"]
        results[f"ledger spool ({args.spool_records / 1e6:g}M records), --by tenant"] = r
        print(
            f"  {_walls(r)}, {r['peak_mib']:,.0f} MiB: {r['mb_s']:.0f} MB/s, {r['records_s']:,.0f} records/s; "
            f"totals {r['check']}",
            flush=True,
        )

    # 4. Prometheus on the last --prom-hours of the same traffic, and the ledger on the same window
    prom = None
    if not args.skip_prometheus:
        # the last hours before 23:00 of the last day: inside one 24 h block (promtool parses its input
        # once per block)
        p_end = end - 3600
        p_start = p_end - args.prom_hours * 3600
        prom_dir = _params_dir("prom", {**params, "window_end": p_end, "hours": args.prom_hours, "scrape_s": SCRAPE_S})
        print(
            f"Prometheus TSDB: {TOKEN_METRIC} of {iso(p_start)} .. {iso(p_end)} every {SCRAPE_S} s in {prom_dir} ...",
            flush=True,
        )
        prom = build_prometheus(table_dir, prom_dir, p_start, p_end, start)
        print(
            f"  {prom['series']:,} series, {prom['samples']:,} samples; OpenMetrics {prom['bytes'] / 2**20:,.0f} MiB "
            f"written in {prom['openmetrics_s']:.0f} s, promtool {prom['promtool_s']:.0f} s, TSDB "
            f"{prom['tsdb_bytes'] / 2**20:,.1f} MiB",
            flush=True,
        )
        minutes = args.prom_hours * 60
        windows = {
            f"prometheus, {minutes // 2}m, --by tenant": (minutes // 2, p_end),
            f"prometheus, {minutes}m, --by tenant": (minutes, p_end),
        }
        print(f"report --prometheus --range {minutes // 2}m and {minutes}m --by tenant, alternated ...", flush=True)
        prom_results = prometheus_reports(prom_dir, windows, "tenant", out_dir, args.repeat)
        for name, r in prom_results.items():
            window_minutes, _ = windows[name]
            window_check = run_step("check-table", str(table_dir), p_end - window_minutes * 60, p_end)
            labelled = {row["tenant"] for row in window_check["tenants"]}
            if r["rc"] == 0:
                got = tenant_totals(r["json"])
                kept = {t: v for t, v in got.items() if t != semconv.LABEL_OTHER}
                check_kept = {"tenants": [row for row in window_check["tenants"] if row["tenant"] in kept]}
                other = got.get(semconv.LABEL_OTHER, {})
                expected_other = {
                    f: sum(int(row[f]) for row in window_check["tenants"] if row["tenant"] not in kept)
                    for f in ("input", "cached_input", "output")
                }
                r["check"] = (
                    f"{len(kept)} labelled tenants: "
                    + compare(kept, check_kept, with_requests=False)
                    + f"; 'other' ({len(labelled) - len(kept):,} tenants) "
                    + ("ok" if all(other.get(f, 0) == v for f, v in expected_other.items()) else "FAIL")
                )
                r["rows"] = len(r["json"]["rows"])
                print(
                    f"  {name}: {_walls(r)}, {r['peak_mib']:,.0f} MiB (Prometheus server: "
                    f"{r['prometheus_cpu_s']:.2f} s CPU, peak RSS {r['prometheus_peak_mib']:,.0f} MiB); {r['check']}",
                    flush=True,
                )
            else:
                r["check"], r["rows"] = f"FAIL rc={r['rc']}: {r['stderr']}", 0
                print(f"  {name}: {r['check']}", flush=True)
            results[name] = r
        print(f"report --ledger chdb://... --range {minutes}m --by tenant (the same window) ...", flush=True)
        r = measure_n(
            [
                "--ledger",
                ledger_url,
                "--range",
                f"{minutes}m",
                "--end",
                str(int(p_end)),
                "--by",
                "tenant",
                "--format",
                "json",
            ],
            out_dir / "ledger-window.json",
            args.repeat,
        )
        r["check"] = (
            compare(tenant_totals(r["json"]), window_check) if r["rc"] == 0 else f"FAIL rc={r['rc']}: {r['stderr']}"
        )
        r["rows"] = len(r["json"]["rows"]) if r["rc"] == 0 else 0
        results[f"ledger table, {minutes}m, --by tenant"] = r
        print(f"  {_walls(r)}, {r['peak_mib']:,.0f} MiB; totals {r['check']}", flush=True)

    # the interpreter alone: `otel-llm report --help` (Python start, imports)
    base = measure_n(["--help"], out_dir / "help.txt", args.repeat)
    shutil.rmtree(out_dir, ignore_errors=True)

    # 5. the table
    print(
        f"\nBilling report, fleet scale ({dt.date.today()}, {os.cpu_count()} cores): {args.records:,} usage records "
        f"({params['duplicates']:,} re-shipped duplicates), {args.tenants:,} tenants, {args.days} days. Each report "
        f"a fresh process, {args.repeat} runs: median wall (min-max), including Python's start "
        f"({base['wall_s']:.2f} s, {base['peak_mib']:.0f} MiB for `report --help`); peak = that process's max RSS"
    )
    print(f"{'report':46} {'wall s':>7} {'(min-max)':>13} {'peak MiB':>9} {'rows':>8}  totals")
    for name, r in results.items():
        spread = f"({r['wall_min']:.1f}-{r['wall_max']:.1f})"
        print(
            f"{name:46} {r['wall_s']:7.2f} {spread:>13} {r['peak_mib']:9,.0f} {r['rows']:8,}  "
            f"{r['check'].split(' (')[0]}"
        )
    key30 = f"ledger table, {args.days}d, --by tenant"
    ratios = [
        (
            f"ledger, {args.days} days, --by {by} / 10 s target",
            f"x{results[f'ledger table, {args.days}d, --by {by}']['wall_s'] / 10:.2f}",
        )
        for by in ("tenant", "tenant,model,day")
    ]
    spool_key = f"ledger spool ({args.spool_records / 1e6:g}M records), --by tenant"
    if spool_key in results:
        table_rate = args.records / results[key30]["wall_s"]
        ratios.append(
            (
                "ledger records/s, spool files / otel_logs table (--by tenant)",
                f"x{results[spool_key]['records_s'] / table_rate:.2f} ({results[spool_key]['records_s']:,.0f} "
                f"vs {table_rate:,.0f} records/s)",
            )
        )
    others = _cpu_of_others() - others0
    used = [
        (name, _dir_bytes(d))
        for name, d in (("table", table_dir), ("spool", spool_dir), ("Prometheus TSDB", prom_dir))
        if d is not None and d.exists()
    ]
    print(f"disk under {CACHE.relative_to(ROOT)}: " + ", ".join(f"{name} {b / 2**20:,.0f} MiB" for name, b in used))
    print(
        f"noise: other processes used {others:,.0f} CPU-seconds during this run"
        + (" -- the machine was not quiet; rerun when it is" if others > 30 else "")
    )
    if prom is not None:
        minutes = args.prom_hours * 60
        half, full = (results[f"prometheus, {m}m, --by tenant"] for m in (minutes // 2, minutes))
        lw = results[f"ledger table, {minutes}m, --by tenant"]
        print(
            f"\nSame traffic, same window ({minutes} min: {prom['series']:,} series, {prom['samples']:,} samples at "
            f"{SCRAPE_S} s; {minutes // 2} min: {prom['half_series']:,} series, {prom['half_samples']:,} samples. "
            f"Prometheus names {LABEL_LIMIT} tenants + 'other', the ledger all {lw['rows']:,} of the window):"
        )
        if half["rc"] == 0 and full["rc"] == 0:
            print(
                f"  Prometheus / ledger, measured: wall x{full['wall_s'] / lw['wall_s']:.2f}, report process peak "
                f"memory x{full['peak_mib'] / lw['peak_mib']:.2f}; the Prometheus server besides: "
                f"{full['prometheus_cpu_s']:.2f} s CPU, {full['prometheus_peak_mib']:,.0f} MiB peak RSS"
            )
            # Extrapolation: a straight line through the two windows, in samples (the month has
            # month_samples; the report works a day at a time, so its memory is that of the largest day)
            dn = prom["samples"] - prom["half_samples"]
            slope = lambda key: max((full[key] - half[key]) / dn, 0.0) if dn > 0 else 0.0  # noqa: E731
            method = f"a straight line through the {minutes // 2} and {minutes} min runs, in samples,"
            if full["wall_min"] <= half["wall_max"]:  # the two windows' runs overlap: no usable slope
                method = (
                    f"(the {minutes // 2} and {minutes} min runs overlap: no usable slope) the {minutes} min run "
                    f"scaled in proportion to samples"
                )
                ratio = lambda key, base_value: (full[key] - base_value) / prom["samples"]  # noqa: E731
                # memory: left as measured (it may grow with series rather than samples)
                slope = lambda key: 0.0 if key == "peak_mib" else max(ratio(key, base.get(key, 0.0)), 0.0)  # noqa: E731
            est_wall = full["wall_s"] + slope("wall_s") * (prom["month_samples"] - prom["samples"])
            est_cpu = full["prometheus_cpu_s"] + slope("prometheus_cpu_s") * (prom["month_samples"] - prom["samples"])
            est_peak = full["peak_mib"] + slope("peak_mib") * max(prom["last_day_samples"] - prom["samples"], 0)
            print(
                f"  ESTIMATE for {args.days} days, not measured: the same traffic is {prom['month_series']:,} series and "
                f"{prom['month_samples']:,} samples in {args.days} days ({prom['last_day_samples']:,} in the last "
                f"day's query); {method} gives "
                f"~{est_wall:,.0f} s wall (Prometheus server CPU ~{est_cpu:,.0f} s) and a report process peak of "
                f"~{est_peak:,.0f} MiB: x{est_wall / results[key30]['wall_s']:,.0f} the ledger's measured "
                f"{args.days}-day wall, for {LABEL_LIMIT} of {args.tenants:,} tenants"
            )
            if prom["last_day_samples"] > 50_000_000:
                print(
                    f"  (a query fetching one day's raw samples, {prom['last_day_samples']:,}, is over Prometheus' "
                    f"default --query.max-samples of 50,000,000, which refuses it)"
                )
            ratios.append(
                (
                    f"Prometheus / ledger, same {minutes} min window",
                    f"wall x{full['wall_s'] / lw['wall_s']:.2f}, report process memory "
                    f"x{full['peak_mib'] / lw['peak_mib']:.2f}",
                )
            )
            ratios.append(
                (
                    f"Prometheus / ledger, {args.days} days (Prometheus ESTIMATED)",
                    f"wall x{est_wall / results[key30]['wall_s']:,.0f}, report process memory "
                    f"x{est_peak / results[key30]['peak_mib']:.2f}",
                )
            )
    print(f"\nRatios (medians of this run; target: a {args.days}-day ledger report under 10 s on this machine)")
    for name, value in ratios:
        print(f"  {name:64} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
