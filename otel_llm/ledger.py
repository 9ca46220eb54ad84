"""The billing ledger's reading side: `otel-llm report --ledger`, `reconcile` and `export`.

The same ClickHouse SQL runs over two sources of the same records (otel_llm/usage.py):
- a spool directory, read in process by the embedded ClickHouse engine chDB (`file()` over
  `usage-*.jsonl`): `--ledger DIR`;
- the OTel Collector's ClickHouse exporter table (`otel_logs`, the record's fields in
  `LogAttributes`): `--ledger clickhouse://[USER[:PASSWORD]@]HOST:8123/DATABASE[?table=otel_logs]`
  over ClickHouse's HTTP interface, or `chdb://PATH` for a chDB session directory holding that table.

Records are counted exactly once: rows are first grouped by their idempotency key (a spool shipped
twice, or a file read by both the filelog receiver and OTLP, bills once), then summed.
"""

from __future__ import annotations

import glob
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from otel_llm import semconv
from otel_llm.report import UNSET, ReportError, Row
from otel_llm.usage import SPOOL_PREFIX, SPOOL_SUFFIX

SPOOL_GLOB = f"{SPOOL_PREFIX}*{SPOOL_SUFFIX}"
TOKEN_TYPES = tuple(token_type for _, token_type in semconv.USAGE_TOKEN_FIELDS)

# normalized column -> (record field, ClickHouse type); the token columns are named by token type
_STRING_FIELDS = {
    "key": semconv.USAGE_ID,
    "tenant": semconv.TENANT_ID,
    "scene": semconv.TENANT_SCENE,
    "cost_center": semconv.TENANT_COST_CENTER,
    "model": semconv.GEN_AI_REQUEST_MODEL,
    "served_model": semconv.GEN_AI_RESPONSE_MODEL,
    "operation": semconv.GEN_AI_OPERATION_NAME,
    "instance": semconv.SERVICE_INSTANCE_ID,
    "service": semconv.SERVICE_NAME,
    "outcome": semconv.REQUEST_OUTCOME,
    "response_id": semconv.GEN_AI_RESPONSE_ID,
}
_INT_FIELDS = {
    **{token_type: field for field, token_type in semconv.USAGE_TOKEN_FIELDS},
    "n": semconv.GEN_AI_REQUEST_CHOICE_COUNT,
}
# report --by dimension -> normalized column (`day` is computed from the end time)
DIMENSIONS = ("tenant", "scene", "cost_center", "model", "served_model", "operation", "instance", "outcome")
COLUMNS = (*_STRING_FIELDS, *_INT_FIELDS, "ts", "trace_id")


def _ident(name: str) -> str:
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"


def _literal(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


# --- sources: a subquery with the normalized COLUMNS -----------------------------------------------

def spool_source(directory: str) -> str:
    """The records of a spool directory, through ClickHouse's file() table function."""
    pattern = os.path.join(os.path.abspath(directory), SPOOL_GLOB)
    structure = ", ".join(
        [f"{_ident(field)} String" for field in _STRING_FIELDS.values()]
        + [f"{_ident(field)} UInt64" for field in _INT_FIELDS.values()]
        + [f"{_ident(semconv.USAGE_TIME)} UInt64", f"{_ident(semconv.USAGE_TRACE_ID)} String"])
    columns = ([f"{_ident(field)} AS {name}" for name, field in _STRING_FIELDS.items()]
               + [f"{_ident(field)} AS {name}" for name, field in _INT_FIELDS.items()]
               + [f"fromUnixTimestamp64Nano(toInt64({_ident(semconv.USAGE_TIME)}), 'UTC') AS ts",
                  f"{_ident(semconv.USAGE_TRACE_ID)} AS trace_id"])
    return (f"SELECT {', '.join(columns)} FROM file({_literal(pattern)}, 'JSONEachRow', {_literal(structure)})")


def otel_logs_source(table: str = "otel_logs") -> str:
    """The records in the collector ClickHouse exporter's logs table (LogAttributes are strings)."""
    attr = lambda field: f"LogAttributes[{_literal(field)}]"  # noqa: E731
    columns = ([f"{attr(field)} AS {name}" for name, field in _STRING_FIELDS.items()]
               + [f"toUInt64OrZero({attr(field)}) AS {name}" for name, field in _INT_FIELDS.items()]
               + ["Timestamp AS ts", "TraceId AS trace_id"])
    return (f"SELECT {', '.join(columns)} FROM {table} "
            f"WHERE mapContains(LogAttributes, {_literal(semconv.USAGE_ID)})")


def _deduplicated(source: str, start: float, end: float) -> str:
    """One row per idempotency key, ended inside [start, end)."""
    keep = ", ".join(f"any({c}) AS {c}" for c in COLUMNS)
    # grouping by a 128-bit hash of the key, not the key string, takes 40 % less memory
    inside = (f"SELECT *, sipHash128(key) AS key_hash FROM ({source}) "
              f"WHERE ts >= fromUnixTimestamp64Nano({int(start * 1e9)}, 'UTC') "
              f"AND ts < fromUnixTimestamp64Nano({int(end * 1e9)}, 'UTC') AND key != ''")
    return f"SELECT {keep} FROM ({inside}) GROUP BY key_hash"


def _dimension(name: str) -> str:
    if name == "day":
        return "toString(toDate(ts, 'UTC'))"
    return f"if({name} = '', {_literal(UNSET)}, {name})"


def usage_sql(source: str, start: float, end: float, by: list[str]) -> str:
    dims = ", ".join(f"{_dimension(d)} AS d{i}" for i, d in enumerate(by))
    sums = ", ".join(f"sum({t}) AS {t}" for t in TOKEN_TYPES)
    groups = ", ".join(f"d{i}" for i in range(len(by)))
    return (f"SELECT {dims}, {sums}, count() AS requests FROM ({_deduplicated(source, start, end)}) "
            f"GROUP BY {groups} ORDER BY {groups}")


def reconcile_sql(source: str, start: float, end: float, by: list[str]) -> str:
    """Token sums per `by` key, plus the prompt tokens vLLM's counter adds for n > 1 (it counts the
    prompt once per choice; usage and the ledger count it once)."""
    dims = ", ".join(f"{_dimension(d)} AS d{i}" for i, d in enumerate(by))
    sums = ", ".join(f"sum({t}) AS {t}" for t in TOKEN_TYPES)
    groups = ", ".join(f"d{i}" for i in range(len(by)))
    per_request = (f"SELECT *, input * (greatest(n, 1) - 1) AS extra, n > 1 AS multi "
                   f"FROM ({_deduplicated(source, start, end)})")
    return (f"SELECT {dims}, {sums}, sum(extra) AS extra_choice_prompts, sum(multi) AS multi_choice_requests, "
            f"count() AS requests FROM ({per_request}) GROUP BY {groups} ORDER BY {groups}")


def records_sql(source: str, start: float, end: float) -> str:
    return f"SELECT * FROM ({_deduplicated(source, start, end)}) ORDER BY ts, key"


# --- executors ------------------------------------------------------------------------------------

class ChdbExecutor:
    """Runs SQL in the embedded ClickHouse engine (chDB), in this process.

    chDB holds one embedded server per process, bound to one data path: a session on a table's
    path replaces any other, and file() queries over a spool run in whatever session is open."""

    _open: list = []  # [(path, session)]: the process's one chDB session

    def __init__(self, session_path: str | None = None):
        try:
            from chdb import session
        except ImportError:
            raise ReportError("reading the ledger needs the embedded ClickHouse engine: "
                              "pip install 'otel-llm[ledger]' (chdb)") from None
        opened = ChdbExecutor._open
        if opened and session_path is not None and opened[0][0] != session_path:
            opened.pop()[1].close()
        if not opened:
            opened.append((session_path, session.Session(session_path)))
        self.session = opened[0][1]

    def rows(self, sql: str) -> list[dict]:
        sql += " SETTINGS input_format_allow_errors_num = 1000000000, input_format_allow_errors_ratio = 1"
        try:
            result = self.session.query(sql, "JSON")
        except Exception as exc:  # noqa: BLE001 - chDB raises RuntimeError with ClickHouse's message
            raise ReportError(f"ledger query failed: {str(exc).splitlines()[0]}") from None
        text = result.bytes() if hasattr(result, "bytes") else bytes(result)
        return json.loads(text)["data"] if text.strip() else []

    def execute(self, sql: str) -> None:
        self.session.query(sql)


class ClickHouseHTTP:
    """ClickHouse's HTTP interface: clickhouse[s]://[user[:password]@]host:port/database."""

    def __init__(self, url: str, timeout: float = 60.0):
        parsed = urllib.parse.urlsplit(url)
        scheme = "https" if parsed.scheme == "clickhouses" else "http"
        self.database = parsed.path.strip("/") or "default"
        self.base = f"{scheme}://{parsed.hostname}:{parsed.port or (8443 if scheme == 'https' else 8123)}/"
        self.headers = {"X-ClickHouse-Database": self.database}
        if parsed.username:
            self.headers["X-ClickHouse-User"] = urllib.parse.unquote(parsed.username)
            self.headers["X-ClickHouse-Key"] = urllib.parse.unquote(parsed.password or "")
        self.timeout = timeout
        self.where = f"ClickHouse at {parsed.hostname}:{parsed.port or ''}"

    def rows(self, sql: str) -> list[dict]:
        request = urllib.request.Request(self.base + "?default_format=JSON", data=sql.encode(), headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace").strip().splitlines()
            raise ReportError(f"{self.where} answered {exc.code}: {detail[0] if detail else exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise ReportError(f"cannot reach {self.where}: {getattr(exc, 'reason', exc)}") from None
        try:
            return json.loads(body)["data"] if body.strip() else []
        except (ValueError, KeyError):
            raise ReportError(f"{self.where} did not answer with ClickHouse JSON") from None


# --- a ledger: source + executor --------------------------------------------------------------------

@dataclass
class Ledger:
    source: str
    executor: object
    description: str
    spool_pattern: str | None = None

    def unreadable_lines(self) -> int:
        """Spool lines that are not whole JSON records (a line torn by a machine crash or a full
        disk); the report skips them and says how many."""
        if self.spool_pattern is None:
            return 0
        rows = self.executor.rows(f"SELECT count() AS n FROM file({_literal(self.spool_pattern)}, 'LineAsString') "
                                  f"WHERE NOT isValidJSON(line)")
        return int(rows[0]["n"]) if rows else 0

    def usage(self, start: float, end: float, by: list[str]) -> dict[tuple[str, ...], Row]:
        rows = {}
        for item in self.executor.rows(usage_sql(self.source, start, end, by)):
            key = tuple(str(item[f"d{i}"]) for i in range(len(by)))
            row = Row(key)
            row.tokens = {t: int(item[t]) for t in TOKEN_TYPES}
            row.requests = int(item["requests"])
            rows[key] = row
        return rows

    def reconcile_totals(self, start: float, end: float, by: list[str]) -> dict[tuple[str, ...], dict]:
        return {tuple(str(item[f"d{i}"]) for i in range(len(by))): item
                for item in self.executor.rows(reconcile_sql(self.source, start, end, by))}

    def records(self, start: float, end: float) -> list[dict]:
        return self.executor.rows(records_sql(self.source, start, end))


def open_ledger(where: str, timeout: float = 60.0) -> Ledger:
    """A spool directory, clickhouse[s]://host:port/db[?table=T], or chdb://SESSION_DIR[?table=T]."""
    parsed = urllib.parse.urlsplit(where)
    table = urllib.parse.parse_qs(parsed.query).get("table", ["otel_logs"])[0]
    if not table.replace("_", "").replace(".", "").isalnum():
        raise ReportError(f"--ledger {where!r}: table must be a plain (database.)name, got {table!r}")
    if parsed.scheme in ("clickhouse", "clickhouses"):
        if not parsed.hostname:
            raise ReportError(f"--ledger {where!r}: expected clickhouse://HOST:PORT/DATABASE")
        client = ClickHouseHTTP(where, timeout)
        return Ledger(otel_logs_source(table), client, f"{client.where}, table {client.database}.{table}")
    if parsed.scheme == "chdb":
        path = parsed.netloc + parsed.path
        return Ledger(otel_logs_source(table), ChdbExecutor(path), f"chDB session {path}, table {table}")
    if parsed.scheme:
        raise ReportError(f"--ledger {where!r}: use a spool directory, clickhouse://HOST:PORT/DB or chdb://PATH")
    if not os.path.isdir(where):
        raise ReportError(f"--ledger {where}: no such directory (the OTEL_LLM_USAGE_DIR of the servers)")
    if not glob.glob(os.path.join(where, SPOOL_GLOB)):
        raise ReportError(f"--ledger {where}: no usage-*.jsonl files (is OTEL_LLM_USAGE_DIR set on the servers?)")
    return Ledger(spool_source(where), ChdbExecutor(), f"spool {os.path.abspath(where)}",
                  spool_pattern=os.path.join(os.path.abspath(where), SPOOL_GLOB))


def otel_logs_ddl(database: str = "default", table: str = "otel_logs") -> str:
    """The logs table the collector's ClickHouse exporter creates (its internal/sql_templates/
    logs_table.sql with the default MergeTree engine), for tests and local loading."""
    return LOGS_TABLE_TEMPLATE % (database, table, "", "MergeTree()", "")


# contrib exporter/clickhouseexporter/internal/sql_templates/logs_table.sql (Apache-2.0)
LOGS_TABLE_TEMPLATE = """CREATE TABLE IF NOT EXISTS "%s"."%s" %s (
    Timestamp DateTime64(9) CODEC(Delta(8), ZSTD(1)),
    TimestampTime DateTime DEFAULT toDateTime(Timestamp),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    TraceFlags UInt8,
    SeverityText LowCardinality(String) CODEC(ZSTD(1)),
    SeverityNumber UInt8,
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    Body String CODEC(ZSTD(1)),
    ResourceSchemaUrl LowCardinality(String) CODEC(ZSTD(1)),
    ResourceAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    ScopeSchemaUrl LowCardinality(String) CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion LowCardinality(String) CODEC(ZSTD(1)),
    ScopeAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    LogAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),

    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_res_attr_key mapKeys(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_res_attr_value mapValues(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_scope_attr_key mapKeys(ScopeAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_scope_attr_value mapValues(ScopeAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_log_attr_key mapKeys(LogAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_log_attr_value mapValues(LogAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_body Body TYPE tokenbf_v1(32768, 3, 0) GRANULARITY 8
    ) ENGINE = %s
    PARTITION BY toDate(TimestampTime)
    PRIMARY KEY (ServiceName, TimestampTime)
    ORDER BY (ServiceName, TimestampTime, Timestamp)
    %s
    SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1
"""


def insert_records_sql(records: list[dict], table: str = "otel_logs") -> str:
    """INSERT spool records into an otel_logs table the way the collector's pipeline stores them:
    end time as Timestamp, trace context in TraceId/SpanId, every other field a LogAttributes string."""
    values = []
    for record in records:
        attrs = {k: (json.dumps(v) if isinstance(v, list) else str(v)) for k, v in record.items()
                 if k not in (semconv.USAGE_TIME, semconv.USAGE_TRACE_ID, semconv.USAGE_SPAN_ID)}
        attr_sql = "map(" + ", ".join(f"{_literal(k)}, {_literal(v)}" for k, v in attrs.items()) + ")"
        values.append(f"(fromUnixTimestamp64Nano({int(record[semconv.USAGE_TIME])}, 'UTC'), "
                      f"{_literal(record.get(semconv.USAGE_TRACE_ID, ''))}, "
                      f"{_literal(record.get(semconv.USAGE_SPAN_ID, ''))}, "
                      f"{_literal(str(record.get(semconv.SERVICE_NAME, '')))}, {attr_sql})")
    return (f"INSERT INTO {table} (Timestamp, TraceId, SpanId, ServiceName, LogAttributes) VALUES "
            + ", ".join(values))


def read_spool(directory: str) -> list[dict]:
    """Every whole record line of a spool directory (a torn last line is skipped), in Python."""
    records = []
    for path in sorted(glob.glob(os.path.join(directory, SPOOL_GLOB))):
        with open(path, "rb") as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue
    return records
