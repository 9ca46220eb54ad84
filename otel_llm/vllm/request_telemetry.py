"""One OpenAI-compatible (or offline) request -> GenAI span, phase child spans, metrics and usage record.

A RequestTelemetry is created when a request enters vLLM (the serving handler, or
AsyncLLM/LLMEngine used directly). vLLM's per-request `RequestState` objects are attached to
it as the engine accepts them; everything is read from them once, when the request ends, so
nothing here runs per output token. At the end it writes the usage record and hands the sink the
request's facts, from which the span's end, phase spans and metrics are built (request_facts.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial
from itertools import compress
from operator import attrgetter, is_not
from typing import Any

from opentelemetry.context import Context

from otel_llm import content, redaction, semconv
from otel_llm.sdk import current
from otel_llm.vllm import contract
from otel_llm.vllm.attribution import NO_CALLER, Caller
from otel_llm.vllm.request_facts import cost_summary, engine_facts, new_request_facts, start_attributes
from otel_llm.vllm.request_metrics import outcome
from otel_llm.vllm.telemetry import Telemetry, Usage
from otel_llm.warn import failed, guarded

_log = logging.getLogger(__name__)

# A failed request's error text (vLLM's message, an exception's) is redacted before it is set as the
# span's status description: vLLM's 404 echoes the model name it was asked for, an exception can
# carry the prompt. The redactor reads at most MAX_ERROR_SCAN characters of it; MAX_ERROR_TEXT are kept.
MAX_ERROR_SCAN = 16_384
MAX_ERROR_TEXT = 500

# The usage record's fields written when their value is not None, in the order _write_usage gives the values
_USAGE_OPTIONAL = (
    semconv.GEN_AI_REQUEST_MODEL,
    semconv.GEN_AI_RESPONSE_MODEL,
    semconv.VLLM_LORA_NAME,
    semconv.GEN_AI_RESPONSE_ID,
    semconv.TENANT_ID,
    semconv.TENANT_SCENE,
    semconv.TENANT_COST_CENTER,
    semconv.API_KEY_ID,
    semconv.USER_ID,
    semconv.GEN_AI_CONVERSATION_ID,
    semconv.ERROR_TYPE,
    # the breakdowns (semconv.USAGE_DETAIL_TOKEN_FIELDS: inclusive), only when non-zero
    semconv.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS,
    semconv.VLLM_EXTERNAL_CACHED_TOKENS,
    semconv.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS,
    semconv.VLLM_SPEC_DRAFT_TOKENS,
    semconv.VLLM_SPEC_ACCEPTED_TOKENS,
)
_given = partial(is_not, None)  # value -> value is not None, in C
_request_id = attrgetter("request_id")
_index = attrgetter("index")
_spec_figures = attrgetter("spec_decode")

# The request being served in the current task; the engine hooks attach to it.
CURRENT: ContextVar["RequestTelemetry | None"] = ContextVar("otel_llm_vllm_request", default=None)


@dataclass(slots=True)  # (not frozen: a frozen dataclass's __init__ calls object.__setattr__ per field)
class RequestInfo:
    """What the client asked for (gen_ai.request.*); never changed once made."""

    operation: str
    model: str | None = None
    stream: bool = False
    choice_count: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    tenant: str | None = None
    scene: str | None = None
    cost_center: str | None = None
    api_key_id: str | None = None  # the id the API-key map gives the request's key
    user: str | None = None  # the end user the request names (safety_identifier, else user)
    conversation_id: str | None = None  # from OTEL_LLM_CONVERSATION_HEADERS (vLLM's session id comes first)
    api_type: str | None = None  # openai.api.type: set for the Responses API
    # beam search: one engine request per beam per step, so usage is what vLLM reports, not a sum
    beam_search: bool = False
    # the request object itself, kept only when content capture is on (read at the end)
    request: Any = field(default=None, compare=False, repr=False)

    @property
    def generates(self) -> bool:
        """False for pooling (embeddings, score, ...): no output tokens, finish reasons or decode."""
        return self.operation not in semconv.POOLING_OPERATIONS

    def start_values(self) -> tuple:
        """The span's start attributes as plain values (request_facts.start_attributes makes them)."""
        return start_values(self)

    def span_attributes(self) -> dict[str, Any]:
        return start_attributes(self.start_values())


# RequestInfo.start_values in C (no frame per request): its fields in start_attributes' order
start_values = attrgetter(
    "operation",
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "tenant",
    "scene",
    "cost_center",
    "api_key_id",
    "user",
    "api_type",
    "stream",
    "choice_count",
)


def _no_fields(name: str) -> None:
    return None


def request_info(
    operation: str,
    get=_no_fields,
    *,
    caller: Caller = NO_CALLER,
    api_type: str | None = None,
    request: Any = None,
    conversation_id: str | None = None,
) -> RequestInfo:
    """The RequestInfo of every kind of request: get(name) gives each of its parameters or None (a
    handler's request: contract.request_fields; a route's JSON body; an engine request's sampling
    params; none for a rejected request), caller who it is billed to. The first of
    max_completion_tokens / max_tokens / max_output_tokens (Responses API) is its max tokens."""
    max_tokens = get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = get("max_tokens")
    if max_tokens is None:
        max_tokens = get("max_output_tokens")
    top_k = get("top_k")
    if top_k is not None and top_k <= 0:  # vLLM's "disabled" sentinel (-1 / 0)
        top_k = None
    # (positional, in the fields' order: a call with 20 keywords costs twice as much, per request)
    return RequestInfo(
        operation,
        get("model"),
        get("stream") is True,
        get("n"),
        max_tokens,
        get("temperature"),
        get("top_p"),
        top_k,
        get("seed"),
        get("frequency_penalty"),
        get("presence_penalty"),
        *caller,  # tenant, scene, cost_center, api_key_id, user
        conversation_id,
        api_type,
        get("use_beam_search") is True,
        request,
    )


class RequestTelemetry:
    __slots__ = (
        "telemetry",
        "info",
        "span",
        "context",
        "start_ns",
        "engine_states",
        "finish_reasons",
        "first_chunk_ns",
        "response_id",
        "engine_owned",
        "ended",
        "route_made",
        "metadata",
        "engine_aborted",
        "pd_role",
        "live_counted",
        "session_id",
        "final_outputs",
    )

    def __init__(
        self,
        telemetry: Telemetry,
        info: RequestInfo,
        *,
        engine_owned: bool = False,
        start_ns: int | None = None,
        links=None,
        context=None,
    ):
        self.telemetry = telemetry
        self.info = info
        self.start_ns = start_ns or time.time_ns()
        self.span = telemetry.sink.start_request_span(info, context, links, self.start_ns)
        # (trace.set_span_in_context(self.span), without the API's frames: otel_llm/sdk/current.py)
        self.context = Context({**current.current_context(), current.SPAN_KEY: self.span})
        self.engine_states: list[Any] = []
        self.finish_reasons: dict[str, str] = {}
        self.first_chunk_ns: int | None = None
        self.response_id: str | None = None
        self.engine_owned = engine_owned
        self.ended = False
        self.route_made = False  # started by a route's first engine request (routes.py), ended there
        self.metadata: Any = None  # vLLM's RequestResponseMetadata of the HTTP request, if any
        self.engine_aborted = False  # vLLM aborted one of its engine requests (the client left)
        self.pd_role: str | None = None  # the P/D leg this node served (semconv.PD_ROLE_*), if any
        # (input, cached input, output) tokens counted while in flight (otel_llm/vllm/live.py), if any
        self.live_counted: tuple[int, int, int] | None = None
        self.session_id: str | None = None  # vLLM's session id of its first engine request (gen_ai.conversation.id)
        self.final_outputs: set[str] | None = None  # engine requests whose final output vLLM handed over

    # --- engine events (API-server process, output handler task) ---------------------------
    def attach_engine_request(self, req_state) -> None:
        self.engine_states.append(req_state)
        self.telemetry.engine_records[contract.read_state_id(req_state)] = self
        self.telemetry.live.track(self)

    # Whatever the order of vLLM's hooks (finish, final output, abort; newer releases send aborted requests
    # through the finish hook too), a request ends once, and aborted when any of them said abort.
    def on_engine_finished(self, req_state, finish_reason, final_output_follows: bool = False) -> None:
        """vLLM finished one of its engine requests (its stats hook). An engine-owned request ends when
        all of its engine requests finished and, where vLLM hands them over after this hook
        (final_output_follows), their final outputs came too: the engine's figures are on them."""
        engine_id = contract.read_state_id(req_state)
        reason = str(finish_reason)
        self.finish_reasons[engine_id] = reason
        if reason == semconv.FINISH_REASON_ABORT:
            self.telemetry.engine_records.pop(engine_id, None)
            self.on_engine_aborted()
            return
        if not self.engine_owned:
            self.telemetry.engine_records.pop(engine_id, None)
            return
        if final_output_follows and engine_id not in (self.final_outputs or ()):
            return  # still tracked: its final output finds this record (ending untracks it)
        self.telemetry.engine_records.pop(engine_id, None)
        self._end_when_done(final_output_follows)

    def on_final_output(self, req_state) -> None:
        """vLLM handed over a finished engine request's final output (after its stats hook)."""
        if self.final_outputs is None:
            self.final_outputs = set()
        self.final_outputs.add(contract.read_state_id(req_state))
        if self.engine_owned:
            self._end_when_done(True)

    def on_engine_aborted(self) -> None:
        self.engine_aborted = True
        if self.engine_owned:
            self.end(aborted=True)

    def _end_when_done(self, final_outputs_expected: bool) -> None:
        if len(self.finish_reasons) < len(self.engine_states):
            return
        if final_outputs_expected and not (self.final_outputs or set()).issuperset(self.finish_reasons):
            return
        self.end()

    def end_with_engines(self) -> bool:
        """A stream's record after its first chunk: from now on it ends as an engine-owned one, when its
        engine requests finish (with their final outputs, where vLLM hands them over) or are aborted, so
        its stream needs no work of ours per chunk (streams.py). Only where it has engine requests and
        none has finished or been aborted yet (vLLM adds all of a request's before its first output);
        else False, and the stream's end ends it."""
        if self.ended or self.engine_owned or not self.engine_states or self.finish_reasons or self.engine_aborted:
            return False
        self.engine_owned = True
        return True

    def on_first_chunk(self) -> None:
        self.first_chunk_ns = time.time_ns()

    # --- end -------------------------------------------------------------------------------
    def end(
        self,
        *,
        error_type: str | None = None,
        error_message: str | None = None,
        aborted: bool = False,
        response: Any = None,
    ) -> None:
        """End the span and record metrics, exactly once. Never raises."""
        live = self.telemetry.live
        with live.lock:  # after a progress record being written (the finalizer thread ends requests too)
            if self.ended:
                return
            self.ended = True
        live.untrack(self)
        try:
            self._end(error_type, error_message, aborted, response)
        except Exception:  # instrumentation must never break serving
            failed("finishing the span of a vLLM request")
            try:
                self.span.end()
                self.telemetry.sink.finish(self.span)
            except Exception:
                pass

    def _end(self, error_type, error_message, aborted, response) -> None:
        """The API server's part of a request's end: vLLM's objects read once into the request's facts,
        the usage record written (before the span ends, and whether or not the trace is sampled); then
        the sink builds the span's end, phase spans and metrics from the facts (request_facts.py), here
        or in the export process. Content, the usage record and the metric key each fail alone
        (counted), so the rest still arrives. (One frame for what every request reads: each function a
        request runs costs the API server cache misses.)"""
        end_ns = time.time_ns()
        tel = self.telemetry
        info = self.info
        states = self.engine_states
        records = tel.engine_records
        for state in states:  # (forgotten by the registry: read once, here)
            records.pop(contract.read_state_id(state), None)
        if aborted and error_type is None:
            error_type = semconv.ERROR_CLIENT_ABORTED
        engines = list(map(contract.read_engine_request, states))
        usage = self._usage(engines)
        answered_id, answered_model, reasons, reasoning = contract.read_answer(response, self.metadata)
        finish_reasons = reasons or self._finish_reasons(aborted or error_type is not None, engines)
        generates = info.generates
        # the id the response (or its metadata) carries: the usage record's; the span falls back to vLLM's
        answered_id = self.response_id or answered_id
        response_id = answered_id
        if response_id is None and engines and generates:
            response_id = engines[0].external_id
        request_model = info.model
        # vLLM answers with the served name it was asked for; a failed request has no response model
        response_model = answered_model or (request_model if error_type is None else None)
        conversation_id = self.session_id or info.conversation_id or None
        if not (reasoning and generates):
            reasoning = None
        figures = list(filter(_given, map(_spec_figures, engines)))  # (in C: no comprehension's frame per request)
        spec = _spec_decode(figures) if figures else None
        status_text = None
        if error_type is not None:  # (a request that succeeded named a model vLLM serves)
            redact = redaction.default().redact
            error_type = redact(error_type)
            status_text = redacted_error(error_message) if error_message else None
            if request_model:
                request_model = redact(request_model)
        captured = None
        if tel.capture is not None and info.request is not None:
            captured = guarded("capturing a request's content", self._capture, engines, finish_reasons)
        # a P/D prefill leg is billed (and counted) on its decode node (the request the client sees): no record here
        prefill_leg = self.pd_role == semconv.PD_ROLE_PREFILL
        # (each step under a try of its own, as `guarded` would run it, without its frame per request)
        if engines and tel.ledger.enabled and not prefill_leg:
            try:
                self._write_usage(
                    end_ns,
                    engines,
                    usage,
                    (request_model, response_model, answered_id, conversation_id, error_type, reasoning, spec),
                    finish_reasons,
                )
            except Exception:  # noqa: BLE001
                failed("writing a request's usage record")
        try:
            metric = self._metric(error_type, request_model, response_model, None if prefill_leg else usage)
        except Exception:  # noqa: BLE001
            failed("recording a request's metrics")
            metric = None
        facts = new_request_facts(
            (
                info.operation,
                info.model,
                self.start_ns,
                end_ns,
                time.time() - time.monotonic(),
                self.first_chunk_ns,
                list(map(engine_facts, engines)),
                (
                    usage.input_tokens,
                    usage.cached_input_tokens,
                    usage.cache_creation_input_tokens,
                    usage.external_cached_input_tokens,
                    usage.output_tokens,
                )
                if engines or response is not None
                else None,
                finish_reasons,
                error_type,
                status_text,
                request_model if error_type is not None else None,
                response_model,
                response_id or None,
                conversation_id,
                reasoning,
                spec,
                aborted,
                self.pd_role,
                *(metric or (None, None)),
                captured,
            )
        )
        tel.sink.finish_request(self.span, self.context, facts, tel)
        # vLLM's objects let go once read: vLLM frees a finished engine request's state where it finishes
        # it, its code and data in the CPU's caches; an ended record kept them until it was itself freed,
        # after the rest of the response (a stream's last chunks), and they were freed from memory
        states.clear()
        self.metadata = None

    def _capture(self, engines: list[contract.EngineRequest], finish_reasons: list[str]) -> dict | None:
        """Opt-in content: the request's messages or prompt, and what the engine generated for each
        choice (the detokenizer's whole text: assembled once here, never per chunk)."""
        inputs = content.input_messages(self.info.operation, contract.read_request_content(self.info.request))
        if inputs is None:
            return None
        outputs: dict[int, list] = {}
        for engine in engines:
            if engine.output_text is not None:
                outputs.setdefault(engine.index, []).append(engine.output_text)
        captured: dict[str, Any] = {}
        self.telemetry.capture.set_attributes(captured, inputs, outputs, dict(enumerate(finish_reasons)))
        return captured

    def _write_usage(
        self, end_ns: int, engines: list[contract.EngineRequest], usage: Usage, named: tuple, finish_reasons: list[str]
    ) -> None:
        """The request's billing record (otel_llm/usage.py): full tenant values, exact tokens. `named`: its
        request model (redacted on an error), response model, answered id, conversation id, error type,
        reasoning tokens and speculative-decoding figures."""
        request_model, response_model, answered_id, conversation_id, error_type, reasoning, spec = named
        first = engines[0]
        info = self.info
        ledger = self.telemetry.ledger
        fields: dict[str, Any] = {
            semconv.USAGE_ID: ledger.key(first.prompt_id),
            semconv.USAGE_SCHEMA_VERSION: semconv.USAGE_SCHEMA,
            semconv.SERVICE_NAME: ledger.service,
            semconv.SERVICE_INSTANCE_ID: ledger.instance,
            semconv.VLLM_REQUEST_ID: first.external_id,
            semconv.GEN_AI_OPERATION_NAME: info.operation,
            semconv.REQUEST_OUTCOME: outcome(error_type),
            semconv.USAGE_DURATION: (end_ns - self.start_ns) / 1e9,
            semconv.GEN_AI_USAGE_INPUT_TOKENS: usage.input_tokens,
            semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: usage.cached_input_tokens,
            semconv.GEN_AI_USAGE_OUTPUT_TOKENS: usage.output_tokens,
            semconv.GEN_AI_REQUEST_CHOICE_COUNT: info.choice_count or 1,
            semconv.USAGE_ENGINE_REQUEST_IDS: list(map(_request_id, engines)),
        }
        served = first.lora_name
        optional = (  # (_USAGE_OPTIONAL's order)
            request_model,
            served or response_model or request_model,
            served,
            answered_id,
            info.tenant,
            info.scene,
            info.cost_center,
            info.api_key_id,
            info.user,
            conversation_id,
            error_type,
            usage.cache_creation_input_tokens or None,
            usage.external_cached_input_tokens or None,
            reasoning,
            None if spec is None else spec[0],
            None if spec is None else spec[1],
        )
        fields.update(compress(zip(_USAGE_OPTIONAL, optional, strict=True), map(_given, optional)))  # (in C)
        if finish_reasons and info.generates:
            fields[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = list(finish_reasons)
        ledger.write(fields, end_ns, self.span.get_span_context(), self.context)

    def _usage(self, engines: list[contract.EngineRequest]) -> Usage:
        if self.info.beam_search:
            reported = contract.read_reported_usage(self.metadata)
            if reported is not None:
                return Usage(input_tokens=reported[0], output_tokens=reported[1], cached_input_tokens=reported[2])
        usage = Usage()
        seen_prompts: set[str] = set()
        for engine in engines:
            usage.output_tokens += engine.output_tokens or 0
            # n > 1: the children of one ParentRequest share the prompt; count it once,
            # as vLLM's `usage` does.
            if engine.prompt_id in seen_prompts:
                continue
            seen_prompts.add(engine.prompt_id)
            usage.input_tokens += engine.prompt_tokens
            usage.cached_input_tokens += engine.cached_tokens
            usage.cache_creation_input_tokens += engine.cache_creation_tokens
            # a P/D decode leg: the prefill node's hits; else what a KV connector loaded (the engine's figures)
            external = (
                engine.remote_cached_tokens
                if engine.remote_cached_tokens is not None
                else cost_summary(engine.engine_cost)[1]
                if engine.engine_cost
                else 0
            )
            if external:
                usage.external_cached_input_tokens = (usage.external_cached_input_tokens or 0) + external
        return usage

    def _finish_reasons(self, failed: bool, engines: list[contract.EngineRequest]) -> list[str]:
        """The finish reasons of a request whose response named none (a stream's): its engine requests'."""
        reasons = []
        for engine in sorted(engines, key=_index) if len(engines) > 1 else engines:  # (one: no sort to run)
            reason = self.finish_reasons.get(engine.request_id)
            if reason is None:
                reason = semconv.FINISH_REASON_ABORT if failed else None
            if reason is not None:
                reasons.append(reason)
        return reasons

    def _metric(self, error_type, request_model, response_model, usage: Usage | None) -> tuple:
        """(the request's metric key, the token counter's increments): what the measurement needs of this
        process (the label guards, what live counting counted). usage None: none counted here (a P/D
        prefill leg: counted on its decode node)."""
        key = self._metric_key(error_type, request_model, response_model)
        tokens = (
            (usage.input_tokens, usage.cached_input_tokens, usage.output_tokens)
            if self.engine_states and usage is not None
            else None
        )
        if tokens is not None and self.live_counted is not None:  # the rest of what it counted in flight
            tokens = tuple(max(0, total - counted) for total, counted in zip(tokens, self.live_counted))
        return key, tokens

    def _metric_key(self, error_type, request_model: str | None, response_model: str | None) -> tuple:
        """The request's metric series (a MetricKey's values, as a plain tuple: marshal's, and no named
        tuple's __new__ per request), label values guarded."""
        tel = self.telemetry
        info = self.info
        # a failed request's model name is whatever the client sent (redacted): guard it like a tenant
        model = request_model if error_type is None else tel.label_failed_model(request_model)
        return (
            info.operation,
            model,
            response_model,
            tel.label_tenant(info.tenant),
            tel.label_scene(info.scene),
            tel.label_cost_center(info.cost_center),
        )

    # --- live counting (otel_llm/vllm/live.py; on the event loop, under its lock) ----------
    def progress(self, now_ns: int) -> tuple | None:
        """While in flight, when its tokens so far grew since the last sweep: a progress record of them
        (cumulative) in the spool, and (metric key, tokens added since) for the token counter. None
        when nothing grew, or for a P/D prefill leg (counted and billed on its decode node)."""
        if not self.engine_states or self.pd_role == semconv.PD_ROLE_PREFILL:
            return None
        engines = [contract.read_engine_request(state) for state in self.engine_states]
        usage = self._usage(engines)
        tokens = (usage.input_tokens, usage.cached_input_tokens, usage.output_tokens)
        counted = self.live_counted or (0, 0, 0)
        if all(now <= before for now, before in zip(tokens, counted)):
            return None
        self.live_counted = tuple(max(now, before) for now, before in zip(tokens, counted))
        if self.telemetry.ledger.spool is not None:
            self._write_progress(engines[0], usage, now_ns)
        added = tuple(after - before for after, before in zip(self.live_counted, counted))
        return self._metric_key(None, self.info.model, self.info.model), added

    def _write_progress(self, first: contract.EngineRequest, usage: Usage, now_ns: int) -> None:
        """A progress record: the fields a budget needs, with the USAGE_ID its bill will have."""
        info = self.info
        ledger = self.telemetry.ledger
        fields: dict[str, Any] = {
            semconv.USAGE_KIND: semconv.USAGE_KIND_PROGRESS,
            semconv.USAGE_ID: ledger.key(first.prompt_id),
            semconv.USAGE_SCHEMA_VERSION: semconv.USAGE_SCHEMA,
            semconv.SERVICE_NAME: ledger.service,
            semconv.SERVICE_INSTANCE_ID: ledger.instance,
            semconv.GEN_AI_OPERATION_NAME: info.operation,
            semconv.GEN_AI_USAGE_INPUT_TOKENS: usage.input_tokens,
            semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: usage.cached_input_tokens,
            semconv.GEN_AI_USAGE_OUTPUT_TOKENS: usage.output_tokens,
        }
        for key, value in (
            (semconv.GEN_AI_REQUEST_MODEL, info.model),
            (semconv.TENANT_ID, info.tenant),
            (semconv.TENANT_SCENE, info.scene),
            (semconv.TENANT_COST_CENTER, info.cost_center),
            (semconv.API_KEY_ID, info.api_key_id),
            (semconv.USER_ID, info.user),
        ):
            if value is not None:
                fields[key] = value
        ledger.write_progress(fields, now_ns, self.span.get_span_context())


def _spec_decode(figures: list[tuple[int, int, int]]) -> tuple[int, int, int]:
    """(drafts proposed, accepted, verify steps) summed over the request's engine requests that vLLM
    recorded them for (none: no speculator, or --per-request-spec-decode-metrics none; not asked then)."""
    return tuple(sum(f[i] for f in figures) for i in range(3))


def redacted_error(text: str) -> str:
    """An error's text for a status description: redacted (redaction.redacted_error, from at most
    MAX_ERROR_SCAN characters), then cut to MAX_ERROR_TEXT. Redacted before the cut, so a cut never
    leaves part of a key no rule recognises any more."""
    text = redaction.redacted_error(text, MAX_ERROR_SCAN)
    return text if len(text) <= MAX_ERROR_TEXT else text[:MAX_ERROR_TEXT] + "…"


def start_request(telemetry: Telemetry, info: RequestInfo, **options) -> RequestTelemetry:
    """A request's telemetry, its GenAI span started (options: RequestTelemetry's, e.g. `start_ns`,
    default now)."""
    return RequestTelemetry(telemetry, info, **options)


def end_with_exception(record: RequestTelemetry, exc: BaseException) -> None:
    """End `record` for the exception that stopped its request (or its stream)."""
    if isinstance(exc, StopAsyncIteration):  # the stream is done
        record.end()
    elif isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        record.end(aborted=True)
    else:
        record.end(error_type=type(exc).__qualname__, error_message=str(exc))  # redacted, then cut, at the end


def attach(record: RequestTelemetry):
    """Make record current (OTel context and our ContextVar); returns tokens for detach()."""
    return current.attach(record.context), CURRENT.set(record)


def detach(tokens) -> None:
    ctx_token, var_token = tokens
    CURRENT.reset(var_token)
    current.detach(ctx_token)
