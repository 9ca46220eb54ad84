"""Current use of every budget, from the usage ledger, for enforcement and alerts.

A BudgetTracker keeps, per budget of a budget file (otel_llm/ops/budgets.py), what its tenant (and
scene) used in the current period. It reads the ledger where the ledger lives, incrementally:

- a spool directory (or several: one per host): it tails the spool files itself, from where it
  stopped; records are written when a request ends, and `progress` records while a long stream
  runs (OTEL_LLM_LIVE_INTERVAL), so streams count while they run;
- ClickHouse (`clickhouse://...`, the collector's usage pipeline) or a chDB session (`chdb://...`):
  at start one query sums the bills of the horizon per hour (exact: the ledger's own bill SQL), then
  every poll reads the records of the last OVERLAP_S seconds, skipping those it has counted.

A bill counts once; a stream's progress records count as they come and its bill replaces them, so
the total is the bill. Checking a tenant reads memory: microseconds, however large the ledger.

What it does not see (the bill does): an engine record billed by an instrumented API server whose
own record never arrived; with ClickHouse, records that land more than OVERLAP_S after their time.
"""

from __future__ import annotations

import glob
import json
import math
import os
import threading
import time
from dataclasses import dataclass

from otel_llm import semconv
from otel_llm.ops.budgets import Budget, labels
from otel_llm.usage import SPOOL_PREFIX, SPOOL_SUFFIX

TOKEN_FIELDS = semconv.USAGE_TOKEN_FIELDS  # (record field, token type)
TOKEN_TYPES = semconv.TOKEN_TYPES
OVERLAP_S = 300  # ClickHouse: each poll rereads this much (records that land late, out of order)
PROGRESS_TTL_S = 3600  # a stream's progress with no bill for this long: its server is gone, forget it
PREPAID_RETRY_S = 300  # Retry-After for an exhausted prepaid balance (no period ends it: a top-up does)
_BILL_KINDS = ("", semconv.USAGE_KIND_REQUEST)


@dataclass(frozen=True, slots=True)
class Usage:
    """One ledger record, as the tracker needs it."""

    kind: str
    key: str
    tenant: str | None
    scene: str | None
    model: str
    t: float  # Unix seconds: when it was written (a bill: the request's end)
    tokens: tuple[int, int, int]  # TOKEN_TYPES order: input (cached included), cached input, output


@dataclass(frozen=True)
class Decision:
    allowed: bool
    state: str  # semconv.BUDGET_STATE_*: the worst of the tenant's budgets
    retry_after: int | None  # seconds until the exceeded budgets' periods end (refused requests)
    budgets: list[dict]


class _Tally:
    __slots__ = ("budget", "used", "unpriced")

    def __init__(self, budget: Budget):
        self.budget = budget
        self.used: dict[float, float] = {}  # period start -> amount
        self.unpriced: dict[float, int] = {}


class BudgetTracker:
    def __init__(
        self, budgets: list[Budget], prices: dict | None = None, currency: str | None = None, feed=None, clock=time.time
    ):
        self.budgets, self.prices, self.currency, self.feed, self.clock = budgets, prices or {}, currency, feed, clock
        self._tallies = [_Tally(b) for b in budgets]
        self._by_tenant: dict[str, list[_Tally]] = {}
        for tally in self._tallies:
            self._by_tenant.setdefault(tally.budget.tenant, []).append(tally)
        self._progress: dict[str, tuple[tuple[int, int, int], float]] = {}  # key -> (tokens counted, time)
        self._lock = threading.Lock()
        self.bills = 0  # bills counted
        self.read_through: float | None = None  # clock time of the last complete read of the feed

    def horizon(self) -> float:
        """The earliest time any budget's current period starts (the feed reads from there)."""
        now = self.clock()
        starts = [b.period_start(now) for b in self.budgets]
        starts = [s if s is not None else b.since for s, b in zip(starts, self.budgets)]
        return min(starts) if starts else now

    # --- reading the ledger ---------------------------------------------------------------------

    def refresh(self) -> int:
        """Read what the feed has that is new; returns how many records were counted."""
        started = self.clock()
        counted = 0
        for usage in self.feed.read(self.horizon()):
            counted += self.add(usage)
        self.read_through = started
        return counted

    def add(self, usage: Usage) -> int:
        """Count one record (1) or skip it (0): bills and progress of budgeted tenants."""
        tallies = self._by_tenant.get(usage.tenant)
        with self._lock:
            if usage.kind == semconv.USAGE_KIND_PROGRESS:
                before, _ = self._progress.get(usage.key, ((0, 0, 0), 0.0))
                delta = tuple(max(0, n - b) for n, b in zip(usage.tokens, before))
                self._progress[usage.key] = (tuple(max(n, b) for n, b in zip(usage.tokens, before)), usage.t)
            else:
                before, _ = self._progress.pop(usage.key, ((0, 0, 0), 0.0))
                delta = tuple(n - b for n, b in zip(usage.tokens, before))  # the bill replaces its progress
                self.bills += bool(usage.key)  # (a ledger feed's first read gives hourly sums, keyless)
            if not tallies:
                return 0
            tokens = dict(zip(TOKEN_TYPES, delta))
            price = (self.prices.get(usage.model) or self.prices.get("*")) if self.prices else None
            for tally in tallies:
                budget = tally.budget
                if not budget.matches(usage.tenant, usage.scene):
                    continue
                start = budget.period_start(usage.t)
                if start is None:
                    continue
                amount = budget.amount(tokens, price)
                if amount is None:
                    tally.unpriced[start] = tally.unpriced.get(start, 0) + sum(delta[0::2])
                else:
                    tally.used[start] = tally.used.get(start, 0) + amount
        return 1

    def forget_stale_progress(self) -> None:
        cutoff = self.clock() - PROGRESS_TTL_S
        with self._lock:
            for key in [k for k, (_, t) in self._progress.items() if t < cutoff]:
                del self._progress[key]

    # --- reading the figures --------------------------------------------------------------------

    def figures(self, tenant: str | None = None, scene: str | None = None, now: float | None = None) -> list[dict]:
        """Each budget's (of one tenant, and scene: the tenant's budgets and those of that scene)
        figure in its current period."""
        now = self.clock() if now is None else now
        tallies = self._tallies if tenant is None else self._by_tenant.get(tenant, [])
        out = []
        with self._lock:
            for tally in tallies:
                budget = tally.budget
                if tenant is not None and not budget.matches(tenant, scene):
                    continue
                start = budget.period_start(now)
                used = tally.used.get(start, 0) if start is not None else 0
                for old in [s for s in tally.used if start is not None and s < start]:
                    del tally.used[old]  # a period that ended: nothing counts there any more
                    tally.unpriced.pop(old, None)
                limit = budget.limit_at(now)
                end = budget.period_end(now)
                out.append(
                    {
                        "tenant": budget.tenant,
                        "scene": budget.scene or "",
                        "period": budget.period,
                        "unit": labels(budget, self.currency)[semconv.prometheus_label(semconv.BUDGET_UNIT)],
                        "used": used,
                        "limit": limit,
                        "warn_ratio": budget.warn_ratio,
                        "state": budget.state(used, now),
                        "resets_in": None if end is None else end - now,
                        "unpriced_tokens": tally.unpriced.get(start, 0),
                        "budget": budget,
                    }
                )
        return out

    def check(self, tenant: str | None, scene: str | None = None, now: float | None = None) -> Decision:
        """May this tenant (scene) send a request now? Refused while any of its budgets is over."""
        found = self.figures(tenant, scene, now) if tenant is not None else []
        over = [f for f in found if f["state"] == semconv.BUDGET_STATE_OVER]
        states = {f["state"] for f in found}
        state = (
            semconv.BUDGET_STATE_OVER
            if over
            else semconv.BUDGET_STATE_NEAR
            if semconv.BUDGET_STATE_NEAR in states
            else semconv.BUDGET_STATE_OK
        )
        retry = None
        if over:
            retry = max(PREPAID_RETRY_S if f["resets_in"] is None else math.ceil(f["resets_in"]) for f in over)
        return Decision(not over, state, retry, [_public(f) for f in found])

    def lag(self) -> float | None:
        return None if self.read_through is None else max(0.0, self.clock() - self.read_through)

    def exposition(self) -> str:
        """The figures in Prometheus' text format (label values exact: no label cap here)."""
        lines = []
        figures = self.figures()
        series = (
            (semconv.BUDGET_USED, "used"),
            (semconv.BUDGET_LIMIT, "limit"),
            (semconv.BUDGET_WARN_RATIO, "warn_ratio"),
            (semconv.BUDGET_UNPRICED_TOKENS, "unpriced_tokens"),
        )
        for metric, field in series:
            name = semconv.prometheus_metric(metric)
            lines += [f"# HELP {name} {semconv.METRICS[metric].description}", f"# TYPE {name} gauge"]
            for f in figures:
                if field == "unpriced_tokens" and not f["budget"].money:
                    continue
                lines.append(f"{name}{_labels(labels(f['budget'], self.currency))} {float(f[field])!r}")
        lag = self.lag()
        if lag is not None:
            name = semconv.prometheus_metric(semconv.BUDGET_TRACKER_LAG)
            lines += [
                f"# HELP {name} {semconv.METRICS[semconv.BUDGET_TRACKER_LAG].description}",
                f"# TYPE {name} gauge",
                f"{name} {lag!r}",
            ]
        return "\n".join(lines) + "\n"


def _public(figure: dict) -> dict:
    return {k: v for k, v in figure.items() if k != "budget"}


def _labels(values: dict[str, str]) -> str:
    escape = lambda v: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")  # noqa: E731
    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in values.items()) + "}"


# --- feeds: where the records come from ---------------------------------------------------------------


def from_record(record: dict) -> Usage | None:
    """A spool record (usage.py's fields) as Usage; None for records that are no bill nor progress:
    engine windows, an engine request an instrumented API server bills, a P/D prefill leg."""
    if not isinstance(record, dict):
        return None
    kind = record.get(semconv.USAGE_KIND) or ""
    if kind == semconv.USAGE_KIND_ENGINE:
        if record.get(semconv.USAGE_FRONTEND_BILLED) or record.get(semconv.VLLM_PD_ROLE) == semconv.PD_ROLE_PREFILL:
            return None
        kind = ""  # no instrumented frontend: the engine's record is the bill
    elif kind not in _BILL_KINDS and kind != semconv.USAGE_KIND_PROGRESS:
        return None
    key, t = record.get(semconv.USAGE_ID), record.get(semconv.USAGE_TIME)
    if not isinstance(key, str) or not isinstance(t, int):
        return None
    tokens = tuple(_int(record.get(field)) for field, _ in TOKEN_FIELDS)
    return Usage(
        kind,
        key,
        _str(record.get(semconv.TENANT_ID)),
        _str(record.get(semconv.TENANT_SCENE)),
        _str(record.get(semconv.GEN_AI_REQUEST_MODEL)) or "",
        t / 1e9,
        tokens,
    )


def _int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _str(value) -> str | None:
    return value if isinstance(value, str) and value else None


class SpoolFeed:
    """Tails the spool files of one or more directories: each poll reads the whole lines written
    since the last one. A file last modified before the horizon is skipped unread."""

    def __init__(self, *directories: str):
        self.patterns = [os.path.join(d, f"{SPOOL_PREFIX}*{SPOOL_SUFFIX}") for d in directories]
        self._offsets: dict[str, int] = {}
        self.unreadable = 0  # lines that are not JSON (a torn line: the ledger's report counts them too)

    def read(self, horizon: float):
        live = set()
        for path in sorted(p for pattern in self.patterns for p in glob.glob(pattern)):
            live.add(path)
            offset = self._offsets.get(path)
            try:
                if offset is None and os.path.getmtime(path) < horizon:
                    self._offsets[path] = os.path.getsize(path)
                    continue
                if offset and os.path.getsize(path) < offset:
                    offset = 0  # the file was replaced under its name: read the new one whole
                with open(path, "rb") as f:
                    f.seek(offset or 0)
                    data = f.read()
            except OSError:
                continue  # removed meanwhile (retention)
            whole = data[: data.rfind(b"\n") + 1]
            self._offsets[path] = (offset or 0) + len(whole)
            for line in whole.splitlines():
                try:
                    usage = from_record(json.loads(line))
                except ValueError:
                    self.unreadable += 1
                    continue
                if usage is not None:
                    yield usage
        for gone in set(self._offsets) - live:
            del self._offsets[gone]


class LedgerFeed:
    """A ledger in ClickHouse or a chDB session (otel_llm.billing.ledger.open_ledger). The first read sums the
    bills from the horizon to OVERLAP_S ago per hour; each read then takes the records of the last
    OVERLAP_S seconds before the newest it has seen, and skips those it counted already."""

    def __init__(self, ledger, clock=time.time):
        self.ledger, self.clock = ledger, clock
        self._seen: dict[tuple, float] = {}  # (key, kind, time) -> time, of the records of the overlap
        self._from: float | None = None  # records before this are counted

    def read(self, horizon: float):
        from otel_llm.billing import ledger as ledger_sql

        if self._from is None:
            self._from = max(horizon, self.clock() - OVERLAP_S)
            for row in self.ledger.executor.rows(ledger_sql.hourly_bills_sql(self.ledger.source, horizon, self._from)):
                yield Usage(
                    "",
                    "",
                    _str(row["tenant"]),
                    _str(row["scene"]),
                    row["model"] or "",
                    float(row["hour"]),
                    tuple(int(row[t]) for t in TOKEN_TYPES),
                )
        newest = self._from
        for row in self.ledger.executor.rows(ledger_sql.recent_records_sql(self.ledger.source, self._from)):
            t = int(row["t"]) / 1e9
            ident = (row["key"], row["kind"], t)
            if ident in self._seen:
                continue
            self._seen[ident] = t
            newest = max(newest, t)
            usage = from_record(
                {
                    semconv.USAGE_KIND: row["kind"],
                    semconv.USAGE_ID: row["key"],
                    semconv.USAGE_TIME: int(row["t"]),
                    semconv.TENANT_ID: row["tenant"],
                    semconv.TENANT_SCENE: row["scene"],
                    semconv.GEN_AI_REQUEST_MODEL: row["model"],
                    semconv.USAGE_FRONTEND_BILLED: bool(int(row["frontend_billed"])),
                    semconv.VLLM_PD_ROLE: row["pd_role"],
                    **{field: int(row[t]) for field, t in TOKEN_FIELDS},
                }
            )
            if usage is not None:
                yield usage
        self._from = max(self._from, newest - OVERLAP_S)
        for ident in [i for i, t in self._seen.items() if t < self._from]:
            del self._seen[ident]
