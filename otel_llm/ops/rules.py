"""Prometheus recording and alerting rules for an instrumented vLLM fleet, generated from the names
in `otel_llm.semconv`: ours, and vLLM's own `vllm:*` metrics (its end section).

`render(Params(...))` is the rule file's text; `otel-llm rules [--out FILE] [--queue-length 20 ...]`
prints or writes it. Each alert carries a `runbook_url` to its subsection of the README's "Alerts"
section. Per-tenant daily token budgets are not here: `otel-llm budget-rules` (otel_llm/ops/budgets.py)
makes those from a budget file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields

from otel_llm import semconv
from otel_llm.billing import promql

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
SCENE = semconv.prometheus_label(semconv.TENANT_SCENE)
VLLM_MODEL = semconv.VLLM_LABEL_MODEL

# Recording rule names (level:metric:operations)
HIT_RATIO = "otel_llm:prefix_cache_hit_ratio:rate5m"
HIT_RATIO_BY_MODEL = f"{MODEL}:otel_llm_prefix_cache_hit_ratio:rate5m"
TOKENS_BY_TENANT = f"{TENANT}_{TOKEN_TYPE}:{TOKENS.removesuffix('_total')}:rate5m"
TOKENS_RATE_1H = f"otel_llm:{TOKENS.removesuffix('_total')}:rate1h"
QUANTILES = (0.5, 0.95, 0.99)
# per tenant and scene, recorded only while > 0 (so that a mean over time is the mean of its active time)
TENANT_REQUESTS = f"{TENANT}_{SCENE}:{REQUESTS.removesuffix('_total')}:rate5m"
TENANT_TOKENS = f"{TENANT}_{SCENE}_{TOKEN_TYPE}:{TOKENS.removesuffix('_total')}:rate5m"
ANOMALY_WINDOW_SECONDS = 300  # of the two rates above
# Multi-window multi-burn-rate alerts of the time-to-first-token objective (Google SRE workbook,
# "Alerting on SLOs", for a 30-day objective): (alert, severity, for, [(burn rate, long window,
# short window), ...]). Burn rate 14.4 over 1 h spends 2 % of a 30-day error budget, 6 over 6 h 5 %,
# 3 over 1 d 10 %, 1 over 3 d 10 %; the short window ends the alert soon after the burn stops.
BURN_ALERTS = (
    ("LLMTimeToFirstTokenBudgetBurnFast", "critical", "2m", ((14.4, "1h", "5m"), (6, "6h", "30m"))),
    ("LLMTimeToFirstTokenBudgetBurnSlow", "warning", "15m", ((3, "1d", "2h"), (1, "3d", "6h"))),
)
SLO_WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
# the anomaly baseline leaves out the last hour: a change is flagged for at least that long before it
# starts to become the tenant's new normal
ANOMALY_BASELINE_OFFSET = "1h"
INSTANCE_MEMORY = "1h"  # how long a vanished vLLM instance is remembered (and alerted on)


def slo_miss_rule(window: str) -> str:
    """Recorded share of requests whose time to first token was over the objective, by model."""
    return f"{MODEL}:{TTFT}:slo_miss_ratio_rate{window}"


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
    # Anomalies of one tenant and scene against its own anomaly_baseline_hours before the last hour
    # (whatever history it has: from its second hour on): request rate over request_rate_factor x its
    # mean while active, tokens (or output tokens) per request over request_size_factor x its mean,
    # each only with at least anomaly_min_requests requests in the last 5 min. watch_tenants
    # (comma-separated tenant ids) restricts them to those tenants; default every tenant label
    # (capped in the process, so the series are bounded).
    watch_tenants: str = ""
    anomaly_baseline_hours: int = 24
    request_rate_factor: float = 3.0
    request_size_factor: float = 2.0
    anomaly_min_requests: int = 10
    # requests running in an engine that generated no token for this long: stalled
    stall_seconds: int = 120
    # an instance's generation tokens/s of the last 10 min under this share of the hour before, when
    # that hour averaged over throughput_min_rate tokens/s
    throughput_drop_ratio: float = 0.5
    throughput_min_rate: float = 1.0
    # objective: ttft_slo_ratio of requests get their first token within ttft_slo_seconds (a bucket
    # bound of the time-to-first-token histogram, semconv.TTFT_BUCKETS)
    ttft_slo_seconds: float = 2.5
    ttft_slo_ratio: float = 0.99

    def __post_init__(self):
        if self.ttft_slo_seconds not in semconv.TTFT_BUCKETS:
            raise ValueError(
                f"ttft_slo_seconds {self.ttft_slo_seconds:g} is not a bucket bound of the time to "
                f"first token histogram: one of {', '.join(f'{b:g}' for b in semconv.TTFT_BUCKETS)}"
            )
        for name in ("ttft_slo_ratio", "throughput_drop_ratio"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be between 0 and 1, not {getattr(self, name):g}")

    @property
    def near_max_len_bucket(self) -> int:
        return int(self.max_model_len * self.context_ratio)

    @property
    def watched_tenants(self) -> tuple[str, ...]:
        return tuple(t for t in (t.strip() for t in self.watch_tenants.split(",")) if t)


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
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {"summary": self.summary, "description": self.description, "runbook_url": self.runbook_url},
        }


def _rate(selector: str, window: str = "5m") -> str:
    return f"rate({selector}[{window}])"


def _duration(seconds: int) -> str:
    """A PromQL duration: 120 -> 2m, 90 -> 90s."""
    return f"{seconds // 60}m" if seconds % 60 == 0 else f"{seconds}s"


def _number(x: float) -> str:
    return f"{round(x, 10):g}"


def _le(bound: float) -> str:
    """Matcher of a histogram bucket: exporters write a whole bound as "10" or "10.0"."""
    return f'le=~"{bound:g}(\\\\.0)?"' if bound == int(bound) else f'le="{bound:g}"'


def _selector(metric: str, *matchers: str) -> str:
    """`metric{a="1",b="2"}` of the non-empty matchers (just `metric` without any)."""
    matchers = [m for m in matchers if m]
    return metric + (f"{{{','.join(matchers)}}}" if matchers else "")


def _tenant_matcher(p: Params) -> str:
    """`tenant_id=~"a|b"` for the watched tenants (regex-escaped, in a PromQL string); "" for all."""
    if not p.watched_tenants:
        return ""
    alternatives = "|".join(re.escape(t) for t in p.watched_tenants)
    return f"{TENANT}=~{json.dumps(alternatives)}"


def _quantile_rules(metric: str) -> list[dict]:
    return [
        {
            "record": quantile_rule(metric),
            "expr": f"histogram_quantile({q}, sum by ({MODEL}, le) ({_rate(metric + '_bucket')}))",
            "labels": {"quantile": str(q)},
        }
        for q in QUANTILES
    ]


def _tenant_rules(p: Params) -> list[dict]:
    by = f"{TENANT}, {SCENE}"
    billed = f'{TOKEN_TYPE}=~"{semconv.TOKEN_TYPE_INPUT}|{semconv.TOKEN_TYPE_OUTPUT}"'  # input includes cached
    window = _duration(ANOMALY_WINDOW_SECONDS)
    requests = _selector(REQUESTS, _tenant_matcher(p))
    tokens = _selector(TOKENS, billed, _tenant_matcher(p))
    return [
        {"record": TENANT_REQUESTS, "expr": f"sum by ({by}) ({_rate(requests, window)}) > 0"},
        {"record": TENANT_TOKENS, "expr": f"sum by ({by}, {TOKEN_TYPE}) ({_rate(tokens, window)}) > 0"},
    ]


def _slo_rules(p: Params) -> list[dict]:
    within = f"{TTFT}_bucket{{{_le(p.ttft_slo_seconds)}}}"
    return [
        {
            "record": slo_miss_rule(w),
            "expr": f"1 - sum by ({MODEL}) ({_rate(within, w)}) / sum by ({MODEL}) ({_rate(TTFT + '_count', w)})",
        }
        for w in SLO_WINDOWS
    ]


def recording_rules(p: Params = Params()) -> list[dict]:
    cached = f'{TOKENS}{{{TOKEN_TYPE}="{semconv.TOKEN_TYPE_CACHED_INPUT}"}}'
    inputs = f'{TOKENS}{{{TOKEN_TYPE}="{semconv.TOKEN_TYPE_INPUT}"}}'
    # input includes cached_input, so input + output is every token once
    billed = f'{TOKENS}{{{TOKEN_TYPE}=~"{semconv.TOKEN_TYPE_INPUT}|{semconv.TOKEN_TYPE_OUTPUT}"}}'
    return [
        # share of prompt tokens served from the prefix cache (engine counts, cached <= input)
        {"record": HIT_RATIO, "expr": f"sum({_rate(cached)}) / sum({_rate(inputs)})"},
        {
            "record": HIT_RATIO_BY_MODEL,
            "expr": f"sum by ({MODEL}) ({_rate(cached)}) / sum by ({MODEL}) ({_rate(inputs)})",
        },
        # tokens/s per tenant and type (input includes cached_input: do not add the two)
        {"record": TOKENS_BY_TENANT, "expr": f"sum by ({TENANT}, {TOKEN_TYPE}) ({_rate(TOKENS)})"},
        # tokens/s (input + output) over the last hour, all tenants and models
        {"record": TOKENS_RATE_1H, "expr": f"sum({_rate(billed, '1h')})"},
        *_quantile_rules(TTFT),
        *_quantile_rules(TPOT),
        *_quantile_rules(DURATION),
        *_tenant_rules(p),
        *_slo_rules(p),
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
        return (
            f'sum by ({semconv.VLLM_LABEL_MODEL}) (increase({hist}_bucket{{le="+Inf"}}[5m])) - '
            f"sum by ({semconv.VLLM_LABEL_MODEL}) (increase({hist}_bucket{{{le}}}[5m]))"
        )

    errors = f'{REQUESTS}{{{OUTCOME}="{semconv.OUTCOME_ERROR}"}}'
    ttft_p95 = f'{quantile_rule(TTFT)}{{quantile="0.95"}}'
    instance = f"vLLM {{{{ $labels.instance }}}} (model {{{{ $labels.{semconv.VLLM_LABEL_MODEL} }}}})"
    return [
        Alert(
            "LLMTimeToFirstTokenHigh",
            f"{ttft_p95} > {p.ttft_p95_seconds:g}",
            "5m",
            "warning",
            f"P95 time to first token of model {{{{ $labels.{MODEL} }}}} is {{{{ $value | humanizeDuration }}}} "
            f"(over {p.ttft_p95_seconds:g} s for 5 min)",
            "Users wait long for the first token: requests queue in vLLM, or prefill of long prompts is slow.",
        ),
        Alert(
            "LLMQueueTooLong",
            f"{semconv.VLLM_METRIC_WAITING} > {p.queue_length}",
            "5m",
            "warning",
            f"{{{{ $value }}}} requests waiting in vLLM {{{{ $labels.instance }}}} "
            f"(model {{{{ $labels.{semconv.VLLM_LABEL_MODEL} }}}}, over {p.queue_length} for 5 min)",
            "vLLM gets more requests than it can schedule: they wait before prefill starts.",
        ),
        Alert(
            "LLMErrorRateHigh",
            f"sum({_rate(errors)}) / sum({_rate(REQUESTS)}) > {p.error_ratio:g}",
            "5m",
            "critical",
            f"{{{{ $value | humanizePercentage }}}} of requests end in an error (over {p.error_ratio:.0%} for 5 min)",
            "Requests end with outcome error (not client aborts) on any model.",
        ),
        Alert(
            "LLMTokenUsageSpike",
            f"{TOKENS_RATE_1H} > {p.token_spike_factor:g} * {baseline}",
            "15m",
            "warning",
            f"{{{{ $value | humanize }}}} tokens/s (input + output) in the last hour, over "
            f"{p.token_spike_factor:.0%} of this hour's mean of the previous {p.baseline_days} days",
            "Token consumption of the whole fleet is far above its usual level for this hour of the day.",
        ),
        Alert(
            "LLMRequestNearMaxModelLen",
            f"({over(semconv.VLLM_METRIC_PROMPT_TOKENS)}) + ({over(semconv.VLLM_METRIC_GENERATION_TOKENS)}) > 0",
            "1m",
            "info",
            f"{{{{ $value | humanize }}}} requests to model {{{{ $labels.{semconv.VLLM_LABEL_MODEL} }}}} "
            f"in the last 5 min had a prompt or output over {p.near_max_len_bucket} tokens "
            f"({p.context_ratio:.0%} of max model length {p.max_model_len})",
            "Requests come close to the model's context length: the next longer ones fail or get truncated.",
        ),
        Alert(
            "LLMKVCacheNearlyFull",
            f"{semconv.VLLM_METRIC_KV_CACHE_USAGE} > {p.kv_cache_usage:g}",
            "5m",
            "warning",
            f"KV cache of {instance} is {{{{ $value | humanizePercentage }}}} full "
            f"(over {p.kv_cache_usage:.0%} for 5 min)",
            "vLLM's KV cache is almost full: new requests wait and running ones get preempted.",
        ),
        Alert(
            "LLMPreemptions",
            f"increase({semconv.VLLM_METRIC_PREEMPTIONS}[5m]) > 0",
            "1m",
            "warning",
            f"{instance} preempted {{{{ $value | humanize }}}} requests in the last 5 min (KV cache too small)",
            "vLLM evicted running requests to free KV cache; they are recomputed later, at a latency cost.",
        ),
        Alert(
            "LLMPrefixCacheHitRateLow",
            f"{HIT_RATIO_BY_MODEL} < {p.prefix_cache_hit_floor:g} and on ({MODEL}) "
            f"sum by ({MODEL}) ({_rate(inputs)}) > {p.prefix_cache_min_input_rate:g}",
            "15m",
            "info",
            f"prefix cache hit rate of model {{{{ $labels.{MODEL} }}}} is {{{{ $value | humanizePercentage }}}} "
            f"(under {p.prefix_cache_hit_floor:.0%} for 15 min with over {p.prefix_cache_min_input_rate:g} "
            f"input tokens/s)",
            "Few prompt tokens come from vLLM's prefix cache: shared prefixes are recomputed, TTFT and cost rise.",
        ),
        Alert(
            "LLMTelemetryDropped",
            f"sum by (instance, {ERROR_TYPE}) (increase({EXPORT_DROPPED}[5m])) > 0",
            "5m",
            "warning",
            f"{{{{ $labels.instance }}}} dropped the telemetry of {{{{ $value | humanize }}}} requests in the last "
            f"5 min ({{{{ $labels.{ERROR_TYPE} }}}})",
            "A vLLM API server could not hand requests' spans, request metrics and OTLP usage events to its "
            "export process (stalled or restarting); the usage spool is not affected.",
        ),
        # the counter appears at a point's first failure: a new series counts as much as an increase
        Alert(
            "LLMInstrumentationFailing",
            f"sum by (instance, {FAILURE_POINT}) (increase({FAILURES}[15m]) > 0 "
            f"or ({FAILURES} unless {FAILURES} offset 15m)) > 0",
            "1m",
            "warning",
            f"otel-llm's {{{{ $labels.{FAILURE_POINT} }}}} failed on {{{{ $labels.instance }}}} in the last 15 min",
            "A function of otel-llm that vLLM, FastAPI, uvicorn or OpenTelemetry calls raised: the requests "
            "were served, their spans, metrics or usage events may be incomplete.",
        ),
        *_anomaly_alerts(p),
        *_health_alerts(p),
        *_burn_alerts(p),
    ]


def _anomaly_alerts(p: Params) -> list[Alert]:
    """One tenant and scene against its own anomaly_baseline_hours before the last hour: the recorded
    rates exist only while it is active, so the baseline is its mean while active (idle nights do not
    lower it), from whatever history it has (on its first day: from its second hour)."""
    req, tok = TENANT_REQUESTS, TENANT_TOKENS

    def before(function: str, recorded: str) -> str:  # over the baseline hours before the last hour
        return f"{function}({recorded}[{p.anomaly_baseline_hours}h] offset {ANOMALY_BASELINE_OFFSET})"

    by = f"sum by ({TENANT}, {SCENE})"
    enough = f"{req} * {ANOMALY_WINDOW_SECONDS} >= {p.anomaly_min_requests}"
    output = f'{tok}{{{TOKEN_TYPE}="{semconv.TOKEN_TYPE_OUTPUT}"}}'

    def per_request(tokens: str) -> str:  # tokens per request now / the same over the baseline window
        usual = f"{by} ({before('sum_over_time', tokens)}) / {before('sum_over_time', req)}"
        return f"({by} ({tokens}) / {req}) / ({usual})"

    who = f"tenant {{{{ $labels.{TENANT} }}}} (scene {{{{ $labels.{SCENE} }}}})"
    usual = "{{ $value | humanize }}x its usual"
    window = f"in the {p.anomaly_baseline_hours} h before the last hour"
    rate, size = f"over {p.request_rate_factor:g}x", f"over {p.request_size_factor:g}x"
    return [
        Alert(
            "LLMTenantRequestRateHigh",
            f"{req} / {before('avg_over_time', req)} > {p.request_rate_factor:g} and {enough}",
            "10m",
            "warning",
            f"{who} sends {usual} requests/s ({rate} its mean while active {window}, for 10 min)",
            "One tenant and scene sends far more requests than in its own recent history: a looping client, "
            "a retry storm, a test script or a new integration.",
        ),
        Alert(
            "LLMTenantTokensPerRequestHigh",
            f"{per_request(tok)} > {p.request_size_factor:g} and {enough}",
            "10m",
            "warning",
            f"{who} uses {usual} tokens per request (input + output; {size} its mean {window}, for 10 min)",
            "One tenant and scene's requests are much larger than in its own recent history: prompts that "
            "grow (chat history not trimmed, more retrieved context), a changed client or prompt template.",
        ),
        Alert(
            "LLMTenantOutputLengthHigh",
            f"{per_request(output)} > {p.request_size_factor:g} and {enough}",
            "10m",
            "warning",
            f"{who} gets {usual} output tokens per request ({size} its mean {window}, for 10 min)",
            "One tenant and scene's responses are much longer than in its own recent history: a changed "
            "prompt or max_tokens, or generation that runs on to the limit (no stop sequence, repetition).",
        ),
    ]


def _health_alerts(p: Params) -> list[Alert]:
    instance = f"vLLM {{{{ $labels.instance }}}} (model {{{{ $labels.{VLLM_MODEL} }}}})"
    stall = _duration(p.stall_seconds)
    by_instance = f"sum by (job, instance, {VLLM_MODEL})"
    generated = semconv.VLLM_METRIC_GENERATION_TOKENS_TOTAL
    drop = f"{p.throughput_drop_ratio:.0%}"
    return [
        # a request in prefill has produced no generation token yet: prompt tokens count as progress
        Alert(
            "LLMEngineStalled",
            f"{semconv.VLLM_METRIC_RUNNING} > 0 and increase({generated}[{stall}]) == 0 "
            f"and increase({semconv.VLLM_METRIC_PROMPT_TOKENS_TOTAL}[{stall}]) == 0",
            "1m",
            "critical",
            f"{{{{ $value }}}} requests are running in {instance}, which computed no token in {stall}",
            "vLLM's engine stopped producing tokens while requests run: a hung engine core or GPU (driver, "
            "collective, deadlock) or a stopped process. Streams hang open without an error.",
        ),
        # its series went stale (scrape failing) or away (gone from service discovery); remembered for
        # INSTANCE_MEMORY, then the alert resolves by itself
        Alert(
            "LLMInstanceDown",
            f"group by (job, instance) (max_over_time({semconv.VLLM_METRIC_RUNNING}[{INSTANCE_MEMORY}])) "
            f"unless on (job, instance) {semconv.VLLM_METRIC_RUNNING}",
            "5m",
            "critical",
            "vLLM {{ $labels.instance }} (job {{ $labels.job }}) served no metrics for 5 min",
            f"A vLLM instance Prometheus scraped in the last {INSTANCE_MEMORY} is down, unreachable or gone "
            "from service discovery.",
        ),
        Alert(
            "LLMThroughputDropped",
            f"{by_instance} (rate({generated}[10m])) < {p.throughput_drop_ratio:g} * "
            f"({by_instance} (rate({generated}[1h] offset 10m)) > {p.throughput_min_rate:g})",
            "10m",
            "warning",
            f"{instance} generates {{{{ $value | humanize }}}} tokens/s, under {drop} of its mean of the hour "
            f"before (for 10 min)",
            "An instance produces far fewer tokens than an hour ago: the engine slowed down (GPU throttling, "
            "preemptions, long prompts) or fewer requests reach it (load balancer, gateway, a client gone).",
        ),
    ]


def _burn_alerts(p: Params) -> list[Alert]:
    """The error budget is the share of requests that may miss the objective (1 - ttft_slo_ratio)."""
    budget = 1 - p.ttft_slo_ratio
    objective = f"{p.ttft_slo_ratio * 100:g}% within {p.ttft_slo_seconds:g} s"
    made = []
    outlook = {"critical": "gone in under 2 days", "warning": "gone before the 30 days end"}
    for name, severity, for_, conditions in BURN_ALERTS:
        expr = " or ".join(
            " and ".join(f"{slo_miss_rule(w)} > {_number(burn * budget)}" for w in (long, short))
            for burn, long, short in conditions
        )
        windows = " or ".join(f"{burn:g}x ({long} and {short} windows)" for burn, long, short in conditions)
        made.append(
            Alert(
                name,
                expr,
                for_,
                severity,
                f"{{{{ $value | humanizePercentage }}}} of requests to model {{{{ $labels.{MODEL} }}}} waited over "
                f"{p.ttft_slo_seconds:g} s for their first token (objective: {objective})",
                f"The time-to-first-token objective's error budget burns at over {windows} the rate that "
                f"spends it in 30 days: {outlook[severity]}.",
            )
        )
    return made


ALERTS = tuple(a.name for a in alerts())


def rules(p: Params = Params()) -> dict:
    return {
        "groups": [
            {"name": "otel-llm-recording", "interval": "1m", "rules": recording_rules(p)},
            {"name": "otel-llm-alerts", "interval": "1m", "rules": [a.rule() for a in alerts(p)]},
        ]
    }


def render(p: Params = Params()) -> str:
    """The rule file: what `otel-llm rules` prints (the header names the options that made it)."""
    args = "".join(f" {option(f.name)} {getattr(p, f.name)}" for f in fields(p) if getattr(p, f.name) != f.default)
    return f"# generated by `otel-llm rules{args}` from otel_llm/semconv.py; do not edit\n" + promql.yaml_text(rules(p))


def problems(data: dict | None = None) -> list[str]:
    """What a rule reads that nothing emits: not our metric (semconv.METRICS), not vLLM's, not a
    recording rule of `data` (default: the generated rules)."""
    groups = (data or rules())["groups"]
    recorded = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    return [
        f"rule {r.get('record') or r.get('alert')} reads {m}, which nothing emits"
        for g in groups
        for r in g["rules"]
        for m in sorted(promql.unknown_metrics(r["expr"], recorded))
    ]
