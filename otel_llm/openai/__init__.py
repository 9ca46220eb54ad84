"""Client-side instrumentation of the OpenAI Python client (sync, async, streaming).

Every touch point of the openai package is in `PATCHES`; each is applied (wrapt) when openai is
imported, and a missing one logs one warning instead of failing. See `telemetry.py` for what a
call records and `streams.py` for how streamed calls end.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Collection, NamedTuple

import wrapt
from opentelemetry import metrics, trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.instrumentation.utils import unwrap

from otel_llm import __version__, ensure_log_handler, semconv
from otel_llm.openai.telemetry import ClientSettings, ClientTelemetry

_log = logging.getLogger("otel_llm.openai")


class Patch(NamedTuple):
    modules: tuple[str, ...]  # candidate module paths, newest openai layout first
    classes: tuple[str, str]  # (sync class, async class)
    method: str
    operation: str
    api_type: str | None = None


PATCHES = (
    Patch(("openai.resources.chat.completions.completions", "openai.resources.chat.completions"),
          ("Completions", "AsyncCompletions"), "create", semconv.OP_CHAT, semconv.OPENAI_API_TYPE_CHAT),
    Patch(("openai.resources.chat.completions.completions", "openai.resources.chat.completions"),
          ("Completions", "AsyncCompletions"), "parse", semconv.OP_CHAT, semconv.OPENAI_API_TYPE_CHAT),
    Patch(("openai.resources.completions",), ("Completions", "AsyncCompletions"), "create",
          semconv.OP_TEXT_COMPLETION),
    Patch(("openai.resources.embeddings",), ("Embeddings", "AsyncEmbeddings"), "create", semconv.OP_EMBEDDINGS),
    Patch(("openai.resources.responses.responses", "openai.resources.responses"),
          ("Responses", "AsyncResponses"), "create", semconv.OP_CHAT, semconv.OPENAI_API_TYPE_RESPONSES),
)


class OpenAIInstrumentor(BaseInstrumentor):
    """GenAI CLIENT spans and metrics for openai's chat, completions, embeddings and responses calls.

    Keyword arguments of `instrument()` (each overrides its environment variable):
    tracer_provider, meter_provider, capture_content (bool), include_usage (bool),
    propagate (bool), provider_name (str).
    """

    _applied: list = []
    _telemetry: ClientTelemetry | None = None

    def instrumentation_dependencies(self) -> Collection[str]:
        # openai is one of the package's `instruments-any`; its absence is handled in _instrument.
        return ()

    def _instrument(self, **kwargs):
        ensure_log_handler()
        if importlib.util.find_spec("openai") is None:
            _log.debug("otel-llm: openai is not installed; nothing to instrument")
            return
        tracer = trace.get_tracer("otel_llm.openai", __version__, kwargs.get("tracer_provider"))
        meter = metrics.get_meter("otel_llm.openai", __version__, kwargs.get("meter_provider"))
        OpenAIInstrumentor._telemetry = ClientTelemetry(tracer, meter, ClientSettings.from_env(**kwargs))
        # Patched when the app imports openai (importing it here would cost every process that
        # `opentelemetry-instrument` starts, vLLM servers included).
        wrapt.register_post_import_hook(lambda _module: self._patch(), "openai")

    def _patch(self) -> None:
        telemetry = OpenAIInstrumentor._telemetry
        if telemetry is None:
            return
        from otel_llm.openai.wrappers import make_wrapper

        for patch in PATCHES:
            module = _first_module(patch.modules, patch.classes[0], patch.method)
            if module is None:
                _log.warning("otel-llm: openai %s.%s not found in %s; those calls are not traced",
                             patch.classes[0], patch.method, " | ".join(patch.modules))
                continue
            for cls, is_async in ((patch.classes[0], False), (patch.classes[1], True)):
                target = getattr(module, cls, None)
                if target is None or isinstance(vars(target).get(patch.method), wrapt.FunctionWrapper):
                    continue
                wrapper = make_wrapper(telemetry, patch.operation, patch.api_type, is_async)
                wrapt.wrap_function_wrapper(module, f"{cls}.{patch.method}", wrapper)
                OpenAIInstrumentor._applied.append((target, patch.method))

    def _uninstrument(self, **kwargs):
        OpenAIInstrumentor._telemetry = None
        for target, method in reversed(OpenAIInstrumentor._applied):
            unwrap(target, method)
        OpenAIInstrumentor._applied.clear()


def _first_module(candidates: tuple[str, ...], cls: str, method: str):
    for name in candidates:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(getattr(module, cls, None), method):
            return module
    return None
