"""The tail-sampling policies of collector-config/otelcol.yaml applied to REAL traces.

One real `opentelemetry-instrument vllm serve` (tiny model, CPU) exports its spans to the in-test
OTLP receiver. We produce one trace per case (normal, unknown model 404, aborted stream, slow,
big prompt, cache miss on a long prompt and the cache hit of its second send), then run the same
policy evaluator as tests/collector/validator.py on the spans the server really exported.

The server captures prompt and completion content (OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT
on, redacted in the server), so the model of the collector's content processors runs on the real
spans too: the policy tail_sampling records (the first in config order that samples), then
otelcol.yaml's transforms. Content must survive exactly on the traces kept for a reason, redacted a
second time, and be gone from a trace kept only by the probabilistic baseline.

The policies are loaded from otelcol.yaml; only numeric thresholds are scaled down to values the
tiny model reaches (max-model-len 2048). Names, types, attribute keys and OTTL conditions are the
config's own, so this checks that the attributes the server really emits (names, int vs float
types, presence on the right span) make each policy keep what it is meant to keep. The evaluator
is our reading of the processor's semantics; the real otelcol decides (not runnable here).
"""

from __future__ import annotations

import copy
import json
import secrets
from types import SimpleNamespace

import httpx
import pytest
import yaml
from collector.validator import (
    BASELINE,
    CONFIG_DIR,
    CONTENT_ATTRIBUTES,
    collector_redact,
    keeping_policies,
    parse_ottl,
    recorded_policy,
    release,
    tail_sampling_policies,
)
from helpers import Traceparent, abandon_stream, genai_spans, request_trace, start_server

from devkit.tiny_model import MODEL_NAME
from otel_llm import config, semconv

MAX_MODEL_LEN = 2048
LONG_PROMPT_TOKENS = 600  # cache-miss case (> scaled cache-miss threshold, < big-input threshold)
BIG_PROMPT_TOKENS = 1500  # big-input case
SLOW_MAX_TOKENS = 1500
# personal data in two prompts: a 404 (kept for its error) and a normal request (baseline only)
PII = "I am jane.doe@example.com, card 4111 1111 1111 1111, from 10.0.12.7"
PII_PIECES = ("jane.doe", "4111 1111 1111 1111", "10.0.12.7")
ABORT_MAX_TOKENS = 1900

# Scaled thresholds (the config's are for real models: 32k/8k tokens, 4000-token prompts, 30 s).
SCALED = {
    "big-input": 1000,  # numeric_attribute min_value on gen_ai.usage.input_tokens
    "big-output": 1000,  # numeric_attribute min_value on gen_ai.usage.output_tokens
    "cache-miss-long-prompt": 400,  # the input_tokens literal in the OTTL condition
}

# case -> policies that must keep it besides the probabilistic baseline, with SCALED thresholds.
# A long prompt's first send is also a cache miss; a long generation is also a big output.
EXPECTED = {
    "normal": set(),
    "error_404": {"errors-status", "errors-type"},
    "aborted": {"aborted", "errors-type", "errors-status"},
    "slow": {"slow-requests", "big-output"},
    "big_input": {"big-input", "cache-miss-long-prompt"},
    "cache_miss": {"cache-miss-long-prompt"},
    "cache_hit": set(),
}


def scaled_policies(longest_other_ms: float, slow_ms: float) -> tuple[list[dict], dict[str, object]]:
    """otelcol.yaml's policies with numeric thresholds scaled for the tiny model.

    Returns (policies, {policy: new threshold}). slow-ttft keeps its config threshold (5 s): the
    tiny model's TTFT never gets near it, so the test asserts it keeps nothing."""
    policies = copy.deepcopy(tail_sampling_policies(yaml.safe_load((CONFIG_DIR / "otelcol.yaml").read_text())))
    changed: dict[str, object] = {}
    by_name = {p["name"]: p for p in policies}
    for name in ("big-input", "big-output"):
        by_name[name]["numeric_attribute"]["min_value"] = SCALED[name]
        changed[name] = f"min_value {SCALED[name]}"
    cond = by_name["cache-miss-long-prompt"]["ottl_condition"]["span"]
    (original,) = cond
    old = f'attributes["{semconv.GEN_AI_USAGE_INPUT_TOKENS}"] > 4000'
    assert old in original, original
    cond[0] = original.replace(
        old, f'attributes["{semconv.GEN_AI_USAGE_INPUT_TOKENS}"] > {SCALED["cache-miss-long-prompt"]}'
    )
    parse_ottl(cond[0])  # still inside the evaluator's OTTL subset
    changed["cache-miss-long-prompt"] = cond[0]
    # slow-requests: halfway, as ratios, between the longest of the other (short) traces and the slow one
    # (about 8 s for 2 s and 32 s on the 2-core VM): a margin of the same factor on both sides, so that one
    # short trace held up on a busy machine (an abort seen late) does not push it past the slow trace
    threshold = max(1000, int((longest_other_ms * slow_ms) ** 0.5))
    by_name["slow-requests"]["latency"]["threshold_ms"] = threshold
    changed["slow-requests"] = f"threshold_ms {threshold}"
    return policies, changed


def as_eval_trace(spans) -> list[dict]:
    return [
        {
            "name": s.name,
            "status": s.status,
            "start_ms": s.start_ns / 1e6,
            "end_ms": s.end_ns / 1e6,
            "attributes": dict(s.attributes),
        }
        for s in spans
    ]


def _prompt(client: httpx.Client, nonce: str, tokens: int) -> str:
    """A prompt of about `tokens` tokens (counted by the server's /tokenize), starting with a
    nonce so it shares no prefix-cache block with any other prompt."""

    def count(text: str) -> int:
        r = client.post("/tokenize", json={"model": MODEL_NAME, "prompt": text})
        r.raise_for_status()
        return r.json()["count"]

    words = [f"{nonce}"] + [f"word{i % 97} tells about telemetry" for i in range(200)]
    per_word = count(" ".join(words)) / len(words)
    n = int(tokens / per_word)
    text = " ".join([nonce] + [f"word{i % 97} tells about telemetry" for i in range(n)])
    while count(text) > tokens:
        text = text.rsplit(" ", 4)[0]
    return text


@pytest.fixture(scope="module")
def server(receiver, tmp_path_factory):
    srv = start_server(
        receiver,
        tmp_path_factory,
        "sampling",
        extra_args=["--enable-prompt-tokens-details", "--max-model-len", str(MAX_MODEL_LEN)],
        paced=True,
        env={config.ENV_CAPTURE_CONTENT: "true"},
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def traces(server, receiver):
    """case -> list of the real spans of its trace (complete: HTTP, GenAI and phase spans)."""
    ids: dict[str, Traceparent] = {}
    responses: dict[str, dict] = {}
    with httpx.Client(base_url=server.url, timeout=300) as c:

        def complete(case, prompt, max_tokens, **extra):
            tp = ids[case] = Traceparent()
            r = c.post(
                "/v1/completions",
                headers=tp.headers(),
                json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra},
            )
            assert r.status_code == 200, r.text
            responses[case] = r.json()

        complete("normal", f"hello there. {PII}", 8)

        tp = ids["error_404"] = Traceparent()
        r = c.post(
            "/v1/chat/completions",
            headers=tp.headers(**{"x-tenant-id": "acme"}),
            json={"model": "no-such-model", "messages": [{"role": "user", "content": f"hi. {PII}"}]},
        )
        assert r.status_code == 404, r.text

        left = abandon_stream(
            server.url,
            "/v1/chat/completions",
            {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "write a long story"}],
                "max_tokens": ABORT_MAX_TOKENS,
                "ignore_eos": True,
            },
            lambda: Traceparent().headers(),
        )[-1]
        ids["aborted"] = SimpleNamespace(trace_id=left.trace_id)

        complete("slow", "tell me everything", SLOW_MAX_TOKENS, ignore_eos=True)
        complete("big_input", _prompt(c, secrets.token_hex(4), BIG_PROMPT_TOKENS), 4)
        long_prompt = _prompt(c, secrets.token_hex(4), LONG_PROMPT_TOKENS)
        complete("cache_miss", long_prompt, 4)
        complete("cache_hit", long_prompt, 4)

    result = {}
    for case, tp in ids.items():
        phases = 0 if case == "error_404" else 3
        spans = request_trace(receiver, tp.trace_id, phases=phases, timeout=60)
        result[case] = spans
    # the server's own numbers, to be sure each case is what it claims to be
    usage = {case: r["usage"] for case, r in responses.items()}
    assert usage["big_input"]["prompt_tokens"] > SCALED["big-input"]
    assert SCALED["cache-miss-long-prompt"] < usage["cache_miss"]["prompt_tokens"] < SCALED["big-input"]
    assert usage["cache_miss"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage["cache_hit"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert usage["slow"]["completion_tokens"] == SLOW_MAX_TOKENS
    return result


@pytest.fixture(scope="module")
def policies(traces):
    durations = {
        case: (max(s.end_ns for s in spans) - min(s.start_ns for s in spans)) / 1e6 for case, spans in traces.items()
    }
    longest_other = max(d for case, d in durations.items() if case != "slow")
    print("\ntrace durations (ms):", {k: round(v, 1) for k, v in durations.items()})
    # the slow case must be slow next to the others (1,500 tokens against at most a 1,500-token prefill)
    assert durations["slow"] >= 2 * longest_other, durations
    policies, changed = scaled_policies(longest_other, durations["slow"])
    print("scaled policy thresholds (otelcol.yaml otherwise unchanged):")
    for name, what in changed.items():
        print(f"  {name}: {what}")
    return policies


def test_policies_are_the_configs(policies):
    config = tail_sampling_policies(yaml.safe_load((CONFIG_DIR / "otelcol.yaml").read_text()))
    assert [(p["name"], p["type"]) for p in policies] == [(p["name"], p["type"]) for p in config]


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_real_trace_kept_by_its_policies(case, traces, policies):
    spans = traces[case]
    kept_by = keeping_policies(policies, as_eval_trace(spans))
    (genai,) = genai_spans(spans)
    shown = ("gen_ai.usage", "vllm.latency.time_to", "vllm.request.aborted", "error")
    print(
        f"{case}: kept by {sorted(kept_by)}; GenAI span attributes: "
        f"{ {k: v for k, v in genai.attributes.items() if k.startswith(shown)} }"
    )
    assert BASELINE in kept_by
    assert kept_by - {BASELINE} == _reasons(case, genai), f"{case}: kept by {sorted(kept_by)}"


def _reasons(case, genai) -> set[str]:
    """The policies besides the baseline that must keep the case's trace."""
    expected = set(EXPECTED[case])
    if _ttft(genai) > SLOW_TTFT_S:  # a machine so busy that a first token took over 5 s
        expected.add("slow-ttft")
    return expected


SLOW_TTFT_S = 5.0  # the slow-ttft policy's threshold in otelcol.yaml, kept unscaled


def _ttft(genai) -> float:
    return genai.attributes.get(semconv.VLLM_TTFT_SECONDS, 0.0)


def test_cache_hit_is_not_a_cache_miss(traces, policies):
    (hit,) = genai_spans(traces["cache_hit"])
    (miss,) = genai_spans(traces["cache_miss"])
    assert hit.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == miss.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS]
    assert miss.attributes[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == 0
    assert hit.attributes[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] > 0
    assert "cache-miss-long-prompt" not in keeping_policies(policies, as_eval_trace(traces["cache_hit"]))


def test_real_attribute_types_match_policy_types(traces):
    """numeric_attribute matches ints only and the TTFT OTTL literal is a float: the real spans
    carry exactly those types."""
    (genai,) = genai_spans(traces["slow"])
    attrs = genai.attributes
    for key in (
        semconv.GEN_AI_USAGE_INPUT_TOKENS,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS,
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
    ):
        assert type(attrs[key]) is int, key
    assert type(attrs[semconv.VLLM_TTFT_SECONDS]) is float
    (aborted,) = genai_spans(traces["aborted"])
    assert aborted.attributes[semconv.VLLM_ABORTED] is True
    assert aborted.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] < SCALED["big-output"]


def test_slow_ttft_unscaled_keeps_exactly_the_traces_over_5_s(traces, policies):
    """slow-ttft keeps its config threshold (5 s, a float): it keeps a trace exactly when its first
    token took longer (on a quiet machine none of these; a very busy one can slow a prefill past it,
    so the expectation is read from the span, not assumed)."""
    (ttft,) = [p for p in policies if p["name"] == "slow-ttft"]
    assert f"> {SLOW_TTFT_S}" in ttft["ottl_condition"]["span"][0]
    for case, spans in traces.items():
        kept = "slow-ttft" in keeping_policies([ttft], as_eval_trace(spans))
        ttfts = [_ttft(g) for g in genai_spans(spans)]
        assert kept == any(t > SLOW_TTFT_S for t in ttfts), (case, ttfts)


def test_every_span_attribute_a_traceql_panel_reads_is_on_real_spans(traces):
    """The Traces dashboard's TraceQL tables can only match attributes the server really emits (a
    panel on an attribute nothing emits shows an empty table forever)."""
    from otel_llm.ops import dashboards

    emitted = {key for spans in traces.values() for s in spans for key in s.attributes}
    read = {
        (name, title, attr)
        for name, board in dashboards.dashboards().items()
        for title, query in dashboards.traceql_targets(board)
        for attr in dashboards.traceql_span_attributes(query)
    }
    assert read, "no TraceQL panel found"
    assert [(name, title, attr) for name, title, attr in sorted(read) if attr not in emitted] == []
    # and the check can fail: the end-to-end latency attribute the fault-and-fuzz run found a panel
    # reading was never emitted (the span's own duration is the end-to-end time)
    assert "vllm.latency.e2e" not in emitted


@pytest.mark.parametrize("baseline_samples", [True, False], ids=["baseline-samples", "baseline-not"])
@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_content_survives_only_where_a_reason_kept_the_trace(case, baseline_samples, traces, policies):
    """tail_sampling records the first policy in config order that samples the trace; otelcol.yaml's
    transforms then delete content where that is the baseline (or nothing) and redact what is left.
    Both probabilistic outcomes: a trace with a reason is recorded under it either way."""
    cfg = yaml.safe_load((CONFIG_DIR / "otelcol.yaml").read_text())
    spans = traces[case]
    (genai,) = genai_spans(spans)
    assert semconv.GEN_AI_INPUT_MESSAGES in genai.attributes  # the server captured it
    trace = as_eval_trace(spans)
    reasons = _reasons(case, genai)
    policy = recorded_policy(policies, trace, baseline_samples)
    if reasons:
        assert policy == next(p["name"] for p in policies if p["name"] in reasons), (case, policy)
    else:
        assert policy == (BASELINE if baseline_samples else None), (case, policy)
    if policy is None:
        return  # not kept at all
    exported = release(cfg, trace, policy)
    kept = {(s["name"], key) for s in exported for key in CONTENT_ATTRIBUTES if key in s["attributes"]}
    if not reasons:
        assert kept == set(), f"{case}: content left on a baseline-only trace: {kept}"
        assert [{k: v for k, v in s["attributes"].items() if k not in CONTENT_ATTRIBUTES} for s in trace] == [
            s["attributes"] for s in exported
        ]  # nothing else removed
        return
    assert kept == {(s["name"], key) for s in trace for key in CONTENT_ATTRIBUTES if key in s["attributes"]}
    assert (genai.name, semconv.GEN_AI_INPUT_MESSAGES) in kept
    for before, after in zip(trace, exported):
        for key in CONTENT_ATTRIBUTES:
            if key in before["attributes"]:
                assert after["attributes"][key] == collector_redact(cfg, before["attributes"][key])


def test_exported_content_has_no_personal_data(traces, policies):
    """The 404's prompt had an e-mail, a card number and an address: the server's redaction removed
    them and the collector's second line left its tokens alone; the normal request's prompt (the same
    data) is not exported at all when only the baseline keeps the trace."""
    cfg = yaml.safe_load((CONFIG_DIR / "otelcol.yaml").read_text())
    (genai,) = genai_spans(traces["error_404"])
    assert "<EMAIL>" in genai.attributes[semconv.GEN_AI_INPUT_MESSAGES]
    for case in ("error_404", "normal"):
        trace = as_eval_trace(traces[case])
        for baseline_samples in (True, False):
            policy = recorded_policy(policies, trace, baseline_samples)
            exported = json.dumps([s["attributes"] for s in release(cfg, trace, policy)]) if policy else ""
            assert not [p for p in PII_PIECES if p in exported], (case, baseline_samples)
    (exported,) = [
        s
        for s in release(cfg, as_eval_trace(traces["error_404"]), "errors-status")
        if semconv.GEN_AI_OPERATION_NAME in s["attributes"]
    ]
    assert exported["attributes"][semconv.GEN_AI_INPUT_MESSAGES] == genai.attributes[semconv.GEN_AI_INPUT_MESSAGES]
