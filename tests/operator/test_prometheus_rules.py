"""collector-config/prometheus/otel-llm-rules.yml: what `otel-llm rules` (rules.render) prints,
valid for the real promtool, each alert unit-tested with `promtool test rules`, firing and not
firing, on series with our real metric and label names; every metric a rule reads is emitted by
us or vLLM, and every alert's runbook is a heading of the README."""

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from otel_llm import semconv
from otel_llm.billing import promql
from otel_llm.ops import budgets, rules

ROOT = Path(__file__).resolve().parents[2]
RULES_FILE = ROOT / "collector-config" / "prometheus" / "otel-llm-rules.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool (Debian package prometheus) is installed by `make test`"
)
MODEL, TENANT, SCENE = rules.MODEL, rules.TENANT, semconv.prometheus_label(semconv.TENANT_SCENE)
OPERATION = semconv.prometheus_label(semconv.GEN_AI_OPERATION_NAME)
VLLM = {"instance": "vllm-0:8000", "job": "vllm", semconv.VLLM_LABEL_MODEL: "llama", "engine": "0"}
N_RECORDING, N_ALERTING = 22, 18


def test_names_are_the_exporters():
    assert (rules.DURATION, rules.TTFT, rules.TPOT, rules.TOKENS, rules.REQUESTS) == (
        "gen_ai_server_request_duration_seconds",
        "gen_ai_server_time_to_first_token_seconds",
        "gen_ai_server_time_per_output_token_seconds",
        "otel_llm_server_token_usage_total",
        "otel_llm_server_requests_total",
    )
    assert (MODEL, TENANT, SCENE, rules.TOKEN_TYPE, rules.OUTCOME) == (
        "gen_ai_request_model",
        "tenant_id",
        "tenant_scene",
        "gen_ai_token_type",
        "otel_llm_request_outcome",
    )
    groups = rules.rules()["groups"]
    assert [len(g["rules"]) for g in groups] == [N_RECORDING, N_ALERTING]
    assert [r["alert"] for r in groups[1]["rules"]] == list(rules.ALERTS)
    for r in groups[1]["rules"]:
        assert r["for"] and r["labels"]["severity"] in ("info", "warning", "critical")
        assert set(r["annotations"]) == {"summary", "description", "runbook_url"} and all(r["annotations"].values())
        assert r["annotations"]["runbook_url"] == f"{promql.RUNBOOK_URL}#alert-{r['alert'].lower()}"


def github_anchor(heading: str) -> str:
    """The id GitHub gives a Markdown heading: lower case, punctuation but - and _ dropped, spaces -> -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_github_anchor():
    assert github_anchor("Alert: LLMQueueTooLong") == "alert-llmqueuetoolong"
    assert github_anchor("`otel-llm report`") == "otel-llm-report"


def test_every_runbook_is_a_heading_of_the_readme():
    text = (ROOT / "README.md").read_text()
    alerts_section = text[text.index("\n## Alerts\n") :]
    anchors = {github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", alerts_section, re.M)}
    for alert in rules.alerts():
        assert alert.runbook_url.startswith(promql.RUNBOOK_URL + "#")
        assert alert.runbook_url.split("#")[1] in anchors, alert.name
    for name in (
        budgets.ALERT_NEAR,
        budgets.ALERT_OVER,
        budgets.ALERT_UNWATCHED,
        budgets.ALERT_TRACKER_BEHIND,
    ):  # otel-llm budget-rules' alerts
        assert promql.runbook_anchor(name) in anchors, name
    # the options a "Tune:" line names are `otel-llm rules` options
    tuned = re.findall(r"`(--[a-z-]+)`", " ".join(re.findall(r"Tune: ([^.]+)", alerts_section)))
    assert tuned and set(tuned) <= {rules.option(f) for f in rules.Params.__dataclass_fields__}


def vllm_missing(names) -> list[str]:
    """The vLLM metric names among `names` that the installed vLLM does not define (its
    vllm/v1/metrics/loggers.py, read, not imported: importing vLLM takes seconds). A counter's name
    is defined without its `_total`."""
    spec = importlib.util.find_spec("vllm")
    source = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    return [n for n in names if f'"{n.removesuffix("_total")}"' not in source]


def test_vllm_names_exist_in_the_installed_vllm():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    assert vllm_missing(semconv.VLLM_PROMETHEUS_METRICS) == []
    assert vllm_missing(["vllm:no_such_metric_total"]) == ["vllm:no_such_metric_total"]


def test_every_metric_a_rule_reads_is_emitted_or_recorded():
    assert rules.problems() == []
    data = rules.rules()
    data["groups"][1]["rules"][1]["expr"] = "vllm:num_requests_wating > 50 or otel_llm_made_up_total > 0"
    data["groups"][0]["rules"].pop(0)  # otel_llm:prefix_cache_hit_ratio:rate5m is no longer recorded
    data["groups"][1]["rules"].append({"alert": "X", "expr": f"{rules.HIT_RATIO} < 0.1"})
    assert rules.problems(data) == [
        "rule LLMQueueTooLong reads otel_llm_made_up_total, which nothing emits",
        "rule LLMQueueTooLong reads vllm:num_requests_wating, which nothing emits",
        f"rule X reads {rules.HIT_RATIO}, which nothing emits",
    ]
    # a histogram is read through its series, not its own name
    data = {"groups": [{"rules": [{"record": "r", "expr": f"rate({rules.TTFT}[5m]) + rate({rules.TTFT}_sum[5m])"}]}]}
    assert rules.problems(data) == [f"rule r reads {rules.TTFT}, which nothing emits"]


def test_committed_file_is_what_the_generator_prints():
    assert RULES_FILE.read_text() == rules.render(), "stale: run `make generate`"
    assert yaml.safe_load(RULES_FILE.read_text()) == rules.rules()


def otel_llm(*args, cwd):
    return subprocess.run([sys.executable, "-m", "otel_llm.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_rules_command(tmp_path):
    printed = otel_llm("rules", cwd=tmp_path)  # no repository paths: runs anywhere
    assert printed.returncode == 0 and printed.stdout == rules.render(), printed.stderr
    # parameters: the file says how it was made
    out = tmp_path / "sub" / "rules.yml"
    made = otel_llm("rules", "--out", str(out), "--max-model-len", "4096", "--queue-length", "20", cwd=tmp_path)
    assert made.returncode == 0 and made.stdout == "", made.stderr
    text = out.read_text()
    assert text == rules.render(rules.Params(max_model_len=4096, queue_length=20))
    assert text.startswith("# generated by `otel-llm rules --queue-length 20 --max-model-len 4096`")
    assert 'le=~"3686(\\\\.0)?"' in text and "vllm:num_requests_waiting > 20" in text


def test_rules_command_objective_watch_list_and_stall_window(tmp_path):
    made = otel_llm(
        "rules",
        "--ttft-slo-seconds",
        "1",
        "--ttft-slo-ratio",
        "0.999",
        "--watch-tenants",
        "acme,b.c",
        "--stall-seconds",
        "90",
        cwd=tmp_path,
    )
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith(
        "# generated by `otel-llm rules --watch-tenants acme,b.c --stall-seconds 90 "
        "--ttft-slo-seconds 1.0 --ttft-slo-ratio 0.999`"
    )
    # a whole bound as either exporter writes it; the budget is 0.1 %; tenant ids as literal regexes
    assert '_bucket{le=~"1(\\\\.0)?"}[5m]' in made.stdout and "slo_miss_ratio_rate1h > 0.0144 and" in made.stdout
    assert '{tenant_id=~"acme|b\\\\.c"}' in made.stdout and "increase(vllm:generation_tokens_total[90s])" in made.stdout
    assert yaml.safe_load(made.stdout) == rules.rules(
        rules.Params(ttft_slo_seconds=1.0, ttft_slo_ratio=0.999, watch_tenants="acme,b.c", stall_seconds=90)
    )
    # an objective between two buckets cannot be read from the histogram
    refused = otel_llm("rules", "--ttft-slo-seconds", "2", "--out", str(tmp_path / "r.yml"), cwd=tmp_path)
    assert refused.returncode == 2 and not (tmp_path / "r.yml").exists()
    assert refused.stderr.startswith(
        "otel-llm rules: ttft_slo_seconds 2 is not a bucket bound of the time to first "
        "token histogram: one of 0.001, 0.005,"
    )
    for bad in ({"ttft_slo_ratio": 1.0}, {"throughput_drop_ratio": 0.0}):
        with pytest.raises(ValueError, match="must be between 0 and 1"):
            rules.Params(**bad)


@pytest.mark.parametrize(
    "value",
    [
        "plain",
        "it's",
        "yes",
        "No",
        "a: b",
        "a #b",
        "x:",
        " lead",
        "trail ",
        "{{ $v }}",
        "'q'",
        '"dq" \\ ',
        "tab\there",
        "new\nline",
        "日本語",
        "1m",
        "0.5",
        "",
        "-",
        "~",
        "null",
        "@at",
        "%p",
        "[x]",
        "*star",
        "&a",
        "!t",
        "|",
        ">",
        "?",
        "<<",
    ],
)
def test_yaml_text_reads_back_equal(value):
    data = {"groups": [{"name": value, "rules": [{"labels": {"k": value}, "annotations": {}}], "empty": []}]}
    assert yaml.safe_load(promql.yaml_text(data)) == data


@needs_promtool
def test_promtool_check_rules():
    check = subprocess.run([PROMTOOL, "check", "rules", str(RULES_FILE)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {N_RECORDING + N_ALERTING} rules found" in check.stdout


def series(metric, labels, values):
    return {"series": metric + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


def ours(model, **extra):
    return {OPERATION: "chat", MODEL: model, TENANT: "acme", SCENE: "support", **extra}


def tokens(model, token_type, values, tenant="acme"):
    return series(rules.TOKENS, {**ours(model), TENANT: tenant, rules.TOKEN_TYPE: token_type}, values)


def fired(labels, summary, severity):
    return {"exp_labels": {**labels, "severity": severity}, "exp_annotations": {"summary": summary}}


def ttft_test():
    # model "slow": 10 requests a minute between 2.5 s and 5 s (P95 4.875 s interpolated);
    # model "fast": 10 a minute between 0.25 s and 0.5 s (P95 0.4875 s)
    def buckets(model, counts):
        return [
            series(rules.TTFT + "_bucket", {**ours(model), "le": le}, f"0+{n}x30")
            for le, n in zip(("0.25", "0.5", "2.5", "5.0", "+Inf"), counts)
        ]

    slow = {MODEL: "slow", "quantile": "0.95"}
    return {
        "interval": "1m",
        "input_series": [*buckets("slow", (0, 0, 0, 10, 10)), *buckets("fast", (0, 10, 10, 10, 10))],
        "alert_rule_test": [
            {"eval_time": "4m", "alertname": "LLMTimeToFirstTokenHigh", "exp_alerts": []},  # pending
            {
                "eval_time": "10m",
                "alertname": "LLMTimeToFirstTokenHigh",
                "exp_alerts": [
                    fired(slow, "P95 time to first token of model slow is 4.875s (over 3 s for 5 min)", "warning")
                ],
            },
        ],
        # promtool 2.42 compares values exactly: round away the float noise (in 10^-4 s)
        "promql_expr_test": [
            {
                "expr": f'round(10000 * {rules.quantile_rule(rules.TTFT)}{{quantile="0.95"}})',
                "eval_time": "10m",
                "exp_samples": [
                    {"labels": f'{{{MODEL}="fast",quantile="0.95"}}', "value": 4875},
                    {"labels": f'{{{MODEL}="slow",quantile="0.95"}}', "value": 48750},
                ],
            }
        ],
    }


def vllm_gauges_test():
    other = {**VLLM, "instance": "vllm-1:8000"}
    return {
        "interval": "1m",
        "input_series": [
            series(semconv.VLLM_METRIC_WAITING, VLLM, "60x20"),
            series(semconv.VLLM_METRIC_WAITING, other, "50x20"),
            series(semconv.VLLM_METRIC_KV_CACHE_USAGE, VLLM, "0.97x20"),
            series(semconv.VLLM_METRIC_KV_CACHE_USAGE, other, "0.95x20"),
            # vllm-0 preempts one request at minute 6; vllm-1 never
            series(semconv.VLLM_METRIC_PREEMPTIONS, VLLM, "0x5 1x14"),
            series(semconv.VLLM_METRIC_PREEMPTIONS, other, "0x20"),
        ],
        "alert_rule_test": [
            {"eval_time": "4m", "alertname": "LLMQueueTooLong", "exp_alerts": []},
            {
                "eval_time": "10m",
                "alertname": "LLMQueueTooLong",
                "exp_alerts": [
                    fired(VLLM, "60 requests waiting in vLLM vllm-0:8000 (model llama, over 50 for 5 min)", "warning")
                ],
            },
            {"eval_time": "4m", "alertname": "LLMKVCacheNearlyFull", "exp_alerts": []},
            {
                "eval_time": "10m",
                "alertname": "LLMKVCacheNearlyFull",
                "exp_alerts": [
                    fired(
                        VLLM, "KV cache of vLLM vllm-0:8000 (model llama) is 97% full (over 95% for 5 min)", "warning"
                    )
                ],
            },
            {"eval_time": "5m", "alertname": "LLMPreemptions", "exp_alerts": []},
            {
                "eval_time": "8m",
                "alertname": "LLMPreemptions",
                "exp_alerts": [
                    fired(
                        VLLM,
                        "vLLM vllm-0:8000 (model llama) preempted 1 requests in the last 5 min (KV cache too small)",
                        "warning",
                    )
                ],
            },
            {"eval_time": "15m", "alertname": "LLMPreemptions", "exp_alerts": []},  # none since
        ],
    }


def error_rate_test(errors_per_minute):
    # 90 finished and 10 aborted requests a minute; errors start after minute 10
    return {
        "interval": "1m",
        "input_series": [
            series(rules.REQUESTS, {**ours("llama"), rules.OUTCOME: semconv.OUTCOME_FINISHED}, "0+90x30"),
            series(rules.REQUESTS, {**ours("llama"), rules.OUTCOME: semconv.OUTCOME_ABORTED}, "0+10x30"),
            series(
                rules.REQUESTS,
                {**ours("bad-model"), rules.OUTCOME: semconv.OUTCOME_ERROR},
                f"0x10 {errors_per_minute}+{errors_per_minute}x20",
            ),
        ],
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": "LLMErrorRateHigh", "exp_alerts": []},
            {
                "eval_time": "25m",
                "alertname": "LLMErrorRateHigh",
                "exp_alerts": []
                if errors_per_minute < 10
                else [fired({}, "9.091% of requests end in an error (over 5% for 5 min)", "critical")],
            },
        ],
    }


def token_spike_test():
    # every 15 min: 100 input (60 of them cached) and 100 output tokens for 175 h (7.3 days), then
    # 500 input: the last hour's 600 tokens per 15 min against a same-hour mean of 200
    step = 15 * 60
    return {
        "interval": "15m",
        "input_series": [
            tokens("llama", "input", "0+100x700 70500+500x20"),
            tokens("llama", "cached_input", "0+60x720"),
            tokens("llama", "output", "0+100x720"),
        ],
        "alert_rule_test": [
            {"eval_time": "174h", "alertname": "LLMTokenUsageSpike", "exp_alerts": []},
            {"eval_time": "175h35m", "alertname": "LLMTokenUsageSpike", "exp_alerts": []},  # pending
            {
                "eval_time": "177h",
                "alertname": "LLMTokenUsageSpike",
                "exp_alerts": [
                    fired(
                        {},
                        "666.7m tokens/s (input + output) in the last hour, over 200% of this hour's "
                        "mean of the previous 7 days",
                        "warning",
                    )
                ],
            },
        ],
        "promql_expr_test": [
            {
                "expr": rules.TOKENS_RATE_1H,
                "eval_time": "174h",
                "exp_samples": [{"labels": rules.TOKENS_RATE_1H, "value": 200 / step}],
            }
        ],
    }


def near_max_len_test():
    # buckets as prometheus_client writes them: one request a minute over 7372 prompt tokens from
    # minute 11 on for model "llama"; "small" never comes near
    def hist(metric, model, le_counts):
        return [
            series(metric + "_bucket", {**VLLM, semconv.VLLM_LABEL_MODEL: model, "le": le}, values)
            for le, values in le_counts
        ]

    return {
        "interval": "1m",
        "input_series": [
            *hist(
                semconv.VLLM_METRIC_PROMPT_TOKENS,
                "llama",
                [("5000.0", "0+5x20"), ("7372.0", "0+5x20"), ("8192.0", "0+5x10 55+6x9"), ("+Inf", "0+5x10 55+6x9")],
            ),
            *hist(semconv.VLLM_METRIC_GENERATION_TOKENS, "llama", [("7372.0", "0+5x20"), ("+Inf", "0+5x20")]),
            *hist(semconv.VLLM_METRIC_PROMPT_TOKENS, "small", [("7372.0", "0+5x20"), ("+Inf", "0+5x20")]),
            *hist(semconv.VLLM_METRIC_GENERATION_TOKENS, "small", [("7372.0", "0+5x20"), ("+Inf", "0+5x20")]),
        ],
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": "LLMRequestNearMaxModelLen", "exp_alerts": []},
            {
                "eval_time": "16m",
                "alertname": "LLMRequestNearMaxModelLen",
                "exp_alerts": [
                    fired(
                        {semconv.VLLM_LABEL_MODEL: "llama"},
                        "5 requests to model llama in the last 5 min had a prompt or "
                        "output over 7372 tokens (90% of max model length 8192)",
                        "info",
                    )
                ],
            },
        ],
    }


def prefix_cache_test():
    # per minute: "low" 1000 input / 100 cached (10 %), "high" 1000 / 925, "idle" 50 / 0 (under 1 token/s)
    inputs = {"low": (1000, 100), "high": (1000, 925), "idle": (50, 0)}
    by_model = rules.HIT_RATIO_BY_MODEL
    return {
        "interval": "1m",
        "input_series": [
            tokens(m, t, f"0+{n}x40") for m, counts in inputs.items() for t, n in zip(("input", "cached_input"), counts)
        ],
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": "LLMPrefixCacheHitRateLow", "exp_alerts": []},  # pending
            {
                "eval_time": "20m",
                "alertname": "LLMPrefixCacheHitRateLow",
                "exp_alerts": [
                    fired(
                        {MODEL: "low"},
                        "prefix cache hit rate of model low is 10% (under 20% for 15 min with over 1 input tokens/s)",
                        "info",
                    )
                ],
            },
        ],
        "promql_expr_test": [
            {
                "expr": rules.HIT_RATIO,
                "eval_time": "20m",
                "exp_samples": [{"labels": rules.HIT_RATIO, "value": 0.5}],
            },  # 1025 / 2050
            {
                "expr": f"round(1000 * {by_model})",
                "eval_time": "20m",
                "exp_samples": [  # per mille
                    {"labels": f'{{{MODEL}="high"}}', "value": 925},
                    {"labels": f'{{{MODEL}="idle"}}', "value": 0},
                    {"labels": f'{{{MODEL}="low"}}', "value": 100},
                ],
            },
            {
                "expr": f'round(60 * {rules.TOKENS_BY_TENANT}{{{rules.TOKEN_TYPE}="cached_input"}})',  # a minute
                "eval_time": "20m",
                "exp_samples": [{"labels": f'{{{TENANT}="acme",{rules.TOKEN_TYPE}="cached_input"}}', "value": 1025}],
            },
        ],
    }


def telemetry_dropped_test():
    # vllm-0 drops 3 requests' telemetry a minute from minute 10 (its export process stalled); vllm-1 none
    def dropped(instance, error_type, values):
        return series(rules.EXPORT_DROPPED, {"instance": instance, "job": "vllm", rules.ERROR_TYPE: error_type}, values)

    return {
        "interval": "1m",
        "input_series": [
            dropped("vllm-0:8000", semconv.EXPORT_DROP_QUEUE_FULL, "0x10 3+3x20"),
            dropped("vllm-1:8000", semconv.EXPORT_DROP_EXPORTER_DOWN, "0x30"),
        ],
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": "LLMTelemetryDropped", "exp_alerts": []},
            {"eval_time": "13m", "alertname": "LLMTelemetryDropped", "exp_alerts": []},  # pending
            {
                "eval_time": "20m",
                "alertname": "LLMTelemetryDropped",
                "exp_alerts": [
                    fired(
                        {"instance": "vllm-0:8000", rules.ERROR_TYPE: semconv.EXPORT_DROP_QUEUE_FULL},
                        "vllm-0:8000 dropped the telemetry of 15 requests in the last 5 min (queue_full)",
                        "warning",
                    )
                ],
            },
        ],
    }


def instrumentation_failing_test():
    # vllm-0: DeferredSpan.end failed once at minute 10, never again; vllm-1: its server request hook
    # fails twice a minute from minute 20
    def failures(instance, point, values):
        return series(rules.FAILURES, {"instance": instance, "job": "vllm", rules.FAILURE_POINT: point}, values)

    def failing(instance, point):
        return fired(
            {"instance": instance, rules.FAILURE_POINT: point},
            f"otel-llm's {point} failed on {instance} in the last 15 min",
            "warning",
        )

    return {
        "interval": "1m",
        "input_series": [
            failures("vllm-0:8000", "DeferredSpan.end", "_x10 1x30"),
            failures("vllm-1:8000", "server request hook", "_x20 2+2x20"),
        ],
        "alert_rule_test": [
            {"eval_time": "9m", "alertname": "LLMInstrumentationFailing", "exp_alerts": []},
            {
                "eval_time": "12m",
                "alertname": "LLMInstrumentationFailing",
                "exp_alerts": [  # its first failure
                    failing("vllm-0:8000", "DeferredSpan.end")
                ],
            },
            {
                "eval_time": "35m",
                "alertname": "LLMInstrumentationFailing",
                "exp_alerts": [  # vllm-0's is old
                    failing("vllm-1:8000", "server request hook")
                ],
            },
        ],
    }


def counter(per_minute) -> str:
    """promtool values of a counter from 0 at minute 0 that grows by per_minute[m] from minute m to m + 1."""
    total, values = 0, ["0"]
    for increase in per_minute:
        total += increase
        values.append(str(round(total, 6)))
    return " ".join(values)


# (tenant, scene) -> minute -> (requests, input tokens per request, output tokens per request) in that
# minute; everything changes at minute 90: the tenants' first day, their baseline the 30 min before the
# last hour
CHANGE, MINUTES = 90, 180
TENANTS = {
    ("acme", "support"): lambda m: (20, 800, 200),  # steady: never flagged
    ("loop", "ci"): lambda m: (20 if m < CHANGE else 300, 800, 200),  # a test script starts looping
    ("acme", "rag"): lambda m: (10, 800 if m < CHANGE else 2500, 100),  # its prompts grow (issue's example)
    ("beta", "chat"): lambda m: (5, 300, 100 if m < CHANGE else 400),  # 4x output; tokens/request 1.75x only
    ("tiny", "cron"): lambda m: (0.2 if m < CHANGE else 1, 500, 100),  # 5x, but 5 requests in 5 min
    ("night", "batch"): lambda m: (20 if m < 30 or m >= 120 else 0, 800, 200),  # idle for 1.5 h, then back
}


def tenant_series():
    out = []
    for (tenant, scene), traffic in TENANTS.items():
        minutes = [traffic(m) for m in range(MINUTES)]
        labels = {**ours("llama"), TENANT: tenant, SCENE: scene}
        out.append(
            series(
                rules.REQUESTS, {**labels, rules.OUTCOME: semconv.OUTCOME_FINISHED}, counter(n for n, _, _ in minutes)
            )
        )
        # cached input (half the input) is part of input: the tokens rule must not add it again
        for token_type, per_minute in (
            (semconv.TOKEN_TYPE_INPUT, [n * i for n, i, _ in minutes]),
            (semconv.TOKEN_TYPE_CACHED_INPUT, [n * i / 2 for n, i, _ in minutes]),
            (semconv.TOKEN_TYPE_OUTPUT, [n * o for n, _, o in minutes]),
        ):
            out.append(series(rules.TOKENS, {**labels, rules.TOKEN_TYPE: token_type}, counter(per_minute)))
    return out


def tenant(name, scene):
    return {TENANT: name, SCENE: scene}


# Detection time the README's runbooks promise: the 5-min rate crosses the factor within 5 min of a
# step change of twice the factor or more, then `for` 10 min, then the next evaluation
DETECTED = CHANGE + 16


def anomaly_test():
    rate, size, length = "LLMTenantRequestRateHigh", "LLMTenantTokensPerRequestHigh", "LLMTenantOutputLengthHigh"
    req, tok = rules.TENANT_REQUESTS, rules.TENANT_TOKENS
    return {
        "interval": "1m",
        "input_series": tenant_series(),
        "alert_rule_test": [
            *({"eval_time": f"{CHANGE}m", "alertname": a, "exp_alerts": []} for a in (rate, size, length)),
            # pending, not yet firing
            *({"eval_time": f"{CHANGE + 10}m", "alertname": a, "exp_alerts": []} for a in (rate, size, length)),
            {
                "eval_time": f"{DETECTED}m",
                "alertname": rate,
                "exp_alerts": [
                    fired(
                        tenant("loop", "ci"),
                        "tenant loop (scene ci) sends 15.68x its usual requests/s "
                        "(over 3x its mean while active in the 24 h before the last hour, for 10 min)",
                        "warning",
                    )
                ],
            },
            {
                "eval_time": f"{DETECTED}m",
                "alertname": size,
                "exp_alerts": [
                    fired(
                        tenant("acme", "rag"),
                        "tenant acme (scene rag) uses 2.889x its usual tokens per request "
                        "(input + output; over 2x its mean in the 24 h before the last hour, for 10 min)",
                        "warning",
                    )
                ],
            },
            {
                "eval_time": f"{DETECTED}m",
                "alertname": length,
                "exp_alerts": [
                    fired(
                        tenant("beta", "chat"),
                        "tenant beta (scene chat) gets 4x its usual output tokens "
                        "per request (over 2x its mean in the 24 h before the last hour, for 10 min)",
                        "warning",
                    )
                ],
            },
            # still flagged an hour on; the night batch is back at its usual rate (its idle time is no
            # part of its baseline)
            {
                "eval_time": f"{CHANGE + 60}m",
                "alertname": rate,
                "exp_alerts": [
                    fired(
                        tenant("loop", "ci"),
                        "tenant loop (scene ci) sends 15.34x its usual requests/s "
                        "(over 3x its mean while active in the 24 h before the last hour, for 10 min)",
                        "warning",
                    )
                ],
            },
        ],
        "promql_expr_test": [  # per minute; an idle tenant has no recorded rate
            {
                "expr": f"round(60 * {req})",
                "eval_time": "50m",
                "exp_samples": [
                    {"labels": f'{{{TENANT}="{t}",{SCENE}="{s}"}}', "value": n}
                    for (t, s), n in (
                        (("acme", "rag"), 10),
                        (("acme", "support"), 20),
                        (("beta", "chat"), 5),
                        (("loop", "ci"), 20),
                        (("tiny", "cron"), 0),
                    )
                ],
            },
            {
                "expr": f'round(60 * {tok}{{{TENANT}="acme"}})',
                "eval_time": "50m",
                "exp_samples": [
                    {"labels": f'{{{TENANT}="acme",{SCENE}="{s}",{rules.TOKEN_TYPE}="{t}"}}', "value": n}
                    for s, t, n in (
                        ("rag", "input", 8000),
                        ("rag", "output", 1000),
                        ("support", "input", 16000),
                        ("support", "output", 4000),
                    )
                ],
            },
        ],
    }


def stall_test():
    # every 15 s: vllm-0 runs 4 requests and stops generating at minute 10 until minute 20; vllm-1 is
    # idle (nothing running, nothing generated); vllm-2 generates throughout
    def instance(name, running, generated):
        labels = {**VLLM, "instance": name}
        return [
            series(semconv.VLLM_METRIC_RUNNING, labels, running),
            series(semconv.VLLM_METRIC_GENERATION_TOKENS_TOTAL, labels, generated),
            series(semconv.VLLM_METRIC_PROMPT_TOKENS_TOTAL, labels, generated),
        ]

    stalled = {**VLLM, "instance": "vllm-0:8000"}
    return {
        "interval": "15s",
        "input_series": [
            *instance("vllm-0:8000", "4x160", "0+100x40 4000x40 4100+100x79"),
            *instance("vllm-1:8000", "0x160", "500x160"),
            *instance("vllm-2:8000", "3x160", "0+100x160"),
        ],
        "alert_rule_test": [
            {"eval_time": "11m", "alertname": "LLMEngineStalled", "exp_alerts": []},
            {"eval_time": "12m", "alertname": "LLMEngineStalled", "exp_alerts": []},  # pending
            {
                "eval_time": "14m",
                "alertname": "LLMEngineStalled",
                "exp_alerts": [
                    fired(
                        stalled,
                        "4 requests are running in vLLM vllm-0:8000 (model llama), which computed no token in 2m",
                        "critical",
                    )
                ],
            },
            {"eval_time": "25m", "alertname": "LLMEngineStalled", "exp_alerts": []},  # generating again
        ],
    }


def instance_down_test():
    # vllm-0's scrapes fail from minute 11 (its series go stale); vllm-1 stays
    return {
        "interval": "1m",
        "input_series": [
            series(semconv.VLLM_METRIC_RUNNING, VLLM, "1x10 stale"),
            series(semconv.VLLM_METRIC_RUNNING, {**VLLM, "instance": "vllm-1:8000"}, "1x90"),
        ],
        "alert_rule_test": [
            {"eval_time": "15m", "alertname": "LLMInstanceDown", "exp_alerts": []},  # pending
            {
                "eval_time": "17m",
                "alertname": "LLMInstanceDown",
                "exp_alerts": [
                    fired(
                        {"instance": "vllm-0:8000", "job": "vllm"},
                        "vLLM vllm-0:8000 (job vllm) served no metrics for 5 min",
                        "critical",
                    )
                ],
            },
            {"eval_time": "75m", "alertname": "LLMInstanceDown", "exp_alerts": []},  # forgotten after 1 h
        ],
    }


def throughput_test():
    # generation tokens a minute: vllm-0 1000, down to 300 from minute 90; vllm-1 1000 throughout;
    # vllm-2 30 (0.5 tokens/s, under the floor), then nothing
    def generated(name, per_minute):
        return series(semconv.VLLM_METRIC_GENERATION_TOKENS_TOTAL, {**VLLM, "instance": name}, counter(per_minute))

    dropped = {"instance": "vllm-0:8000", "job": "vllm", semconv.VLLM_LABEL_MODEL: "llama"}
    return {
        "interval": "1m",
        "input_series": [
            generated("vllm-0:8000", [1000 if m < 90 else 300 for m in range(130)]),
            generated("vllm-1:8000", [1000] * 130),
            generated("vllm-2:8000", [30 if m < 90 else 0 for m in range(130)]),
        ],
        "alert_rule_test": [
            {"eval_time": "90m", "alertname": "LLMThroughputDropped", "exp_alerts": []},
            {"eval_time": "105m", "alertname": "LLMThroughputDropped", "exp_alerts": []},  # pending
            {
                "eval_time": "110m",
                "alertname": "LLMThroughputDropped",
                "exp_alerts": [
                    fired(
                        dropped,
                        "vLLM vllm-0:8000 (model llama) generates 5 tokens/s, under 50% of its mean of "
                        "the hour before (for 10 min)",
                        "warning",
                    )
                ],
            },
        ],
    }


def ttft_burn_test():
    # 100 requests a minute per model; share over 2.5 s to the first token: "down" none, then all from
    # minute 60 (an outage); "degraded" 5 % (5x the 1 % budget); "healthy" 0.5 %
    over = {"down": lambda m: 0 if m < 60 else 100, "degraded": lambda m: 5, "healthy": lambda m: 0.5}

    def buckets(model, misses):
        within = counter(100 - misses(m) for m in range(180))
        return [
            series(rules.TTFT + "_bucket", {**ours(model), "le": "2.5"}, within),
            series(rules.TTFT + "_count", ours(model), counter([100] * 180)),
        ]

    def burning(model, value):
        return fired(
            {MODEL: model},
            f"{value} of requests to model {model} waited over 2.5 s for their first token "
            "(objective: 99% within 2.5 s)",
            "critical" if model == "down" else "warning",
        )

    fast, slow = "LLMTimeToFirstTokenBudgetBurnFast", "LLMTimeToFirstTokenBudgetBurnSlow"
    return {
        "interval": "1m",
        "input_series": [s for model, misses in over.items() for s in buckets(model, misses)],
        "alert_rule_test": [
            {"eval_time": "15m", "alertname": slow, "exp_alerts": []},  # pending
            {"eval_time": "30m", "alertname": slow, "exp_alerts": [burning("degraded", "5%")]},
            {"eval_time": "30m", "alertname": fast, "exp_alerts": []},
            {"eval_time": "65m", "alertname": fast, "exp_alerts": []},  # 1 h window not over 14.4x yet
            {
                "eval_time": "75m",
                "alertname": fast,
                "exp_alerts": [{**burning("down", "25%"), "exp_labels": {MODEL: "down", "severity": "critical"}}],
            },
        ],
        "promql_expr_test": [
            {
                "expr": f"round(1000 * {rules.slo_miss_rule('5m')})",
                "eval_time": "30m",
                "exp_samples": [
                    {"labels": f'{{{MODEL}="{m}"}}', "value": v}
                    for m, v in (("degraded", 50), ("down", 0), ("healthy", 5))
                ],
            }
        ],
    }


@needs_promtool
def test_promtool_unit_tests_fire_and_do_not_fire_each_alert(tmp_path):
    shutil.copy(RULES_FILE, tmp_path / "rules.yml")
    # the spike test spans 8 days: evaluated every 5 min (every minute would take promtool seconds)
    files = {
        "tests.yml": (
            "1m",
            [
                ttft_test(),
                vllm_gauges_test(),
                error_rate_test(10),
                error_rate_test(4),
                near_max_len_test(),
                prefix_cache_test(),
                telemetry_dropped_test(),
                instrumentation_failing_test(),
                anomaly_test(),
                stall_test(),
                instance_down_test(),
                throughput_test(),
                ttft_burn_test(),
            ],
        ),
        "tests-days.yml": ("5m", [token_spike_test()]),
    }
    every = [t for _, tests in files.values() for test in tests for t in test["alert_rule_test"]]
    assert {t["alertname"] for t in every if t["exp_alerts"]} == set(rules.ALERTS)  # each fires
    assert {t["alertname"] for t in every if not t["exp_alerts"]} == set(rules.ALERTS)  # and does not
    alerts = {a.name: a for a in rules.alerts()}
    for t in every:  # the fixed annotations of each alert
        for expected in t["exp_alerts"]:
            alert = alerts[t["alertname"]]
            expected["exp_annotations"].update(description=alert.description, runbook_url=alert.runbook_url)
    promtool_test(tmp_path, files)


def promtool_test(directory, files, rule_file="rules.yml"):
    """`promtool test rules` of {test file name: (evaluation interval, tests)} on the rule file in directory."""
    for name, (interval, tests) in files.items():
        # promtool evaluates groups in random order unless told: alerts would read this or last minute's
        # recording rules
        (directory / name).write_text(
            yaml.safe_dump(
                {
                    "rule_files": [rule_file],
                    "evaluation_interval": interval,
                    "group_eval_order": [g["name"] for g in rules.rules()["groups"]],
                    "tests": tests,
                },
                sort_keys=False,
                width=1000,
            )
        )
    result = subprocess.run(
        [PROMTOOL, "test", "rules", *files], cwd=directory, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_watch_tenants_restricts_the_anomaly_rules(tmp_path):
    """With --watch-tenants acme,beta the looping tenant of anomaly_test is not covered; acme and beta are."""
    params = rules.Params(watch_tenants="acme, beta")
    (tmp_path / "watched.yml").write_text(rules.render(params))
    test = anomaly_test()
    alerts = {a.name: a for a in rules.alerts(params)}
    for t in test["alert_rule_test"]:
        t["exp_alerts"] = [e for e in t["exp_alerts"] if e["exp_labels"][TENANT] != "loop"]
        for e in t["exp_alerts"]:
            e["exp_annotations"].update(
                description=alerts[t["alertname"]].description, runbook_url=alerts[t["alertname"]].runbook_url
            )
    assert [t["alertname"] for t in test["alert_rule_test"] if t["exp_alerts"]] == [
        "LLMTenantTokensPerRequestHigh",
        "LLMTenantOutputLengthHigh",
    ]
    test["promql_expr_test"][0]["exp_samples"] = [
        s for s in test["promql_expr_test"][0]["exp_samples"] if '"acme"' in s["labels"] or '"beta"' in s["labels"]
    ]
    promtool_test(tmp_path, {"tests.yml": ("1m", [test])}, rule_file="watched.yml")
