"""The billing ledger's reading side: `otel-llm report --ledger`, `reconcile` and `export`.

The same ClickHouse SQL runs over two sources of the same records (otel_llm/usage.py):
- a spool directory, read in process by the embedded ClickHouse engine chDB (`file()` over
  `usage-*.jsonl`): `--ledger DIR`;
- the OTel Collector's ClickHouse exporter table (`otel_logs`, the record's fields in
  `LogAttributes`): `--ledger clickhouse://[USER[:PASSWORD]@]HOST:8123/DATABASE[?table=otel_logs]`
  over ClickHouse's HTTP interface, or `chdb://PATH` for a chDB session directory holding that table.

Records are counted exactly once: rows are first grouped by their idempotency key (a spool shipped
twice, or a file read by both the filelog receiver and OTLP, bills once), then summed.

Schema 2 adds the engine core's records (docs/ledger.md, "Costs"). A bill is an API server's record,
its cost figures summed from the engine records of the engine requests it lists; or an engine record
that no API server's record lists (a frontend otel-llm cannot see, or an API server whose half never
arrived). engine_window records are never bills: they price the engines (`windows_sql`).
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
from otel_llm.billing.promql import ReportError
from otel_llm.billing.rows import SPEC_DECODE_COLUMNS, UNSET, Row
from otel_llm.usage import SPOOL_PREFIX, SPOOL_SUFFIX

SPOOL_GLOB = f"{SPOOL_PREFIX}*{SPOOL_SUFFIX}"
TOKEN_TYPES = semconv.TOKEN_TYPES


def _ident(name: str) -> str:
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"


def _literal(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


# normalized column -> (record field, ClickHouse type); the token columns are named by token type
_STRING_FIELDS = {
    "key": semconv.USAGE_ID,
    "tenant": semconv.TENANT_ID,
    "scene": semconv.TENANT_SCENE,
    "cost_center": semconv.TENANT_COST_CENTER,
    "api_key": semconv.API_KEY_ID,
    "user": semconv.USER_ID,
    "session": semconv.GEN_AI_CONVERSATION_ID,
    "model": semconv.GEN_AI_REQUEST_MODEL,
    "served_model": semconv.GEN_AI_RESPONSE_MODEL,
    "operation": semconv.GEN_AI_OPERATION_NAME,
    "instance": semconv.SERVICE_INSTANCE_ID,
    "service": semconv.SERVICE_NAME,
    "outcome": semconv.REQUEST_OUTCOME,
    "response_id": semconv.GEN_AI_RESPONSE_ID,
    "kind": semconv.USAGE_KIND,
    "engine_id": semconv.VLLM_ENGINE_REQUEST_ID,
    "engine_instance": semconv.VLLM_ENGINE_INSTANCE,
    "pd_role": semconv.VLLM_PD_ROLE,
}
# a bill's token breakdowns and speculative-decoding counts (rows.TOKEN_DETAILS: absent is 0), from the
# API server's record like its tokens
DETAIL_FIELDS = {
    **{column: field for field, column in semconv.USAGE_DETAIL_TOKEN_FIELDS},
    **dict(zip(SPEC_DECODE_COLUMNS, (semconv.VLLM_SPEC_DRAFT_TOKENS, semconv.VLLM_SPEC_ACCEPTED_TOKENS))),
}
_INT_FIELDS = {
    **{token_type: field for field, token_type in semconv.USAGE_TOKEN_FIELDS},
    **DETAIL_FIELDS,
    "n": semconv.GEN_AI_REQUEST_CHOICE_COUNT,
}
# what an engine request cost its engine (engine records), summed per bill
COST_FIELDS = {
    "compute_ns": semconv.COST_COMPUTE_NS,
    "prefill_compute_ns": semconv.COST_PREFILL_COMPUTE_NS,
    "scheduled_tokens": semconv.COST_SCHEDULED_TOKENS,
    "kv_block_ns": semconv.COST_KV_BLOCK_NS,
    "kv_hit_block_ns": semconv.COST_KV_HIT_BLOCK_NS,
    "preempted_ns": semconv.COST_PREEMPTED_NS,
}
# an engine instance's accounting over one window (engine_window records)
_WINDOW_FIELDS = {
    "window_start": semconv.ENGINE_WINDOW_START,
    "busy_ns": semconv.ENGINE_BUSY_NS,
    "idle_ns": semconv.ENGINE_IDLE_NS,
    "kv_capacity_blocks": semconv.ENGINE_KV_CAPACITY_BLOCKS,
    "kv_block_size": semconv.ENGINE_KV_BLOCK_SIZE,
    "window_kv_block_ns": semconv.ENGINE_KV_BLOCK_NS,
}
_UINT_FIELDS = {**_INT_FIELDS, **COST_FIELDS, **_WINDOW_FIELDS}
# report --by dimension -> normalized column (`day` and `hour` are computed from the end time)
DIMENSIONS = (
    "tenant",
    "scene",
    "cost_center",
    "api_key",
    "user",
    "session",
    "model",
    "served_model",
    "operation",
    "instance",
    "outcome",
    "engine_instance",
)
COLUMNS = (*_STRING_FIELDS, *_UINT_FIELDS, "engine_ids", "frontend_billed", "ts", "trace_id")
# a bill's own columns come from the API server's record when there is one, else from the engine's;
# its engine figures from the engine records joined to it
_BILL_COLUMNS = tuple(c for c in (*_STRING_FIELDS, *_INT_FIELDS, "ts", "trace_id") if c != "engine_instance")
_EXTERNAL = dict(semconv.USAGE_DETAIL_TOKEN_FIELDS)[semconv.VLLM_EXTERNAL_CACHED_TOKENS]
# engine records are joined to API-server records ended this much before or after the report window
JOIN_MARGIN_S = 3600
_API = f"kind IN ('', {_literal(semconv.USAGE_KIND_REQUEST)})"
_ENGINE = f"kind = {_literal(semconv.USAGE_KIND_ENGINE)}"
_WINDOW = f"kind = {_literal(semconv.USAGE_KIND_ENGINE_WINDOW)}"
_ABORTED = f"outcome = {_literal(semconv.OUTCOME_ABORTED)}"
# The figures a bill takes from its engine records where they are more than its API server's record says:
# column -> (how its engine requests' figures add up, when the bill takes them)
_FROM_ENGINE = {
    # the connector's part of the hit, which the API server's record misses when it came after the final
    # output; but a P/D decode leg's is the prefill node's hits, as its frontend says
    _EXTERNAL: ("sum", f"pd_role != {_literal(semconv.PD_ROLE_DECODE)}"),
    # an aborted request: what its engine computed after the API server stopped reading (docs/ledger.md,
    # "Clients that leave a stream")
    semconv.TOKEN_TYPE_OUTPUT: ("sum", _ABORTED),
    # (n > 1: the choices share the prompt, counted once, as the API server's record does)
    semconv.TOKEN_TYPE_CACHED_INPUT: ("max", _ABORTED),
}


# --- sources: a subquery with the normalized COLUMNS -----------------------------------------------


# normalized column -> (spool record field, its type in the spool's JSON, the column's SQL over it: {} is the field)
_SPOOL_COLUMNS = {
    **{name: (field, "String", "{}") for name, field in _STRING_FIELDS.items()},
    **{name: (field, "UInt64", "{}") for name, field in _UINT_FIELDS.items()},
    "engine_ids": (semconv.USAGE_ENGINE_REQUEST_IDS, "Array(String)", "{}"),
    "frontend_billed": (semconv.USAGE_FRONTEND_BILLED, "Bool", "toUInt8({})"),
    "ts": (semconv.USAGE_TIME, "UInt64", "fromUnixTimestamp64Nano(toInt64({}), 'UTC')"),
    "trace_id": (semconv.USAGE_TRACE_ID, "String", "{}"),
}


def spool_source(directory: str) -> str:
    """The records of a spool directory, through ClickHouse's file() table function."""
    pattern = os.path.join(os.path.abspath(directory), SPOOL_GLOB)
    structure = ", ".join(f"{_ident(field)} {kind}" for field, kind, _ in _SPOOL_COLUMNS.values())
    columns = ", ".join(f"{sql.format(_ident(field))} AS {name}" for name, (field, _, sql) in _SPOOL_COLUMNS.items())
    return f"SELECT {columns} FROM file({_literal(pattern)}, 'JSONEachRow', {_literal(structure)})"


def otel_logs_source(table: str = "otel_logs") -> str:
    """The records in the collector ClickHouse exporter's logs table (LogAttributes are strings; an
    array is its JSON text)."""
    attr = lambda field: f"LogAttributes[{_literal(field)}]"  # noqa: E731
    columns = (
        [f"{attr(field)} AS {name}" for name, field in _STRING_FIELDS.items()]
        + [f"toUInt64OrZero({attr(field)}) AS {name}" for name, field in _UINT_FIELDS.items()]
        + [
            f"JSONExtract({attr(semconv.USAGE_ENGINE_REQUEST_IDS)}, 'Array(String)') AS engine_ids",
            f"toUInt8(lower({attr(semconv.USAGE_FRONTEND_BILLED)}) IN ('true', '1')) AS frontend_billed",
            "Timestamp AS ts",
            "TraceId AS trace_id",
        ]
    )
    return f"SELECT {', '.join(columns)} FROM {table} WHERE mapContains(LogAttributes, {_literal(semconv.USAGE_ID)})"


def _ended(start: float, end: float) -> str:
    return (
        f"ts >= fromUnixTimestamp64Nano({int(start * 1e9)}, 'UTC') "
        f"AND ts < fromUnixTimestamp64Nano({int(end * 1e9)}, 'UTC')"
    )


def _deduplicated(source: str, start: float, end: float, kinds: str) -> str:
    """One row per idempotency key among the records of `kinds` (a condition), ended inside [start, end)."""
    keep = ", ".join(f"any({c}) AS {c}" for c in COLUMNS)
    # grouping by a 128-bit hash of the key, not the key string, takes 40 % less memory
    inside = (
        f"SELECT *, sipHash128(key) AS key_hash FROM ({source}) WHERE {_ended(start, end)} AND key != '' AND {kinds}"
    )
    return f"SELECT {keep} FROM ({inside}) GROUP BY key_hash"


def _bills(source: str, start: float, end: float, engine_tokens: bool = True) -> str:
    """One row per bill ended inside [start, end), each record counted once (however often it arrived):

    - an API server's record, with the sums of COST_FIELDS over the engine records (ended within
      JOIN_MARGIN_S of the window) of the engine requests it lists, and their engine_instance;
      an aborted request's output and cached input tokens are its engine records' where those are
      more (engine_tokens; the engine computed tokens the API server had stopped reading: see
      docs/ledger.md, "Clients that leave a stream");
    - an engine record that no API server's record ended within JOIN_MARGIN_S lists: its engine has no
      instrumented frontend (frontend_billed false), or the API server's record never arrived (`orphan`);
      never a P/D prefill leg's (billed by its decode node; its compute stays in the engine's busy time).

    Rows are grouped by engine request id (`eid`: an API server's record has one row per id it lists,
    or its key when it lists none), then by the bill's key. `costed`: the bill has engine figures."""
    eid = "arrayJoin(if(is_api, if(empty(engine_ids), [key], engine_ids), [if(engine_id = '', key, engine_id)]))"
    rows = (
        f"SELECT *, {_API} AS is_api, sipHash128({eid}) AS eid{''.join(f', {c} AS raw_{c}' for c in _FROM_ENGINE)} "
        f"FROM ({source}) "
        f"WHERE ({_API} OR ({_ENGINE} AND pd_role != {_literal(semconv.PD_ROLE_PREFILL)})) AND key != '' "
        f"AND {_ended(start - JOIN_MARGIN_S, end + JOIN_MARGIN_S)}"
    )
    own = ", ".join(f"if(max(is_api), anyIf({c}, is_api), anyIf({c}, NOT is_api)) AS {c}" for c in _BILL_COLUMNS)
    figures = ", ".join(f"anyIf({c}, NOT is_api) AS {c}" for c in (*COST_FIELDS, "engine_instance"))
    # (raw_*: the columns under other names, as `own` redefines them)
    figures += "".join(f", anyIf(raw_{c}, NOT is_api) AS engine_{c}" for c in _FROM_ENGINE)
    per_engine_request = (
        f"SELECT {own}, {figures}, min(is_api) = 0 AS costed, "
        f"max(is_api) = 0 AND anyIf(frontend_billed, NOT is_api) = 1 AS orphan "
        f"FROM ({rows}) GROUP BY eid"
    )
    per_engine_request = f"SELECT *, sipHash128(key) AS bill_hash FROM ({per_engine_request})"
    keep = ", ".join(
        [
            *(f"any({c}) AS {c}" for c in _BILL_COLUMNS),
            *(f"{add_up}(engine_{c}) AS engine_{c}" for c, (add_up, _) in _FROM_ENGINE.items()),
            *(f"sum({c}) AS {c}" for c in COST_FIELDS),
            "max(engine_instance) AS engine_instance",
            "max(costed) AS costed",
            "max(orphan) AS orphan",
        ]
    )
    taken = ", ".join(
        f"if({when}, greatest({c}, engine_{c}), {c}) AS {c}"
        for c, (_, when) in _FROM_ENGINE.items()
        if engine_tokens or when != _ABORTED
    )
    bills = f"SELECT {keep} FROM ({per_engine_request}) GROUP BY bill_hash"
    return (
        f"SELECT * EXCEPT ({', '.join(f'engine_{c}' for c in _FROM_ENGINE)}) REPLACE ({taken}) "
        f"FROM ({bills}) WHERE {_ended(start, end)}"
    )


def _dimension(name: str) -> str:
    if name == "day":
        return "toString(toDate(ts, 'UTC'))"
    if name == "hour":  # the UTC hour the record ended in: 2026-12-01T08
        return "formatDateTime(ts, '%Y-%m-%dT%H', 'UTC')"
    return f"if({name} = '', {_literal(UNSET)}, {name})"


def _sums(columns) -> str:
    """Sums that cannot overflow (a month of KV block-nanoseconds is past 2^64)."""
    return ", ".join(f"sum(toUInt128({c})) AS {c}" for c in columns)


def usage_sql(source: str, start: float, end: float, by: list[str]) -> str:
    dims = ", ".join(f"{_dimension(d)} AS d{i}" for i, d in enumerate(by))
    groups = ", ".join(f"d{i}" for i in range(len(by)))
    return (
        f"SELECT {dims}, {_sums([*TOKEN_TYPES, *DETAIL_FIELDS, *COST_FIELDS])}, count() AS requests, "
        f"sum(orphan) AS orphans FROM ({_bills(source, start, end)}) GROUP BY {groups} ORDER BY {groups}"
    )


def reconcile_sql(source: str, start: float, end: float, by: list[str]) -> str:
    """Token sums per `by` key, plus the prompt tokens vLLM's counter adds for n > 1 (it counts the
    prompt once per choice; usage and the ledger count it once). The API server's own token counts:
    vLLM's counters, like its record, miss what the engine computed after the API server dropped an
    aborted request."""
    dims = ", ".join(f"{_dimension(d)} AS d{i}" for i, d in enumerate(by))
    sums = ", ".join(f"sum({t}) AS {t}" for t in TOKEN_TYPES)
    groups = ", ".join(f"d{i}" for i in range(len(by)))
    bills = _bills(source, start, end, engine_tokens=False)
    per_request = f"SELECT *, input * (greatest(n, 1) - 1) AS extra, n > 1 AS multi FROM ({bills})"
    return (
        f"SELECT {dims}, {sums}, sum(extra) AS extra_choice_prompts, sum(multi) AS multi_choice_requests, "
        f"count() AS requests FROM ({per_request}) GROUP BY {groups} ORDER BY {groups}"
    )


def records_sql(source: str, start: float, end: float) -> str:
    return f"SELECT * FROM ({_bills(source, start, end)}) ORDER BY ts, key"


def windows_sql(source: str, start: float, end: float, by: list[str]) -> str:
    """Per `by` key (engine_instance, and day): the engine_window records ended inside [start, end):
    their wall time, busy and idle time, KV capacity x wall time, and the service instance and model."""
    dims = ", ".join(f"{_dimension(d)} AS d{i}" for i, d in enumerate(by))
    groups = ", ".join(f"d{i}" for i in range(len(by)))
    wall = "(toUnixTimestamp64Nano(ts) - window_start)"
    windows = (
        f"SELECT *, {wall} AS wall_ns, toUInt128(kv_capacity_blocks) * {wall} AS kv_capacity_block_ns "
        f"FROM ({_deduplicated(source, start, end, _WINDOW)}) WHERE window_start > 0 AND {wall} >= 0"
    )
    return (
        f"SELECT {dims}, any(instance) AS service_instance, any(model) AS model, "
        f"{_sums(['wall_ns', 'busy_ns', 'idle_ns', 'kv_capacity_block_ns', 'window_kv_block_ns'])} "
        f"FROM ({windows}) GROUP BY {groups} ORDER BY {groups}"
    )


def engine_check_sql(source: str, start: float, end: float) -> str:
    """Per engine instance: its engine_window records ended inside [start, end) (their count and busy_ns),
    and the compute_ns of its engine records ended inside it up to its last window's end (`pending`: how
    many ended later: an engine writes its window when it is next busy, or at shutdown)."""
    rows = (
        f"SELECT *, {_ENGINE} AS is_engine, max(if(is_engine, toDateTime64(0, 9, 'UTC'), ts)) "
        f"OVER (PARTITION BY engine_instance) AS covered "
        f"FROM ({_deduplicated(source, start, end, f'({_ENGINE} OR {_WINDOW})')})"
    )
    return (
        f"SELECT {_dimension('engine_instance')} AS engine_instance, "
        f"countIf(is_engine AND ts <= covered) AS engine_records, countIf(is_engine AND ts > covered) AS pending, "
        f"countIf(NOT is_engine) AS windows, "
        f"sum(toUInt128(if(is_engine AND ts <= covered, compute_ns, 0))) AS compute_ns, "
        f"sum(toUInt128(if(is_engine, 0, busy_ns))) AS busy_ns "
        f"FROM ({rows}) GROUP BY engine_instance ORDER BY engine_instance"
    )


def hourly_bills_sql(source: str, start: float, end: float) -> str:
    """The budget tracker's first read: token sums of the bills ended in [start, end) per tenant, scene,
    model and hour (`hour`: its start, Unix seconds)."""
    return (
        f"SELECT tenant, scene, model, toUnixTimestamp(toStartOfHour(ts)) AS hour, "
        f"{', '.join(f'sum({t}) AS {t}' for t in TOKEN_TYPES)} FROM ({_bills(source, start, end)}) "
        f"GROUP BY tenant, scene, model, hour ORDER BY hour"
    )


def recent_records_sql(source: str, start: float) -> str:
    """The budget tracker's polls: the records (bills, engine records, progress) written since start,
    each as it arrived (duplicates included: the tracker skips those it counted)."""
    kinds = ", ".join(
        _literal(k) for k in ("", semconv.USAGE_KIND_REQUEST, semconv.USAGE_KIND_ENGINE, semconv.USAGE_KIND_PROGRESS)
    )
    return (
        f"SELECT key, kind, tenant, scene, model, {', '.join(TOKEN_TYPES)}, frontend_billed, pd_role, "
        f"toUnixTimestamp64Nano(ts) AS t FROM ({source}) "
        f"WHERE ts >= fromUnixTimestamp64Nano({int(start * 1e9)}, 'UTC') AND key != '' AND kind IN ({kinds}) "
        f"ORDER BY ts"
    )


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
            raise ReportError(
                "reading the ledger needs the embedded ClickHouse engine: pip install 'otel-llm[ledger]' (chdb)"
            ) from None
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
        rows = self.executor.rows(
            f"SELECT count() AS n FROM file({_literal(self.spool_pattern)}, 'LineAsString') WHERE NOT isValidJSON(line)"
        )
        return int(rows[0]["n"]) if rows else 0

    def usage(self, start: float, end: float, by: list[str]) -> dict[tuple[str, ...], Row]:
        rows = {}
        for item in self.executor.rows(usage_sql(self.source, start, end, by)):
            key = tuple(str(item[f"d{i}"]) for i in range(len(by)))
            row = Row(key)
            row.tokens = {t: int(item[t]) for t in TOKEN_TYPES}
            row.tokens.update((d, int(item[d])) for d in DETAIL_FIELDS if int(item[d]))  # absent: 0
            row.requests = int(item["requests"])
            row.compute_ns, row.prefill_compute_ns, row.kv_block_ns = (
                int(item[c]) for c in ("compute_ns", "prefill_compute_ns", "kv_block_ns")
            )
            row.orphans = int(item["orphans"])
            rows[key] = row
        return rows

    def reconcile_totals(self, start: float, end: float, by: list[str]) -> dict[tuple[str, ...], dict]:
        return {
            tuple(str(item[f"d{i}"]) for i in range(len(by))): item
            for item in self.executor.rows(reconcile_sql(self.source, start, end, by))
        }

    def records(self, start: float, end: float) -> list[dict]:
        return self.executor.rows(records_sql(self.source, start, end))

    def windows(self, start: float, end: float, by: list[str]) -> dict[tuple[str, ...], dict]:
        """Per `by` key: wall_ns, busy_ns, idle_ns, kv_capacity_block_ns, window_kv_block_ns (ints),
        service_instance and model of the engine_window records (windows_sql)."""
        dims = [f"d{i}" for i in range(len(by))]
        return {
            tuple(str(item[d]) for d in dims): {
                k: (v if k in ("service_instance", "model") else int(v)) for k, v in item.items() if k not in dims
            }
            for item in self.executor.rows(windows_sql(self.source, start, end, by))
        }

    def engine_check(self, start: float, end: float) -> list[dict]:
        """Per engine instance: engine_records, compute_ns and busy_ns (engine_check_sql)."""
        return [
            {k: (v if k == "engine_instance" else int(v)) for k, v in item.items()}
            for item in self.executor.rows(engine_check_sql(self.source, start, end))
        ]


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
    return Ledger(
        spool_source(where),
        ChdbExecutor(),
        f"spool {os.path.abspath(where)}",
        spool_pattern=os.path.join(os.path.abspath(where), SPOOL_GLOB),
    )


def add_ledger_argument(parser) -> None:
    """--ledger, as `reconcile` and `export` take it (for open_ledger)."""
    parser.add_argument(
        "--ledger",
        required=True,
        metavar="DIR|URL",
        help="spool directory, clickhouse://HOST:8123/DB or chdb://SESSION_DIR",
    )


def load_otel_logs(session_path: str, records: list[dict], table: str = "otel_logs") -> Ledger:
    """A chDB session at session_path with the collector's logs table holding these records (spool
    records: read_spool's), as a Ledger: for tests, and to try the ClickHouse queries locally."""
    executor = ChdbExecutor(session_path)
    executor.execute(otel_logs_ddl("default", table))
    if records:
        executor.execute(insert_records_sql(records, table))
    return Ledger(otel_logs_source(table), executor, f"chDB session {session_path}, table {table}")


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
        attrs = {
            k: (json.dumps(v) if isinstance(v, list) else str(v))
            for k, v in record.items()
            if k not in (semconv.USAGE_TIME, semconv.USAGE_TRACE_ID, semconv.USAGE_SPAN_ID)
        }
        attr_sql = "map(" + ", ".join(f"{_literal(k)}, {_literal(v)}" for k, v in attrs.items()) + ")"
        values.append(
            f"(fromUnixTimestamp64Nano({int(record[semconv.USAGE_TIME])}, 'UTC'), "
            f"{_literal(record.get(semconv.USAGE_TRACE_ID, ''))}, "
            f"{_literal(record.get(semconv.USAGE_SPAN_ID, ''))}, "
            f"{_literal(str(record.get(semconv.SERVICE_NAME, '')))}, {attr_sql})"
        )
    return f"INSERT INTO {table} (Timestamp, TraceId, SpanId, ServiceName, LogAttributes) VALUES " + ", ".join(values)


def read_spool(directory: str, kinds: tuple[str, ...] | None = (semconv.USAGE_KIND_REQUEST,)) -> list[dict]:
    """The whole record lines of a spool directory (a torn last line is skipped), in Python: the API
    servers' records (bills) unless `kinds` names others (None: every kind)."""
    records = []
    for path in sorted(glob.glob(os.path.join(directory, SPOOL_GLOB))):
        with open(path, "rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if kinds is None or record.get(semconv.USAGE_KIND, semconv.USAGE_KIND_REQUEST) in kinds:
                    records.append(record)
    return records
