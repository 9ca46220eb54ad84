"""Grafana dashboards for an instrumented vLLM fleet, generated from the names in `otel_llm.semconv`
(ours), the recording rules of `otel_llm.rules` and vLLM's own `vllm:*` metrics.

    python -m otel_llm.dashboards           # rewrite dashboards/*.json
    python -m otel_llm.dashboards --check   # exit 1 when a committed file differs from the generator
                                            # or a panel queries a metric nobody emits

Datasources are template variables (`${prometheus}`, `${tempo}`), so the files import anywhere.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

from otel_llm import rules, semconv
from otel_llm.rules import DURATION, MODEL, OUTCOME, REQUESTS, TENANT, TOKEN_TYPE, TOKENS, TPOT, TTFT

DASHBOARDS_DIR = Path(__file__).resolve().parents[1] / "dashboards"
SCENE = semconv.prometheus_label(semconv.TENANT_SCENE)
VLLM_MODEL = rules.VLLM_MODEL

# vLLM's own metrics the dashboards query (vllm/v1/metrics/loggers.py, prometheus_client names).
VLLM_METRICS = {
    "running": "vllm:num_requests_running",
    "waiting": rules.VLLM_WAITING,
    "kv_cache": rules.VLLM_KV_CACHE_USAGE,
    "preemptions": rules.VLLM_PREEMPTIONS,
    "queue_time": "vllm:request_queue_time_seconds",
    "prefill_time": "vllm:request_prefill_time_seconds",
    "decode_time": "vllm:request_decode_time_seconds",
}
HISTOGRAMS = (DURATION, TTFT, TPOT, VLLM_METRICS["queue_time"], VLLM_METRICS["prefill_time"],
              VLLM_METRICS["decode_time"])
PRICES = (("price_input", "Input price per 1M tokens", "2"),
          ("price_cached_input", "Cached input price per 1M tokens", "0.5"),
          ("price_output", "Output price per 1M tokens", "8"))

PROM = {"type": "prometheus", "uid": "${prometheus}"}
TEMPO = {"type": "tempo", "uid": "${tempo}"}
OURS = f'{MODEL}=~"$model", {TENANT}=~"$tenant", {SCENE}=~"$scene"'
ENGINE = f'{VLLM_MODEL}=~"$model"'
RI = "$__rate_interval"


def emitted_metrics() -> set[str]:
    """Every metric name a panel may query: ours, our recording rules, the vLLM ones above."""
    names = {TOKENS, REQUESTS} | {r["record"] for r in rules.recording_rules()}
    names |= {f"{h}_{s}" for h in (DURATION, TTFT, TPOT) for s in ("bucket", "sum", "count")}
    for name in VLLM_METRICS.values():
        names |= {f"{name}_{s}" for s in ("bucket", "sum", "count")} if name in HISTOGRAMS else {name}
    return names


def vllm_missing() -> list[str]:
    """vLLM metric names above that the installed vLLM does not define (empty if vLLM is absent)."""
    return rules.vllm_missing(VLLM_METRICS.values())


_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
             "offset", "bool", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression references (template variables removed first)."""
    e = re.sub(r"\$\{?\w+\}?", "0", expr)
    e = re.sub(r'"(\\.|[^"\\])*"', '""', e)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    found = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(\s*\()?", e):
        if not m.group(2) and m.group(1).lower() not in _KEYWORDS:
            found.add(m.group(1))
    return found


# --- builders -----------------------------------------------------------------------------
def target(expr: str, legend: str = "", ref: str = "A", exemplar: bool = False) -> dict:
    return {"datasource": PROM, "expr": expr, "legendFormat": legend or "__auto", "refId": ref,
            "exemplar": exemplar, "range": True}


def panel(title: str, targets: list[dict], unit: str = "short", kind: str = "timeseries",
          w: int = 12, h: int = 8, datasource: dict = PROM, description: str = "") -> dict:
    for ref, t in zip("ABCDEFGHIJ", targets):
        t["refId"] = ref
    return {"type": kind, "title": title, "description": description, "datasource": datasource,
            "targets": targets, "w": w, "h": h,
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, "options": {}}


def quantiles(metric: str, filters: str, exemplar: bool = True) -> list[dict]:
    return [target(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{filters}}}[{RI}])))",
                   f"P{int(q * 100)}", exemplar=exemplar) for q in rules.QUANTILES]


def tokens(token_type: str, extra: str = "") -> str:
    return f'{TOKENS}{{{OURS}, {TOKEN_TYPE}="{token_type}"{extra}}}'


def variables(prices: bool = False) -> list[dict]:
    out = [{"name": "prometheus", "label": "Prometheus", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0},
           {"name": "tempo", "label": "Tempo", "type": "datasource", "query": "tempo", "current": {}, "hide": 0}]
    for name, label in (("model", MODEL), ("tenant", TENANT), ("scene", SCENE)):
        query = f"label_values({TOKENS}, {label})"
        out.append({"name": name, "label": name.capitalize(), "type": "query", "datasource": PROM,
                    "query": {"query": query, "refId": f"{name}-values"}, "definition": query,
                    "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "sort": 1,
                    "current": {"text": "All", "value": "$__all"}})
    if prices:
        for name, label, default in PRICES:
            out.append({"name": name, "label": label, "type": "textbox", "query": default,
                        "current": {"text": default, "value": default}})
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
    return {"uid": uid, "title": title, "tags": ["otel-llm", "vllm"], "timezone": "browser",
            "schemaVersion": 39, "editable": True, "refresh": "30s", "time": {"from": "now-1h", "to": "now"},
            "templating": {"list": variables(prices)}, "annotations": {"list": []}, "links": [],
            "panels": layout(panels)}


# --- dashboards ---------------------------------------------------------------------------
def overview() -> dict:
    err = f'{REQUESTS}{{{OURS}, {OUTCOME}="{semconv.OUTCOME_ERROR}"}}'
    return dashboard("otel-llm-overview", "otel-llm / Overview", [
        panel("Requests/s by outcome", [target(f"sum by ({OUTCOME}) (rate({REQUESTS}{{{OURS}}}[{RI}]))",
                                               f"{{{{{OUTCOME}}}}}")], "reqps"),
        panel("Error rate", [target(f"(sum(rate({err}[{RI}])) or vector(0)) / "
                                    f"(sum(rate({REQUESTS}{{{OURS}}}[{RI}])) > 0)", "errors")], "percentunit",
              description="Share of requests with outcome error (aborted by the client is not an error)"),
        panel("Tokens/s by type", [target(f"sum by ({TOKEN_TYPE}) (rate({TOKENS}{{{OURS}}}[{RI}]))",
                                          f"{{{{{TOKEN_TYPE}}}}}")], "short",
              description="input includes cached_input"),
        panel("Prefix cache hit rate", [target(
            f"sum(rate({tokens(semconv.TOKEN_TYPE_CACHED_INPUT)}[{RI}])) / "
            f"(sum(rate({tokens(semconv.TOKEN_TYPE_INPUT)}[{RI}])) > 0)", "hit rate")], "percentunit",
              description="cached input tokens / input tokens"),
        panel("KV cache usage", [target(f"max by ({VLLM_MODEL}) ({VLLM_METRICS['kv_cache']}{{{ENGINE}}})",
                                        f"{{{{{VLLM_MODEL}}}}}")], "percentunit", w=8),
        panel("Requests waiting (queue)", [target(f"sum by ({VLLM_MODEL}) ({VLLM_METRICS['waiting']}{{{ENGINE}}})",
                                                  f"{{{{{VLLM_MODEL}}}}}")], w=8),
        panel("Requests running", [target(f"sum by ({VLLM_MODEL}) ({VLLM_METRICS['running']}{{{ENGINE}}})",
                                          f"{{{{{VLLM_MODEL}}}}}")], w=8),
        panel("Time to first token", quantiles(TTFT, OURS), "s", w=8),
        panel("Time per output token", quantiles(TPOT, OURS), "s", w=8),
        panel("Request duration (e2e)", quantiles(DURATION, OURS), "s", w=8),
        panel("Preemptions/s", [target(f"sum by ({VLLM_MODEL}) (rate({VLLM_METRICS['preemptions']}{{{ENGINE}}}[{RI}]))",
                                       f"{{{{{VLLM_MODEL}}}}}")], "short", w=24,
              description="Requests the scheduler preempted (KV cache too small)"),
    ])


def latency() -> dict:
    def mean(metric: str, filters: str, legend: str) -> dict:
        return target(f"sum(rate({metric}_sum{{{filters}}}[{RI}])) / (sum(rate({metric}_count{{{filters}}}[{RI}])) > 0)",
                      legend, exemplar=True)

    phases = [mean(VLLM_METRICS[f"{p}_time"], ENGINE, p) for p in ("queue", "prefill", "decode")]
    panels = [panel("Mean queue / prefill / decode time", phases, "s", w=24,
                     description="vLLM's per-request phase histograms, mean per request")]
    for p in ("queue", "prefill", "decode"):
        panels.append(panel(f"{p.capitalize()} time", quantiles(VLLM_METRICS[f"{p}_time"], ENGINE), "s", w=8))
    panels += [
        panel("TTFT vs e2e (P95)", [
            target(f"histogram_quantile(0.95, sum by (le) (rate({TTFT}_bucket{{{OURS}}}[{RI}])))", "TTFT P95", exemplar=True),
            target(f"histogram_quantile(0.95, sum by (le) (rate({DURATION}_bucket{{{OURS}}}[{RI}])))", "e2e P95",
                   exemplar=True)], "s"),
        panel("TTFT vs e2e (mean)", [mean(TTFT, OURS, "TTFT"), mean(DURATION, OURS, "e2e")], "s"),
        panel("TTFT P95 by model (recorded)", [target(
            f'{rules.quantile_rule(TTFT)}{{{MODEL}=~"$model", quantile="0.95"}}', f"{{{{{MODEL}}}}}")], "s"),
        panel("Time per output token P95 by model (recorded)", [target(
            f'{rules.quantile_rule(TPOT)}{{{MODEL}=~"$model", quantile="0.95"}}', f"{{{{{MODEL}}}}}")], "s"),
    ]
    return dashboard("otel-llm-latency", "otel-llm / Latency breakdown", panels)


def cost() -> dict:
    by = f"{TENANT}, {SCENE}, {MODEL}"

    def used(token_type: str, window: str = "$__range") -> str:
        return f"sum by ({by}) (increase({tokens(token_type)}[{window}]))"

    def rate(token_type: str) -> str:
        return f"sum by ({by}) (rate({tokens(token_type)}[{RI}]))"

    inputs, output = used(semconv.TOKEN_TYPE_INPUT), used(semconv.TOKEN_TYPE_OUTPUT)
    cached = f"({used(semconv.TOKEN_TYPE_CACHED_INPUT)} or 0 * {inputs})"
    # input includes cached_input: uncached input at the input price, cached at the cached price
    cost_expr = (f"(({inputs} - {cached}) * $price_input + {cached} * $price_cached_input "
                 f"+ {output} * $price_output) / 1e6")
    legend = f"{{{{{TENANT}}}}} / {{{{{SCENE}}}}} / {{{{{MODEL}}}}}"
    return dashboard("otel-llm-cost", "otel-llm / Cost and usage", [
        panel("Tokens/s by tenant and type", [target(
            f"sum by ({TENANT}, {TOKEN_TYPE}) (rate({TOKENS}{{{OURS}}}[{RI}]))",
            f"{{{{{TENANT}}}}} {{{{{TOKEN_TYPE}}}}}")], w=12),
        panel("Tokens/s by tenant and type (recorded, 5m)", [target(
            f'{rules.TOKENS_BY_TENANT}{{{TENANT}=~"$tenant"}}', f"{{{{{TENANT}}}}} {{{{{TOKEN_TYPE}}}}}")], w=12),
        panel("Requests/s by tenant and outcome", [target(
            f"sum by ({TENANT}, {OUTCOME}) (rate({REQUESTS}{{{OURS}}}[{RI}]))",
            f"{{{{{TENANT}}}}} {{{{{OUTCOME}}}}}")], "reqps", w=12),
        panel("Tokens in range by tenant, scene, model and type", [target(
            f"sum by ({by}, {TOKEN_TYPE}) (increase({TOKENS}{{{OURS}}}[$__range]))", legend)], kind="table", w=12),
        panel("Cost in range", [target(cost_expr, legend)], "currencyUSD", kind="table", w=12,
              description="Prices are the dashboard variables, per million tokens"),
        panel("Cache savings in range", [target(f"{cached} * ($price_input - $price_cached_input) / 1e6", legend)],
              "currencyUSD", kind="table", w=12,
              description="What the cached input tokens would have cost at the input price, minus what they cost"),
        panel("Cost rate (per hour, upper bound)", [target(
            f"({rate(semconv.TOKEN_TYPE_INPUT)} * $price_input + {rate(semconv.TOKEN_TYPE_OUTPUT)} * $price_output)"
            " * 3600 / 1e6", legend)], "currencyUSD", w=24,
              description="All input at the input price (cached input is cheaper: see cache savings)"),
    ], prices=True)


def traces() -> dict:
    def traceql(title: str, query: str) -> dict:
        return panel(title, [{"datasource": TEMPO, "queryType": "traceql", "query": query, "limit": 50,
                              "tableType": "traces", "refId": "A"}], kind="table", w=24, datasource=TEMPO)

    return dashboard("otel-llm-traces", "otel-llm / Trace links", [
        panel("Time to first token (exemplars link to traces)", quantiles(TTFT, OURS), "s"),
        panel("Request duration (exemplars link to traces)", quantiles(DURATION, OURS), "s"),
        traceql("Slow requests: time to first token over 2 s",
                f'{{ span.{semconv.VLLM_TTFT_SECONDS} > 2 && span.{semconv.TENANT_ID} =~ "$tenant" }}'),
        traceql("Slow requests: end to end over 30 s",
                f'{{ span.{semconv.GEN_AI_OPERATION_NAME} != nil && duration > 30s }}'),
        traceql("Large requests: over 4000 input tokens", f"{{ span.{semconv.GEN_AI_USAGE_INPUT_TOKENS} > 4000 }}"),
        traceql("Failed requests", f'{{ span.{semconv.ERROR_TYPE} != nil && span.{semconv.TENANT_ID} =~ "$tenant" }}'),
    ])


def dashboards() -> dict[str, dict]:
    return {"overview.json": overview(), "latency.json": latency(), "cost.json": cost(), "traces.json": traces()}


def promql_targets(board: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every Prometheus query of a dashboard."""
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"] if "expr" in t]


def traceql_targets(board: dict) -> list[tuple[str, str]]:
    """(panel title, query) of every TraceQL query of a dashboard."""
    return [(p["title"], t["query"]) for p in board["panels"] for t in p["targets"]
            if t.get("queryType") == "traceql"]


def traceql_span_attributes(query: str) -> set[str]:
    """The span attributes (`span.NAME`) a TraceQL query reads."""
    return set(re.findall(r"\bspan\.([A-Za-z_][\w.]*)", query))


def render(board: dict) -> str:
    return json.dumps(board, indent=2) + "\n"


def problems(directory: Path = DASHBOARDS_DIR) -> list[str]:
    out, known = [], emitted_metrics()
    out += [f"vLLM metric {n} is not defined by the installed vLLM" for n in vllm_missing()]
    for name, board in dashboards().items():
        for title, expr in promql_targets(board):
            out += [f"{name}: panel {title!r} queries {m}, which nothing emits" for m in metric_names(expr) - known]
        path = directory / name
        current = path.read_text() if path.exists() else ""
        if current != render(board):
            sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), render(board).splitlines(True),
                                                       str(path), "generated"))
            out.append(f"{path} is not what `python -m otel_llm.dashboards` generates: rerun it")
    return out


def check_files(directory: Path) -> list[str]:
    """Metric names in the committed files' own PromQL that nothing emits."""
    out, known = [], emitted_metrics()
    for path in sorted(directory.glob("*.json")):
        for title, expr in promql_targets(json.loads(path.read_text())):
            out += [f"{path.name}: panel {title!r} queries {m}, which nothing emits" for m in metric_names(expr) - known]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m otel_llm.dashboards", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a file differs from the generator's or queries an unknown metric")
    parser.add_argument("-d", "--directory", type=Path, default=DASHBOARDS_DIR, help="default %(default)s")
    args = parser.parse_args(argv)
    if args.check:
        found = check_files(args.directory) + problems(args.directory)
        for line in dict.fromkeys(found):
            print(line, file=sys.stderr)
        return 1 if found else 0
    args.directory.mkdir(parents=True, exist_ok=True)
    for name, board in dashboards().items():
        (args.directory / name).write_text(render(board))
    return 0


if __name__ == "__main__":
    sys.exit(main())
