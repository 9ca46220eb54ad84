"""Budgets per tenant (optionally per scene): the budget file, each budget's period and what a
request's tokens count against it. The budget tracker (otel_llm/ops/budget_tracker.py) counts them from
the usage ledger; `otel-llm budget-rules` turns the file into Prometheus alerts on the tracker's
figures; `otel-llm report --budgets` shows them.

Budget file (JSON, or YAML with PyYAML):

    {"budgets": [
      {"tenant": "acme", "period": "day", "tokens": 2000000},
      {"tenant": "acme", "scene": "batch", "period": "month", "cost": 500, "warn_ratio": 0.9},
      {"tenant": "globex", "period": "prepaid", "cost": 100, "since": "2026-11-01T00:00:00Z",
       "top_ups": [{"at": "2026-11-20T00:00:00Z", "amount": 50}]},
      {"tenant": "initech", "tokens_per_day": 100000, "token_types": ["output"]}
    ]}

A budget limits `tokens` (of `token_types`: input and output by default; input includes cached
input) or `cost` (money: the tokens at the price file's prices, in its currency). `period`: `day`
and `month` are UTC calendar periods (the figure starts at 0 at 00:00 UTC, on the 1st); `prepaid`
is a balance drawn down from `since` on, raised by each top-up once its time has come. `warn_ratio`
(0.8) is where a budget is near. `tokens_per_day` is the first file format's daily token budget.
A tenant may have several budgets (a day and a month, tokens and money); one per tenant, scene,
period and unit.
"""

from __future__ import annotations

import calendar
import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from otel_llm import semconv
from otel_llm.billing.promql import DIMENSIONS, TOKEN_TYPES, ReportError, iso_time, read_config, runbook_url, yaml_text

DEFAULT_TYPES = (semconv.TOKEN_TYPE_INPUT, semconv.TOKEN_TYPE_OUTPUT)
PERIODS = (semconv.BUDGET_PERIOD_DAY, semconv.BUDGET_PERIOD_MONTH, semconv.BUDGET_PERIOD_PREPAID)
ALERT_NEAR = "BudgetNearLimit"
ALERT_OVER = "BudgetExceeded"
ALERT_UNWATCHED = "BudgetNotWatched"
ALERT_TRACKER_BEHIND = "BudgetTrackerBehind"
TRACKER_MAX_LAG_S = 120  # BudgetTrackerBehind: the tracker has not read its ledger through for this long
# an attribution value otel-llm accepts (otel_llm/vllm/attribution.py); a budget on a longer or
# non-printable name could never match a request
MAX_NAME_LENGTH = 256


@dataclass(frozen=True)
class Budget:
    tenant: str
    limit: float  # tokens (int) or money
    unit: str  # semconv.BUDGET_UNIT_TOKENS or "cost"
    period: str = semconv.BUDGET_PERIOD_DAY
    scene: str | None = None
    warn_ratio: float = 0.8
    token_types: tuple[str, ...] = DEFAULT_TYPES
    since: float | None = None  # prepaid: the balance's start (Unix seconds)
    top_ups: tuple[tuple[float, float], ...] = ()  # prepaid: (time, amount)

    @property
    def name(self) -> str:
        return self.tenant + (f"/{self.scene}" if self.scene else "") + f" {self.period} {self.unit}"

    @property
    def money(self) -> bool:
        return self.unit == COST

    def matches(self, tenant: str | None, scene: str | None) -> bool:
        return tenant == self.tenant and (self.scene is None or scene == self.scene)

    def period_start(self, t: float) -> float | None:
        """Start of the period holding time t (None: t is before a prepaid balance began)."""
        if self.period == semconv.BUDGET_PERIOD_PREPAID:
            return self.since if t >= self.since else None
        day = dt.datetime.fromtimestamp(t, dt.timezone.utc)
        if self.period == semconv.BUDGET_PERIOD_MONTH:
            day = day.replace(day=1)
        return calendar.timegm(day.date().timetuple())

    def period_end(self, t: float) -> float | None:
        """When the period holding t ends (the figure starts again at 0); None for a prepaid balance."""
        if self.period == semconv.BUDGET_PERIOD_PREPAID:
            return None
        start = dt.datetime.fromtimestamp(self.period_start(t), dt.timezone.utc)
        if self.period == semconv.BUDGET_PERIOD_DAY:
            return calendar.timegm((start + dt.timedelta(days=1)).timetuple())
        year, month = (start.year + 1, 1) if start.month == 12 else (start.year, start.month + 1)
        return calendar.timegm(dt.date(year, month, 1).timetuple())

    def limit_at(self, t: float) -> float:
        """The limit at time t: a prepaid balance's amount plus the top-ups made by then."""
        return self.limit + sum(amount for at, amount in self.top_ups if at <= t)

    def amount(self, tokens: dict[str, int], price) -> float | None:
        """What tokens ({token type: count}) of one model count against this budget: their count in
        token_types, or their price (None: the model has no price)."""
        if not self.money:
            return sum(tokens.get(t, 0) for t in self.token_types)
        if price is None:
            return None
        cached = tokens.get(semconv.TOKEN_TYPE_CACHED_INPUT, 0)
        return price.cost(
            tokens.get(semconv.TOKEN_TYPE_INPUT, 0) - cached, cached, tokens.get(semconv.TOKEN_TYPE_OUTPUT, 0)
        )

    def state(self, used: float, t: float) -> str:
        limit = self.limit_at(t)
        if used >= limit:
            return semconv.BUDGET_STATE_OVER
        return semconv.BUDGET_STATE_NEAR if used > self.warn_ratio * limit else semconv.BUDGET_STATE_OK


COST = "cost"


def parse_time(value, where: str) -> float:
    if isinstance(value, (dt.datetime, dt.date)):  # YAML reads timestamps itself
        value = value.isoformat()
    if not isinstance(value, str):
        raise ReportError(f"{where}: expected an ISO 8601 time, got {value!r}")
    try:
        return iso_time(value)
    except ValueError:
        raise ReportError(f"{where}: expected an ISO 8601 time, got {value!r}") from None


def _number(value, where: str, whole: bool) -> float:
    ok = isinstance(value, int) if whole else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or value <= 0:
        raise ReportError(f"{where} must be a {'whole number' if whole else 'number'} > 0, got {value!r}")
    return value


def _name(value, where: str, required: bool) -> str | None:
    if value is None and not required:
        return None
    if (
        not isinstance(value, str)
        or not value
        or value != value.strip()
        or len(value) > MAX_NAME_LENGTH
        or not value.isprintable()
    ):
        raise ReportError(
            f"{where}: must be a tenant/scene name a request can carry (printable, no surrounding "
            f"blanks, at most {MAX_NAME_LENGTH} characters), got {value!r}: no request would match it"
        )
    return value


def _budget(entry, where: str) -> Budget:
    if not isinstance(entry, dict):
        raise ReportError(f"{where}: needs a tenant")
    if not isinstance(entry.get("tenant"), str) or not entry["tenant"]:
        raise ReportError(f"{where}: needs a tenant")
    tenant = _name(entry.get("tenant"), f"{where}: tenant", True)
    scene = _name(entry.get("scene") or None, f"{where}: scene", False)
    if "tokens_per_day" in entry:  # the first format
        period, unit = semconv.BUDGET_PERIOD_DAY, semconv.BUDGET_UNIT_TOKENS
        limit = _number(entry["tokens_per_day"], f"{where}: tokens_per_day", True)
    else:
        period = entry.get("period", semconv.BUDGET_PERIOD_DAY)
        if period not in PERIODS:
            raise ReportError(f"{where}: period must be one of {', '.join(PERIODS)}, got {period!r}")
        if ("tokens" in entry) == ("cost" in entry):
            raise ReportError(f"{where}: give either tokens or cost (money, at the price file's prices)")
        unit = semconv.BUDGET_UNIT_TOKENS if "tokens" in entry else COST
        limit = _number(entry[unit], f"{where}: {unit}", unit == semconv.BUDGET_UNIT_TOKENS)
    ratio = entry.get("warn_ratio", 0.8)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
        raise ReportError(f"{where}: warn_ratio must be between 0 and 1, got {ratio!r}")
    types = tuple(entry.get("token_types") or DEFAULT_TYPES)
    if not set(types) <= set(TOKEN_TYPES):
        raise ReportError(f"{where}: token_types must be among {', '.join(TOKEN_TYPES)}, got {list(types)}")
    if unit == COST and "token_types" in entry:
        raise ReportError(f"{where}: a cost budget prices every token type (token_types is for token budgets)")
    since, top_ups = None, ()
    if period == semconv.BUDGET_PERIOD_PREPAID:
        since = parse_time(entry.get("since"), f"{where}: since (when the prepaid balance starts)")
        raw = entry.get("top_ups") or []
        if not isinstance(raw, list):
            raise ReportError(f"{where}: top_ups must be a list of {{at: TIME, amount: N}}")
        top_ups = tuple(
            (
                parse_time(t.get("at") if isinstance(t, dict) else None, f"{where}: top-up time"),
                _number(
                    t.get("amount") if isinstance(t, dict) else None,
                    f"{where}: top-up amount",
                    unit == semconv.BUDGET_UNIT_TOKENS,
                ),
            )
            for t in raw
        )
    elif "since" in entry or "top_ups" in entry:
        raise ReportError(f"{where}: since and top_ups are for prepaid budgets")
    return Budget(tenant, limit, unit, period, scene, float(ratio), types, since, top_ups)


def load(path: str | Path) -> list[Budget]:
    path = Path(path)
    data = read_config(path, "budget file")
    entries = data.get("budgets") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ReportError(
            f'budget file {path}: expected {{"budgets": [{{"tenant": .., "period": .., "tokens" or "cost": ..}}]}}'
        )
    budgets, seen = [], set()
    for index, entry in enumerate(entries):
        where = f"budget file {path}, budget {index + 1}"
        budget = _budget(entry, where)
        key = (budget.tenant, budget.scene, budget.period, budget.unit)
        if key in seen:
            raise ReportError(f"{where}: {budget.name} has a budget already")
        seen.add(key)
        budgets.append(budget)
    return budgets


def unit_label(budget: Budget, currency: str | None) -> str:
    """The budget's unit as the tracker labels it: tokens, or the price file's currency."""
    return semconv.BUDGET_UNIT_TOKENS if not budget.money else (currency or COST)


def labels(budget: Budget, currency: str | None) -> dict[str, str]:
    """The labels of a budget's series on the tracker's /metrics (tenant, scene, period, unit)."""
    return {
        DIMENSIONS["tenant"]: budget.tenant,
        DIMENSIONS["scene"]: budget.scene or "",
        semconv.prometheus_label(semconv.BUDGET_PERIOD): budget.period,
        semconv.prometheus_label(semconv.BUDGET_UNIT): unit_label(budget, currency),
    }


def _selector(budget: Budget, currency: str | None) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels(budget, currency).items()) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def rules(budgets: list[Budget], currency: str | None = None) -> dict:
    """Prometheus rule groups over the budget tracker's series: per budget a warning near it, a
    critical alert over it, and an alert when the tracker does not serve it (another budget file, or
    no tracker); and one when the tracker stopped reading its ledger."""
    used, limit = semconv.prometheus_metric(semconv.BUDGET_USED), semconv.prometheus_metric(semconv.BUDGET_LIMIT)
    alerts = []
    for budget in budgets:
        selector = _selector(budget, currency)
        alert_labels = {
            "tenant": budget.tenant,
            **({"scene": budget.scene} if budget.scene else {}),
            "period": budget.period,
        }
        what = f"{budget.name}: {{{{ $value | humanizePercentage }}}} of its {budget.period} budget used"
        ratio = f"{used}{selector} / {limit}{selector}"
        common = {
            "description": "From the budget tracker's reading of the usage ledger (streams in flight "
            "included); `otel-llm report --budgets` shows the figures."
        }
        alerts.append(
            {
                "alert": ALERT_NEAR,
                "expr": f"{ratio} > {budget.warn_ratio:g}",
                "labels": {**alert_labels, "severity": "warning"},
                "annotations": {
                    "summary": f"{what}, over {budget.warn_ratio:.0%}",
                    **common,
                    "runbook_url": runbook_url(ALERT_NEAR),
                },
            }
        )
        alerts.append(
            {
                "alert": ALERT_OVER,
                "expr": f"{ratio} >= 1",
                "labels": {**alert_labels, "severity": "critical"},
                "annotations": {"summary": f"{what}: over its limit", **common, "runbook_url": runbook_url(ALERT_OVER)},
            }
        )
        alerts.append(
            {
                "alert": ALERT_UNWATCHED,
                "expr": f"absent({limit}{selector})",
                "for": "5m",
                "labels": {**alert_labels, "severity": "critical"},
                "annotations": {
                    "summary": f"{budget.name}: no budget tracker serves this budget",
                    "description": "Run `otel-llm budget-server` with this budget file and let "
                    "Prometheus scrape it; until then the budget is not watched.",
                    "runbook_url": runbook_url(ALERT_UNWATCHED),
                },
            }
        )
    lag = semconv.prometheus_metric(semconv.BUDGET_TRACKER_LAG)
    alerts.append(
        {
            "alert": ALERT_TRACKER_BEHIND,
            "expr": f"{lag} > {TRACKER_MAX_LAG_S}",
            "for": "2m",
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": "The budget tracker {{ $labels.instance }} has not read its ledger "
                "through for {{ $value | humanizeDuration }}",
                "description": "Budget figures are stale: enforcement and budget alerts lag.",
                "runbook_url": runbook_url(ALERT_TRACKER_BEHIND),
            },
        }
    )
    return {"groups": [{"name": "otel-llm-budgets", "interval": "1m", "rules": alerts}]}


def rules_yaml(budgets: list[Budget], currency: str | None = None) -> str:
    return "# generated by `otel-llm budget-rules`; do not edit\n" + yaml_text(rules(budgets, currency))


def check_watchable(budgets: list[Budget], prices: dict | None) -> None:
    """Raise for a budget the tracker could not count: a money budget without a price file."""
    money = [b.name for b in budgets if b.money]
    if money and not prices:
        raise ReportError(f"money budgets need the price file the tracker prices with (--prices): {', '.join(money)}")


def status(
    budgets: list[Budget], usage_since, prices: dict | None, now: float, currency: str | None = None
) -> list[dict]:
    """Each budget's figure in its current period. usage_since(start) -> {(tenant, scene, model):
    {token type: count}} of the bills ended in [start, now) (one call per distinct period start)."""
    cache, result = {}, []
    for budget in budgets:
        start = budget.period_start(now)
        used, unpriced = 0.0, 0
        if start is not None:
            if start not in cache:
                cache[start] = usage_since(start)
            for (tenant, scene, model), tokens in cache[start].items():
                if budget.matches(tenant, scene):
                    amount = budget.amount(tokens, _price(prices, model))
                    if amount is None:
                        unpriced += sum(tokens.get(t, 0) for t in DEFAULT_TYPES)
                    else:
                        used += amount
        limit = budget.limit_at(now)
        result.append(
            {
                "tenant": budget.tenant,
                "scene": budget.scene or "",
                "period": budget.period,
                "unit": unit_label(budget, currency),
                "used": round(used, 6) if budget.money else int(used),
                "limit": limit,
                "share": round(used / limit, 4),
                "state": budget.state(used, now),
                "resets": budget.period_end(now),
                "unpriced_tokens": unpriced,
            }
        )
    return result


def _price(prices: dict | None, model: str):
    if not prices:
        return None
    return prices.get(model) or prices.get("*")
