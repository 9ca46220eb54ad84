"""`otel-llm report --ledger ... --costs costs.yaml`: what the engines cost, shared out over the bills.

An engine instance costs its hourly rate x its wall time in the window (the sum of its engine_window
records' end - start). A bill gets the share of that cost its engine figures weigh: compute_ns over the
instance's wall time (`compute`), KV block-ns over its KV capacity x wall time (`kv`), or a weighted
blend. What no bill used is the instance's `idle` row (`idle: row`), or is shared out over the bills in
proportion to their weight (`idle: spread`). docs/ledger.md, "Costs".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from otel_llm.billing.promql import ReportError, read_config
from otel_llm.billing.rows import UNSET, Row

IDLE = "idle"  # the dimension values of an instance's idle row
ALLOCATIONS = ("compute", "kv")
_KEYS = {"currency", "usd_per_hour", "allocate", "idle", "instances", "models"}
_ENTRY_KEYS = {"usd_per_hour", "gpu", "gpus", "usd_per_gpu_hour"}


@dataclass(frozen=True)
class Costs:
    currency: str = "USD"
    usd_per_hour: float | None = None  # every engine instance's rate unless `instances` or `models` say
    weights: dict[str, float] = field(default_factory=lambda: {"compute": 1.0, "kv": 0.0})
    idle: str = "row"  # row | spread
    instances: dict[str, float] = field(default_factory=dict)  # engine or service instance -> rate per hour
    models: dict[str, float] = field(default_factory=dict)  # gen_ai.request.model -> rate per instance-hour

    def rate(self, engine_instance: str, service_instance: str, model: str) -> float | None:
        for table, key in ((self.instances, engine_instance), (self.instances, service_instance), (self.models, model)):
            if key in table:
                return table[key]
        return self.usd_per_hour


def _number(value, what: str, path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ReportError(f"cost file {path}: {what} must be a number >= 0, got {value!r}")
    return float(value)


def _rate(entry, what: str, path) -> float:
    """{usd_per_hour: X} or {gpus: N, usd_per_gpu_hour: X, gpu: NAME (a label)}."""
    if not isinstance(entry, dict) or set(entry) - _ENTRY_KEYS:
        raise ReportError(
            f"cost file {path}: {what}: expected {{usd_per_hour: X}} or "
            f"{{gpu: NAME, gpus: N, usd_per_gpu_hour: X}}, got {entry!r}"
        )
    if "usd_per_hour" in entry:
        if "gpus" in entry or "usd_per_gpu_hour" in entry:
            raise ReportError(f"cost file {path}: {what}: give usd_per_hour or gpus x usd_per_gpu_hour, not both")
        return _number(entry["usd_per_hour"], f"{what}: usd_per_hour", path)
    gpus = entry.get("gpus")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ReportError(
            f"cost file {path}: {what}: gpus must be a whole number >= 1 (with usd_per_gpu_hour), got {gpus!r}"
        )
    return gpus * _number(entry.get("usd_per_gpu_hour"), f"{what}: usd_per_gpu_hour", path)


def load(path: str | Path) -> Costs:
    """The cost file (JSON, or YAML when PyYAML is installed); the smallest is `usd_per_hour: 3.5`."""
    path = Path(path)
    data = read_config(path, "cost file")
    if not isinstance(data, dict):
        raise ReportError(f"cost file {path}: expected a mapping such as {{usd_per_hour: 3.5}}")
    unknown = sorted(set(data) - _KEYS, key=str)
    if unknown:
        raise ReportError(
            f"cost file {path}: unknown key(s) {', '.join(map(str, unknown))}; known: {', '.join(sorted(_KEYS))}"
        )
    default = _number(data["usd_per_hour"], "usd_per_hour", path) if "usd_per_hour" in data else None
    tables = {}
    for name in ("instances", "models"):
        table = data.get(name) or {}
        if not isinstance(table, dict):
            raise ReportError(f"cost file {path}: {name} must map names to rates, got {table!r}")
        tables[name] = {str(k): _rate(v, f"{name} {k!r}", path) for k, v in table.items()}
    if default is None and not tables["instances"] and not tables["models"]:
        raise ReportError(
            f"cost file {path}: no rate: set usd_per_hour (every engine instance's), or rates under instances or models"
        )
    allocate = data.get("allocate", "compute")
    if allocate in ALLOCATIONS:
        weights = {a: float(a == allocate) for a in ALLOCATIONS}
    elif isinstance(allocate, dict) and allocate and not set(allocate) - set(ALLOCATIONS):
        weights = {a: _number(allocate.get(a, 0), f"allocate: {a}", path) for a in ALLOCATIONS}
        if abs(sum(weights.values()) - 1) > 1e-9:
            raise ReportError(f"cost file {path}: allocate: the weights must add up to 1, got {allocate!r}")
    else:
        raise ReportError(
            f"cost file {path}: allocate must be compute, kv or weights such as "
            f"{{compute: 0.7, kv: 0.3}}, got {allocate!r}"
        )
    idle = data.get("idle", "row")
    if idle not in ("row", "spread"):
        raise ReportError(f"cost file {path}: idle must be row or spread, got {idle!r}")
    currency = data.get("currency", "USD")
    if not isinstance(currency, str) or not currency:
        raise ReportError(f"cost file {path}: currency must be a name such as USD, got {currency!r}")
    return Costs(currency, default, weights, idle, tables["instances"], tables["models"])


def allocate(
    rows: dict[tuple, Row], fine_by: list[str], by: list[str], windows: dict[tuple, dict], costs: Costs
) -> tuple[dict[tuple, Row], list[Row], list[str]]:
    """rows: the ledger's usage per `fine_by` key (`by` plus engine_instance); windows: the ledger's
    engine_window totals per unit (engine_instance, plus day when `by` has it).

    Returns the rows per `by` key with their engine cost, the idle rows, and warnings."""
    unit_of = [fine_by.index("engine_instance")] + ([fine_by.index("day")] if "day" in by else [])
    instance_cost = {}
    for unit, window in windows.items():
        rate = costs.rate(unit[0], window["service_instance"], window["model"])
        if rate is None:
            raise ReportError(
                f"no rate for engine instance {unit[0]} (service.instance.id "
                f"{window['service_instance']}, model {window['model']}): set usd_per_hour, or add "
                f"it under instances or models in the cost file"
            )
        instance_cost[unit] = rate * window["wall_ns"] / 3600e9

    def weight(row: Row, window: dict) -> float:
        kv = row.kv_block_ns / window["kv_capacity_block_ns"] if window["kv_capacity_block_ns"] else 0.0
        return costs.weights["compute"] * row.compute_ns / window["wall_ns"] + costs.weights["kv"] * kv

    weights = {}
    for fine in rows.values():
        unit = tuple(fine.key[i] for i in unit_of)
        if unit in windows and windows[unit]["wall_ns"]:
            weights[unit] = weights.get(unit, 0.0) + weight(fine, windows[unit])
    merged: dict[tuple, Row] = {}
    used = {unit: [0.0, 0, 0] for unit in windows}  # cost, compute_ns, kv_block_ns of the unit's bills
    uncosted, unpriced = 0, set()
    for fine in rows.values():
        unit = tuple(fine.key[i] for i in unit_of)
        cost = 0.0
        if unit[0] == UNSET:
            uncosted += fine.requests or 0
        elif unit not in windows or not windows[unit]["wall_ns"]:
            unpriced.add(unit[0])
        elif costs.idle == "row":
            cost = instance_cost[unit] * weight(fine, windows[unit])
        elif weights[unit]:
            cost = instance_cost[unit] * weight(fine, windows[unit]) / weights[unit]
        if unit in used:
            used[unit][0] += cost
            used[unit][1] += fine.compute_ns
            used[unit][2] += fine.kv_block_ns
        fine.engine_cost = cost
        fine.engine_cost_input = cost * fine.prefill_compute_ns / fine.compute_ns if fine.compute_ns else 0.0
        add_row(merged.setdefault(key := tuple(fine.key[fine_by.index(d)] for d in by), Row(key)), fine)
    idle_rows = []
    for unit, window in sorted(windows.items()):
        cost, compute_ns, kv_block_ns = used[unit]
        if costs.idle == "spread" and weights.get(unit):
            continue
        # what the unit's bills did not use: with `spread`, only a unit whose bills weigh nothing has one
        values = {
            "instance": window["service_instance"],
            "engine_instance": unit[0],
            "day": unit[-1] if "day" in by else None,
        }
        row = Row(tuple(values.get(d) or IDLE for d in by), requests=0)
        row.compute_ns, row.kv_block_ns = window["wall_ns"] - compute_ns, window["kv_capacity_block_ns"] - kv_block_ns
        row.engine_cost = instance_cost[unit] - cost
        idle_rows.append(row)
    warnings = []
    if uncosted:
        warnings.append(
            f"{uncosted} request(s) have no engine cost figures (no engine record joined: a server "
            f"without schema 2, or its engine records are missing): their cost is 0"
        )
    if unpriced:
        warnings.append(
            f"engine instance(s) {', '.join(sorted(unpriced))} served requests but have no "
            f"engine_window records in the window: their requests' cost is 0"
        )
    return merged, idle_rows, warnings


def add_row(total: Row, row: Row) -> None:
    """Adds row's counts and costs into total."""
    for t, n in row.tokens.items():
        total.tokens[t] = total.tokens.get(t, 0) + n
    total.requests = (total.requests or 0) + (row.requests or 0)
    total.compute_ns += row.compute_ns
    total.prefill_compute_ns += row.prefill_compute_ns
    total.kv_block_ns += row.kv_block_ns
    total.orphans += row.orphans
    for name in ("engine_cost", "engine_cost_input", "cost", "savings"):
        value = getattr(row, name)
        if value is not None:
            setattr(total, name, (getattr(total, name) or 0.0) + value)
