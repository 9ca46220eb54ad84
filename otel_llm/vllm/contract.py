"""The fields of vLLM objects otel-llm reads: declared (FIELDS, next to the hook table), read (the
functions below are the only code of otel-llm that reads a vLLM object: the engine's request state,
stats and detokenizer, the engine core's scheduler and requests, a handler's request, response and
metadata), and checked against vLLM's Python sources: the installed vLLM (`otel-llm
doctor`) or any release unpacked from its wheel (`otel-llm doctor --source DIR`, `make compat`),
without importing vLLM or needing a GPU.

The checker reads the sources with `ast`: a class offers a field when it declares it (dataclass,
pydantic or msgspec annotation), assigns `self.<field>` in a method, defines it as a method or
property, or inherits it from a base class it can follow (same module or a `from vllm... import`).
"""

from __future__ import annotations

import ast
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from operator import attrgetter
from pathlib import Path
from typing import Any

from otel_llm.warn import warn_once


@dataclass(frozen=True)
class Fields:
    modules: tuple[str, ...]  # candidates, newest vLLM first
    cls: str
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()  # read with a default where a release lacks them
    why: str = ""
    optional_class: bool = False  # a release without the class loses only what `why` says


_OUTPUT_PROCESSOR = ("vllm.v1.engine.output_processor",)
_CHAT_PROTOCOL = ("vllm.entrypoints.openai.chat_completion.protocol", "vllm.entrypoints.openai.protocol")
_COMPLETION_PROTOCOL = ("vllm.entrypoints.openai.completion.protocol", "vllm.entrypoints.openai.protocol")
_RESPONSES_PROTOCOL = ("vllm.entrypoints.openai.responses.protocol", "vllm.entrypoints.openai.protocol")
_SERVE_PROTOCOL = ("vllm.entrypoints.serve.engine.protocol", "vllm.entrypoints.openai.protocol")
_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty")

FIELDS: tuple[Fields, ...] = (
    Fields(
        _OUTPUT_PROCESSOR,
        "OutputProcessor",
        ("request_states",),
        ("tracing_enabled",),
        why="engine request -> its RequestState; its final output (the engine's figures)",
    ),
    Fields(
        _OUTPUT_PROCESSOR,
        "RequestState",
        (
            "request_id",
            "external_req_id",
            "parent_req",
            "request_index",
            "prompt_len",
            "num_cached_tokens",
            "detokenizer",
            "stats",
        ),
        ("lora_name", "num_cache_creation_tokens", "remote_prefill_cached_tokens", "spec_decode_metrics"),
        why="tokens, ids and timing of each engine request",
    ),
    Fields(
        ("vllm.v1.metrics.stats",),
        "PrefillStats",
        ("num_external_cached_tokens",),
        optional_class=True,
        why="the part of a request's prefix-cache hit a KV connector loaded (local vs external)",
    ),
    Fields(
        ("vllm.v1.metrics.stats",),
        "RequestSpecDecodeMetrics",
        ("histogram", "num_draft_tokens"),
        optional_class=True,
        why="speculative decoding per request: drafts proposed and accepted",
    ),
    Fields(
        ("vllm.v1.metrics.stats",),
        "RequestStateStats",
        (
            "queued_ts",
            "scheduled_ts",
            "first_token_ts",
            "last_token_ts",
            "first_token_latency",
            "num_generation_tokens",
        ),
        ("num_preemptions",),
        why="queue / prefill / decode phases, TTFT",
    ),
    Fields(("vllm.v1.engine.detokenizer",), "IncrementalDetokenizer", ("num_output_tokens",), why="output tokens"),
    Fields(
        ("vllm.v1.engine.detokenizer",),
        "BaseIncrementalDetokenizer",
        ("output_text",),
        why="output text for opt-in content capture",
    ),
    Fields(
        ("vllm.v1.engine.parallel_sampling",),
        "ParentRequest",
        ("request_id",),
        why="n > 1: one prompt for the choices of one request",
    ),
    Fields(
        ("vllm.entrypoints.generate.base.protocol", "vllm.entrypoints.openai.protocol"),
        "RequestResponseMetadata",
        ("request_id", "final_usage_info"),
        why="response id; the usage vLLM reports (beam search)",
    ),
    Fields(
        ("vllm.v1.engine",),
        "EngineCoreRequest",
        ("request_id", "sampling_params"),
        ("session_id",),
        why="the engine request OutputProcessor.add_request gets; its session id: gen_ai.conversation.id",
    ),
    Fields(
        _SERVE_PROTOCOL,
        "UsageInfo",
        ("prompt_tokens", "completion_tokens"),
        ("prompt_tokens_details", "completion_tokens_details"),
        why="the usage vLLM reports: beam search's tokens; reasoning tokens (with a reasoning parser)",
    ),
    Fields(
        _SERVE_PROTOCOL,
        "PromptTokenUsageInfo",
        ("cached_tokens",),
        optional_class=True,
        why="beam search's cached prompt tokens, as vLLM reports them",
    ),
    Fields(
        _SERVE_PROTOCOL,
        "CompletionTokenUsageInfo",
        ("reasoning_tokens",),
        optional_class=True,
        why="gen_ai.usage.reasoning.output_tokens",
    ),
    Fields(
        ("vllm.sampling_params",),
        "SamplingParams",
        ("n", *_SAMPLING[:-2]),
        ("extra_args",),
        why="gen_ai.request.* of AsyncLLM / offline requests; kv_transfer_params: the P/D leg",
    ),
    Fields(("vllm.v1.engine.async_llm",), "AsyncLLM", ("model_config",), why="the model of AsyncLLM requests"),
    Fields(("vllm.v1.engine.llm_engine",), "LLMEngine", ("model_config",), why="the model of offline requests"),
    Fields(
        ("vllm.config.model", "vllm.config"),
        "ModelConfig",
        ("model", "served_model_name"),
        why="gen_ai.request.model of AsyncLLM / offline requests",
    ),
    Fields(
        _SERVE_PROTOCOL,
        "ErrorResponse",
        ("error",),
        why="error.type of a handler that answered with an error",
    ),
    Fields(
        _SERVE_PROTOCOL,
        "ErrorInfo",
        ("type", "code", "message"),
        why="error.type and status message",
    ),
    Fields(
        _CHAT_PROTOCOL,
        "ChatCompletionRequest",
        ("model", "messages", "stream", "n", "max_completion_tokens", *_SAMPLING, "use_beam_search"),
        ("user",),
        why="gen_ai.request.* of chat; the end user it names",
    ),
    Fields(
        _COMPLETION_PROTOCOL,
        "CompletionRequest",
        ("model", "prompt", "stream", "n", *_SAMPLING, "use_beam_search"),
        ("user",),
        why="gen_ai.request.* of completions; the end user it names",
    ),
    # a handler's (non-streamed) result: read when it has choices (read_response_*)
    Fields(
        _CHAT_PROTOCOL,
        "ChatCompletionResponse",
        ("id", "model", "choices", "usage"),
        why="gen_ai.response.id / model / finish_reasons of chat; its usage's reasoning tokens",
    ),
    Fields(_CHAT_PROTOCOL, "ChatCompletionResponseChoice", ("finish_reason",), why="gen_ai.response.finish_reasons"),
    Fields(
        _COMPLETION_PROTOCOL,
        "CompletionResponse",
        ("id", "model", "choices", "usage"),
        why="gen_ai.response.id / model / finish_reasons of completions",
    ),
    Fields(_COMPLETION_PROTOCOL, "CompletionResponseChoice", ("finish_reason",), why="gen_ai.response.finish_reasons"),
    # the engine core (engine_cost.py)
    Fields(
        ("vllm.v1.engine.core",),
        "EngineCoreProc",
        ("scheduler", "has_work"),
        ("engine_index",),
        why="the scheduler an engine's cost book lives on; when the engine waits idle",
    ),
    Fields(
        ("vllm.v1.core.sched.scheduler",),
        "Scheduler",
        ("requests", "kv_cache_manager", "vllm_config"),
        why="the requests an engine holds, its KV cache, its model",
    ),
    Fields(
        ("vllm.v1.core.kv_cache_manager",),
        "KVCacheManager",
        ("coordinator", "block_pool"),
        why="the KV-cache groups and the pool's size",
    ),
    Fields(
        ("vllm.v1.core.kv_cache_coordinator",),
        "KVCacheCoordinator",
        ("single_type_managers",),
        why="one manager per KV-cache group",
    ),
    Fields(
        ("vllm.v1.core.single_type_kv_cache_manager",),
        "SingleTypeKVCacheManager",
        ("req_to_blocks", "block_size"),
        why="the blocks each request holds",
    ),
    Fields(("vllm.v1.core.block_pool",), "BlockPool", ("num_gpu_blocks",), why="the KV pool's capacity"),
    Fields(
        ("vllm.v1.core.sched.output",),
        "SchedulerOutput",
        ("num_scheduled_tokens", "total_num_scheduled_tokens", "scheduled_new_reqs", "scheduled_cached_reqs"),
        why="a step's requests and their scheduled tokens: the split of its time",
    ),
    Fields(
        ("vllm.v1.core.sched.output",),
        "NewRequestData",
        ("req_id", "num_computed_tokens"),
        why="a request's prefix-cache hit when admitted",
    ),
    Fields(
        ("vllm.v1.core.sched.output",),
        "CachedRequestData",
        ("req_ids", "num_computed_tokens"),
        ("resumed_req_ids",),
        why="a preempted request's prefix-cache hit when resumed",
    ),
    Fields(
        ("vllm.v1.request",),
        "Request",
        (
            "request_id",
            "num_prompt_tokens",
            "num_computed_tokens",
            "num_output_tokens",
            "arrival_time",
            "lora_request",
            "trace_headers",
            "get_finished_reason",
        ),
        ("prefill_stats",),
        why="an engine request's tokens, finish reason, trace and tenant when it finishes",
    ),
    Fields(
        ("vllm.v1.engine",),
        "EngineCoreRequest",
        ("trace_headers",),
        why="the frontend hands the engine its bill marker, traceparent and tenant",
    ),
    Fields(
        _RESPONSES_PROTOCOL,
        "ResponsesRequest",
        ("model", "input", "instructions", "stream", "max_output_tokens", "temperature", "top_p"),
        ("top_k", "seed", "frequency_penalty", "presence_penalty", "user", "safety_identifier"),
        why="gen_ai.request.* of the Responses API; the end user it names",
    ),
    Fields(
        ("vllm.entrypoints.pooling.embed.protocol", "vllm.entrypoints.openai.protocol"),
        "EmbeddingCompletionRequest",
        ("model",),
        ("user",),
        optional_class=True,
        why="gen_ai.request.model of embeddings; the end user it names",
    ),
)


# --- reading vLLM's objects --------------------------------------------------------------------


@dataclass(slots=True)  # (read once, never changed: not frozen, whose __init__ sets each field slowly)
class EngineTiming:
    """RequestStateStats: engine-core monotonic seconds, 0.0 = not reached."""

    queued: float
    scheduled: float
    first_token: float
    last_token: float
    first_token_latency: float
    generation_tokens: int
    preemptions: int


@dataclass(slots=True)  # (read once, never changed: not frozen, whose __init__ sets each field slowly)
class EngineRequest:
    """One of vLLM's RequestState objects, read once when its request ends."""

    request_id: str  # vLLM's internal id (external id + random suffix)
    external_id: str | None  # the id the client's request got (its response id)
    prompt_id: str  # n > 1: the parent's id, shared by the choices of one prompt
    index: int  # the choice it generates
    prompt_tokens: int
    cached_tokens: int
    cache_creation_tokens: int
    remote_cached_tokens: int | None  # P/D decode leg: the prefill node's prefix-cache hits
    output_tokens: int | None  # None: a pooling request (no detokenizer)
    output_text: str | None
    lora_name: str | None
    timing: EngineTiming | None  # None: stats off (--disable-log-stats)
    engine_cost: str | None = None  # the engine core's figures (engine_cost.py's summary), when they came
    # speculative decoding (vLLM --per-request-spec-decode-metrics): (draft tokens proposed, accepted,
    # verify steps), or None
    spec_decode: tuple[int, int, int] | None = None


def read_engine_request(state) -> EngineRequest:
    parent = state.parent_req
    detokenizer = state.detokenizer
    stats = state.stats
    text = getattr(detokenizer, "output_text", None)  # BaseIncrementalDetokenizer only
    spec = getattr(state, "spec_decode_metrics", None)
    # (positional, in the fields' order: keywords cost a call twice as much, per engine request)
    return EngineRequest(
        state.request_id,
        state.external_req_id,
        parent.request_id if parent is not None else state.request_id,
        state.request_index or 0,
        state.prompt_len or 0,
        state.num_cached_tokens or 0,
        getattr(state, "num_cache_creation_tokens", 0) or 0,
        getattr(state, "remote_prefill_cached_tokens", None),
        detokenizer.num_output_tokens() if detokenizer is not None else None,
        text if isinstance(text, str) else None,
        getattr(state, "lora_name", None),
        None
        if stats is None
        else EngineTiming(
            stats.queued_ts,
            stats.scheduled_ts,
            stats.first_token_ts,
            stats.last_token_ts,
            stats.first_token_latency,
            stats.num_generation_tokens,
            getattr(stats, "num_preemptions", 0) or 0,
        ),  # vLLM >= 0.30
        getattr(state, _STASHED_COST, None),  # (stash_engine_cost's)
        None if spec is None else _spec_decode(spec),  # vLLM >= 0.30
    )


def _spec_decode(metrics) -> tuple[int, int, int] | None:
    """RequestSpecDecodeMetrics: histogram[j] = verify steps that accepted j draft tokens."""
    try:
        histogram = metrics.histogram
        return int(metrics.num_draft_tokens), sum(j * count for j, count in enumerate(histogram)), sum(histogram)
    except (AttributeError, TypeError, ValueError):  # a release that reshaped it: the rest of the request stays
        warn_once(
            "spec decode shape",
            "otel-llm: vLLM's RequestSpecDecodeMetrics has a shape otel-llm does not "
            "know; spans and bills have no speculative-decoding figures",
        )
        return None


def read_added_request(output_processor, engine_request) -> tuple:
    """What the request path reads of an EngineCoreRequest vLLM's OutputProcessor has just added, in one
    call (once per engine request, in the API server; each distinct function it runs costs the API
    server cache misses):
    - its internal id (EngineCoreRequest.request_id, which OutputProcessor keys its RequestStates by);
    - the RequestState OutputProcessor keeps for it (OutputProcessor.request_states), or None;
    - its kv_transfer_params (P/D), from its sampling params' extra_args, or None;
    - its session id (EngineCoreRequest.session_id, vLLM >= 0.30: the body's session_id, else
      X-Session-ID, else vllm_xargs.session_id, as vLLM's serving layer chose it; or the session_id
      AsyncLLM.generate got), or None."""
    engine_id = engine_request.request_id
    extra = getattr(getattr(engine_request, "sampling_params", None), "extra_args", None)
    params = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    session = getattr(engine_request, "session_id", None)
    return (
        engine_id,
        output_processor.request_states.get(engine_id),
        params if isinstance(params, dict) else None,
        session if isinstance(session, str) and session else None,
    )


# RequestState.request_id: the internal id of the engine request a RequestState tracks (a C callable: no
# frame per call on the request path)
read_state_id = attrgetter("request_id")


def read_engine_model(engine) -> str | None:
    """The served model name (else the model) of an AsyncLLM or LLMEngine."""
    config = getattr(engine, "model_config", None)
    name = getattr(config, "served_model_name", None) or getattr(config, "model", None)
    if isinstance(name, list):  # several served names: vLLM answers with the first
        name = name[0] if name else None
    return name if isinstance(name, str) else None


def read_sampling_params(params) -> dict:
    """gen_ai.request.* of SamplingParams; {} for PoolingParams (no generation)."""
    if not hasattr(params, "max_tokens"):
        return {}
    top_k = getattr(params, "top_k", None)
    return {
        "n": getattr(params, "n", None),
        "max_tokens": params.max_tokens,
        "temperature": getattr(params, "temperature", None),
        "top_p": getattr(params, "top_p", None),
        "top_k": top_k if top_k and top_k > 0 else None,  # -1 / 0: disabled
        "seed": getattr(params, "seed", None),
    }


def read_error(result) -> tuple[str, str] | None:
    """(error.type, message) when a handler returned an error instead of raising: vLLM's
    ErrorResponse, or a starlette Response with an error status (pooling endpoints)."""
    error = read_field(result, "error")
    if error is not None and hasattr(error, "code"):
        return str(getattr(error, "type", None) or error.code), str(getattr(error, "message", ""))
    status = read_field(result, "status_code")
    if isinstance(status, int) and status >= 400:
        return str(status), ""
    return None


def read_reported_usage(metadata) -> tuple[int, int, int] | None:
    """(prompt, completion, cached prompt) tokens vLLM put in the response's usage, from its
    RequestResponseMetadata.final_usage_info."""
    info = getattr(metadata, "final_usage_info", None)
    prompt = getattr(info, "prompt_tokens", None)
    if not isinstance(prompt, int):
        return None
    cached = getattr(getattr(info, "prompt_tokens_details", None), "cached_tokens", None)
    return prompt, getattr(info, "completion_tokens", None) or 0, cached if isinstance(cached, int) else 0


def read_response_metadata(raw_request) -> tuple:
    """(the RequestResponseMetadata vLLM's handler keeps on raw_request.state, or None; its request_id, the
    id vLLM puts in the response and every chunk, or None). Read from the dict a Starlette request keeps
    its state in, its ASGI scope's "state" (what `Request.state` wraps: each read through its State is a
    Python `__getattr__` call)."""
    scope = getattr(raw_request, "scope", None)
    state = scope.get("state") if type(scope) is dict else None
    if type(state) is dict:
        metadata = state.get("request_metadata")
    else:
        metadata = getattr(getattr(raw_request, "state", None), "request_metadata", None)
    response_id = getattr(metadata, "request_id", None)
    return metadata, response_id if isinstance(response_id, str) else None


# --- the serving layer: a handler's request, the HTTP request it came with, its result ----------


# The fields of a handler's request the request path reads (request_telemetry.request_info, the end
# user of attribution.py), the names request_fields' get is asked
REQUEST_FIELD_NAMES = (
    "model",
    "stream",
    "n",
    "max_completion_tokens",
    "max_tokens",
    "max_output_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "use_beam_search",
    "safety_identifier",
    "user",
)


def request_fields(request):
    """get(name) over a handler's request (ChatCompletionRequest, CompletionRequest, ResponsesRequest,
    an embeddings request) for the names in REQUEST_FIELD_NAMES: the field, or None where its type has
    none (`read_field`). Where that is the answer of the
    model's __dict__ for every such name (no extra fields sent, no class attribute of such a name
    outside its fields), get is the dictionary's own."""
    fields = getattr(request, "__dict__", None) or {}
    extra = getattr(request, "__pydantic_extra__", None) or {}
    if not extra:
        answers = _DICT_ANSWERS.get(type(request))  # (known per class: no frame of ours per request)
        if answers if answers is not None else _dict_answers(type(request)):
            return fields.get

    return partial(read_field, request)


def read_field(obj, name: str):
    """getattr(obj, name, None) for a pydantic model (vLLM's requests and responses) without pydantic's
    `__getattr__` raising and catching an AttributeError for a name the model lacks, per request: read
    from its __dict__ (getattr warns on deprecated fields, max_tokens, per request), then its extra
    fields (vLLM's models allow them: a client's `safety_identifier` where vLLM has no such field);
    getattr only for a name its class has (asked once per class and name), or on any other object."""
    fields = getattr(obj, "__dict__", None)
    if fields is None:  # (None, a generator: no pydantic model)
        return getattr(obj, name, None)
    if name in fields:
        return fields[name]
    extra = getattr(obj, "__pydantic_extra__", None)
    if extra and name in extra:
        return extra[name]
    found = _CLASS_HAS.get((type(obj), name))  # (known per class and name: no frame of ours per request)
    return getattr(obj, name, None) if (found if found is not None else _class_has(obj, name)) else None


def _class_has(obj, name: str) -> bool:
    """Whether getattr(obj, name) may find something, asked of its class once per class and name (kept
    in _CLASS_HAS): an object that is no pydantic model may answer any name from its own __getattr__."""
    cls = type(obj)
    found = hasattr(cls, name) or not hasattr(cls, "model_fields")
    if len(_CLASS_HAS) < 4096:
        _CLASS_HAS[(cls, name)] = found
    return found


_CLASS_HAS: dict[tuple[type, str], bool] = {}  # read_field: (class, name) -> getattr may find it


def _dict_answers(cls: type) -> bool:
    """A pydantic model class whose instances' __dict__ answers every name of REQUEST_FIELD_NAMES
    (asked once per class: kept in _DICT_ANSWERS, which request_fields reads)."""
    model_fields = getattr(cls, "model_fields", None)
    found = isinstance(model_fields, dict) and not any(
        hasattr(cls, name) and name not in model_fields for name in REQUEST_FIELD_NAMES
    )
    if len(_DICT_ANSWERS) < 4096:
        _DICT_ANSWERS[cls] = found
    return found


_DICT_ANSWERS: dict[type, bool] = {}


def read_request_content(request) -> dict:
    """The content of a handler's request (opt-in capture): its messages, prompt, input and
    instructions, None where its type has none."""
    return {name: getattr(request, name, None) for name in ("messages", "prompt", "input", "instructions")}


def read_headers(raw_request):
    """The headers of the HTTP request a handler got: its ASGI scope's list of (name, value) byte pairs
    where it has one (a Starlette request: the list its Headers reads, without their Python calls), else
    its `headers`; None without a request (a background response)."""
    scope = getattr(raw_request, "scope", None)
    if type(scope) is dict:
        raw = scope.get("headers")
        if type(raw) is list:
            return raw
    return getattr(raw_request, "headers", None)


SSE_DONE = "data: [DONE]\n\n"  # the last data chunk of every OpenAI-style SSE stream vLLM sends


def is_stream(result) -> bool:
    """A handler answered with a stream (an async generator of SSE chunks): an async iterator, asked of
    its class by the ABC's cache in C. (Asking the result, or its class, for `__anext__` has pydantic's
    `__getattr__`, or its model class's metaclass `__getattr__`, raise and catch an AttributeError per
    request.)"""
    return isinstance(result, AsyncIterator)


def generation_response(result):
    """A handler's result when it is a ChatCompletionResponse or CompletionResponse (it has choices),
    else None: nothing else of a result (embeddings, Responses API) is read."""
    return result if read_field(result, "choices") is not None else None


def read_result(result) -> tuple:
    """What a request's end reads of its handler's result, in one call: (read_error's (type, message) or
    None, whether it is a stream (is_stream), its generation_response or None). A ChatCompletionResponse
    or CompletionResponse with no extra fields, or a stream (nearly every result), is recognized by its
    class (asked once per class) and answered without reading it again."""
    kind = _RESULT_KINDS.get(type(result))  # (known per class: no frame of ours per request)
    if kind is None:
        kind = _result_kind(type(result))
    if kind is _STREAM:
        return None, True, None
    if (
        kind is _RESPONSE
        and not getattr(result, "__pydantic_extra__", None)
        and result.__dict__.get("choices") is not None
    ):
        return None, False, result
    error = read_error(result)
    if error is not None:
        return error, False, None
    if is_stream(result):
        return None, True, None
    return None, False, generation_response(result)


_RESPONSE, _STREAM, _OTHER = "response", "stream", "other"


def _result_kind(cls: type) -> str:
    """_RESPONSE: a pydantic model class with a `choices` field; _STREAM: an async iterator; _OTHER:
    anything else, or what read_error could find something in (an `error` or `status_code`), kept in
    _RESULT_KINDS, which read_result reads."""
    model_fields = getattr(cls, "model_fields", None)
    if hasattr(cls, "error") or hasattr(cls, "status_code"):
        kind = _OTHER
    elif issubclass(cls, AsyncIterator):  # (one that may answer any name, or a model: read as any other)
        kind = _OTHER if isinstance(model_fields, dict) or hasattr(cls, "__getattr__") else _STREAM
    elif (
        isinstance(model_fields, dict)
        and "choices" in model_fields
        and hasattr(cls, "__pydantic_extra__")
        and "error" not in model_fields
        and "status_code" not in model_fields
    ):
        kind = _RESPONSE
    else:
        kind = _OTHER
    if len(_RESULT_KINDS) < 4096:
        _RESULT_KINDS[cls] = kind
    return kind


_RESULT_KINDS: dict[type, str] = {}


def read_answer(response, metadata) -> tuple:
    """What a request's end reads of vLLM's answer, in one call: (id, model, finish reasons, reasoning
    tokens).
    - id and model: those a generation_response names (the model: the served name it was asked for);
      None without a response (a stream) or without one.
    - finish reasons: each choice's finish_reason ("error" where vLLM set none); [] without choices.
    - reasoning tokens: completion_tokens_details.reasoning_tokens of the usage vLLM reported for a chat
      request: the response's, else its RequestResponseMetadata.final_usage_info (set for streams too).
      vLLM counts them only when it runs a reasoning parser."""
    fields = getattr(response, "__dict__", None)
    if response is None:  # (a stream's end, a failed request: only the metadata)
        response_id = model = usage = choices = None
    elif type(fields) is dict and _ANSWER_FIELDS <= fields.keys():  # (declared fields: read_field's answers)
        response_id, model, usage, choices = fields["id"], fields["model"], fields["usage"], fields["choices"]
    else:
        response_id, model = read_field(response, "id"), read_field(response, "model")
        usage = read_field(response, "usage")
        choices = getattr(response, "choices", None)
    reasons = []
    for choice in choices or ():
        reason = choice.finish_reason
        reasons.append("error" if reason is None else str(reason))
    reasoning = None
    final = None if metadata is None else read_field(metadata, "final_usage_info")
    for source in (usage, final):  # the response's usage first
        details = None if source is None else read_field(source, "completion_tokens_details")
        value = None if details is None else read_field(details, "reasoning_tokens")
        if type(value) is int:
            reasoning = value
            break
    return response_id, model, reasons, reasoning


_ANSWER_FIELDS = frozenset(("id", "model", "usage", "choices"))


def read_rejection_type(response) -> str:
    """error.type of the response vLLM's exception handler made for a request it rejected (an
    ErrorResponse as JSON), else its HTTP status ("400" without one)."""
    status = str(getattr(response, "status_code", "400"))
    try:
        return json.loads(response.body)["error"]["type"] or status
    except Exception:  # not vLLM's error body
        return status


# --- the engine core (otel_llm/vllm/engine_cost.py): read per step, so each reader loops itself -------

ENGINE_BILLED_HEADER = "otel-llm-billed"  # trace_headers key an instrumented frontend adds: it bills the request
ENGINE_BILLED = "1"
ENGINE_BILLED_PD_PREFILL = "pd-prefill"  # the P/D prefill leg: billed by its decode node, never here
# the engine's figures for a finished request, back to the frontend on its final EngineCoreOutput
ENGINE_COST_HEADER = "otel-llm-cost"


@dataclass(frozen=True, slots=True)
class KVPool:
    groups: tuple  # per KV-cache group: vLLM's request id -> block list dict (read with .get: no insert)
    block_sizes: tuple[int, ...]
    capacity_blocks: int  # usable blocks (the pool without its null block)


def read_kv_pool(scheduler) -> KVPool:
    manager = scheduler.kv_cache_manager
    managers = manager.coordinator.single_type_managers
    return KVPool(
        tuple(m.req_to_blocks for m in managers),
        tuple(int(m.block_size) for m in managers),
        max(0, int(manager.block_pool.num_gpu_blocks) - 1),
    )


def read_scheduler_requests(scheduler) -> dict:
    """Scheduler.requests: request id -> Request, while the scheduler holds it (the same dict for life)."""
    return scheduler.requests


def read_scheduler_model(scheduler) -> str | None:
    return read_engine_model(scheduler.vllm_config)


def read_engine_scheduler(engine_core):
    return engine_core.scheduler


def read_engine_index(engine_core) -> int:
    return int(getattr(engine_core, "engine_index", 0) or 0)


def read_has_work(engine_core) -> bool:
    return engine_core.has_work()


def read_scheduled(so) -> tuple[dict, int]:
    """SchedulerOutput: request id -> tokens scheduled this step (drafts included), and their total."""
    return so.num_scheduled_tokens, so.total_num_scheduled_tokens


def read_admitted(so, requests: dict) -> list[tuple[str, int, int, dict | None, int]]:
    """(request id, tokens already computed: its prefix-cache hit, prompt tokens, the headers an
    instrumented frontend sent, the part of the hit a KV connector loaded) of the requests admitted
    this step, new or resumed after a preemption (a resumed one: its connector part is not read, 0).

    The caller takes the frontend's headers off the Request once it has kept them
    (drop_frontend_headers): vLLM copies trace_headers into every output of a request, and the API
    server would decode them per token."""
    admitted = []
    for new in so.scheduled_new_reqs:
        request = requests.get(new.req_id)
        if request is not None:
            admitted.append(
                (
                    new.req_id,
                    new.num_computed_tokens,
                    request.num_prompt_tokens,
                    _frontend_headers(request),
                    _external_hit(request),
                )
            )
    cached = so.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", None)
    if resumed:
        for rid, n in zip(cached.req_ids, cached.num_computed_tokens):
            request = requests.get(rid) if rid in resumed else None
            if request is not None:
                admitted.append((rid, n, request.num_prompt_tokens, None, 0))
    return admitted


def _external_hit(request) -> int:
    """Request.prefill_stats.num_external_cached_tokens (vLLM >= 0.30): set by the schedule that admits
    a request the first time, taken away with its first output."""
    stats = getattr(request, "prefill_stats", None)
    if stats is None:
        return 0
    return getattr(stats, "num_external_cached_tokens", 0) or 0


def _frontend_headers(request) -> dict | None:
    headers = request.trace_headers
    return headers if headers and ENGINE_BILLED_HEADER in headers else None


def drop_frontend_headers(request) -> None:
    request.trace_headers = None


def set_final_output_cost(outputs, summaries: dict[str, str]) -> None:
    """Put each finished request's figures on its final EngineCoreOutput of this step (the dict
    update_from_output returns, before vLLM sends it): the frontend reads them once per request."""
    for engine_outputs in outputs.values():
        for output in engine_outputs.outputs:
            summary = summaries.get(output.request_id)
            if summary is not None:
                output.trace_headers = {ENGINE_COST_HEADER: summary}


def read_core_request_id(request) -> str:
    return request.request_id


@dataclass(slots=True)  # (read once, never changed: not frozen, whose __init__ sets each field slowly)
class CoreRequest:
    """The engine core's Request, read once when it finishes."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str | None
    arrival_time: float
    lora_name: str | None
    trace_headers: Any  # Mapping[str, str] | None
    frontend_billed: bool
    pd_prefill: bool


def read_core_request(request, headers=None) -> CoreRequest:
    """headers: the frontend's, taken off the request when it was admitted (read_admitted)."""
    headers = headers if headers is not None else request.trace_headers
    billed = headers.get(ENGINE_BILLED_HEADER) if headers else None
    reason = request.get_finished_reason()
    lora = request.lora_request
    return CoreRequest(
        request_id=request.request_id,
        prompt_tokens=int(request.num_prompt_tokens or 0),
        output_tokens=int(request.num_output_tokens),
        finish_reason=str(reason) if reason is not None else None,
        arrival_time=float(request.arrival_time),
        lora_name=getattr(lora, "lora_name", None),
        trace_headers=headers,
        frontend_billed=billed is not None,
        pd_prefill=billed == ENGINE_BILLED_PD_PREFILL,
    )


def enable_final_outputs(output_processor) -> None:
    """Have vLLM's OutputProcessor call do_tracing(final EngineCoreOutput, RequestState, ...) for every
    finished request: otel-llm's hook replaces vLLM's do_tracing (its own tracing) and reads the
    engine's figures there. Only when that hook is in place (Telemetry.reads_final_outputs)."""
    output_processor.tracing_enabled = True


def final_outputs_enabled(output_processor) -> bool:
    """vLLM will call do_tracing for each finished request (after its stats hook)."""
    return getattr(output_processor, "tracing_enabled", False) is True


def stash_engine_cost(engine_core_output, req_state) -> None:
    headers = engine_core_output.trace_headers
    summary = headers.get(ENGINE_COST_HEADER) if headers else None
    if summary is not None:
        setattr(req_state, _STASHED_COST, summary)


_STASHED_COST = "otel_llm_engine_cost"  # our attribute on vLLM's RequestState, not one of its fields


def mark_frontend_billed(
    engine_request, traceparent: str | None, baggage: str | None, value: str = ENGINE_BILLED
) -> None:
    """Tell the engine core that this frontend bills the EngineCoreRequest, with its trace and tenant
    (W3C baggage), through its trace_headers: the one field that reaches the engine's Request (vLLM
    reads only traceparent and tracestate from it, for its own tracing, which otel-llm turns off)."""
    headers = dict(engine_request.trace_headers or {})
    headers[ENGINE_BILLED_HEADER] = value
    if traceparent and "traceparent" not in headers:
        headers["traceparent"] = traceparent
    if baggage and "baggage" not in headers:
        headers["baggage"] = baggage
    engine_request.trace_headers = headers


# --- reading sources without importing them ----------------------------------------------------


class Source:
    """vLLM's Python sources under `root` (the directory holding the `vllm` package)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._trees: dict[str, ast.Module | None] = {}

    def path(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            path = self.path(module)
            self._trees[module] = ast.parse(path.read_text(encoding="utf-8")) if path else None
        return self._trees[module]

    def locate(self, modules: tuple[str, ...]) -> str | None:
        return next((m for m in modules if self.path(m) is not None), None)

    def find_class(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        tree = self.tree(module)
        if tree is None or depth > 4:
            return None
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return module, node
        for node in tree.body:  # imported: `from vllm.x import Name`, `from ..x import Name`
            if isinstance(node, ast.ImportFrom):
                source_module = self.absolute(module, node)
                if source_module and source_module.startswith("vllm"):
                    for alias in node.names:
                        if (alias.asname or alias.name) == name:
                            return self.find_class(source_module, alias.name, depth + 1)
        return None

    def absolute(self, module: str, node: ast.ImportFrom) -> str | None:
        if not node.level:
            return node.module
        path = self.path(module)
        package = module.split(".") if path is not None and path.name == "__init__.py" else module.split(".")[:-1]
        if node.level > 1:
            package = package[: len(package) - (node.level - 1)]
        return ".".join(package + ([node.module] if node.module else []))

    def members(self, module: str, cls: ast.ClassDef, depth: int = 0) -> set[str]:
        names: set[str] = set()
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
                for sub in ast.walk(node):
                    targets = (
                        sub.targets
                        if isinstance(sub, ast.Assign)
                        else [sub.target]
                        if isinstance(sub, (ast.AnnAssign, ast.AugAssign))
                        else []
                    )
                    for target in targets:
                        if (
                            isinstance(target, ast.Attribute)
                            and isinstance(target.value, ast.Name)
                            and target.value.id == "self"
                        ):
                            names.add(target.attr)
        if depth < 6:
            for base in cls.bases:
                base_name = (
                    base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
                )
                found = self.find_class(module, base_name) if base_name else None
                if found is not None:
                    names |= self.members(found[0], found[1], depth + 1)
        return names

    def has_attribute(self, module: str, attribute: str) -> bool:
        """`Class.method` or a module-level function/name (also one it imports)."""
        tree = self.tree(module)
        if tree is None:
            return False
        if "." in attribute:
            cls_name, member = attribute.split(".", 1)
            found = self.find_class(module, cls_name)
            return found is not None and member in self.members(*found)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == attribute:
                return True
            if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.asname or a.name) == attribute for a in node.names
            ):
                return True
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == attribute for t in node.targets
            ):
                return True
        return False


def shim_target(source: Source, module: str) -> str | None:
    """The module `module` replaces itself with in sys.modules (an alias shim left behind by a
    package move), or None. vLLM imports the target's name, so a hook must be registered there."""
    path = source.path(module)
    if path is None:
        return None
    text = path.read_text(encoding="utf-8")
    if "sys.modules[__name__]" not in text:
        return None
    names = set()
    for node in ast.walk(ast.parse(text)):  # `import_module("vllm.x")` or `from vllm.x import *`
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    targets = {name for name in names if name.startswith("vllm.") and name != module and source.path(name) is not None}
    return targets.pop() if len(targets) == 1 else None


# --- the check ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    kind: str  # "hook" | "fields"
    name: str
    ok: bool
    required: bool
    detail: str


def check(root: str | Path, hooks: tuple, fields: tuple[Fields, ...] = FIELDS) -> list[Finding]:
    """Every hook (otel_llm.vllm.hooks.HOOKS: the caller's, as hooks.py imports this module) and field
    against the sources under root."""
    source = Source(root)
    findings = []
    for hook in hooks:
        module = source.locate(hook.modules)
        if module is None:
            findings.append(
                Finding("hook", hook.name, False, hook.required, "module not found: " + " | ".join(hook.modules))
            )
            continue
        target = shim_target(source, module)
        if target is not None:
            findings.append(
                Finding(
                    "hook",
                    hook.name,
                    False,
                    hook.required,
                    f"{module} is an alias of {target}: a hook on it would never fire (list {target} first)",
                )
            )
            continue
        ok = source.has_attribute(module, hook.attribute)
        findings.append(
            Finding("hook", hook.name, ok, hook.required, f"{module}.{hook.attribute}" + ("" if ok else " not found"))
        )
    for spec in fields:
        module = source.locate(spec.modules)
        found = source.find_class(module, spec.cls) if module else None
        if found is None:
            findings.append(
                Finding(
                    "fields", spec.cls, False, not spec.optional_class, "class not found in " + " | ".join(spec.modules)
                )
            )
            continue
        members = source.members(*found)
        missing = [f for f in spec.required if f not in members]
        absent = [f for f in spec.optional if f not in members]
        detail = f"{found[0]}.{spec.cls}"
        if missing:
            detail += " lacks " + ", ".join(missing)
        if absent:
            detail += " (optional, absent: " + ", ".join(absent) + ")"
        findings.append(Finding("fields", spec.cls, not missing, True, detail))
    return findings


def installed_root() -> str | None:
    """The directory holding the installed `vllm` package, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.dirname(list(spec.submodule_search_locations)[0])


def version_of(root: str | Path) -> str | None:
    path = Path(root) / "vllm" / "_version.py"
    if not path.is_file():
        return None
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in node.targets)
            and isinstance(node.value, ast.Constant)
        ):
            return str(node.value.value)
    return None
