"""Prometheus recording and alerting rules for an instrumented vLLM fleet, generated from the names
in `otel_llm.semconv` (ours) and vLLM's own `vllm:*` metrics.

    python -m otel_llm.rules           # rewrite collector-config/prometheus/otel-llm-rules.yml
    python -m otel_llm.rules --check   # exit 1 when the committed file differs from the generator

Per-tenant daily token budgets are not here: `otel-llm budget-rules` (otel_llm/budgets.py) makes
those from a budget file.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from otel_llm import semconv

RULES_FILE = Path(__file__).resolve().parents[1] / "collector-config" / "prometheus" / "otel-llm-rules.yml"

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

# --- vLLM's own metrics (vllm/v1/metrics/loggers.py, prometheus_client; labels model_name, engine).
# No semconv constant exists for them: they are vLLM's names, checked against the installed vLLM.
VLLM_WAITING = "vllm:num_requests_waiting"  # gauge
VLLM_KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # gauge, 1 = 100 %
VLLM_PREEMPTIONS = "vllm:num_preemptions_total"  # Counter "vllm:num_preemptions"
VLLM_PROMPT_TOKENS = "vllm:request_prompt_tokens"  # histogram per request, buckets "request_tokens"
VLLM_GENERATION_TOKENS = "vllm:request_generation_tokens"  # same bucket family
VLLM_MODEL = "model_name"
# the engine's own token counters, which `otel-llm reconcile` compares the usage ledger with
VLLM_PROMPT_TOKENS_TOTAL = "vllm:prompt_tokens_total"  # Counter "vllm:prompt_tokens": per engine request
VLLM_GENERATION_TOKENS_TOTAL = "vllm:generation_tokens_total"
VLLM_PROMPT_TOKENS_CACHED_TOTAL = "vllm:prompt_tokens_cached_total"


def vllm_missing(names) -> list[str]:
    """The vLLM metric names among `names` that the installed vLLM does not define (its
    vllm/v1/metrics/loggers.py, read, not imported: importing vLLM takes seconds); empty when vLLM
    is not installed. A counter's name is defined without its `_total`."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return []
    source = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    return [n for n in names if f'"{n.removesuffix("_total")}"' not in source]

# Recording rule names (level:metric:operations)
HIT_RATIO = "otel_llm:prefix_cache_hit_ratio:rate5m"
HIT_RATIO_BY_MODEL = f"{MODEL}:otel_llm_prefix_cache_hit_ratio:rate5m"
TOKENS_BY_TENANT = f"{TENANT}_{TOKEN_TYPE}:{TOKENS.removesuffix('_total')}:rate5m"
TOKENS_RATE_1H = f"otel_llm:{TOKENS.removesuffix('_total')}:rate1h"
QUANTILES = (0.5, 0.95, 0.99)


def quantile_rule(metric: str) -> str:
    """Recorded P50/P95/P99 of one of our histograms by model (label `quantile`)."""
    return f"{MODEL}:{metric}:quantile_rate5m"


ALERTS = ("LLMTimeToFirstTokenHigh", "LLMQueueTooLong", "LLMErrorRateHigh", "LLMTokenUsageSpike",
          "LLMRequestNearMaxModelLen", "LLMKVCacheNearlyFull", "LLMPreemptions", "LLMPrefixCacheHitRateLow")


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


def alerting_rules(p: Params) -> list[dict]:
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
        return (f'sum by ({VLLM_MODEL}) (increase({hist}_bucket{{le="+Inf"}}[5m])) - '
                f"sum by ({VLLM_MODEL}) (increase({hist}_bucket{{{le}}}[5m]))")

    errors = f'{REQUESTS}{{{OUTCOME}="{semconv.OUTCOME_ERROR}"}}'
    ttft_p95 = f'{quantile_rule(TTFT)}{{quantile="0.95"}}'
    return [
        {"alert": ALERTS[0], "expr": f"{ttft_p95} > {p.ttft_p95_seconds:g}", "for": "5m",
         "labels": {"severity": "warning"},
         "annotations": {"summary": f"P95 time to first token of model {{{{ $labels.{MODEL} }}}} is "
                                    f"{{{{ $value | humanizeDuration }}}} (over {p.ttft_p95_seconds:g} s for 5 min)"}},
        {"alert": ALERTS[1], "expr": f"{VLLM_WAITING} > {p.queue_length}", "for": "5m",
         "labels": {"severity": "warning"},
         "annotations": {"summary": f"{{{{ $value }}}} requests waiting in vLLM {{{{ $labels.instance }}}} "
                                    f"(model {{{{ $labels.{VLLM_MODEL} }}}}, over {p.queue_length} for 5 min)"}},
        {"alert": ALERTS[2],
         "expr": f"sum({_rate(errors)}) / sum({_rate(REQUESTS)}) > {p.error_ratio:g}",
         "for": "5m", "labels": {"severity": "critical"},
         "annotations": {"summary": f"{{{{ $value | humanizePercentage }}}} of requests end in an error "
                                    f"(over {p.error_ratio:.0%} for 5 min)"}},
        {"alert": ALERTS[3],
         "expr": f"{TOKENS_RATE_1H} > {p.token_spike_factor:g} * {baseline}", "for": "15m",
         "labels": {"severity": "warning"},
         "annotations": {"summary": f"{{{{ $value | humanize }}}} tokens/s (input + output) in the last hour, over "
                                    f"{p.token_spike_factor:.0%} of this hour's mean of the previous "
                                    f"{p.baseline_days} days"}},
        {"alert": ALERTS[4],
         "expr": f"({over(VLLM_PROMPT_TOKENS)}) + ({over(VLLM_GENERATION_TOKENS)}) > 0", "for": "1m",
         "labels": {"severity": "info"},
         "annotations": {"summary": f"{{{{ $value | humanize }}}} requests to model {{{{ $labels.{VLLM_MODEL} }}}} in "
                                    f"the last 5 min had a prompt or output over {p.near_max_len_bucket} tokens "
                                    f"({p.context_ratio:.0%} of max model length {p.max_model_len})"}},
        {"alert": ALERTS[5], "expr": f"{VLLM_KV_CACHE_USAGE} > {p.kv_cache_usage:g}", "for": "5m",
         "labels": {"severity": "warning"},
         "annotations": {"summary": f"KV cache of vLLM {{{{ $labels.instance }}}} "
                                    f"(model {{{{ $labels.{VLLM_MODEL} }}}}) is {{{{ $value | humanizePercentage }}}} full (over {p.kv_cache_usage:.0%} "
                                    f"for 5 min)"}},
        {"alert": ALERTS[6], "expr": f"increase({VLLM_PREEMPTIONS}[5m]) > 0", "for": "1m",
         "labels": {"severity": "warning"},
         "annotations": {"summary": f"vLLM {{{{ $labels.instance }}}} (model {{{{ $labels.{VLLM_MODEL} }}}}) preempted "
                                    f"{{{{ $value | humanize }}}} requests in the last 5 min (KV cache too small)"}},
        {"alert": ALERTS[7],
         "expr": f"{HIT_RATIO_BY_MODEL} < {p.prefix_cache_hit_floor:g} and on ({MODEL}) "
                 f"sum by ({MODEL}) ({_rate(inputs)}) > {p.prefix_cache_min_input_rate:g}",
         "for": "15m", "labels": {"severity": "info"},
         "annotations": {"summary": f"prefix cache hit rate of model {{{{ $labels.{MODEL} }}}} is "
                                    f"{{{{ $value | humanizePercentage }}}} (under {p.prefix_cache_hit_floor:.0%} "
                                    f"for 15 min with over {p.prefix_cache_min_input_rate:g} input tokens/s)"}},
    ]


def rules(p: Params = Params()) -> dict:
    return {"groups": [
        {"name": "otel-llm-recording", "interval": "1m", "rules": recording_rules()},
        {"name": "otel-llm-alerts", "interval": "1m", "rules": alerting_rules(p)},
    ]}


def rules_yaml(p: Params = Params()) -> str:
    import yaml

    changed = {f.name: getattr(p, f.name) for f in fields(p) if getattr(p, f.name) != f.default}
    args = "".join(f" --{k.replace('_', '-')} {v}" for k, v in changed.items())
    return (f"# generated by `python -m otel_llm.rules{args}` from otel_llm/semconv.py; do not edit\n"
            + yaml.safe_dump(rules(p), sort_keys=False, width=1000))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m otel_llm.rules", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from the generator's")
    parser.add_argument("-o", "--output", type=Path, default=RULES_FILE, help="default %(default)s")
    for f in fields(Params):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                            help="default %(default)s")
    args = parser.parse_args(argv)
    text = rules_yaml(Params(**{f.name: getattr(args, f.name) for f in fields(Params)}))
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                                       str(args.output), "generated"))
            print(f"{args.output} is not what `python -m otel_llm.rules` generates: rerun it", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
