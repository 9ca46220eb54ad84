"""Client-side instrumentation of the OpenAI Python client (sync, async, streaming).

Every touch point of the openai package is in `HOOKS`; each is applied (wrapt) when openai imports
its module, and a missing one logs one warning instead of failing. See `telemetry.py` for what a
call records and `streams.py` for how streamed calls end.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Collection

from opentelemetry import metrics, trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_llm import __version__, ensure_log_handler, patching, semconv
from otel_llm.config import ClientSettings
from otel_llm.openai.telemetry import ClientTelemetry
from otel_llm.patching import Hook

_log = logging.getLogger("otel_llm.openai")

_CHAT = ("openai.resources.chat.completions.completions", "openai.resources.chat.completions")


def _hooks(
    modules: tuple[str, ...],
    classes: tuple[str, str],
    method: str,
    operation: str,
    api_type: str | None = None,
    required: bool = True,
) -> tuple[Hook, ...]:
    """The sync and the async class's method: one hook each."""

    def factory(is_async: bool):
        def make(telemetry: ClientTelemetry):
            from otel_llm.openai.wrappers import make_wrapper

            return make_wrapper(telemetry, operation, api_type, is_async)

        return make

    return tuple(
        Hook(
            f"{cls}.{method}",
            modules,
            f"{cls}.{method}",
            factory(is_async),
            f"{operation} spans and metrics for {cls}.{method}",
            required,
        )
        for cls, is_async in ((classes[0], False), (classes[1], True))
    )


# Every touch point of the openai package (applied by otel_llm/patching.py when openai imports
# each module; a missing one logs one warning instead of failing). `otel-llm doctor` lists them.
HOOKS: tuple[Hook, ...] = (
    *_hooks(_CHAT, ("Completions", "AsyncCompletions"), "create", semconv.OP_CHAT, semconv.OPENAI_API_TYPE_CHAT),
    *_hooks(
        _CHAT,
        ("Completions", "AsyncCompletions"),
        "parse",
        semconv.OP_CHAT,
        semconv.OPENAI_API_TYPE_CHAT,
        required=False,
    ),
    *_hooks(
        ("openai.resources.completions",), ("Completions", "AsyncCompletions"), "create", semconv.OP_TEXT_COMPLETION
    ),
    *_hooks(("openai.resources.embeddings",), ("Embeddings", "AsyncEmbeddings"), "create", semconv.OP_EMBEDDINGS),
    *_hooks(
        ("openai.resources.responses.responses", "openai.resources.responses"),
        ("Responses", "AsyncResponses"),
        "create",
        semconv.OP_CHAT,
        semconv.OPENAI_API_TYPE_RESPONSES,
        required=False,
    ),
)


class OpenAIInstrumentor(BaseInstrumentor):
    """GenAI CLIENT spans and metrics for openai's chat, completions, embeddings and responses calls.

    Keyword arguments of `instrument()` (each overrides its environment variable):
    tracer_provider, meter_provider, capture_content (bool), include_usage (bool),
    propagate (bool), provider_name (str).
    """

    _patcher: patching.Patcher | None = None

    def instrumentation_dependencies(self) -> Collection[str]:
        # openai is one of the package's `instruments-any`; its absence is handled in _instrument.
        return ()

    def _instrument(self, **kwargs):
        ensure_log_handler()
        if importlib.util.find_spec("openai") is None:
            _log.debug("otel-llm: openai is not installed; nothing to instrument")
            return
        tracer = trace.get_tracer(semconv.CLIENT_SCOPE, __version__, kwargs.get("tracer_provider"))
        meter = metrics.get_meter(semconv.CLIENT_SCOPE, __version__, kwargs.get("meter_provider"))
        telemetry = ClientTelemetry(tracer, meter, ClientSettings.from_env(**kwargs))
        # Patched when the app imports each openai module (importing openai here would cost every
        # process that `opentelemetry-instrument` starts, vLLM servers included).
        OpenAIInstrumentor._patcher = patcher(telemetry)
        OpenAIInstrumentor._patcher.install()

    def _uninstrument(self, **kwargs):
        patcher_, OpenAIInstrumentor._patcher = OpenAIInstrumentor._patcher, None
        if patcher_ is not None:
            patcher_.uninstall()


def patcher(telemetry, hooks: tuple[Hook, ...] = HOOKS) -> patching.Patcher:
    return patching.Patcher(telemetry, hooks, _log, "openai")
