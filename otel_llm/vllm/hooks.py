"""Every place otel-llm touches vLLM, in one table, with the wrappers that run there.

vLLM moves things between releases: each hook lists candidate modules (newest first). At
instrument time we look for the module files without importing vLLM (importing it costs
seconds); the patch itself is applied by a post-import hook when vLLM imports the module.
A hook that cannot be found logs one warning naming it, and serving goes on without it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import wrapt
from opentelemetry import context as otel_context, trace
from opentelemetry.instrumentation.utils import unwrap

from otel_llm import finalizer, semconv
from otel_llm.vllm import contract, http, routes
from otel_llm.vllm.request_telemetry import (CURRENT, RequestInfo, Telemetry, attach, detach, end_with_exception,
                                             request_info)

_log = logging.getLogger("otel_llm.vllm")


@dataclass(frozen=True)
class Hook:
    name: str
    modules: tuple[str, ...]  # candidates, newest vLLM first
    attribute: str  # "Class.method" or "function"
    factory: Callable[[Telemetry], Callable]  # -> wrapt wrapper
    purpose: str
    required: bool = True
    # other modules that bind the function by name (`from x import f`) and need the patch too
    aliases: tuple[str, ...] = ()


# --- wrappers -----------------------------------------------------------------------------


def _safe(what: str):
    """Decorator for our own bookkeeping: log once, never raise into vLLM."""
    warned = []

    def deco(fn):
        def inner(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception:
                if not warned:
                    warned.append(True)
                    _log.warning("otel-llm: %s failed; the request is served, its telemetry may be incomplete", what, exc_info=True)
                return None

        return inner

    return deco


def _request_info(operation: str, request, tel: Telemetry, raw_request, api_type: str | None = None) -> RequestInfo:
    tenant, scene, cost_center = tel.attribution(getattr(raw_request, "headers", None))
    return request_info(operation, lambda name: getattr(request, name, None), tenant=tenant, scene=scene,
                        cost_center=cost_center, api_type=api_type,
                        request=request if tel.capture is not None else None)


def _error_of(result) -> tuple[str, str] | None:
    """(error.type, message) when a handler returned an error instead of raising."""
    error = getattr(result, "error", None)  # vLLM's ErrorResponse
    if error is not None and hasattr(error, "code"):
        return str(getattr(error, "type", None) or error.code), str(getattr(error, "message", ""))
    status = getattr(result, "status_code", None)  # a starlette Response (pooling endpoints)
    if isinstance(status, int) and status >= 400:
        return str(status), ""
    return None


_SSE_DONE = "data: [DONE]\n\n"  # the last chunk of every OpenAI-style SSE stream vLLM sends


class _StreamTelemetry:
    """Wraps the SSE generator a streaming handler returns: first chunk time and the end.

    Per chunk this adds one await and a flag test; the span ends exactly once on
    exhaustion, error, cancellation (client gone) or close.
    """

    __slots__ = ("_inner", "_record", "_started", "_sse")

    def __init__(self, inner, record, sse: bool = True):
        finalizer.ensure_started()
        self._inner = inner
        self._record = record
        self._started = False
        self._sse = sse  # an HTTP stream: its first chunk is the client's first byte

    def __aiter__(self):
        return self

    async def __anext__(self):
        record = self._record
        if self._started:
            try:
                chunk = await self._inner.__anext__()
            except BaseException as exc:
                _end_on_exception(record, exc)
                raise
            if chunk == _SSE_DONE:
                # the client holds a complete response once this is sent: end (and bill) it now,
                # so a server killed before the generator's own end loses no usage record
                record.end()
            return chunk
        # first chunk: the engine request is added now, in whatever task iterates us
        tokens = _make_current(record)
        try:
            chunk = await self._inner.__anext__()
        except BaseException as exc:
            _end_on_exception(record, exc)
            raise
        finally:
            _restore_context(tokens)
        self._started = True
        if self._sse:
            _first_chunk(record)
        return chunk

    async def aclose(self):
        try:
            await self._inner.aclose()
        finally:
            self._record.end(aborted=True)

    async def athrow(self, *args):
        return await self._inner.athrow(*args)

    def __del__(self):
        record = self._record
        if not record.ended:  # never ended here: see otel_llm/finalizer.py
            finalizer.defer(record.end, aborted=True)


_first_chunk = _safe("recording a stream's first chunk")(lambda record: record.on_first_chunk())
# Making a record current and restoring the context around vLLM's code are our calls on every
# request path too: a fault there leaves the span without its engine request (no tokens), and never
# fails the request. The lambdas look the functions up at call time.
_make_current = _safe("making a request's span current")(lambda record: attach(record))
_restore_context = _safe("restoring the context after a request")(
    lambda tokens: detach(tokens) if tokens is not None else None
)
# Called while vLLM's exception (or the end of a stream) propagates: a fault here must not
# replace that exception with ours.
_end_on_exception = _safe("ending a request's span on an exception")(
    lambda record, exc: _end_with_exception(record, exc)
)


_end_with_exception = end_with_exception  # (a name here: the fault-injection suite targets it)


def handler_wrapper(operation: str, api_type: str | None = None):
    def factory(tel: Telemetry):
        start = _safe(f"starting the {operation} span")(
            lambda request, raw_request: _claimed(tel.start(_request_info(operation, request, tel, raw_request,
                                                                           api_type)))
        )

        async def wrapper(wrapped, instance, args, kwargs):
            request = args[0] if args else kwargs.get("request")
            raw_request = args[1] if len(args) > 1 else kwargs.get("raw_request")
            record = start(request, raw_request)
            if record is None:
                return await wrapped(*args, **kwargs)
            _mark_traced(raw_request)
            result = await _run_current(record, wrapped, args, kwargs)
            return _finish_handler(record, result, raw_request)

        return wrapper

    return factory


async def _run_current(record, wrapped, args, kwargs):
    """await vLLM's coroutine with `record` current; an exception ends the record and goes on."""
    tokens = _make_current(record)
    try:
        return await wrapped(*args, **kwargs)
    except BaseException as exc:
        _end_on_exception(record, exc)
        raise
    finally:
        _restore_context(tokens)


def _claimed(record):
    _claim(record)  # the route this request came by adds no span of its own
    return record


_claim = _safe("claiming a request for its route")(lambda record: routes.claim(record))


@_safe("marking a request as traced")
def _mark_traced(raw_request) -> None:
    """The request has its GenAI span: an exception handler running for it records no rejection."""
    state = getattr(raw_request, "state", None)
    if state is not None:
        state.otel_llm_traced = True


@_safe("reading a vLLM response")
def _read_response(record, result, raw_request):
    # the id vLLM puts in the response (and every stream chunk) is kept for its middleware
    metadata = getattr(getattr(raw_request, "state", None), "request_metadata", None)
    record.metadata = metadata
    response_id = contract.read_response_id(metadata)
    if response_id is not None:
        record.response_id = response_id
    error = _error_of(result)
    if error is not None:
        record.end(error_type=error[0], error_message=error[1])
        return result
    if hasattr(result, "__anext__"):
        return _StreamTelemetry(result, record)
    record.end(response=result if hasattr(result, "choices") else None)
    return result


def _finish_handler(record, result, raw_request):
    wrapped = _read_response(record, result, raw_request)
    if wrapped is None:
        record.end()
        return result
    return wrapped


def attach_engine_request(tel: Telemetry):
    on_attach = _safe("attaching an engine request")(
        lambda instance, request: _attach(tel, instance, request)
    )

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        request = args[0] if args else kwargs.get("request")
        on_attach(instance, request)
        return result

    return wrapper


def _attach(tel: Telemetry, output_processor, request) -> None:
    record = CURRENT.get()
    if record is None:
        record = routes.record_for_engine_request(tel)
    if record is None or record.ended:
        return
    state = contract.read_request_states(output_processor).get(request.request_id)
    if state is not None and state.request_id not in tel.by_engine_id:
        record.attach_engine_request(state)
        if record.pd_role is None:
            record.pd_role = _pd_role(request)


def _pd_role(request) -> str | None:
    """The P/D leg an engine request is, from the kv_transfer_params vLLM passes in extra_args."""
    params = contract.read_kv_transfer_params(request)
    if params is None:
        return None
    if params.get("do_remote_decode"):
        return semconv.PD_ROLE_PREFILL
    if params.get("do_remote_prefill"):
        return semconv.PD_ROLE_DECODE
    return None


def engine_finished(tel: Telemetry):
    @_safe("recording an engine finish")
    def on_finish(req_state, finish_reason):
        record = tel.by_engine_id.get(req_state.request_id)
        if record is not None:
            record.on_engine_finished(req_state, finish_reason)

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        req_state = args[0] if args else kwargs.get("req_state")
        finish_reason = args[1] if len(args) > 1 else kwargs.get("finish_reason")
        on_finish(req_state, finish_reason)
        return result

    return wrapper


def engine_aborted(tel: Telemetry):
    @_safe("recording an engine abort")
    def on_abort(aborted_ids):
        for request_id in aborted_ids or ():
            record = tel.by_engine_id.pop(request_id, None)
            if record is None:
                continue
            record.engine_aborted = True
            if record.engine_owned:
                record.end(aborted=True)

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        on_abort(result)
        return result

    return wrapper


def native_tracing_off(tel: Telemetry):
    """vLLM's own `llm_request` span (--otlp-traces-endpoint) would trace every request twice."""

    def wrapper(wrapped, instance, args, kwargs):
        return None

    return wrapper


def _engine_model(engine) -> str | None:
    config = getattr(engine, "model_config", None)
    return getattr(config, "served_model_name", None) or getattr(config, "model", None)


def async_llm_generate(tel: Telemetry):
    """AsyncLLM used directly (no OpenAI handler around it): the generate() call is the request."""
    start = _safe("starting an AsyncLLM span")(
        lambda engine, params: tel.start(_engine_request_info(engine, params))
    )

    def wrapper(wrapped, instance, args, kwargs):
        if CURRENT.get() is not None or routes.SCOPE.get() is not None:  # a handler's or a route's span
            return wrapped(*args, **kwargs)
        record = start(instance, args[1] if len(args) > 1 else kwargs.get("sampling_params"))
        if record is None:
            return wrapped(*args, **kwargs)
        # generate() is an async generator: its body, add_request included, runs on the first
        # __anext__, which _StreamTelemetry runs with the record current
        return _StreamTelemetry(wrapped(*args, **kwargs), record, sse=False)

    return wrapper


def _engine_request_info(engine, params) -> RequestInfo:
    n = getattr(params, "n", None)
    top_k = getattr(params, "top_k", None)
    return RequestInfo(
        operation=semconv.OP_TEXT_COMPLETION if hasattr(params, "max_tokens") else semconv.OP_EMBEDDINGS,
        model=_engine_model(engine),
        choice_count=n,
        max_tokens=getattr(params, "max_tokens", None),
        temperature=getattr(params, "temperature", None),
        top_p=getattr(params, "top_p", None),
        top_k=top_k if top_k and top_k > 0 else None,  # -1 / 0: disabled
        seed=getattr(params, "seed", None),
    )


def llm_engine_add_request(tel: Telemetry):
    """Offline LLMEngine (vllm.LLM): one span per engine request, ended when the engine finishes."""
    start = _safe("starting an LLMEngine span")(
        lambda engine, params: tel.start(_engine_request_info(engine, params), engine_owned=True)
    )

    def wrapper(wrapped, instance, args, kwargs):
        if CURRENT.get() is not None:
            return wrapped(*args, **kwargs)
        record = start(instance, args[2] if len(args) > 2 else kwargs.get("params"))
        if record is None:
            return wrapped(*args, **kwargs)
        tokens = _make_current(record)
        try:
            return wrapped(*args, **kwargs)
        except BaseException as exc:
            _end_on_exception(record, exc)
            raise
        finally:
            _restore_context(tokens)

    return wrapper


def llm_keeps_stats(tel: Telemetry):
    """vllm.LLM turns per-request stats off by default; the phase spans need them."""

    def wrapper(wrapped, instance, args, kwargs):
        if "disable_log_stats" not in kwargs:
            kwargs["disable_log_stats"] = False
        return wrapped(*args, **kwargs)

    return wrapper


def validation_rejection(tel: Telemetry, by_exception: bool = False):
    """Requests FastAPI rejects before any handler runs (bad JSON, schema errors) get a span too."""

    @_safe("recording a rejected request")
    def record_rejection(request, exc, response):
        route = routes.ROUTES.get(request.url.path)
        if route is None or getattr(request.state, "otel_llm_traced", False):
            return
        operation = route.operation or semconv.OP_TEXT_COMPLETION
        tenant, scene, cost_center = tel.attribution(request.headers)
        record = tel.start(RequestInfo(operation=operation, tenant=tenant, scene=scene, cost_center=cost_center,
                                       api_type=route.api_type))
        error_type = str(getattr(response, "status_code", "400"))
        if by_exception and exc is not None:
            error_type = type(exc).__qualname__
        else:
            try:
                error_type = json.loads(response.body)["error"]["type"] or error_type
            except Exception:
                pass
        record.end(error_type=error_type, error_message="request rejected before reaching the engine")
        request.state.otel_llm_traced = True  # the route (routes.py) adds no error span of its own

    async def wrapper(wrapped, instance, args, kwargs):
        response = await wrapped(*args, **kwargs)
        record_rejection(args[0] if args else kwargs.get("req", kwargs.get("request")),
                         args[1] if len(args) > 1 else kwargs.get("exc"), response)
        return response

    return wrapper


def vllm_error_rejection(tel: Telemetry):
    """A VLLMError raised before a handler runs (a request model's validator: `prompt` missing) goes
    to vLLM's VLLMError handler; one raised inside a handler already ended that handler's span."""
    return validation_rejection(tel, by_exception=True)


def background_response(tel: Telemetry):
    """Responses API with background=true: the handler answers `queued` and a task generates later.
    That work is its own request (span, tokens, usage record), linked to the request that started it."""
    start = _safe("starting a background response span")(
        lambda request, origin: tel.start(
            _request_info(semconv.OP_CHAT, request, tel, None, semconv.OPENAI_API_TYPE_RESPONSES)
            if origin is None else origin.info,
            links=[trace.Link(origin.span.get_span_context())] if origin is not None else None,
            context=otel_context.Context())  # a trace of its own: the first one may be decided already
    )

    async def wrapper(wrapped, instance, args, kwargs):
        record = start(args[0] if args else kwargs.get("request"), CURRENT.get())
        if record is None:
            return await wrapped(*args, **kwargs)
        result = await _run_current(record, wrapped, args, kwargs)
        _end_background(record)
        return result

    return wrapper


_end_background = _safe("ending a background response span")(lambda record: record.end())


_OUTPUT_PROCESSOR = ("vllm.v1.engine.output_processor",)

HOOKS: tuple[Hook, ...] = (
    Hook("chat handler", ("vllm.entrypoints.openai.chat_completion.serving", "vllm.entrypoints.openai.serving_chat"),
         "OpenAIServingChat.create_chat_completion", handler_wrapper(semconv.OP_CHAT),
         "GenAI span for /v1/chat/completions"),
    Hook("completion handler", ("vllm.entrypoints.openai.completion.serving", "vllm.entrypoints.openai.serving_completion"),
         "OpenAIServingCompletion.create_completion", handler_wrapper(semconv.OP_TEXT_COMPLETION),
         "GenAI span for /v1/completions"),
    Hook("responses handler", ("vllm.entrypoints.openai.responses.serving",),
         "OpenAIServingResponses.create_responses",
         handler_wrapper(semconv.OP_CHAT, semconv.OPENAI_API_TYPE_RESPONSES),
         "GenAI span for /v1/responses (one per request across its tool turns)", required=False),
    Hook("background response", ("vllm.entrypoints.openai.responses.serving",),
         "OpenAIServingResponses._run_background_request", background_response,
         "GenAI span for /v1/responses with background=true", required=False),
    Hook("background response stream", ("vllm.entrypoints.openai.responses.serving",),
         "OpenAIServingResponses._run_background_request_stream", background_response,
         "GenAI span for /v1/responses with background=true and stream=true", required=False),
    Hook("embeddings handler", ("vllm.entrypoints.pooling.embed.serving",),
         "ServingEmbedding.__call__", handler_wrapper(semconv.OP_EMBEDDINGS),
         "GenAI span for /v1/embeddings", required=False),
    Hook("engine request added", _OUTPUT_PROCESSOR, "OutputProcessor.add_request", attach_engine_request,
         "links engine requests (tokens, phase timestamps) to their span"),
    Hook("engine request finished", _OUTPUT_PROCESSOR, "OutputProcessor._update_stats_from_finished",
         engine_finished, "finish reasons; ends offline spans"),
    Hook("engine request aborted", _OUTPUT_PROCESSOR, "OutputProcessor.abort_requests", engine_aborted,
         "ends offline (and marks route) spans of aborted requests"),
    Hook("native tracing", _OUTPUT_PROCESSOR, "OutputProcessor.do_tracing", native_tracing_off,
         "keeps --otlp-traces-endpoint from tracing each request twice", required=False),
    Hook("AsyncLLM.generate", ("vllm.v1.engine.async_llm",), "AsyncLLM.generate", async_llm_generate,
         "GenAI span for AsyncLLM used directly"),
    Hook("LLMEngine.add_request", ("vllm.v1.engine.llm_engine",), "LLMEngine.add_request", llm_engine_add_request,
         "GenAI span for offline vllm.LLM"),
    Hook("LLM stats", ("vllm.entrypoints.llm",), "LLM.__init__", llm_keeps_stats,
         "keeps per-request stats on for offline vllm.LLM", required=False),
    Hook("build_app", ("vllm.entrypoints.launchers.app", "vllm.entrypoints.openai.api_server"), "build_app",
         http.build_app_wrapper, "HTTP server spans on vLLM's FastAPI app",
         aliases=("vllm.entrypoints.launchers.api_server.entry",)),
    Hook("request validation", ("vllm.entrypoints.serve.exception_handling.register",),
         "validation_exception_handler", validation_rejection,
         "error span for requests rejected before a handler runs", required=False),
    Hook("vLLM error handler", ("vllm.entrypoints.serve.exception_handling.register",),
         "vllm_error_handler", vllm_error_rejection,
         "error span for requests a request model's validator rejects with a VLLMError", required=False),
)


# --- applying -----------------------------------------------------------------------------


def module_exists(module: str) -> bool:
    """True if the module's file is there, found without importing vLLM."""
    parts = module.split(".")
    spec = importlib.util.find_spec(parts[0])
    if spec is None or not spec.submodule_search_locations:
        return False
    for base in spec.submodule_search_locations:
        path = os.path.join(base, *parts[1:])
        if os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py")):
            return True
    return False


def locate(hook: Hook) -> str | None:
    """The first candidate module whose file exists; when that file is an alias shim (it replaces
    itself in sys.modules with the module vLLM moved it to), the module it stands for: a post-import
    hook fires on the name vLLM imports, never on the alias."""
    module = next((m for m in hook.modules if module_exists(m)), None)
    if module is None:
        return None
    spec = importlib.util.find_spec(module.split(".")[0])
    for base in (spec.submodule_search_locations or []) if spec else []:
        target = contract.shim_target(contract.Source(os.path.dirname(base)), module)
        if target is not None:
            return target
    return module


def _has_attribute(module, attribute: str) -> bool:
    obj: Any = module
    for part in attribute.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return False
    return True


class Patcher:
    def __init__(self, tel: Telemetry, hooks: tuple[Hook, ...] = HOOKS):
        self.tel = tel
        self.hooks = hooks
        self.applied: list[tuple[Any, str]] = []  # (module, attribute) for unwrap
        self.missing: list[str] = []
        self.active = True

    def install(self) -> None:
        for hook in self.hooks:
            module_name = locate(hook)
            if module_name is None:
                self._missing(hook, "module not found: " + " | ".join(hook.modules))
                continue
            wrapt.register_post_import_hook(lambda module, hook=hook: self._apply(hook, module), module_name)

    def _apply(self, hook: Hook, module) -> None:
        if not self.active:
            return
        try:
            if not _has_attribute(module, hook.attribute):
                self._missing(hook, f"{module.__name__}.{hook.attribute} not found")
                return
            wrapper = hook.factory(self.tel)
            wrapt.wrap_function_wrapper(module, hook.attribute, wrapper)
            self.applied.append((module, hook.attribute))
            if "." not in hook.attribute:
                patched = getattr(module, hook.attribute)
                for alias in hook.aliases:
                    other = sys.modules.get(alias)
                    if other is not None and hasattr(other, hook.attribute):
                        setattr(other, hook.attribute, patched)
                        self.applied.append((other, hook.attribute))
        except Exception:
            _log.warning("otel-llm: could not patch vLLM hook %r", hook.name, exc_info=True)
            self.missing.append(hook.name)

    def _missing(self, hook: Hook, why: str) -> None:
        self.missing.append(hook.name)
        level = logging.WARNING if hook.required else logging.INFO
        _log.log(level, "otel-llm: vLLM hook %r unavailable (%s); without it: no %s. Serving continues.",
                 hook.name, why, hook.purpose)

    def uninstall(self) -> None:
        self.active = False
        for module, attribute in reversed(self.applied):
            parent: Any = module
            *path, name = attribute.split(".")
            for part in path:
                parent = getattr(parent, part)
            unwrap(parent, name)
        self.applied.clear()
