"""Every place otel-llm touches vLLM, in one table (applied by otel_llm/patching.py).

vLLM moves things between releases: each hook lists candidate modules (newest first), and a hook
that cannot be found logs one warning naming it while serving goes on without it. What vLLM objects
are read lives in contract.py; `otel-llm doctor` and `make compat` check both against a vLLM.
"""

from __future__ import annotations

import importlib.util
import logging
import os

from otel_llm import patching, semconv
from otel_llm.patching import Hook
from otel_llm.vllm import contract, engine_cost, http
from otel_llm.vllm.wrappers import (
    async_llm_generate,
    attach_engine_request,
    background_response,
    engine_aborted,
    engine_finished,
    handler_wrapper,
    llm_engine_add_request,
    llm_keeps_stats,
    native_tracing_off,
    redacting_loggers,
    validation_rejection,
    vllm_error_rejection,
)

_log = logging.getLogger("otel_llm.vllm")


_OUTPUT_PROCESSOR = ("vllm.v1.engine.output_processor",)
_SCHEDULER = ("vllm.v1.core.sched.scheduler",)
_ENGINE_CORE = ("vllm.v1.engine.core",)
_COST = "per-request engine cost (compute and KV shares, preemptions, idle time) in the usage ledger"

HOOKS: tuple[Hook, ...] = (
    Hook(
        "chat handler",
        ("vllm.entrypoints.openai.chat_completion.serving", "vllm.entrypoints.openai.serving_chat"),
        "OpenAIServingChat.create_chat_completion",
        handler_wrapper(semconv.OP_CHAT),
        "GenAI span for /v1/chat/completions",
    ),
    Hook(
        "completion handler",
        ("vllm.entrypoints.openai.completion.serving", "vllm.entrypoints.openai.serving_completion"),
        "OpenAIServingCompletion.create_completion",
        handler_wrapper(semconv.OP_TEXT_COMPLETION),
        "GenAI span for /v1/completions",
    ),
    Hook(
        "responses handler",
        ("vllm.entrypoints.openai.responses.serving",),
        "OpenAIServingResponses.create_responses",
        handler_wrapper(semconv.OP_CHAT, semconv.OPENAI_API_TYPE_RESPONSES),
        "GenAI span for /v1/responses (one per request across its tool turns)",
        required=False,
    ),
    Hook(
        "background response",
        ("vllm.entrypoints.openai.responses.serving",),
        "OpenAIServingResponses._run_background_request",
        background_response,
        "GenAI span for /v1/responses with background=true",
        required=False,
    ),
    Hook(
        "background response stream",
        ("vllm.entrypoints.openai.responses.serving",),
        "OpenAIServingResponses._run_background_request_stream",
        background_response,
        "GenAI span for /v1/responses with background=true and stream=true",
        required=False,
    ),
    Hook(
        "embeddings handler",
        ("vllm.entrypoints.pooling.embed.serving",),
        "ServingEmbedding.__call__",
        handler_wrapper(semconv.OP_EMBEDDINGS),
        "GenAI span for /v1/embeddings",
        required=False,
    ),
    Hook(
        "engine request added",
        _OUTPUT_PROCESSOR,
        "OutputProcessor.add_request",
        attach_engine_request,
        "links engine requests (tokens, phase timestamps) to their span",
    ),
    Hook(
        "engine request finished",
        _OUTPUT_PROCESSOR,
        "OutputProcessor._update_stats_from_finished",
        engine_finished,
        "finish reasons; ends offline spans",
    ),
    Hook(
        "engine request aborted",
        _OUTPUT_PROCESSOR,
        "OutputProcessor.abort_requests",
        engine_aborted,
        "ends offline (and marks route) spans of aborted requests",
    ),
    Hook(
        "native tracing",
        _OUTPUT_PROCESSOR,
        "OutputProcessor.do_tracing",
        native_tracing_off,
        "keeps --otlp-traces-endpoint from tracing each request twice",
        required=False,
    ),
    Hook(
        "AsyncLLM.generate",
        ("vllm.v1.engine.async_llm",),
        "AsyncLLM.generate",
        async_llm_generate,
        "GenAI span for AsyncLLM used directly",
    ),
    Hook(
        "LLMEngine.add_request",
        ("vllm.v1.engine.llm_engine",),
        "LLMEngine.add_request",
        llm_engine_add_request,
        "GenAI span for offline vllm.LLM",
    ),
    Hook(
        "LLM stats",
        ("vllm.entrypoints.llm",),
        "LLM.__init__",
        llm_keeps_stats,
        "keeps per-request stats on for offline vllm.LLM",
        required=False,
    ),
    Hook(
        "build_app",
        ("vllm.entrypoints.launchers.app", "vllm.entrypoints.openai.api_server"),
        "build_app",
        http.build_app_wrapper,
        "HTTP server spans on vLLM's FastAPI app",
        aliases=("vllm.entrypoints.launchers.api_server.entry",),
    ),
    Hook(
        "request validation",
        ("vllm.entrypoints.serve.exception_handling.register",),
        "validation_exception_handler",
        validation_rejection,
        "error span for requests rejected before a handler runs",
        required=False,
    ),
    Hook(
        "vLLM error handler",
        ("vllm.entrypoints.serve.exception_handling.register",),
        "vllm_error_handler",
        vllm_error_rejection,
        "error span for requests a request model's validator rejects with a VLLMError",
        required=False,
    ),
    # the engine-core process (otel_llm/vllm/engine_cost.py)
    Hook("engine step scheduled", _SCHEDULER, "Scheduler.schedule", engine_cost.scheduled, _COST, required=False),
    Hook("engine step done", _SCHEDULER, "Scheduler.update_from_output", engine_cost.updated, _COST, required=False),
    Hook(
        "engine request preempted",
        _SCHEDULER,
        "Scheduler._preempt_request",
        engine_cost.preempted,
        _COST,
        required=False,
    ),
    Hook(
        "engine blocks freed", _SCHEDULER, "Scheduler._free_request_blocks", engine_cost.freeing, _COST, required=False
    ),
    Hook("engine request freed", _SCHEDULER, "Scheduler._free_request", engine_cost.finished, _COST, required=False),
    Hook(
        "engine input wait",
        _ENGINE_CORE,
        "EngineCoreProc._process_input_queue",
        engine_cost.input_queue,
        _COST + " (its idle time)",
        required=False,
    ),
    Hook(
        "engine shutdown",
        _ENGINE_CORE,
        "EngineCore.shutdown",
        engine_cost.shutdown,
        _COST + " (the last window)",
        required=False,
    ),
    Hook(
        "vLLM loggers",
        ("vllm.logger",),
        "init_logger",
        redacting_loggers,
        "vLLM's warnings and errors (a 404 echoes the model name) redacted",
        required=False,
    ),
)


def resolve_alias(module: str) -> str | None:
    """The module an alias shim stands for (it replaces itself in sys.modules with the module vLLM
    moved it to), read from vLLM's sources without importing them; None when `module` is no shim."""
    spec = importlib.util.find_spec(module.split(".")[0])
    for base in (spec.submodule_search_locations or []) if spec else []:
        target = contract.shim_target(contract.Source(os.path.dirname(base)), module)
        if target is not None:
            return target
    return None


def locate(hook: Hook) -> str | None:
    """The module name vLLM imports for `hook`, or None when none of its candidates exists."""
    return patching.locate(hook, resolve_alias)


def patcher(telemetry, hooks: tuple[Hook, ...] = HOOKS) -> patching.Patcher:
    return patching.Patcher(telemetry, hooks, _log, "vLLM", resolve_alias)
