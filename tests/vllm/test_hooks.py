"""The vLLM hook table (otel_llm/vllm/hooks.py): every hook found in the installed vLLM, missing
ones reported; the wrappers' error recognition; VLLMInstrumentor install, reinstall and uninstall;
the frontends it cannot trace."""

import logging
import sys
from types import SimpleNamespace

from otel_llm import patching
from otel_llm.vllm import contract, hooks, wrappers


def test_every_hook_is_found_in_the_installed_vllm():
    import importlib

    for hook in hooks.HOOKS:
        module_name = hooks.locate(hook)
        assert module_name is not None, hook.name
        assert patching.has_attribute(importlib.import_module(module_name), hook.attribute), hook.name


def test_missing_hook_warns_once_naming_it(caplog):
    missing = patching.Hook("gone", ("vllm.no_such_module_xyz",), "f", wrappers.native_tracing_off, "something")
    optional = patching.Hook(
        "maybe", ("vllm.no_such_module_abc",), "f", wrappers.native_tracing_off, "extra", required=False
    )
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


def test_error_responses_are_recognised():
    error = SimpleNamespace(error=SimpleNamespace(code=404, type="NotFoundError", message="no model"))
    assert contract.read_error(error) == ("NotFoundError", "no model")
    assert contract.read_error(SimpleNamespace(status_code=503)) == ("503", "")
    assert contract.read_error(SimpleNamespace(choices=[])) is None


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
