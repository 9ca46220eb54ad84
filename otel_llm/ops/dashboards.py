"""Grafana dashboards for an instrumented vLLM fleet, generated from the names in `otel_llm.semconv`
(ours, and vLLM's own `vllm:*` metrics in its end section) and the recording rules of `otel_llm.ops.rules`.

`render()` gives each file's JSON text; `otel-llm dashboards --out DIR` writes them, `--name NAME`
prints one. `problems()` lists what a query reads that nothing emits. Datasources are template
variables (`${prometheus}`, `${tempo}`), so the files import anywhere.
"""

from __future__ import annotations

import json
import re

from otel_llm import semconv
from otel_llm.billing import promql
from otel_llm.ops import price_rules, rules
from otel_llm.ops.rules import DURATION, MODEL, OUTCOME, REQUESTS, TENANT, TOKEN_TYPE, TOKENS, TPOT, TTFT

SCENE = semconv.prometheus_label(semconv.TENANT_SCENE)
COST_CENTER = semconv.prometheus_label(semconv.TENANT_COST_CENTER)
VLLM_MODEL = semconv.VLLM_LABEL_MODEL
# vLLM's per-request phase histograms
PHASES = {
    "queue": semconv.VLLM_METRIC_QUEUE_TIME,
    "prefill": semconv.VLLM_METRIC_PREFILL_TIME,
    "decode": semconv.VLLM_METRIC_DECODE_TIME,
}
PRICES = (
    ("price_input", "Input price per 1M tokens", "2"),
    ("price_cached_input", "Cached input price per 1M tokens", "0.5"),
    ("price_output", "Output price per 1M tokens", "8"),
    ("gpu_usd_per_hour", "Engine instance (GPUs) price per hour", "3.5"),
)
COMPUTE = semconv.prometheus_metric(semconv.SERVER_COMPUTE_TIME)
SCHEDULED_TTFT = semconv.prometheus_metric(semconv.SERVER_SCHEDULED_TIME_TO_FIRST_TOKEN)
SPEC_DRAFTS = semconv.prometheus_metric(semconv.SERVER_SPEC_DRAFT_TOKENS)
SPEC_ACCEPTED = semconv.prometheus_metric(semconv.SERVER_SPEC_ACCEPTED_TOKENS)

PROM = {"type": "prometheus", "uid": "${prometheus}"}
TEMPO = {"type": "tempo", "uid": "${tempo}"}
OURS = f'{MODEL}=~"$model", {TENANT}=~"$tenant", {SCENE}=~"$scene"'
COSTS = f'{OURS}, {COST_CENTER}=~"$cost_center"'  # the cost dashboard's filters
ENGINE = f'{VLLM_MODEL}=~"$model"'
RI = "$__rate_interval"


# --- builders -----------------------------------------------------------------------------
def target(expr: str, legend: str = "", ref: str = "A", exemplar: bool = False, instant: bool = False) -> dict:
    """instant: one value at the panel's end (stat, bar gauge and table panels of a whole range)."""
    t = {
        "datasource": PROM,
        "expr": expr,
        "legendFormat": legend or "__auto",
        "refId": ref,
        "exemplar": exemplar,
        "range": not instant,
    }
    if instant:
        t |= {"instant": True, "format": "table"}
    return t


def panel(
    title: str,
    targets: list[dict],
    unit: str = "short",
    kind: str = "timeseries",
    w: int = 12,
    h: int = 8,
    datasource: dict = PROM,
    description: str = "",
    options: dict | None = None,
    time_from: str | None = None,
) -> dict:
    """time_from: a relative time of the panel's own (Grafana's "now/d": today so far) instead of the
    dashboard's."""
    for ref, t in zip("ABCDEFGHIJ", targets):
        t["refId"] = ref
    out = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": datasource,
        "targets": targets,
        "w": w,
        "h": h,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": options or {},
    }
    if time_from:
        out |= {"timeFrom": time_from, "hideTimeOverride": True}
    return out


def grouped(expr: str, *labels: str, op: str = "sum") -> dict:
    """A target of `op by (labels) (expr)`: a series per value of the labels, named by them."""
    return target(f"{op} by ({', '.join(labels)}) ({expr})", " ".join(f"{{{{{label}}}}}" for label in labels))


def quantiles(metric: str, filters: str, exemplar: bool = True) -> list[dict]:
    return [
        target(
            f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{filters}}}[{RI}])))",
            f"P{int(q * 100)}",
            exemplar=exemplar,
        )
        for q in rules.QUANTILES
    ]


def tokens(token_type: str, filters: str = OURS) -> str:
    return f'{TOKENS}{{{filters}, {TOKEN_TYPE}="{token_type}"}}'


def variables(prices: bool = False) -> list[dict]:
    """prices: the cost dashboard's, with the cost center filter and the price textboxes."""
    out = [
        {
            "name": "prometheus",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
        },
        {"name": "tempo", "label": "Tempo", "type": "datasource", "query": "tempo", "current": {}, "hide": 0},
    ]
    filters = [("model", MODEL), ("tenant", TENANT), ("scene", SCENE)]
    for name, label in filters + ([("cost_center", COST_CENTER)] if prices else []):
        query = f"label_values({TOKENS}, {label})"
        out.append(
            {
                "name": name,
                "label": name.replace("_", " ").capitalize(),
                "type": "query",
                "datasource": PROM,
                "query": {"query": query, "refId": f"{name}-values"},
                "definition": query,
                "includeAll": True,
                "multi": True,
                "allValue": ".*",
                "refresh": 2,
                "sort": 1,
                "current": {"text": "All", "value": "$__all"},
            }
        )
    if prices:
        for name, label, default in PRICES:
            out.append(
                {
                    "name": name,
                    "label": label,
                    "type": "textbox",
                    "query": default,
                    "current": {"text": default, "value": default},
                }
            )
    return out


def layout(panels: list[dict]) -> list[dict]:
    x = y = row_h = 0
    for i, p in enumerate(panels, 1):
        w, h = p.pop("w"), p.pop("h")
        if x + w > 24:
            x, y, row_h = 0, y + row_h, 0
        p["id"], p["gridPos"] = i, {"x": x, "y": y, "w": w, "h": h}
        x, row_h = x + w, max(row_h, h)
    return panels


def dashboard(uid: str, title: str, panels: list[dict], prices: bool = False) -> dict:
    return {
        "uid": uid,
        "title": title,
        "tags": ["otel-llm", "vllm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": variables(prices)},
        "annotations": {"list": []},
        "links": [],
        "panels": layout(panels),
    }


# --- dashboards ---------------------------------------------------------------------------
def overview() -> dict:
    err = f'{REQUESTS}{{{OURS}, {OUTCOME}="{semconv.OUTCOME_ERROR}"}}'
    return dashboard(
        "otel-llm-overview",
        "otel-llm / Overview",
        [
            panel(
                "Requests/s by outcome",
                [grouped(f"rate({REQUESTS}{{{OURS}}}[{RI}])", OUTCOME)],
                "reqps",
            ),
            panel(
                "Error rate",
                [
                    target(
                        f"(sum(rate({err}[{RI}])) or vector(0)) / (sum(rate({REQUESTS}{{{OURS}}}[{RI}])) > 0)", "errors"
                    )
                ],
                "percentunit",
                description="Share of requests with outcome error (aborted by the client is not an error)",
            ),
            panel(
                "Tokens/s by type",
                [grouped(f"rate({TOKENS}{{{OURS}}}[{RI}])", TOKEN_TYPE)],
                "short",
                description="input includes cached_input",
            ),
            panel(
                "Prefix cache hit rate",
                [
                    target(
                        f"sum(rate({tokens(semconv.TOKEN_TYPE_CACHED_INPUT)}[{RI}])) / "
                        f"(sum(rate({tokens(semconv.TOKEN_TYPE_INPUT)}[{RI}])) > 0)",
                        "hit rate",
                    )
                ],
                "percentunit",
                description="cached input tokens / input tokens",
            ),
            panel(
                "KV cache usage",
                [grouped(f"{semconv.VLLM_METRIC_KV_CACHE_USAGE}{{{ENGINE}}}", VLLM_MODEL, op="max")],
                "percentunit",
                w=8,
            ),
            panel(
                "Requests waiting (queue)",
                [grouped(f"{semconv.VLLM_METRIC_WAITING}{{{ENGINE}}}", VLLM_MODEL)],
                w=8,
            ),
            panel(
                "Requests running",
                [grouped(f"{semconv.VLLM_METRIC_RUNNING}{{{ENGINE}}}", VLLM_MODEL)],
                w=8,
            ),
            panel("Time to first token", quantiles(TTFT, OURS), "s", w=8),
            panel("Time per output token", quantiles(TPOT, OURS), "s", w=8),
            panel("Request duration (e2e)", quantiles(DURATION, OURS), "s", w=8),
            panel(
                "Preemptions/s",
                [grouped(f"rate({semconv.VLLM_METRIC_PREEMPTIONS}{{{ENGINE}}}[{RI}])", VLLM_MODEL)],
                "short",
                description="Requests the scheduler preempted (KV cache too small)",
            ),
            panel(
                "Telemetry dropped/s",
                [grouped(f"rate({rules.EXPORT_DROPPED}[{RI}])", "instance", rules.ERROR_TYPE)],
                "reqps",
                description="Requests whose spans, metrics and usage event the API server could not hand to its "
                "export process (queue_full: it does not keep up; exporter_down: it is restarting). "
                "Billing's usage spool is not affected. Alert: LLMTelemetryDropped",
            ),
        ],
    )


def latency() -> dict:
    def mean(metric: str, filters: str, legend: str) -> dict:
        return target(
            f"sum(rate({metric}_sum{{{filters}}}[{RI}])) / (sum(rate({metric}_count{{{filters}}}[{RI}])) > 0)",
            legend,
            exemplar=True,
        )

    phases = [mean(metric, ENGINE, p) for p, metric in PHASES.items()]
    panels = [
        panel(
            "Mean queue / prefill / decode time",
            phases,
            "s",
            w=24,
            description="vLLM's per-request phase histograms, mean per request",
        )
    ]
    for p, metric in PHASES.items():
        panels.append(panel(f"{p.capitalize()} time", quantiles(metric, ENGINE), "s", w=8))
    panels += [
        panel(
            "TTFT vs e2e (P95)",
            [
                target(
                    f"histogram_quantile(0.95, sum by (le) (rate({TTFT}_bucket{{{OURS}}}[{RI}])))",
                    "TTFT P95",
                    exemplar=True,
                ),
                target(
                    f"histogram_quantile(0.95, sum by (le) (rate({DURATION}_bucket{{{OURS}}}[{RI}])))",
                    "e2e P95",
                    exemplar=True,
                ),
            ],
            "s",
        ),
        panel("TTFT vs e2e (mean)", [mean(TTFT, OURS, "TTFT"), mean(DURATION, OURS, "e2e")], "s"),
        panel(
            "TTFT from arrival vs from scheduling (P95)",
            [
                target(
                    f"histogram_quantile(0.95, sum by (le) (rate({TTFT}_bucket{{{OURS}}}[{RI}])))",
                    "from arrival",
                    exemplar=True,
                ),
                target(
                    f"histogram_quantile(0.95, sum by (le) (rate({SCHEDULED_TTFT}_bucket{{{OURS}}}[{RI}])))",
                    "from scheduling (vLLM's metrics.time_to_first_token_ms)",
                    exemplar=True,
                ),
            ],
            "s",
            description="The gap is the queue and what comes before it (docs/request-data.md, two times to first "
            "token)",
        ),
        panel(
            "Speculative decoding: draft acceptance rate by model",
            [
                target(
                    f"sum by ({MODEL}) (rate({SPEC_ACCEPTED}{{{OURS}}}[{RI}])) / "
                    f"(sum by ({MODEL}) (rate({SPEC_DRAFTS}{{{OURS}}}[{RI}])) > 0)",
                    f"{{{{{MODEL}}}}}",
                )
            ],
            "percentunit",
            description="Accepted / proposed draft tokens (vLLM --speculative-config with "
            "--per-request-spec-decode-metrics summary); empty without a speculator",
        ),
        panel(
            "TTFT P95 by model (recorded)",
            [target(f'{rules.quantile_rule(TTFT)}{{{MODEL}=~"$model", quantile="0.95"}}', f"{{{{{MODEL}}}}}")],
            "s",
        ),
        panel(
            "Time per output token P95 by model (recorded)",
            [target(f'{rules.quantile_rule(TPOT)}{{{MODEL}=~"$model", quantile="0.95"}}', f"{{{{{MODEL}}}}}")],
            "s",
        ),
    ]
    return dashboard("otel-llm-latency", "otel-llm / Latency breakdown", panels)


def priced(usage: str, token_type: str) -> str:
    """`usage` (tokens, by model among other labels) times its model's price per million tokens: the
    price file's (`otel-llm price-rules`), else the file's default model "*", else the dashboard's
    price variable of that token type."""
    price = f'{price_rules.PRICE}{{{TOKEN_TYPE}="{token_type}"}}'
    default = f'max({price_rules.PRICE}{{{MODEL}="{price_rules.DEFAULT_MODEL}", {TOKEN_TYPE}="{token_type}"}})'
    return (
        f"({usage} * on ({MODEL}) group_left () {price} or {usage} * scalar({default} or vector($price_{token_type})))"
    )


def cost_of(by: str, window: str = "$__range", fn: str = "increase") -> str:
    """What the tokens cost (of the cost dashboard's filters), summed by `by` (labels; "" for a total), each
    model at its own price. Per million tokens: `increase` gives the currency, `rate` the currency per second."""
    keep = by if MODEL in by.split(", ") else ", ".join(filter(None, (by, MODEL)))

    def used(token_type: str) -> str:
        return f"sum by ({keep}) ({fn}({tokens(token_type, COSTS)}[{window}]))"

    inputs = used(semconv.TOKEN_TYPE_INPUT)
    cached = f"({used(semconv.TOKEN_TYPE_CACHED_INPUT)} or 0 * {inputs})"
    # input includes cached_input: uncached input at the input price, cached at the cached price
    per_model = (
        f"{priced(f'({inputs} - {cached})', semconv.TOKEN_TYPE_INPUT)} "
        f"+ {priced(cached, semconv.TOKEN_TYPE_CACHED_INPUT)} "
        f"+ {priced(used(semconv.TOKEN_TYPE_OUTPUT), semconv.TOKEN_TYPE_OUTPUT)}"
    )
    return f"sum{f' by ({by})' if by else ''} ({per_model}) / 1e6"


def cost() -> dict:
    by = f"{TENANT}, {SCENE}, {MODEL}"

    def used(token_type: str, window: str = "$__range") -> str:
        return f"sum by ({by}) (increase({tokens(token_type, COSTS)}[{window}]))"

    cached = f"({used(semconv.TOKEN_TYPE_CACHED_INPUT)} or 0 * {used(semconv.TOKEN_TYPE_INPUT)})"
    savings = f"({priced(cached, semconv.TOKEN_TYPE_INPUT)} - {priced(cached, semconv.TOKEN_TYPE_CACHED_INPUT)}) / 1e6"
    legend = f"{{{{{TENANT}}}}} / {{{{{SCENE}}}}} / {{{{{MODEL}}}}}"
    prices = (
        "Each model at its price of the price file (`otel-llm price-rules` recording rules), else the file's "
        'default "*", else the dashboard\'s price variables; per million tokens'
    )
    stat = {
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "colorMode": "value",
        "graphMode": "none",
        "textMode": "value",
    }
    bars = {
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "orientation": "horizontal",
        "displayMode": "basic",
        "showUnfilled": True,
    }

    def total(title: str, time_from: str | None, description: str) -> dict:
        return panel(
            title,
            [target(cost_of(""), "cost", instant=True)],
            "currencyUSD",
            kind="stat",
            w=8,
            h=5,
            options=stat,
            time_from=time_from,
            description=f"{description}. {prices}",
        )

    def bar(title: str, label: str) -> dict:
        return panel(
            title,
            [target(f"sort_desc({cost_of(label)})", f"{{{{{label}}}}}", instant=True)],
            "currencyUSD",
            kind="bargauge",
            w=8,
            options=bars,
            description=prices,
        )

    return dashboard(
        "otel-llm-cost",
        "otel-llm / Cost and usage",
        [
            total("Cost today", "now/d", "Since midnight (the browser's time zone), all filters applied"),
            total("Cost this month", "now/M", "Since the first of the month (the browser's time zone)"),
            total("Cost in range", None, "Over the dashboard's time range"),
            bar("Cost in range by model", MODEL),
            bar("Cost in range by tenant", TENANT),
            bar("Cost in range by cost center", COST_CENTER),
            panel(
                "Top consumers in range (tenant / scene)",
                [
                    target(
                        f"topk(10, {cost_of(f'{TENANT}, {SCENE}')})",
                        f"{{{{{TENANT}}}}} / {{{{{SCENE}}}}}",
                        instant=True,
                    )
                ],
                "currencyUSD",
                kind="table",
                w=24,
                description=f"The 10 tenant and scene pairs that cost most over the dashboard's time range. {prices}",
            ),
            panel(
                "Tokens/s by tenant and type",
                [grouped(f"rate({TOKENS}{{{COSTS}}}[{RI}])", TENANT, TOKEN_TYPE)],
                w=12,
            ),
            panel(
                "Tokens/s by tenant and type (recorded, 5m)",
                [target(f'{rules.TOKENS_BY_TENANT}{{{TENANT}=~"$tenant"}}', f"{{{{{TENANT}}}}} {{{{{TOKEN_TYPE}}}}}")],
                w=12,
            ),
            panel(
                "Requests/s by tenant and outcome",
                [grouped(f"rate({REQUESTS}{{{COSTS}}}[{RI}])", TENANT, OUTCOME)],
                "reqps",
                w=12,
            ),
            panel(
                "Tokens in range by tenant, scene, model and type",
                [target(f"sum by ({by}, {TOKEN_TYPE}) (increase({TOKENS}{{{COSTS}}}[$__range]))", legend)],
                kind="table",
                w=12,
            ),
            panel(
                "Cost in range by tenant, scene and model",
                [target(cost_of(by), legend)],
                "currencyUSD",
                kind="table",
                w=12,
                description=prices,
            ),
            panel(
                "Cache savings in range",
                [target(savings, legend)],
                "currencyUSD",
                kind="table",
                w=12,
                description="What the cached input tokens would have cost at the input price, minus what they cost",
            ),
            panel(
                "Engine compute cost in range (GPU time charged to requests)",
                [
                    target(
                        f"sum by ({by}) (increase({COMPUTE}{{{COSTS}}}[$__range])) * $gpu_usd_per_hour / 3600", legend
                    )
                ],
                "currencyUSD",
                kind="table",
                w=12,
                description="Each request's share of the engine's busy time (its scheduled tokens' share of each "
                "step) at the instance price per hour; idle time is not in it. Bills: otel-llm report "
                "--ledger ... --costs costs.yaml (exact, with idle rows)",
            ),
            panel(
                "Engine compute cost per 1M tokens by model",
                [
                    target(
                        f"(sum by ({MODEL}) (increase({COMPUTE}{{{COSTS}}}[$__range])) * $gpu_usd_per_hour / 3600) / "
                        f"((sum by ({MODEL}) (increase({tokens(semconv.TOKEN_TYPE_INPUT, COSTS)}[$__range])) + "
                        f"sum by ({MODEL}) (increase({tokens(semconv.TOKEN_TYPE_OUTPUT, COSTS)}[$__range]))) / 1e6)",
                        f"{{{{{MODEL}}}}}",
                    )
                ],
                "currencyUSD",
                kind="table",
                w=12,
                description="What a million tokens (input + output) cost in engine time, busy time only",
            ),
            panel(
                "Engine busy seconds per second by tenant",
                [grouped(f"rate({COMPUTE}{{{COSTS}}}[{RI}])", TENANT)],
                w=24,
                description="1 = one engine busy all the time on this tenant's requests",
            ),
            panel(
                "Cost rate (per hour)",
                [target(f"{cost_of(by, RI, 'rate')} * 3600", legend)],
                "currencyUSD",
                w=24,
                description=prices,
            ),
        ],
        prices=True,
    )


def traces() -> dict:
    def traceql(title: str, query: str) -> dict:
        return panel(
            title,
            [
                {
                    "datasource": TEMPO,
                    "queryType": "traceql",
                    "query": query,
                    "limit": 50,
                    "tableType": "traces",
                    "refId": "A",
                }
            ],
            kind="table",
            w=24,
            datasource=TEMPO,
        )

    return dashboard(
        "otel-llm-traces",
        "otel-llm / Trace links",
        [
            panel("Time to first token (exemplars link to traces)", quantiles(TTFT, OURS), "s"),
            panel("Request duration (exemplars link to traces)", quantiles(DURATION, OURS), "s"),
            traceql(
                "Slow requests: time to first token over 2 s",
                f'{{ span.{semconv.VLLM_TTFT_SECONDS} > 2 && span.{semconv.TENANT_ID} =~ "$tenant" }}',
            ),
            traceql(
                "Slow requests: end to end over 30 s",
                f"{{ span.{semconv.GEN_AI_OPERATION_NAME} != nil && duration > 30s }}",
            ),
            traceql("Large requests: over 4000 input tokens", f"{{ span.{semconv.GEN_AI_USAGE_INPUT_TOKENS} > 4000 }}"),
            traceql(
                "Failed requests", f'{{ span.{semconv.ERROR_TYPE} != nil && span.{semconv.TENANT_ID} =~ "$tenant" }}'
            ),
        ],
    )


def dashboards() -> dict[str, dict]:
    return {"overview.json": overview(), "latency.json": latency(), "cost.json": cost(), "traces.json": traces()}


def promql_targets(board: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every Prometheus query of a dashboard."""
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"] if "expr" in t]


def traceql_targets(board: dict) -> list[tuple[str, str]]:
    """(panel title, query) of every TraceQL query of a dashboard."""
    return [(p["title"], t["query"]) for p in board["panels"] for t in p["targets"] if t.get("queryType") == "traceql"]


def traceql_span_attributes(query: str) -> set[str]:
    """The span attributes (`span.NAME`) a TraceQL query reads."""
    return set(re.findall(r"\bspan\.([A-Za-z_][\w.]*)", query))


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard, as `otel-llm dashboards` writes them."""
    return {name: json.dumps(board, indent=2) + "\n" for name, board in dashboards().items()}


def problems(boards: dict[str, dict] | None = None) -> list[str]:
    """What the queries of `boards` (default: the generated ones) read that nothing emits: PromQL
    metrics that are not ours (semconv.METRICS), vLLM's or a recording rule of otel_llm.ops.rules, and
    TraceQL `span.X` attributes that semconv does not list as set on spans by vLLM or the client."""
    recorded = {r["record"] for g in rules.rules()["groups"] for r in g["rules"] if "record" in r}
    recorded.add(price_rules.PRICE)  # otel-llm price-rules
    on_spans = {a.name for a in semconv.ATTRIBUTES.values() if a.emitted_by & {semconv.VLLM, semconv.CLIENT}}
    out = []
    for name, board in (boards or dashboards()).items():
        for title, expr in promql_targets(board):
            out += [
                f"{name}: panel {title!r} queries {m}, which nothing emits"
                for m in sorted(promql.unknown_metrics(expr, recorded))
            ]
        for title, query in traceql_targets(board):
            out += [
                f"{name}: panel {title!r} reads span.{a}, which no span carries"
                for a in sorted(traceql_span_attributes(query) - on_spans)
            ]
    return out
