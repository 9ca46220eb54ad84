"""Prometheus recording and alerting rules for an instrumented vLLM fleet, generated from the names
in `otel_llm.semconv`: ours, and vLLM's own `vllm:*` metrics (its end section).

`render(Params(...))` is the rule file's text; `otel-llm rules [--out FILE] [--queue-length 20 ...]`
prints or writes it. Each alert carries a `runbook_url` to its subsection of the README's "Alerts"
section. Per-tenant daily token budgets are not here: `otel-llm budget-rules` (otel_llm/budgets.py)
makes those from a budget file.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from otel_llm import promql, semconv

# --- Our metrics, as our exporter serves them to Prometheus -------------------------------
DURATION = semconv.prometheus_metric(semconv.SERVER_REQUEST_DURATION)
TTFT = semconv.prometheus_metric(semconv.SERVER_TIME_TO_FIRST_TOKEN)
TPOT = semconv.prometheus_metric(semconv.SERVER_TIME_PER_OUTPUT_TOKEN)
TOKENS = semconv.prometheus_metric(semconv.SERVER_TOKEN_USAGE)
REQUESTS = semconv.prometheus_metric(semconv.SERVER_REQUESTS)
MODEL = semconv.prometheus_label(semconv.GEN_AI_REQUEST_MODEL)
TENANT = semconv.prometheus_label(semconv.TENANT_ID)
TOKEN_TYPE = semconv.prometheus_label(semconv.GEN_AI_TOKEN_TYPE)
OUTCOME = semconv.prometheus_label(semconv.REQUEST_OUTCOME)
EXPORT_DROPPED = semconv.prometheus_metric(semconv.EXPORT_DROPPED)
ERROR_TYPE = semconv.prometheus_label(semconv.ERROR_TYPE)
FAILURES = semconv.prometheus_metric(semconv.INSTRUMENTATION_FAILURES)
FAILURE_POINT = semconv.prometheus_label(semconv.FAILURE_POINT)

# Recording rule names (level:metric:operations)
HIT_RATIO = "otel_llm:prefix_cache_hit_ratio:rate5m"
HIT_RATIO_BY_MODEL = f"{MODEL}:otel_llm_prefix_cache_hit_ratio:rate5m"
TOKENS_BY_TENANT = f"{TENANT}_{TOKEN_TYPE}:{TOKENS.removesuffix('_total')}:rate5m"
TOKENS_RATE_1H = f"otel_llm:{TOKENS.removesuffix('_total')}:rate1h"
QUANTILES = (0.5, 0.95, 0.99)



def quantile_rule(metric: str) -> str:
    """Recorded P50/P95/P99 of one of our histograms by model (label `quantile`)."""
    return f"{MODEL}:{metric}:quantile_rate5m"


@dataclass(frozen=True)
class Params:
    ttft_p95_seconds: float = 3.0
    queue_length: int = 50
    error_ratio: float = 0.05
    # hourly consumption over this multiple of the same hour's mean over the previous baseline_days
    token_spike_factor: float = 2.0
    baseline_days: int = 7
    # vLLM exports no max_model_len metric: it is a parameter here. The alert needs a bucket of the
    # vLLM "request_tokens" histograms at context_ratio * max_model_len (see near_max_len_bucket).
    max_model_len: int = 8192
    context_ratio: float = 0.9
    kv_cache_usage: float = 0.95
    prefix_cache_hit_floor: float = 0.2
    # input tokens/s (5 min rate, per model) below which the hit-rate alert stays quiet
    prefix_cache_min_input_rate: float = 1.0

    @property
    def near_max_len_bucket(self) -> int:
        return int(self.max_model_len * self.context_ratio)


def option(field_name: str) -> str:
    """The `otel-llm rules` option of a Params field."""
    return "--" + field_name.replace("_", "-")


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str

    @property
    def runbook_url(self) -> str:
        return promql.runbook_url(self.name)

    def rule(self) -> dict:
        return {"alert": self.name, "expr": self.expr, "for": self.for_, "labels": {"severity": self.severity},
                "annotations": {"summary": self.summary, "description": self.description,
                                "runbook_url": self.runbook_url}}


def _rate(selector: str, window: str = "5m") -> str:
    return f"rate({selector}[{window}])"


def _quantile_rules(metric: str) -> list[dict]:
    return [{
        "record": quantile_rule(metric),
        "expr": f"histogram_quantile({q}, sum by ({MODEL}, le) ({_rate(metric + '_bucket')}))",
        "labels": {"quantile": str(q)},
    } for q in QUANTILES]


def recording_rules() -> list[dict]:
    cached = f'{TOKENS}{{{TOKEN_TYPE}="{semconv.TOKEN_TYPE_CACHED_INPUT}"}}'
    inputs = f'{TOKENS}{{{TOKEN_TYPE}="{semconv.TOKEN_TYPE_INPUT}"}}'
    # input includes cached_input, so input + output is every token once
    billed = f'{TOKENS}{{{TOKEN_TYPE}=~"{semconv.TOKEN_TYPE_INPUT}|{semconv.TOKEN_TYPE_OUTPUT}"}}'
    return [
        # share of prompt tokens served from the prefix cache (engine counts, cached <= input)
        {"record": HIT_RATIO, "expr": f"sum({_rate(cached)}) / sum({_rate(inputs)})"},
        {"record": HIT_RATIO_BY_MODEL,
         "expr": f"sum by ({MODEL}) ({_rate(cached)}) / sum by ({MODEL}) ({_rate(inputs)})"},
        # tokens/s per tenant and type (input includes cached_input: do not add the two)
        {"record": TOKENS_BY_TENANT, "expr": f"sum by ({TENANT}, {TOKEN_TYPE}) ({_rate(TOKENS)})"},
        # tokens/s (input + output) over the last hour, all tenants and models
        {"record": TOKENS_RATE_1H, "expr": f"sum({_rate(billed, '1h')})"},
        *_quantile_rules(TTFT),
        *_quantile_rules(TPOT),
        *_quantile_rules(DURATION),
    ]


def alerts(p: Params = Params()) -> list[Alert]:
    inputs = f'{TOKENS}{{{TOKEN_TYPE}="{semconv.TOKEN_TYPE_INPUT}"}}'
    billed = f'{TOKENS}{{{TOKEN_TYPE}=~"{semconv.TOKEN_TYPE_INPUT}|{semconv.TOKEN_TYPE_OUTPUT}"}}'
    # Baseline of the spike alert: the same clock hour on each of the previous baseline_days days,
    # from the raw counter (`offset Nd`, so it works from day 8 of raw retention, without waiting for
    # a recording rule to build up history), averaged. Comparing with the same hour of earlier days
    # keeps the daily cycle (a busy 10:00 vs a quiet 03:00) from firing. A day without data makes the
    # sum empty, so the alert stays quiet until baseline_days of history exist; a baseline of 0 (an
    # hour that was always idle) never fires.
    days = " + ".join(f"sum(rate({billed}[1h] offset {d}d))" for d in range(1, p.baseline_days + 1))
    baseline = f"({days}) / {p.baseline_days}"
    # Near max model length: vLLM records each request's prompt and generated tokens in two
    # histograms but exports no max_model_len, and one request's prompt + generation is not
    # recoverable from two histograms. This counts requests whose prompt OR generation alone is over
    # the bucket at context_ratio * max_model_len (a lower bound of the requests whose total is; a
    # request cannot be over 90 % on both sides, so none is counted twice). vLLM's default buckets
    # are 1-2-5 up to max_model_len, so start vLLM with that bucket:
    #   --custom-histogram-buckets '{"request_tokens": [..., <bucket>, <max_model_len>]}'
    # (the `le` match accepts "7372" and prometheus_client's "7372.0").
    le = f'le=~"{p.near_max_len_bucket}(\\\\.0)?"'

    def over(hist: str) -> str:
        return (f'sum by ({semconv.VLLM_LABEL_MODEL}) (increase({hist}_bucket{{le="+Inf"}}[5m])) - '
                f"sum by ({semconv.VLLM_LABEL_MODEL}) (increase({hist}_bucket{{{le}}}[5m]))")

    errors = f'{REQUESTS}{{{OUTCOME}="{semconv.OUTCOME_ERROR}"}}'
    ttft_p95 = f'{quantile_rule(TTFT)}{{quantile="0.95"}}'
    instance = f"vLLM {{{{ $labels.instance }}}} (model {{{{ $labels.{semconv.VLLM_LABEL_MODEL} }}}})"
    return [
        Alert("LLMTimeToFirstTokenHigh", f"{ttft_p95} > {p.ttft_p95_seconds:g}", "5m", "warning",
              f"P95 time to first token of model {{{{ $labels.{MODEL} }}}} is {{{{ $value | humanizeDuration }}}} "
              f"(over {p.ttft_p95_seconds:g} s for 5 min)",
              "Users wait long for the first token: requests queue in vLLM, or prefill of long prompts is slow."),
        Alert("LLMQueueTooLong", f"{semconv.VLLM_METRIC_WAITING} > {p.queue_length}", "5m", "warning",
              f"{{{{ $value }}}} requests waiting in vLLM {{{{ $labels.instance }}}} "
              f"(model {{{{ $labels.{semconv.VLLM_LABEL_MODEL} }}}}, over {p.queue_length} for 5 min)",
              "vLLM gets more requests than it can schedule: they wait before prefill starts."),
        Alert("LLMErrorRateHigh", f"sum({_rate(errors)}) / sum({_rate(REQUESTS)}) > {p.error_ratio:g}", "5m",
              "critical",
              f"{{{{ $value | humanizePercentage }}}} of requests end in an error (over {p.error_ratio:.0%} for 5 min)",
              "Requests end with outcome error (not client aborts) on any model."),
        Alert("LLMTokenUsageSpike", f"{TOKENS_RATE_1H} > {p.token_spike_factor:g} * {baseline}", "15m", "warning",
              f"{{{{ $value | humanize }}}} tokens/s (input + output) in the last hour, over "
              f"{p.token_spike_factor:.0%} of this hour's mean of the previous {p.baseline_days} days",
              "Token consumption of the whole fleet is far above its usual level for this hour of the day."),
        Alert("LLMRequestNearMaxModelLen",
              f"({over(semconv.VLLM_METRIC_PROMPT_TOKENS)}) + ({over(semconv.VLLM_METRIC_GENERATION_TOKENS)}) > 0",
              "1m", "info",
              f"{{{{ $value | humanize }}}} requests to model {{{{ $labels.{semconv.VLLM_LABEL_MODEL} }}}} "
              f"in the last 5 min had a prompt or output over {p.near_max_len_bucket} tokens "
              f"({p.context_ratio:.0%} of max model length {p.max_model_len})",
              "Requests come close to the model's context length: the next longer ones fail or get truncated."),
        Alert("LLMKVCacheNearlyFull", f"{semconv.VLLM_METRIC_KV_CACHE_USAGE} > {p.kv_cache_usage:g}", "5m", "warning",
              f"KV cache of {instance} is {{{{ $value | humanizePercentage }}}} full "
              f"(over {p.kv_cache_usage:.0%} for 5 min)",
              "vLLM's KV cache is almost full: new requests wait and running ones get preempted."),
        Alert("LLMPreemptions", f"increase({semconv.VLLM_METRIC_PREEMPTIONS}[5m]) > 0", "1m", "warning",
              f"{instance} preempted {{{{ $value | humanize }}}} requests in the last 5 min (KV cache too small)",
              "vLLM evicted running requests to free KV cache; they are recomputed later, at a latency cost."),
        Alert("LLMPrefixCacheHitRateLow",
              f"{HIT_RATIO_BY_MODEL} < {p.prefix_cache_hit_floor:g} and on ({MODEL}) "
              f"sum by ({MODEL}) ({_rate(inputs)}) > {p.prefix_cache_min_input_rate:g}", "15m", "info",
              f"prefix cache hit rate of model {{{{ $labels.{MODEL} }}}} is {{{{ $value | humanizePercentage }}}} "
              f"(under {p.prefix_cache_hit_floor:.0%} for 15 min with over {p.prefix_cache_min_input_rate:g} "
              f"input tokens/s)",
              "Few prompt tokens come from vLLM's prefix cache: shared prefixes are recomputed, TTFT and cost rise."),
        Alert("LLMTelemetryDropped",
              f"sum by (instance, {ERROR_TYPE}) (increase({EXPORT_DROPPED}[5m])) > 0", "5m", "warning",
              f"{{{{ $labels.instance }}}} dropped the telemetry of {{{{ $value | humanize }}}} requests in the last "
              f"5 min ({{{{ $labels.{ERROR_TYPE} }}}})",
              "A vLLM API server could not hand requests' spans, request metrics and OTLP usage events to its "
              "export process (stalled or restarting); the usage spool is not affected."),
        # the counter appears at a point's first failure: a new series counts as much as an increase
        Alert("LLMInstrumentationFailing",
              f"sum by (instance, {FAILURE_POINT}) (increase({FAILURES}[15m]) > 0 "
              f"or ({FAILURES} unless {FAILURES} offset 15m)) > 0", "1m", "warning",
              f"otel-llm's {{{{ $labels.{FAILURE_POINT} }}}} failed on {{{{ $labels.instance }}}} in the last 15 min",
              "A function of otel-llm that vLLM, FastAPI, uvicorn or OpenTelemetry calls raised: the requests "
              "were served, their spans, metrics or usage events may be incomplete."),
    ]


ALERTS = tuple(a.name for a in alerts())


def rules(p: Params = Params()) -> dict:
    return {"groups": [
        {"name": "otel-llm-recording", "interval": "1m", "rules": recording_rules()},
        {"name": "otel-llm-alerts", "interval": "1m", "rules": [a.rule() for a in alerts(p)]},
    ]}


def render(p: Params = Params()) -> str:
    """The rule file: what `otel-llm rules` prints (the header names the options that made it)."""
    args = "".join(f" {option(f.name)} {getattr(p, f.name)}" for f in fields(p)
                   if getattr(p, f.name) != f.default)
    return f"# generated by `otel-llm rules{args}` from otel_llm/semconv.py; do not edit\n" + promql.yaml_text(rules(p))


def problems(data: dict | None = None) -> list[str]:
    """What a rule reads that nothing emits: not our metric (semconv.METRICS), not vLLM's, not a
    recording rule of `data` (default: the generated rules)."""
    groups = (data or rules())["groups"]
    recorded = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    return [f"rule {r.get('record') or r.get('alert')} reads {m}, which nothing emits"
            for g in groups for r in g["rules"] for m in sorted(promql.unknown_metrics(r["expr"], recorded))]
