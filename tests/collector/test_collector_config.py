"""Static checks of the collector configs in collector-config/ (no otelcol binary exists here).

- every YAML under collector-config/ (except prometheus/) parses and is wired: each component a
  pipeline references is defined, each defined one is used, connectors are exporter in one
  pipeline and receiver in another, with the signals their metadata allows;
- component types exist in otelcol-contrib (schemas in tests/fixtures/collector_schemas, else the contrib
  component list), and the names are the current ones for the stated range (v0.144+);
- component config keys exist in the component's upstream config schema (recursively, following
  $ref / allOf), tail_sampling policy blocks included;
- every attribute a tail_sampling policy, the span_metrics dimensions or the noise filter reads is
  one otel-llm emits (a name in otel_llm/semconv.py; HTTP names from the OTel HTTP semconv), with
  the type the policy needs (numeric_attribute: int, boolean_attribute: bool, OTTL literal of the
  attribute's type);
- a small evaluator applies the policies to synthetic traces: each special case is kept by its
  policy, a normal request only by the probabilistic baseline. The real processor decides; this
  only checks our policy logic against our attribute names.
- the usage ledger (billing) pipeline: never sampled, never batched before it is on disk, straight to
  ClickHouse (the agent too; the samplers have none); the spool receiver keeps read offsets in
  file_storage, maps the spool-only fields (semconv.USAGE_TIME, USAGE_TRACE_ID, USAGE_SPAN_ID) onto
  the record's timestamp and trace context and removes them, and names only semconv fields; OTLP
  logs pass a filter that keeps only records with semconv.USAGE_ID. Stanza operators are checked
  against a hand-written allow-list (upstream has no schema for them). A small model of those
  operators turns a spool line written by otel_llm.usage into the OTLP record's attributes, end
  time and span; again, the real receiver decides.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import re
from pathlib import Path

import pytest
import yaml
from collector.validator import (
    BASELINE,
    CONFIG_DIR,
    CONFIG_FILES,
    CONTENT_ATTRIBUTES,
    FILELOG_TYPES,
    SAMPLING_TYPES,
    SCHEMAS,
    SPOOL_ONLY,
    check_all,
    check_components,
    check_content,
    check_other_attributes,
    check_policy_attributes,
    check_usage,
    check_wiring,
    collector_redact,
    confmap_unescape,
    content_transforms,
    ctype,
    duration_seconds,
    filter_drops,
    go_expand,
    go_replace_all,
    keeping_policies,
    load,
    ottl_string,
    parse_field,
    policy_matches,
    re2_problems,
    recorded_policy,
    redaction_rules,
    release,
    run_operators,
    sampled_pipeline,
    synthetic_trace,
    tail_sampling_policies,
    usage_pipelines,
)
from content.redaction_examples import NEGATIVE, POSITIVE
from opentelemetry.metrics import NoOpMeter
from opentelemetry.trace import SpanContext, TraceFlags

from otel_llm import semconv

CASES = {
    "normal": synthetic_trace(),
    "error": synthetic_trace({semconv.ERROR_TYPE: "500"}, status="ERROR", http_status="ERROR"),
    "rejected_4xx": synthetic_trace({semconv.ERROR_TYPE: "400", semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 0}),
    "aborted": synthetic_trace({semconv.VLLM_ABORTED: True, semconv.ERROR_TYPE: semconv.ERROR_CLIENT_ABORTED}),
    "slow": synthetic_trace(duration_ms=45_000),
    "slow_ttft": synthetic_trace({semconv.VLLM_TTFT_SECONDS: 7.5}),
    "big_input": synthetic_trace(
        {semconv.GEN_AI_USAGE_INPUT_TOKENS: 60_000, semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 58_000}
    ),
    "big_output": synthetic_trace({semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 12_000}, duration_ms=25_000),
    "cache_miss": synthetic_trace(
        {semconv.GEN_AI_USAGE_INPUT_TOKENS: 9_000, semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 0}
    ),
}
# case -> the policies that must keep it (besides the baseline)
EXPECTED = {
    "normal": set(),
    "error": {"errors-status", "errors-type"},
    "rejected_4xx": {"errors-type"},
    "aborted": {"aborted", "errors-type"},
    "slow": {"slow-requests"},
    "slow_ttft": {"slow-ttft"},
    "big_input": {"big-input"},
    "big_output": {"big-output"},
    "cache_miss": {"cache-miss-long-prompt"},
}


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


def test_config_files_present():
    names = {p.relative_to(CONFIG_DIR).as_posix() for p in CONFIG_FILES}
    assert {"otelcol.yaml", "agent.yaml", "sampler.yaml"} <= names
    assert SCHEMAS.is_dir(), f"component schemas not found at {SCHEMAS}"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.relative_to(CONFIG_DIR).as_posix())
def test_config_is_valid(path):
    cfg = yaml.safe_load(path.read_text())
    assert isinstance(cfg, dict) and "service" in cfg
    errors = check_all(cfg)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", ["otelcol.yaml", "sampler.yaml"])
def test_span_metrics_before_sampling(name):
    cfg = load(name)
    pipes = cfg["service"]["pipelines"]
    entry = [pid for pid, p in pipes.items() if "otlp" in p["receivers"] and pid.startswith("traces")]
    assert len(entry) == 1
    assert set(pipes[entry[0]]["exporters"]) == {"span_metrics", "forward"}
    assert "tail_sampling" not in pipes[entry[0]].get("processors", [])
    sampled = [pid for pid, p in pipes.items() if "forward" in p["receivers"]]
    assert len(sampled) == 1 and pipes[sampled[0]]["processors"][0] == "tail_sampling"
    assert any(e.startswith("otlp_grpc/") or e.startswith("otlp_http/") for e in pipes[sampled[0]]["exporters"])
    metrics = [p for pid, p in pipes.items() if pid.startswith("metrics") and "span_metrics" in p["receivers"]]
    assert metrics and any(ctype(e) in ("prometheus", "prometheus_remote_write") for e in metrics[0]["exporters"])
    assert cfg["connectors"]["span_metrics"]["exemplars"]["enabled"] is True
    assert cfg["exporters"]["prometheus"]["enable_open_metrics"] is True


def test_sampler_policies_match_all_in_one():
    assert load("sampler.yaml")["processors"]["tail_sampling"] == load("otelcol.yaml")["processors"]["tail_sampling"]


def test_decision_wait_covers_long_streams():
    ts = load("otelcol.yaml")["processors"]["tail_sampling"]
    wait = ts["decision_wait"]
    seconds = int(wait[:-1]) * {"s": 1, "m": 60}[wait[-1]]
    assert seconds >= 300  # > longest streaming request (see comment in the file)
    assert ts["num_traces"] >= ts["expected_new_traces_per_sec"] * seconds


def test_agent_routes_by_trace_id():
    cfg = load("agent.yaml")
    lb = cfg["exporters"]["loadbalancing"]
    assert lb["routing_key"] == "traceID"
    assert set(lb["resolver"]) & {"dns", "static", "k8s"}
    assert "tail_sampling" not in cfg.get("processors", {})
    assert cfg["service"]["pipelines"]["traces"]["exporters"] == ["loadbalancing"]


def test_metrics_pipeline_receives_our_otlp_metrics():
    for name in ("otelcol.yaml", "agent.yaml"):
        pipes = load(name)["service"]["pipelines"]
        assert any("otlp" in p["receivers"] for pid, p in pipes.items() if pid.startswith("metrics")), name


@pytest.mark.parametrize("case", sorted(CASES))
def test_policy_evaluator(case):
    policies = tail_sampling_policies(load("otelcol.yaml"))
    kept_by = keeping_policies(policies, CASES[case])
    assert BASELINE in kept_by  # probabilistic may keep anything
    assert kept_by - {BASELINE} == EXPECTED[case], f"{case}: kept by {sorted(kept_by)}"


def test_every_policy_is_exercised():
    policies = tail_sampling_policies(load("otelcol.yaml"))
    hit = set().union(*(keeping_policies(policies, t) for t in CASES.values()))
    assert hit == {p["name"] for p in policies}


def test_numeric_attribute_ignores_floats():
    """Why TTFT uses OTTL: a numeric_attribute policy on a float attribute never matches."""
    policy = {
        "name": "x",
        "type": "numeric_attribute",
        "numeric_attribute": {"key": semconv.VLLM_TTFT_SECONDS, "min_value": 1, "max_value": 100},
    }
    assert policy_matches(policy, synthetic_trace({semconv.VLLM_TTFT_SECONDS: 7.5})) is False


# ---- negative tests: mutated copies must fail ---------------------------------------------------


@pytest.fixture
def cfg():
    return copy.deepcopy(load("otelcol.yaml"))


def test_negative_dangling_exporter(cfg):
    cfg["service"]["pipelines"]["traces/sampled"]["exporters"].append("otlp_http/missing")
    assert any("'otlp_http/missing' is not defined" in e for e in check_wiring(cfg))


def test_negative_unused_component(cfg):
    cfg["exporters"]["otlp_http/unused"] = {"endpoint": "http://x:4318"}
    assert any("'otlp_http/unused' is defined but not used" in e for e in check_wiring(cfg))


def test_negative_dangling_forward(cfg):
    del cfg["service"]["pipelines"]["traces/sampled"]
    cfg["exporters"].pop("otlp_grpc/tempo")
    cfg["processors"].pop("tail_sampling")
    errors = check_wiring(cfg)
    assert any("connector 'forward' must be an exporter in one pipeline and a receiver" in e for e in errors)


def test_negative_connector_signal_mismatch(cfg):
    # span_metrics makes metrics: feeding it into a traces pipeline is wrong
    cfg["service"]["pipelines"]["traces/sampled"]["receivers"].append("span_metrics")
    assert any("traces_to_traces" in e for e in check_wiring(cfg))


def test_negative_unknown_attribute(cfg):
    policies = tail_sampling_policies(cfg)
    policies.append(
        {
            "name": "bogus",
            "type": "numeric_attribute",
            "numeric_attribute": {"key": "gen_ai.usage.prompt_tokens", "min_value": 1, "max_value": 2},
        }
    )
    policies.append(
        {"name": "bogus-ottl", "type": "ottl_condition", "ottl_condition": {"span": ['attributes["vllm.ttft"] > 1.0']}}
    )
    errors = check_policy_attributes(cfg)
    assert any("'gen_ai.usage.prompt_tokens' is not a name in otel_llm/semconv.py" in e for e in errors)
    assert any("'vllm.ttft' is not a name" in e for e in errors)


def test_negative_wrong_attribute_type(cfg):
    policies = tail_sampling_policies(cfg)
    policies.append(
        {
            "name": "ttft-numeric",
            "type": "numeric_attribute",
            "numeric_attribute": {"key": semconv.VLLM_TTFT_SECONDS, "min_value": 5, "max_value": 100},
        }
    )
    policies.append(
        {
            "name": "ttft-int-literal",
            "type": "ottl_condition",
            "ottl_condition": {"span": [f'attributes["{semconv.VLLM_TTFT_SECONDS}"] > 5']},
        }
    )
    policies.append(
        {
            "name": "aborted-string",
            "type": "boolean_attribute",
            "boolean_attribute": {"key": semconv.VLLM_ABORTED, "value": "true"},
        }
    )
    errors = check_policy_attributes(cfg)
    assert any("[ttft-numeric]" in e and "is float, policy needs int" in e for e in errors)
    assert any("[ttft-int-literal]" in e and "is float, policy needs int" in e for e in errors)
    assert any("[aborted-string]" in e and "value must be a bool" in e for e in errors)


def test_negative_unknown_policy_field(cfg):
    for p in tail_sampling_policies(cfg):
        if p["type"] == "latency":
            p["latency"]["threshold_msec"] = p["latency"].pop("threshold_ms")
    errors = check_components(cfg)
    assert any("policies[" in e and "unknown key 'threshold_msec'" in e for e in errors), errors


def test_negative_unknown_component_key(cfg):
    cfg["connectors"]["span_metrics"]["exemplar"] = {"enabled": True}
    cfg["processors"]["memory_limiter"]["limit_mb"] = 100
    cfg["exporters"]["otlp_grpc/tempo"]["tls"]["insecur"] = True
    errors = check_components(cfg)
    assert any("connectors.span_metrics: unknown key 'exemplar'" in e for e in errors), errors
    assert any("processors.memory_limiter: unknown key 'limit_mb'" in e for e in errors), errors
    assert any("exporters.otlp_grpc/tempo.tls: unknown key 'insecur'" in e for e in errors), errors


def test_negative_unknown_or_deprecated_type(cfg):
    cfg["connectors"]["spanmetrics"] = cfg["connectors"].pop("span_metrics")
    cfg["processors"]["tailsamplin"] = {}
    errors = check_components(cfg)
    assert any("'spanmetrics' is a deprecated name, use 'span_metrics'" in e for e in errors), errors
    assert any("no component type 'tailsamplin'" in e for e in errors), errors


def test_negative_loadbalancing_schema():
    cfg = copy.deepcopy(load("agent.yaml"))
    cfg["exporters"]["loadbalancing"]["resolver"]["dns"]["hostnames"] = ["a"]
    errors = check_components(cfg)
    assert any("resolver.dns: unknown key 'hostnames'" in e for e in errors), errors


def test_negative_scalar_types(cfg):
    ts = cfg["processors"]["tail_sampling"]
    ts["decision_wait"] = 600  # a bare number is not a duration
    ts["sampling_strategy"] = "trace-completed"
    cfg["connectors"]["span_metrics"]["exemplars"]["enabled"] = "yes"
    errors = check_components(cfg)
    assert any("decision_wait: 600 is not a valid" in e for e in errors), errors
    assert any("sampling_strategy: 'trace-completed'" in e for e in errors), errors
    assert any("exemplars.enabled: 'yes' is not a valid boolean" in e for e in errors), errors


# ---- the usage ledger pipeline ------------------------------------------------------------------

USAGE_LAYOUTS = ["otelcol.yaml", "agent.yaml"]


def spool_receivers(cfg: dict) -> dict[str, dict]:
    return {rid: conf for rid, conf in cfg["receivers"].items() if ctype(rid) in FILELOG_TYPES}


def spool_operator(receiver: dict, op_type: str) -> dict:
    ops = [op for op in receiver["operators"] if op["type"] == op_type]
    assert len(ops) == 1, f"expected one {op_type} operator"
    return ops[0]


@pytest.mark.parametrize("name", USAGE_LAYOUTS)
def test_usage_pipeline_reads_spool_and_otlp_into_clickhouse(name):
    cfg = load(name)
    pipes = usage_pipelines(cfg)
    assert list(pipes) == ["logs/usage"]
    usage = pipes["logs/usage"]
    assert set(usage["receivers"]) == {"filelog/usage", "otlp"}
    assert usage["exporters"] == ["clickhouse/usage"]
    assert cfg["receivers"]["filelog/usage"]["storage"] in cfg["service"]["extensions"]


@pytest.mark.parametrize("name", USAGE_LAYOUTS)
def test_usage_pipeline_has_no_sampling_processor(name):
    for pid, p in usage_pipelines(load(name)).items():
        assert not {ctype(x) for x in p.get("processors", [])} & SAMPLING_TYPES, pid


def test_agent_sends_usage_straight_to_clickhouse():
    cfg = load("agent.yaml")
    for pid, p in cfg["service"]["pipelines"].items():
        if "loadbalancing" in p["exporters"]:
            assert pid == "traces" and not set(p["receivers"]) & set(spool_receivers(cfg)), pid
    assert all(ctype(e) == "clickhouse" for p in usage_pipelines(cfg).values() for e in p["exporters"])


def test_sampler_has_no_usage_pipeline():
    """Usage records never reach the sampling tier: the agents write them to ClickHouse."""
    cfg = load("sampler.yaml")
    assert not usage_pipelines(cfg)
    assert not any(pid.startswith("logs") for pid in cfg["service"]["pipelines"])
    assert not any(ctype(e) == "clickhouse" for e in cfg["exporters"])


def test_usage_components_identical_in_both_layouts():
    one, agent = load("otelcol.yaml"), load("agent.yaml")
    for kind, cid in (
        ("receivers", "filelog/usage"),
        ("processors", "filter/usage"),
        ("exporters", "clickhouse/usage"),
        ("extensions", "file_storage/usage"),
    ):
        assert agent[kind][cid] == one[kind][cid], cid
    assert agent["service"]["pipelines"]["logs/usage"] == one["service"]["pipelines"]["logs/usage"]


@pytest.mark.parametrize("name", USAGE_LAYOUTS)
def test_spool_fields_mapped_and_removed(name):
    receiver = load(name)["receivers"]["filelog/usage"]
    parser = spool_operator(receiver, "json_parser")
    assert parser["parse_ints"] is True
    ts = parser["timestamp"]
    assert parse_field(ts["parse_from"]) == ("attributes", semconv.USAGE_TIME)
    assert (ts["layout_type"], ts["layout"]) == ("epoch", "ns")
    assert parse_field(parser["trace"]["trace_id"]["parse_from"]) == ("attributes", semconv.USAGE_TRACE_ID)
    assert parse_field(parser["trace"]["span_id"]["parse_from"]) == ("attributes", semconv.USAGE_SPAN_ID)
    removed = {parse_field(op["field"]) for op in receiver["operators"] if op["type"] == "remove"}
    assert {("attributes", key) for key in SPOOL_ONLY} <= removed
    assert receiver["include_file_name"] is False


@pytest.mark.parametrize("name", USAGE_LAYOUTS)
def test_spool_receiver_reads_every_spool_file_once(name):
    from otel_llm.usage import SPOOL_PREFIX, SPOOL_SUFFIX, Spool

    receiver = load(name)["receivers"]["filelog/usage"]
    (pattern,) = receiver["include"]
    assert pattern.endswith(f"/{SPOOL_PREFIX}*{SPOOL_SUFFIX}")
    assert pattern.startswith("${env:OTEL_LLM_USAGE_DIR:-")  # the servers' variable
    assert receiver["start_at"] == "beginning" and receiver["force_flush_period"] == "0s"
    # a file left out for its age is finished: a server rotates a file that old before writing again
    excluded_after = duration_seconds(receiver["exclude_older_than"])
    assert excluded_after > inspect.signature(Spool).parameters["max_age_s"].default
    retry = receiver["retry_on_failure"]
    assert retry["enabled"] is True and retry["max_elapsed_time"] == "0s"


@pytest.mark.parametrize("name", USAGE_LAYOUTS)
def test_usage_filter_keeps_only_usage_records(name):
    cfg = load(name)
    conf = cfg["processors"]["filter/usage"]
    assert "filter/usage" in cfg["service"]["pipelines"]["logs/usage"]["processors"]
    assert not filter_drops(conf, {semconv.USAGE_ID: "host/cmpl-1", semconv.TENANT_ID: "acme"})
    assert filter_drops(conf, {semconv.SERVICE_NAME: "vllm", semconv.TENANT_ID: "acme"})
    assert filter_drops(conf, {})


@pytest.mark.parametrize("name", USAGE_LAYOUTS)
def test_usage_export_is_durable_and_matches_the_ledger(name):
    from otel_llm.billing import ledger

    cfg = load(name)
    ch = cfg["exporters"]["clickhouse/usage"]
    # the table `otel-llm report --ledger clickhouse://HOST:8123/otel` reads by default
    assert ch["logs_table_name"] == inspect.signature(ledger.otel_logs_source).parameters["table"].default
    assert ch["database"] == "otel" and ch["create_schema"] is True
    assert ch["endpoint"].startswith("${env:CLICKHOUSE_ENDPOINT:-")
    assert ch["retry_on_failure"]["enabled"] is True and ch["retry_on_failure"]["max_elapsed_time"] == "0s"
    queue = ch["sending_queue"]
    assert queue["enabled"] is True and queue["block_on_overflow"] is True
    assert queue["storage"] == cfg["receivers"]["filelog/usage"]["storage"]
    assert ctype(queue["storage"]) == "file_storage" and queue["storage"] in cfg["service"]["extensions"]
    assert cfg["extensions"][queue["storage"]]["fsync"] is True


def write_spool(directory) -> tuple[str, list[tuple[dict, int, SpanContext | None]]]:
    """Records written by the server's own code (otel_llm.usage): one with trace context, one without."""
    from otel_llm.usage import UsageLedger

    usage = UsageLedger(
        NoOpMeter("test"),
        directory=str(directory),
        events=False,
        instance="node-1:8000",
        service="vllm",
        fsync_interval_s=0,
    )
    fields = {
        semconv.USAGE_ID: usage.key("cmpl-7f3a-0"),
        semconv.USAGE_SCHEMA_VERSION: semconv.USAGE_SCHEMA,
        semconv.SERVICE_NAME: usage.service,
        semconv.SERVICE_INSTANCE_ID: usage.instance,
        semconv.VLLM_REQUEST_ID: "chatcmpl-7f3a",
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
        semconv.REQUEST_OUTCOME: semconv.OUTCOME_FINISHED,
        semconv.USAGE_DURATION: 1.2345,
        semconv.GEN_AI_USAGE_INPUT_TOKENS: 600,
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 512,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 150,
        semconv.GEN_AI_REQUEST_CHOICE_COUNT: 1,
        semconv.GEN_AI_REQUEST_MODEL: "llama-3-8b",
        semconv.GEN_AI_RESPONSE_MODEL: "llama-3-8b",
        semconv.TENANT_ID: "acme",
        semconv.TENANT_SCENE: "support",
        semconv.GEN_AI_RESPONSE_FINISH_REASONS: ["stop"],
    }
    aborted = {
        **fields,
        semconv.USAGE_ID: usage.key("cmpl-9c1e-0"),
        semconv.REQUEST_OUTCOME: semconv.OUTCOME_ABORTED,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 3,
    }
    span = SpanContext(
        trace_id=0x5B8EFFF798038103D269B633813FC60C,
        span_id=0xEEE19B7EC3C1B174,
        is_remote=False,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    # epoch nanoseconds above 2**53: a float64 cannot hold them exactly
    written = [(fields, 1_767_225_600_123_456_789, span), (aborted, 1_767_225_601_987_654_321, None)]
    for record, end_ns, ctx in written:
        usage.write(record, end_ns, ctx)
    usage.close()
    return usage.spool.path, written


@pytest.mark.parametrize("name", USAGE_LAYOUTS)
def test_spool_line_becomes_the_otlp_record(name, tmp_path):
    """Through the configured operators, a spool line has the OTLP record's attributes (the fields
    the server passes to both; otel_llm/usage.py), its end time and its span."""
    receiver = load(name)["receivers"]["filelog/usage"]
    path, written = write_spool(tmp_path)
    lines = Path(path).read_text().splitlines()
    assert len(lines) == len(written)
    for line, (fields, end_ns, span) in zip(lines, written):
        entry = run_operators(line, receiver, path)
        assert set(entry["attributes"]) == set(json.loads(line)) - set(SPOOL_ONLY)
        assert entry["attributes"] == fields  # the OTLP path: logger.emit(attributes=fields)
        assert entry["timestamp"] == end_ns
        assert entry["trace_id"] == (format(span.trace_id, "032x") if span else None)
        assert entry["span_id"] == (format(span.span_id, "016x") if span else None)
        assert entry["body"] is None  # as a usage event's
        assert entry["resource"] == {semconv.SERVICE_NAME: fields[semconv.SERVICE_NAME]}
        assert not filter_drops(load(name)["processors"]["filter/usage"], entry["attributes"])
    assert run_operators(lines[0][:57], receiver, path) is None  # a torn line is no record


# ---- negative tests on the usage pipeline -------------------------------------------------------


def test_negative_sampling_in_usage_pipeline(cfg):
    cfg["processors"]["probabilistic_sampler/usage"] = {"sampling_percentage": 50}
    cfg["service"]["pipelines"]["logs/usage"]["processors"].append("probabilistic_sampler/usage")
    errors = check_usage(cfg)
    assert any("'probabilistic_sampler/usage' samples" in e for e in errors), errors
    cfg["service"]["pipelines"]["logs/usage"]["processors"].insert(0, "tail_sampling")
    assert any("'tail_sampling' samples" in e for e in check_usage(cfg))


def test_negative_batch_processor_in_usage_pipeline(cfg):
    cfg["service"]["pipelines"]["logs/usage"]["processors"].append("batch")
    assert any("'batch' acknowledges records before they are on disk" in e for e in check_usage(cfg))


def test_negative_usage_through_loadbalancing():
    cfg = copy.deepcopy(load("agent.yaml"))
    cfg["service"]["pipelines"]["logs/usage"]["exporters"] = ["loadbalancing"]
    cfg["exporters"].pop("clickhouse/usage")
    assert not check_wiring(cfg)  # well wired, wrong design
    assert any("exports to 'loadbalancing'" in e for e in check_usage(cfg))


def test_negative_otlp_usage_without_the_right_filter(cfg):
    wrong = copy.deepcopy(cfg)
    cfg["service"]["pipelines"]["logs/usage"]["processors"].remove("filter/usage")
    del cfg["processors"]["filter/usage"]
    assert not check_wiring(cfg)
    assert any("need a filter that keeps only records with" in e for e in check_usage(cfg))
    # a filter on another attribute lets other logs through or drops usage records
    wrong["processors"]["filter/usage"]["logs"]["log_record"] = [f'attributes["{semconv.TENANT_ID}"] == nil']
    assert any("need a filter that keeps only records with" in e for e in check_usage(wrong))


def test_negative_wrong_operator_key(cfg):
    ops = cfg["receivers"]["filelog/usage"]["operators"]
    ops[0]["timestamp"]["parse_form"] = ops[0]["timestamp"].pop("parse_from")
    ops[1]["fields"] = ops[1].pop("field")
    ops.append({"type": "json_parse"})
    errors = check_components(cfg)
    assert any("operators[0].timestamp: unknown key 'parse_form'" in e for e in errors), errors
    assert any("operators[1]: unknown key 'fields'" in e for e in errors), errors
    assert any("type 'json_parse' is not one of" in e for e in errors), errors


def test_negative_spool_field_kept_or_misread(cfg):
    receiver = cfg["receivers"]["filelog/usage"]
    receiver["operators"] = [
        op for op in receiver["operators"] if op.get("field") != f"attributes.{semconv.USAGE_SPAN_ID}"
    ]
    receiver["operators"][0]["parse_ints"] = False
    receiver["operators"][0]["timestamp"]["layout"] = "ms"
    receiver["include_file_name"] = True
    errors = check_usage(cfg)
    assert any(f"spool-only field {semconv.USAGE_SPAN_ID!r} is not removed" in e for e in errors), errors
    assert any("parse_ints must be true" in e for e in errors), errors
    assert any("epoch nanoseconds (layout_type epoch, layout ns)" in e for e in errors), errors
    assert any("add log.file.* to LogAttributes" in e for e in errors), errors


def test_negative_usage_attribute_not_in_semconv(cfg):
    ops = cfg["receivers"]["filelog/usage"]["operators"]
    ops[0]["trace"]["trace_id"]["parse_from"] = "attributes.traceid"
    next(op for op in ops if op["type"] == "copy")["from"] = 'attributes["service_name"]'
    ops[0]["timestamp"]["parse_from"] = f"attributes.{semconv.USAGE_ID}"  # dots nest in stanza
    cfg["processors"]["filter/usage"]["logs"]["log_record"] = ['attributes["otel_llm.usage_id"] == nil']
    errors = check_usage(cfg) + check_other_attributes(cfg)
    assert any("attributes key 'traceid' is not a name" in e for e in errors), errors
    assert any("attributes key 'service_name' is not a name" in e for e in errors), errors
    assert any(f"field outside the checked subset: 'attributes.{semconv.USAGE_ID}'" in e for e in errors), errors
    assert any("attribute 'otel_llm.usage_id' is not a name" in e for e in errors), errors


def test_negative_export_and_storage_keys(cfg):
    ch = cfg["exporters"]["clickhouse/usage"]
    ch["sending_queue"]["storge"] = ch["sending_queue"].pop("storage")
    ch["ttl"] = 30
    ch["retry_on_failure"]["max_elapsed"] = "0s"
    cfg["extensions"]["file_storage/usage"]["fsynk"] = True
    errors = check_components(cfg)
    assert any("clickhouse/usage.sending_queue: unknown key 'storge'" in e for e in errors), errors
    assert any("clickhouse/usage.ttl: 30 is not a valid duration" in e for e in errors), errors
    assert any("clickhouse/usage.retry_on_failure: unknown key 'max_elapsed'" in e for e in errors), errors
    assert any("file_storage/usage: unknown key 'fsynk'" in e for e in errors), errors


def test_negative_without_parse_ints_the_timestamp_is_wrong(tmp_path):
    """Why parse_ints: stanza's JSON parser otherwise makes every number a float64."""
    receiver = copy.deepcopy(load("otelcol.yaml")["receivers"]["filelog/usage"])
    spool_operator(receiver, "json_parser")["parse_ints"] = False
    path, written = write_spool(tmp_path)
    entry = run_operators(Path(path).read_text().splitlines()[0], receiver, path)
    assert entry["timestamp"] != written[0][1]


# ---- content: kept where a reason kept the trace, redacted a second time ------------------------

# Server-side content as otel_llm/content.py writes it: JSON, redacted by the server (here: text the
# server's rules left alone, so the collector's second line has work only on the Luhn-invalid number).
SERVER_CONTENT = {
    semconv.GEN_AI_INPUT_MESSAGES: json.dumps(
        [{"role": "user", "parts": [{"type": "text", "content": "I am <EMAIL>\nnot a card: 4111 1111 1111 1112"}]}]
    ),
    semconv.GEN_AI_OUTPUT_MESSAGES: json.dumps(
        [{"role": "assistant", "parts": [{"type": "text", "content": "Hello"}], "finish_reason": "stop"}]
    ),
}
CONTENT_LAYOUTS = ["otelcol.yaml", "sampler.yaml"]


def with_content(trace: list[dict]) -> list[dict]:
    """The trace with content on its GenAI span (the span with gen_ai.operation.name)."""
    return [
        {**s, "attributes": {**s["attributes"], **SERVER_CONTENT}}
        if semconv.GEN_AI_OPERATION_NAME in s["attributes"]
        else s
        for s in trace
    ]


@pytest.mark.parametrize("name", CONTENT_LAYOUTS)
def test_content_processors_follow_tail_sampling(name):
    cfg = load(name)
    pid, after = sampled_pipeline(cfg)
    assert after[:2] == ["transform/content_by_policy", "transform/content_redaction"], after
    assert check_content(cfg) == []
    (strip,) = content_transforms(cfg)[0]
    assert strip[1] == {None, BASELINE} and set(CONTENT_ATTRIBUTES) <= set(strip[2])
    assert semconv.TAILSAMPLING_POLICY == "tailsampling.policy"  # the name contrib's processor.go writes
    for x in after[:2]:
        assert cfg["processors"][x] == load("otelcol.yaml")["processors"][x], x  # same in both layouts


def test_agent_exports_content_only_to_the_samplers():
    cfg = load("agent.yaml")
    assert check_content(cfg) == []
    assert not any(ctype(x) == "transform" for x in cfg.get("processors", {}))  # the samplers strip and redact


@pytest.mark.parametrize("baseline_samples", [True, False], ids=["baseline-samples", "baseline-not"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_content_kept_only_where_a_reason_kept_the_trace(case, baseline_samples):
    cfg = load("otelcol.yaml")
    policies = tail_sampling_policies(cfg)
    trace = with_content(CASES[case])
    policy = recorded_policy(policies, trace, baseline_samples)
    if not EXPECTED[case]:  # a normal request: kept by the baseline or not at all
        assert policy == (BASELINE if baseline_samples else None)
        if policy is None:
            return
        exported = release(cfg, trace, policy)
        assert not any(key in s["attributes"] for s in exported for key in CONTENT_ATTRIBUTES)
        # the rest of the trace is untouched
        assert [{k: v for k, v in s["attributes"].items() if k not in CONTENT_ATTRIBUTES} for s in trace] == [
            s["attributes"] for s in exported
        ]
        return
    # kept for a reason: the first such policy in config order is recorded, whatever the baseline says
    assert policy == next(p["name"] for p in policies if p["name"] in EXPECTED[case])
    (genai,) = [s for s in release(cfg, trace, policy) if semconv.GEN_AI_OPERATION_NAME in s["attributes"]]
    assert genai["scope"] == {semconv.TAILSAMPLING_POLICY: policy}
    assert json.loads(genai["attributes"][semconv.GEN_AI_OUTPUT_MESSAGES]) == json.loads(
        SERVER_CONTENT[semconv.GEN_AI_OUTPUT_MESSAGES]
    )
    assert (
        json.loads(genai["attributes"][semconv.GEN_AI_INPUT_MESSAGES])[0]["parts"][0]["content"]
        == "I am <EMAIL>\nnot a card: <PAYMENT_CARD>"
    )  # the second line: shape only, no Luhn check


def test_spans_without_a_recorded_policy_lose_content():
    """Gate off, or a span released after the decision with no cached policy name: fail closed. A late
    span released by the decision cache carries the trace's policy and keeps its content."""
    cfg = load("otelcol.yaml")
    late = with_content(CASES["error"])[1:2]
    assert not any(key in s["attributes"] for s in release(cfg, late, None) for key in CONTENT_ATTRIBUTES)
    assert all(key in release(cfg, late, "errors-status")[0]["attributes"] for key in SERVER_CONTENT)
    assert load("otelcol.yaml")["processors"]["tail_sampling"]["decision_cache"]["sampled_cache_size"] > 0


@pytest.mark.parametrize("name", CONTENT_LAYOUTS)
def test_redaction_regexes_are_re2(name):
    rules = redaction_rules(load(name))
    assert len(rules) >= 6
    for regex, _ in rules:
        assert re2_problems(regex) == [], regex


def test_re2_check_rejects_what_go_would_not_run():
    assert any("lookaround" in p for p in re2_problems(r"(?<!\d)\d{4}"))
    assert any("lookaround" in p for p in re2_problems(r"\d{4}(?!\d)"))
    assert any("backreference" in p for p in re2_problems(r"(a)\1"))
    assert any("possessive" in p for p in re2_problems(r"a++b"))
    assert any("atomic" in p for p in re2_problems(r"(?>ab)c"))
    assert any("$" in p for p in re2_problems(r"\d+$"))
    assert any("\\s" in p for p in re2_problems(r"a\sb"))
    assert any("1000" in p for p in re2_problems(r"a{1,1001}"))
    assert any("empty" in p for p in re2_problems(r"a*"))
    assert re2_problems(r"(?i:bearer) [A-Za-z0-9._~+/=-]{8,}|(?P<x>a)+?\b[\\^]") == []


def test_ottl_strings_and_dollars():
    assert ottl_string(r'"a\\.b\"c"') == 'a\\.b"c'
    with pytest.raises(ValueError, match="escape"):
        ottl_string(r'"\d"')  # one backslash: Go's strconv.Unquote refuses it, the collector fails to start
    assert confmap_unescape("$$1<EMAIL>") == "$1<EMAIL>"
    with pytest.raises(ValueError, match="single"):
        confmap_unescape("$1<EMAIL>")
    m = re.match(r"(a)(b)?", "a")
    assert go_expand("$1<X>$2|${1}y|$1y|$$", m) == "a<X>|ay||$"  # $1y is group "1y": empty, as in Go


def _as_content(text: str) -> str:
    """A text as it stands in a content attribute (a JSON string, as otel_llm/content.py writes it)."""
    return json.dumps([{"role": "user", "parts": [{"type": "text", "content": text}]}], ensure_ascii=False)


def _text(value: str) -> str:
    return json.loads(value)[0]["parts"][0]["content"]


def _standalone(text: str, match: str) -> str:
    """The example's match with what makes it one: a bearer token needs the word before it."""
    return f"Bearer {match}" if f"Bearer {match}" in text else match


@pytest.mark.parametrize("rule, text, match", POSITIVE, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(POSITIVE)])
def test_collector_redacts_what_the_servers_redact(rule, text, match):
    """Each built-in rule's examples (tests/content/redaction_examples.py): the same typed token as the server's
    rule, also when the text is raw (a producer that does not redact) and whatever precedes it in the
    JSON (a newline is the two characters \\n there)."""
    from otel_llm import redaction

    cfg = load("otelcol.yaml")
    assert _text(collector_redact(cfg, _as_content(text))) == redaction.Redactor().redact(text)
    piece = text[text.index(_standalone(text, match)) :]
    for before in ("\n", "\t", "\\", "邮箱", "(", '"', ""):
        got = _text(collector_redact(cfg, _as_content(before + piece)))
        assert match not in got, (before, got)


# Lookalikes the collector redacts although the servers do not: no checksum runs in the collector
# (Luhn, ID check digit, ipaddress), and an address directly followed by a dot counts.
COLLECTOR_STRICTER = {
    "card 4111 1111 1111 1112 fails Luhn": "card <PAYMENT_CARD> fails Luhn",
    "id 110105194912310021 has a wrong check digit": "id <NATIONAL_ID> has a wrong check digit",
    "version 1.2.3.4.5 and 999.1.1.1 are not addresses": "version <IP_ADDRESS>.5 and 999.1.1.1 are not addresses",
}


@pytest.mark.parametrize("text", NEGATIVE)
def test_collector_leaves_lookalikes(text):
    assert _text(collector_redact(load("otelcol.yaml"), _as_content(text))) == COLLECTOR_STRICTER.get(text, text)


@pytest.mark.parametrize(
    "text, redacted",
    [
        (
            "time 10:45:00, MAC 00:1a:2b:3c:4d:5e, uuid 550e8400-e29b-41d4-a716-446655440000",
            "time 10:45:00, MAC 00:1a:2b:3c:4d:5e, uuid 550e8400-e29b-41d4-a716-446655440000",
        ),
        (
            "epoch 1767225600123456789 ns, 128000 tokens, 2026-05-14T10:20:30Z, $1,234,567.89",
            "epoch 1767225600123456789 ns, 128000 tokens, 2026-05-14T10:20:30Z, $1,234,567.89",
        ),
        # what the servers' Unicode word boundaries miss next to CJK text, and an address ending a sentence
        ("邮箱jane.doe@example.com。", "邮箱<EMAIL>。"),
        ("ip 10.0.0.1. and 13812345678now", "ip <IP_ADDRESS>. and <PHONE>now"),
        (
            "card 4111 1111 1111 1111 cvv 123; amex 3782 822463 10005",
            "card <PAYMENT_CARD> cvv 123; amex <PAYMENT_CARD>",
        ),
        (
            "keys sk-proj-Abcdefghijklmnop1234,AKIAIOSFODNN7EXAMPLE\tBEARER abcdefgh12",
            "keys <SECRET>,<SECRET>\tBEARER <SECRET>",
        ),
    ],
)
def test_collector_redaction_examples(text, redacted):
    assert _text(collector_redact(load("otelcol.yaml"), _as_content(text))) == redacted


def test_collector_redaction_keeps_json_whole_and_is_idempotent():
    """Random texts of the rules' examples between separators: the value stays valid JSON (no match
    starts inside an escape or removes a backslash), nothing of the examples survives, and a second
    pass changes nothing (the tokens match no rule)."""
    import random

    cfg = load("otelcol.yaml")
    matches = [_standalone(text, m) for _, text, m in POSITIVE]
    separators = [
        " ",
        "\n",
        "\t",
        ", ",
        "; ",
        " (",
        ") ",
        '"',
        "'",
        ": ",
        "/",
        "邮箱",
        "。",
        " and ",
        "<",
        ">",
        "=",
        "\r\n",
        "\\n",
        "\\",
    ]
    rng = random.Random(13)
    for _ in range(1500):
        parts = [rng.choice(separators)]
        for _ in range(rng.randint(1, 4)):
            parts += [rng.choice(matches), rng.choice(separators)]
        text = "".join(parts)
        once = collector_redact(cfg, _as_content(text))
        got = _text(once)  # valid JSON
        assert not [m for m in matches if m in got], (text, got)
        assert collector_redact(cfg, once) == once, text


def test_collector_redaction_same_in_go(tmp_path):
    """The rules run by Go's regexp (the collector's engine) give what the Python model gives, on the
    rules' examples and random mixes of them. Runs where a Go toolchain is installed."""
    import random
    import shutil
    import subprocess

    go = shutil.which("go")
    if go is None:
        pytest.skip("no Go toolchain: the RE2 syntax check and the Python model still ran")
    cfg = load("otelcol.yaml")
    rules = redaction_rules(cfg)
    rng = random.Random(7)
    pieces = (
        [_standalone(t, m) for _, t, m in POSITIVE]
        + NEGATIVE
        + ["Bearer abcdefgh12", "邮箱", "\n", "\\", "x", "_", ".", "+", ":"]
    )
    texts = [_as_content(t) for _, t, _ in POSITIVE] + [_as_content(t) for t in NEGATIVE]
    texts += [_as_content("".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))) for _ in range(3000)]
    (tmp_path / "main.go").write_text(GO_REPLACER)
    (tmp_path / "go.mod").write_text("module replacer\n\ngo 1.19\n")
    run = subprocess.run(
        [go, "run", "."],
        cwd=tmp_path,
        input=json.dumps({"Rules": rules, "Texts": texts}),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "GOPROXY": "off", "GOTOOLCHAIN": "local"},
    )
    assert run.returncode == 0, run.stderr
    expected = []
    for t in texts:
        for regex, repl in rules:
            t = go_replace_all(regex, repl, t)
        expected.append(t)
    assert json.loads(run.stdout) == expected


GO_REPLACER = """package main

import (
	"encoding/json"
	"os"
	"regexp"
)

func main() {
	var in struct {
		Rules [][2]string
		Texts []string
	}
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		panic(err)
	}
	var res []*regexp.Regexp
	for _, r := range in.Rules {
		res = append(res, regexp.MustCompile(r[0]))
	}
	out := []string{}
	for _, t := range in.Texts {
		for i, re := range res {
			t = re.ReplaceAllString(t, in.Rules[i][1])
		}
		out = append(out, t)
	}
	json.NewEncoder(os.Stdout).Encode(out)
}
"""


# ---- negative tests on the content processors ------------------------------------------------------


def test_negative_baseline_before_a_reason(cfg):
    policies = tail_sampling_policies(cfg)
    policies.insert(0, policies.pop())
    assert any("'baseline' comes before" in e for e in check_content(cfg))


def test_negative_strip_keeps_unrecorded_or_names_a_reason(cfg):
    group = cfg["processors"]["transform/content_by_policy"]["trace_statements"][0]
    group["conditions"] = [c for c in group["conditions"] if "nil" not in c]
    group["conditions"].append(f'scope.attributes["{semconv.TAILSAMPLING_POLICY}"] == "errors-status"')
    group["conditions"].append(f'scope.attributes["{semconv.TAILSAMPLING_POLICY}"] == "no-such-policy"')
    errors = check_content(cfg)
    assert any("must fail closed" in e for e in errors), errors
    assert any("does not have: ['no-such-policy']" in e for e in errors), errors
    assert any("must be exactly the unselective policies ['baseline']" in e for e in errors), errors


def test_negative_strip_misses_an_attribute_or_is_misplaced(cfg):
    statements = cfg["processors"]["transform/content_by_policy"]["trace_statements"][0]["statements"]
    statements.remove(f'delete_key(span.attributes, "{semconv.GEN_AI_OUTPUT_MESSAGES}")')
    assert any(f"does not delete {semconv.GEN_AI_OUTPUT_MESSAGES!r}" in e for e in check_content(cfg))
    pipes = cfg["service"]["pipelines"]
    pipes["traces/sampled"]["processors"].remove("transform/content_by_policy")
    pipes["traces/in"]["processors"].append("transform/content_by_policy")  # before sampling: no policy yet
    assert any("needs one transform after tail_sampling deleting content" in e for e in check_content(cfg))


def test_negative_content_leaves_unsampled(cfg):
    cfg["service"]["pipelines"]["traces/in"]["exporters"].append("otlp_grpc/tempo")
    assert any("without tail_sampling: content would leave on every trace" in e for e in check_content(cfg))


def test_negative_no_decision_cache(cfg):
    del cfg["processors"]["tail_sampling"]["decision_cache"]
    assert any("decision_cache.sampled_cache_size" in e for e in check_content(cfg))


def test_negative_redaction_rules(cfg):
    statements = cfg["processors"]["transform/content_redaction"]["trace_statements"]
    email = next(i for i, s in enumerate(statements) if "<EMAIL>" in s and semconv.GEN_AI_INPUT_MESSAGES in s)
    statements[email] = statements[email].replace("(\\\\\\\\[", "(?<!x)(\\\\\\\\[")  # a lookbehind
    assert any("lookaround" in e for e in check_content(cfg))
    statements[email] = statements[email].replace("$$1<EMAIL>", "$$2<EMAIL>")
    assert any("refers to $2" in e for e in check_content(cfg))
    statements[email] = statements[email].replace("$$2<EMAIL>", "$1<EMAIL>")
    assert any("single $" in e for e in check_content(cfg))
    del statements[email]  # gen_ai.input.messages loses its e-mail rule, the others keep theirs
    assert any("does not get the same rules" in e for e in check_content(cfg))


def test_negative_redaction_tokens(cfg):
    statements = cfg["processors"]["transform/content_redaction"]["trace_statements"]
    statements[:] = [s.replace("<PHONE>", "<TEL>") for s in statements]
    assert any("replacement tokens" in e and "<TEL>" in e for e in check_content(cfg))
