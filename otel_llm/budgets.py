"""Daily token budgets per tenant (optionally per scene): a config file becomes Prometheus alerting
rules (`otel-llm budget-rules`) and a consumption-vs-budget view (`otel-llm report --budgets`).

Budget file (JSON, or YAML with PyYAML):

    {"budgets": [
      {"tenant": "acme", "tokens_per_day": 2000000},
      {"tenant": "acme", "scene": "batch", "tokens_per_day": 500000, "warn_ratio": 0.9,
       "token_types": ["output"]}
    ]}

`token_types` defaults to input and output (input includes cached input); `warn_ratio` to 0.8.
The alerts look at the last 24 hours (a rolling day); the report at the current UTC day.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from otel_llm import semconv
from otel_llm.promql import (
    DIMENSIONS,
    TOKEN_METRIC,
    TOKEN_TYPES,
    TYPE_LABEL,
    ReportError,
    read_config,
    runbook_url,
    yaml_text,
)

DEFAULT_TYPES = (semconv.TOKEN_TYPE_INPUT, semconv.TOKEN_TYPE_OUTPUT)
ALERT_NEAR = "TokenBudgetNearLimit"
ALERT_OVER = "TokenBudgetExceeded"


@dataclass(frozen=True)
class Budget:
    tenant: str
    tokens_per_day: int
    scene: str | None = None
    warn_ratio: float = 0.8
    token_types: tuple[str, ...] = DEFAULT_TYPES

    @property
    def name(self) -> str:
        return self.tenant + (f"/{self.scene}" if self.scene else "")


def load(path: str | Path) -> list[Budget]:
    path = Path(path)
    data = read_config(path, "budget file")
    entries = data.get("budgets") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ReportError(f'budget file {path}: expected {{"budgets": [{{"tenant": .., "tokens_per_day": ..}}]}}')
    budgets, seen = [], set()
    for index, entry in enumerate(entries):
        where = f"budget file {path}, budget {index + 1}"
        if not isinstance(entry, dict) or not isinstance(entry.get("tenant"), str) or not entry["tenant"]:
            raise ReportError(f"{where}: needs a tenant")
        limit = entry.get("tokens_per_day")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise ReportError(f"{where}: tokens_per_day must be a whole number > 0, got {limit!r}")
        ratio = entry.get("warn_ratio", 0.8)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
            raise ReportError(f"{where}: warn_ratio must be between 0 and 1, got {ratio!r}")
        types = tuple(entry.get("token_types") or DEFAULT_TYPES)
        if not set(types) <= set(TOKEN_TYPES):
            raise ReportError(f"{where}: token_types must be among {', '.join(TOKEN_TYPES)}, got {list(types)}")
        scene = entry.get("scene")
        budget = Budget(entry["tenant"], limit, str(scene) if scene else None, float(ratio), types)
        if (budget.tenant, budget.scene) in seen:
            raise ReportError(f"{where}: {budget.name} has a budget already")
        seen.add((budget.tenant, budget.scene))
        budgets.append(budget)
    return budgets


def _selector(budget: Budget) -> str:
    matchers = [f'{DIMENSIONS["tenant"]}="{_escape(budget.tenant)}"']
    if budget.scene:
        matchers.append(f'{DIMENSIONS["scene"]}="{_escape(budget.scene)}"')
    matchers.append(f'{TYPE_LABEL}=~"{"|".join(budget.token_types)}"')
    return f"{TOKEN_METRIC}{{{','.join(matchers)}}}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def usage_expr(budget: Budget) -> str:
    return f"sum(increase({_selector(budget)}[1d]))"


def rules(budgets: list[Budget]) -> dict:
    """Prometheus rule groups: a warning near each budget, a critical alert over it."""
    alerts = []
    for budget in budgets:
        labels = {"tenant": budget.tenant, **({"scene": budget.scene} if budget.scene else {})}
        what = f"{budget.name}: {{{{ $value | humanize }}}} tokens ({'+'.join(budget.token_types)}) in the last 24 h"
        alerts.append({
            "alert": ALERT_NEAR,
            "expr": f"{usage_expr(budget)} > {budget.warn_ratio:g} * {budget.tokens_per_day}",
            "labels": {**labels, "severity": "warning"},
            "annotations": {"summary": f"{what}, over {budget.warn_ratio:.0%} of its daily budget of "
                                       f"{budget.tokens_per_day}",
                            "description": "A tenant (or one of its scenes) is close to its daily token budget.",
                            "runbook_url": runbook_url(ALERT_NEAR)},
        })
        alerts.append({
            "alert": ALERT_OVER,
            "expr": f"{usage_expr(budget)} > {budget.tokens_per_day}",
            "labels": {**labels, "severity": "critical"},
            "annotations": {"summary": f"{what}, over its daily budget of {budget.tokens_per_day}",
                            "description": "A tenant (or one of its scenes) used more tokens in the last 24 h "
                                           "than its daily budget.",
                            "runbook_url": runbook_url(ALERT_OVER)},
        })
    return {"groups": [{"name": "otel-llm-token-budgets", "interval": "1m", "rules": alerts}]}


def rules_yaml(budgets: list[Budget]) -> str:
    return "# generated by `otel-llm budget-rules`; do not edit\n" + yaml_text(rules(budgets))


def status(budgets: list[Budget], rows) -> list[dict]:
    """Consumption vs budget, from report rows keyed by (tenant, scene)."""
    result = []
    for budget in budgets:
        used = sum(row.tokens[t] for key, row in rows.items()
                   if key[0] == budget.tenant and (budget.scene is None or key[1] == budget.scene)
                   for t in budget.token_types)
        share = used / budget.tokens_per_day
        state = "over" if used > budget.tokens_per_day else ("near" if share > budget.warn_ratio else "ok")
        result.append({"tenant": budget.tenant, "scene": budget.scene or "", "used": used,
                       "budget": budget.tokens_per_day, "share": round(share, 4), "state": state})
    return result
