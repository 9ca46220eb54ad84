"""The names spec (otel_llm/semconv.py) against the OpenTelemetry semantic conventions package and
against the code that emits names. What the running layers really emit is checked against the spec
by every e2e module (the `receiver` fixture in tests/conftest.py: helpers.spec_violations on what it received)."""

import ast
import importlib
import pkgutil
from pathlib import Path

import opentelemetry.semconv._incubating.attributes as incubating_attributes
import opentelemetry.semconv._incubating.metrics as incubating_metrics
import opentelemetry.semconv.attributes as stable_attributes
import pytest

from otel_llm import semconv

PACKAGE = Path(semconv.__file__).parent
# modules that put names on telemetry (spans, metric points, usage records, resources)
EMITTERS = {
    semconv.VLLM: ["vllm", "content.py"],
    semconv.CLIENT: ["openai", "content.py"],
    semconv.USAGE: ["usage.py", "vllm"],
    semconv.RESOURCE: ["sdk/distro.py"],
    semconv.METRIC: ["vllm", "openai", "usage.py", "content.py"],
    semconv.BUDGETS: ["ops/budgets.py", "ops/budget_tracker.py"],
}
OURS = ("vllm.", "tenant.", "otel_llm.")


def _constants(*packages) -> dict[str, str]:
    """value -> constant name of every string constant in the semantic-conventions modules."""
    found = {}
    for package in packages:
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for name, value in vars(module).items():
                if name.isupper() and isinstance(value, str):
                    found[value] = name
    return found


CONVENTION_ATTRIBUTES = _constants(incubating_attributes, stable_attributes)
CONVENTION_METRICS = _constants(incubating_metrics)


def test_convention_names_are_the_semantic_conventions_packages():
    attributes = [a.name for a in semconv.ATTRIBUTES.values() if a.convention and a.name not in CONVENTION_ATTRIBUTES]
    metrics = [m.name for m in semconv.METRICS.values() if m.convention and m.name not in CONVENTION_METRICS]
    assert (attributes, metrics) == ([], [])


def test_our_own_names_are_visibly_ours():
    """Under gen_ai.* / openai.* only what the conventions define (or the opt-in post-v1.41 names)."""
    attributes = [
        a.name
        for a in semconv.ATTRIBUTES.values()
        if not a.convention
        and a.name not in semconv.GENAI_LATEST_NAMES
        and not a.name.startswith(OURS)
        and a.emitted_by & {semconv.VLLM, semconv.CLIENT, semconv.METRIC}
    ]
    metrics = [
        m.name
        for m in semconv.METRICS.values()
        if not m.convention and m.name not in semconv.GENAI_LATEST_METRICS and not m.name.startswith(OURS)
    ]
    assert (attributes, metrics) == ([], [])
    # and a name the conventions define is marked as such (so its check above runs)
    unmarked = [a.name for a in semconv.ATTRIBUTES.values() if not a.convention and a.name in CONVENTION_ATTRIBUTES]
    assert unmarked == []


def test_the_post_v1_41_names_are_not_in_the_v1_41_package():
    assert not semconv.GENAI_LATEST_NAMES & set(CONVENTION_ATTRIBUTES)
    assert not semconv.GENAI_LATEST_METRICS & set(CONVENTION_METRICS)
    assert semconv.GENAI_LATEST_METRICS <= set(semconv.METRICS)
    assert not any(semconv.METRICS[name].convention for name in semconv.GENAI_LATEST_METRICS)


def _references(paths: list[str]) -> set[str]:
    """semconv constant names referenced (semconv.NAME) in the given package files/folders."""
    names = set()
    for path in paths:
        target = PACKAGE / path
        for file in [target] if target.is_file() else target.rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "semconv":
                    names.add(node.attr)
    return names


def _constant_name(value: str) -> list[str]:
    return [k for k, v in vars(semconv).items() if k.isupper() and v == value]


@pytest.mark.parametrize("layer", sorted(EMITTERS))
def test_every_name_a_layer_is_said_to_emit_is_used_by_its_code(layer):
    used = _references(EMITTERS[layer])
    unused = [
        a.name for a in semconv.ATTRIBUTES.values() if layer in a.emitted_by and not set(_constant_name(a.name)) & used
    ]
    assert unused == []


def test_every_metric_is_created_by_some_layer():
    used = (
        _references(["vllm", "openai", "usage.py", "content.py", "ops/budget_tracker.py"]) | _references_in_examples()
    )
    unused = [m.name for m in semconv.METRICS.values() if not set(_constant_name(m.name)) & used]
    assert unused == []


def _references_in_examples() -> set[str]:
    names = set()
    for file in (PACKAGE.parent / "examples").rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "semconv":
                names.add(node.attr)
    return names


def test_no_name_without_a_spec_entry():
    """Every dotted name constant in semconv.py is an attribute or metric of the spec (a name used
    as a value or a unit is not dotted; event names are listed in EVENTS, instrumentation scopes in SCOPES)."""
    loose = [
        k
        for k, v in vars(semconv).items()
        if k.isupper()
        and isinstance(v, str)
        and "." in v
        and v not in semconv.ATTRIBUTES
        and v not in semconv.METRICS
        and v not in semconv.EVENTS
        and v not in semconv.SCOPES
    ]
    assert loose == []


def test_prometheus_names_are_unique_and_spec_derived():
    names = [m.prometheus for m in semconv.METRICS.values()]
    assert len(names) == len(set(names))
    assert semconv.prometheus_metric(semconv.SERVER_REQUEST_DURATION) == "gen_ai_server_request_duration_seconds"
    assert semconv.prometheus_metric(semconv.SERVER_TOKEN_USAGE) == "otel_llm_server_token_usage_total"
    assert semconv.prometheus_metric(semconv.CLIENT_TOKEN_USAGE) == "gen_ai_client_token_usage"
    assert semconv.prometheus_label(semconv.TENANT_ID) == "tenant_id"


def test_spec_violations_reports_what_the_spec_lacks():
    from helpers import spec_violations

    from devkit.otlp_receiver import LogRecord, MetricPoint, Span

    span = Span(
        "t",
        "s",
        "",
        "chat m",
        "INTERNAL",
        0,
        1,
        {semconv.GEN_AI_OPERATION_NAME: "chat", "made.up": 1, semconv.GEN_AI_USAGE_INPUT_TOKENS: "7"},
        "UNSET",
        "",
        {},
        "otel_llm.vllm",
    )
    http = Span("t", "h", "", "POST", "SERVER", 0, 1, {"http.route": "/x"}, "UNSET", "", {}, "opentelemetry.fastapi")
    point = MetricPoint(semconv.SERVER_REQUESTS, semconv.UNIT_REQUEST, "sum", {"reason": "x"})
    unknown = MetricPoint("otel_llm.made.up", "1", "sum", {})
    record = LogRecord(semconv.USAGE_EVENT, 0, "", "", {semconv.USAGE_ID: "i", "extra": 1})
    assert spec_violations([span, http], [point, unknown], [record]) == [
        "span attribute 'made.up' (otel_llm.vllm) is not in semconv.ATTRIBUTES for layer vllm",
        "span attribute 'gen_ai.usage.input_tokens' (otel_llm.vllm) is str, the spec says int",
        "metric attribute 'reason' of otel_llm.server.requests is not in semconv.ATTRIBUTES for layer metric",
        "metric 'otel_llm.made.up' is not in semconv.METRICS",
        "usage record field 'extra' is not in semconv.ATTRIBUTES for layer usage",
    ]
