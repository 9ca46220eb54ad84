"""One OpenAI-compatible (or offline) request -> GenAI span, phase child spans and metrics.

A RequestTelemetry is created when a request enters vLLM (the serving handler, or
AsyncLLM/LLMEngine used directly). vLLM's per-request `RequestState` objects are attached to
it as the engine accepts them; everything is read from them once, when the request ends, so
nothing here runs per output token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from otel_llm import content, redaction, semconv
from otel_llm.vllm import contract
from otel_llm.vllm.attribution import NO_CALLER, Caller
from otel_llm.vllm.request_metrics import Measurement, MetricKey, outcome
from otel_llm.vllm.telemetry import Telemetry, Usage
from otel_llm.warn import failed, guarded, warn_once

_log = logging.getLogger(__name__)

# Phase child spans are made for this many engine requests of one request at most (n > 1 makes one
# engine request per choice; n may be 16384): the rest are counted in VLLM_PHASE_SPANS_OMITTED.
MAX_PHASE_SPAN_CHAINS = 4

# A failed request's error text (vLLM's message, an exception's) is redacted before it is set as the
# span's status description: vLLM's 404 echoes the model name it was asked for, an exception can
# carry the prompt. The redactor reads at most MAX_ERROR_SCAN characters of it; MAX_ERROR_TEXT are kept.
MAX_ERROR_SCAN = 16_384
MAX_ERROR_TEXT = 500

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

    def span_attributes(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            semconv.GEN_AI_OPERATION_NAME: self.operation,
            semconv.GEN_AI_PROVIDER_NAME: semconv.PROVIDER_VLLM,
        }
        optional = (
            (semconv.GEN_AI_REQUEST_MODEL, self.model),
            (semconv.GEN_AI_REQUEST_MAX_TOKENS, self.max_tokens),
            (semconv.GEN_AI_REQUEST_TEMPERATURE, self.temperature),
            (semconv.GEN_AI_REQUEST_TOP_P, self.top_p),
            (semconv.GEN_AI_REQUEST_TOP_K, self.top_k),
            (semconv.GEN_AI_REQUEST_SEED, self.seed),
            (semconv.GEN_AI_REQUEST_FREQUENCY_PENALTY, self.frequency_penalty),
            (semconv.GEN_AI_REQUEST_PRESENCE_PENALTY, self.presence_penalty),
            (semconv.TENANT_ID, self.tenant),
            (semconv.TENANT_SCENE, self.scene),
            (semconv.TENANT_COST_CENTER, self.cost_center),
            (semconv.API_KEY_ID, self.api_key_id),
            (semconv.USER_ID, self.user),
            (semconv.OPENAI_API_TYPE, self.api_type),
        )
        for key, value in optional:
            if value is not None:
                attrs[key] = value
        if self.stream:
            attrs[semconv.GEN_AI_REQUEST_STREAM] = True
        if self.choice_count is not None and self.choice_count != 1:
            attrs[semconv.GEN_AI_REQUEST_CHOICE_COUNT] = self.choice_count
        return attrs


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
    return RequestInfo(
        operation=operation,
        model=get("model"),
        stream=get("stream") is True,
        choice_count=get("n"),
        max_tokens=max_tokens,
        temperature=get("temperature"),
        top_p=get("top_p"),
        top_k=top_k,
        seed=get("seed"),
        frequency_penalty=get("frequency_penalty"),
        presence_penalty=get("presence_penalty"),
        tenant=caller.tenant,
        scene=caller.scene,
        cost_center=caller.cost_center,
        api_key_id=caller.api_key_id,
        user=caller.user,
        conversation_id=conversation_id,
        api_type=api_type,
        beam_search=get("use_beam_search") is True,
        request=request,
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
        self.span = telemetry.tracer.start_span(
            semconv.genai_span_name(info.operation, info.model),
            context=context,
            kind=SpanKind.INTERNAL,
            attributes=info.span_attributes(),
            links=links,
            start_time=self.start_ns,
        )
        self.context = trace.set_span_in_context(self.span)
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
        self.telemetry.track_engine_request(contract.read_state_id(req_state), self)
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
            self.telemetry.untrack_engine_request(engine_id)
            self.on_engine_aborted()
            return
        if not self.engine_owned:
            self.telemetry.untrack_engine_request(engine_id)
            return
        if final_output_follows and engine_id not in (self.final_outputs or ()):
            return  # still tracked: its final output finds this record (ending untracks it)
        self.telemetry.untrack_engine_request(engine_id)
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
        """The steps of a request's end, in order; the phases, content, usage record, metrics and hand-over
        each fail alone (counted), so the rest still arrives."""
        ending = self._read_engines(error_type, aborted, response)
        self._usage_attributes(ending)
        self._response_attributes(ending)
        self._engine_attributes(ending, aborted)
        timing = guarded("reading a request's phase timing", self._phases, ending.end_ns, ending.engines)
        ending.timing = timing or _Timing()
        ending.attrs.update(ending.timing.attributes)
        guarded("reading a request's engine cost", _engine_cost, self.span, ending.attrs, ending.engines)
        self._error_attributes(ending, error_message)
        if self.telemetry.capture is not None and self.info.request is not None:
            guarded("capturing a request's content", self._capture, ending)
        # a P/D prefill leg is billed on its decode node (the request the client sees): no record here
        if ending.engines and self.telemetry.ledger.enabled and not ending.prefill_leg:
            # before the span ends, and whether or not the trace is sampled
            guarded("writing a request's usage record", self._write_usage, ending)
        self.span.set_attributes(ending.attrs)
        self.span.end(end_time=ending.end_ns)
        guarded("recording a request's metrics", self._record_metrics, ending)
        guarded("handing a request's telemetry to the export process", self.telemetry.sink.finish, self.span)

    def _read_engines(self, error_type, aborted: bool, response) -> "_Ending":
        """The end time, the engine requests read once (and forgotten by the registry), the usage and
        the finish reasons."""
        ending = _Ending()
        ending.end_ns = time.time_ns()
        for state in self.engine_states:
            self.telemetry.untrack_engine_request(contract.read_state_id(state))
        ending.error_type = semconv.ERROR_CLIENT_ABORTED if aborted and error_type is None else error_type
        ending.response = response
        ending.engines = engines = [contract.read_engine_request(state) for state in self.engine_states]
        ending.usage = self._usage(engines)
        ending.finish_reasons = self._finish_reasons(response, aborted or ending.error_type is not None, engines)
        ending.prefill_leg = self.pd_role == semconv.PD_ROLE_PREFILL
        ending.request_model = self.info.model
        ending.response_model = None
        ending.spec = None
        ending.attrs = {}
        return ending

    def _usage_attributes(self, ending: "_Ending") -> None:
        usage, attrs = ending.usage, ending.attrs
        if ending.engines or ending.response is not None:
            attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = usage.input_tokens
            attrs[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = usage.cached_input_tokens
            if usage.cache_creation_input_tokens:  # where vLLM's request state tells them
                attrs[self.telemetry.cache_write_attribute] = usage.cache_creation_input_tokens
            if usage.external_cached_input_tokens:
                attrs[semconv.VLLM_EXTERNAL_CACHED_TOKENS] = usage.external_cached_input_tokens
            if self.info.generates:
                attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = usage.output_tokens

    def _response_attributes(self, ending: "_Ending") -> None:
        """Response id, model and finish reasons, vLLM's request id, the conversation."""
        attrs, engines, response, generates = ending.attrs, ending.engines, ending.response, self.info.generates
        response_id = self.response_id or contract.read_response_id(response)
        if response_id is None and engines and generates:
            response_id = engines[0].external_id
        if response_id:
            attrs[semconv.GEN_AI_RESPONSE_ID] = response_id
        # vLLM answers with the served name it was asked for; a failed request has no response model
        ending.response_model = contract.read_response_model(response) or (
            self.info.model if ending.error_type is None else None
        )
        if ending.response_model:
            attrs[semconv.GEN_AI_RESPONSE_MODEL] = ending.response_model
        if ending.finish_reasons and generates:
            attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = ending.finish_reasons
        if engines:
            attrs[semconv.VLLM_REQUEST_ID] = engines[0].external_id
            if len(engines) > 1:
                attrs[semconv.VLLM_ENGINE_REQUESTS] = len(engines)
        conversation_id = self.session_id or self.info.conversation_id
        if conversation_id:
            attrs[semconv.GEN_AI_CONVERSATION_ID] = conversation_id

    def _engine_attributes(self, ending: "_Ending", aborted: bool) -> None:
        """Reasoning tokens, speculative decoding, the abort, the P/D role, the stream's wire TTFT."""
        attrs = ending.attrs
        reasoning = contract.read_reasoning_tokens(ending.response, self.metadata)
        if reasoning and self.info.generates:  # breakdowns only when non-zero
            attrs[semconv.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS] = reasoning
        ending.spec = spec = _spec_decode(ending.engines)
        if spec is not None:
            drafts, accepted, steps = spec
            attrs[semconv.VLLM_SPEC_DRAFT_TOKENS] = drafts
            attrs[semconv.VLLM_SPEC_ACCEPTED_TOKENS] = accepted
            attrs[semconv.VLLM_SPEC_ACCEPTANCE_RATE] = accepted / drafts if drafts else 0.0
            attrs[semconv.VLLM_SPEC_ACCEPTANCE_LENGTH] = 1.0 + accepted / steps if steps else 1.0
        if aborted:
            attrs[semconv.VLLM_ABORTED] = True
        if self.pd_role is not None:
            attrs[semconv.VLLM_PD_ROLE] = self.pd_role
        if self.first_chunk_ns is not None:
            attrs[semconv.VLLM_STREAM_TTFT_SECONDS] = (self.first_chunk_ns - self.start_ns) / 1e9

    def _error_attributes(self, ending: "_Ending", error_message: str | None) -> None:
        """The error path only: the error's text and the model name the client sent are redacted (a
        request that succeeded named a model vLLM serves)."""
        if ending.error_type is None:
            return
        span, attrs = self.span, ending.attrs
        redact = redaction.default().redact
        ending.error_type = error_type = redact(ending.error_type)
        attrs[semconv.ERROR_TYPE] = error_type
        span.set_status(Status(StatusCode.ERROR, redacted_error(error_message) if error_message else error_type))
        if ending.request_model:
            ending.request_model = request_model = redact(ending.request_model)
            if request_model != self.info.model:
                attrs[semconv.GEN_AI_REQUEST_MODEL] = request_model
                span.update_name(semconv.genai_span_name(self.info.operation, request_model))

    def _capture(self, ending: "_Ending") -> None:
        """Opt-in content: the request's messages or prompt, and what the engine generated for each
        choice (the detokenizer's whole text: assembled once here, never per chunk)."""
        inputs = content.input_messages(self.info.operation, contract.read_request_content(self.info.request))
        if inputs is None:
            return
        outputs: dict[int, list] = {}
        for engine in ending.engines:
            if engine.output_text is not None:
                outputs.setdefault(engine.index, []).append(engine.output_text)
        self.telemetry.capture.set_attributes(ending.attrs, inputs, outputs, dict(enumerate(ending.finish_reasons)))

    def _write_usage(self, ending: "_Ending") -> None:
        """The request's billing record (otel_llm/usage.py): full tenant values, exact tokens."""
        usage, engines, attrs, response_model = ending.usage, ending.engines, ending.attrs, ending.response_model
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
            semconv.REQUEST_OUTCOME: outcome(ending.error_type),
            semconv.USAGE_DURATION: (ending.end_ns - self.start_ns) / 1e9,
            semconv.GEN_AI_USAGE_INPUT_TOKENS: usage.input_tokens,
            semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: usage.cached_input_tokens,
            semconv.GEN_AI_USAGE_OUTPUT_TOKENS: usage.output_tokens,
            semconv.GEN_AI_REQUEST_CHOICE_COUNT: info.choice_count or 1,
            semconv.USAGE_ENGINE_REQUEST_IDS: [engine.request_id for engine in engines],
        }
        served = first.lora_name
        optional = (
            (semconv.GEN_AI_REQUEST_MODEL, ending.request_model),
            (semconv.GEN_AI_RESPONSE_MODEL, served or response_model or ending.request_model),
            (semconv.VLLM_LORA_NAME, served),
            (semconv.GEN_AI_RESPONSE_ID, self.response_id or contract.read_response_id(ending.response)),
            (semconv.TENANT_ID, info.tenant),
            (semconv.TENANT_SCENE, info.scene),
            (semconv.TENANT_COST_CENTER, info.cost_center),
            (semconv.API_KEY_ID, info.api_key_id),
            (semconv.USER_ID, info.user),
            (semconv.GEN_AI_CONVERSATION_ID, attrs.get(semconv.GEN_AI_CONVERSATION_ID)),
            (semconv.ERROR_TYPE, ending.error_type),
            # the breakdowns (semconv.USAGE_DETAIL_TOKEN_FIELDS: inclusive), only when non-zero
            (semconv.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS, usage.cache_creation_input_tokens or None),
            (semconv.VLLM_EXTERNAL_CACHED_TOKENS, usage.external_cached_input_tokens or None),
            (semconv.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS, attrs.get(semconv.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS)),
            (semconv.VLLM_SPEC_DRAFT_TOKENS, attrs.get(semconv.VLLM_SPEC_DRAFT_TOKENS)),
            (semconv.VLLM_SPEC_ACCEPTED_TOKENS, attrs.get(semconv.VLLM_SPEC_ACCEPTED_TOKENS)),
        )
        for key, value in optional:
            if value is not None:
                fields[key] = value
        if ending.finish_reasons and info.generates:
            fields[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = list(ending.finish_reasons)
        ledger.write(fields, ending.end_ns, self.span.get_span_context(), self.context)

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
                else _cost_summary(engine.engine_cost)[1]
                if engine.engine_cost
                else 0
            )
            if external:
                usage.external_cached_input_tokens = (usage.external_cached_input_tokens or 0) + external
        return usage

    def _finish_reasons(self, response, failed: bool, engines: list[contract.EngineRequest]) -> list[str]:
        answered = contract.read_finish_reasons(response)  # a non-streamed response's choices
        if answered:
            return answered
        reasons = []
        for engine in sorted(engines, key=lambda e: e.index):
            reason = self.finish_reasons.get(engine.request_id)
            if reason is None:
                reason = semconv.FINISH_REASON_ABORT if failed else None
            if reason is not None:
                reasons.append(reason)
        return reasons

    def _phases(self, end_ns: int, engines: list[contract.EngineRequest]) -> "_Timing":
        """Queue / prefill / decode of the request, and child spans from the engine's monotonic
        timestamps. With n > 1 (one engine request per choice) the request's phases span its
        engine requests: queue until the first was scheduled, prefill until the first token,
        decode until the last token of any; child spans for the first MAX_PHASE_SPAN_CHAINS."""
        timing = _Timing()
        timed = [e for e in engines if e.timing is not None]
        if len(timed) < len(engines) or not timed:
            if engines:
                timing.attributes[semconv.VLLM_PHASE_TIMING_UNAVAILABLE] = True
            return timing
        # The engine core stamps time.monotonic(); on one host that clock is shared by all
        # processes, so wall = monotonic + (time.time() - time.monotonic()) here.
        offset = time.time() - time.monotonic()
        queued = scheduled = first = last = 0.0
        ttft = scheduled_ttft = None
        preemptions = gen_tokens = 0
        have_events = True
        # an unsampled request (head sampling) pays for no child spans
        make_spans = self.telemetry.settings.phase_spans and self.span.is_recording()
        chains = 0
        for engine in timed:
            stats = engine.timing
            preemptions += stats.preemptions
            gen_tokens += stats.generation_tokens
            if stats.first_token_latency and (ttft is None or stats.first_token_latency < ttft):
                ttft = stats.first_token_latency
            if stats.scheduled and stats.first_token:  # vLLM's metrics.time_to_first_token_ms, in seconds
                since_scheduled = stats.first_token - stats.scheduled
                if scheduled_ttft is None or since_scheduled < scheduled_ttft:
                    scheduled_ttft = since_scheduled
            if stats.first_token and stats.last_token:
                first = _earliest(first, stats.first_token)
                last = max(last, stats.last_token)
            bounds = _phase_bounds(stats)
            if bounds is None:
                # no QUEUED event: the engine core records none when it was started with
                # stats off (--disable-log-stats with --api-server-count > 1)
                have_events = False
                if stats.first_token:
                    warn_once("no engine events", _NO_ENGINE_EVENTS)
                continue
            queued = _earliest(queued, bounds[0])
            scheduled = _earliest(scheduled, bounds[1])
            if make_spans and chains < MAX_PHASE_SPAN_CHAINS:
                chains += 1
                self._phase_spans(engine, bounds, offset, end_ns, len(timed) > 1)
        if have_events:
            timing.attributes[semconv.VLLM_QUEUE_SECONDS] = scheduled - queued if scheduled else 0.0
            timing.attributes[semconv.VLLM_PREFILL_SECONDS] = first - scheduled if scheduled and first else 0.0
        else:
            timing.attributes[semconv.VLLM_PHASE_TIMING_UNAVAILABLE] = True
        decode = last - first if first else 0.0
        if self.info.generates:
            timing.attributes[semconv.VLLM_DECODE_SECONDS] = decode
        if make_spans and len(timed) > chains and have_events:
            timing.attributes[semconv.VLLM_PHASE_SPANS_OMITTED] = len(timed) - chains
        timing.attributes[semconv.VLLM_PREEMPTIONS] = preemptions
        if ttft is not None:
            timing.attributes[semconv.VLLM_TTFT_SECONDS] = ttft
            timing.ttft = ttft
        if scheduled_ttft is not None and self.info.generates:
            timing.attributes[semconv.VLLM_SCHEDULED_TTFT_SECONDS] = scheduled_ttft
            timing.scheduled_ttft = scheduled_ttft
        if len(timed) == 1 and gen_tokens > 1:
            timing.tpot = decode / (gen_tokens - 1)
            timing.attributes[semconv.VLLM_TPOT_SECONDS] = timing.tpot
        return timing

    def _phase_spans(self, engine: contract.EngineRequest, bounds, offset: float, end_ns: int, tag: bool) -> None:
        q0, q1, p1, d1 = bounds
        lo, hi = self.start_ns, end_ns
        attrs = {semconv.VLLM_REQUEST_ID: engine.request_id} if tag else None
        sink = self.telemetry.sink
        prev_end = lo
        first = semconv.SPAN_KV_TRANSFER_WAIT if self.pd_role == semconv.PD_ROLE_DECODE else semconv.SPAN_QUEUE
        phases = [(first, q0, q1), (semconv.SPAN_PREFILL, q1, p1)]
        if engine.output_tokens is not None:  # pooling (embeddings) requests have no decode
            phases.append((semconv.SPAN_DECODE, p1, d1))
        for name, start, stop in phases:
            if not start:
                break
            start_ns = min(max(int((start + offset) * 1e9), prev_end), hi)
            stop_ns = hi if not stop else min(max(int((stop + offset) * 1e9), start_ns), hi)
            sink.child_span(self.span, self.context, name, start_ns, stop_ns, attrs)
            prev_end = stop_ns
            if not stop:
                break

    def _record_metrics(self, ending: "_Ending") -> None:
        # (usage and spec None for a P/D prefill leg: counted on its decode node)
        usage, spec = (None, None) if ending.prefill_leg else (ending.usage, ending.spec)
        timing, compute_ns = ending.timing, ending.attrs.get(semconv.COST_COMPUTE_NS)
        tel = self.telemetry
        key = self._metric_key(ending.error_type, ending.request_model, ending.response_model)
        tokens = (
            (usage.input_tokens, usage.cached_input_tokens, usage.output_tokens)
            if self.engine_states and usage is not None
            else None
        )
        if tokens is not None and self.live_counted is not None:  # the rest of what it counted in flight
            tokens = tuple(max(0, total - counted) for total, counted in zip(tokens, self.live_counted))
        tel.sink.record_request(
            self.span,
            self.context,
            Measurement(
                key,
                ending.error_type,
                timing.ttft,
                timing.tpot,
                (ending.end_ns - self.start_ns) / 1e9,
                tokens,
                None if compute_ns is None else compute_ns / 1e9,
                timing.scheduled_ttft,
                None if spec is None else spec[:2],
            ),
        )

    def _metric_key(self, error_type, request_model: str | None, response_model: str | None) -> MetricKey:
        """The request's metric series, label values guarded."""
        tel = self.telemetry
        info = self.info
        # a failed request's model name is whatever the client sent (redacted): guard it like a tenant
        model = request_model if error_type is None else tel.label_failed_model(request_model)
        return MetricKey(
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


def _spec_decode(engines: list[contract.EngineRequest]) -> tuple[int, int, int] | None:
    """(drafts proposed, accepted, verify steps) summed over the request's engine requests, or None
    when vLLM recorded none (no speculator, or --per-request-spec-decode-metrics none)."""
    figures = [e.spec_decode for e in engines if e.spec_decode is not None]
    if not figures:
        return None
    return tuple(sum(f[i] for f in figures) for i in range(3))


def _engine_cost(span, attrs: dict, engines: list[contract.EngineRequest]) -> None:
    """The engine core's figures for the request's engine requests (otel_llm/vllm/engine_cost.py's
    summary on each final output: compute, prefill, KV block-ns, prefix-hit block-ns, preempted ns,
    scheduled tokens; then `;at:waited` per preemption), summed on the span; each preemption a span
    event at the time it happened. Absent when the engine's record came after the final output (a
    request still in an overlapped batch, blocks held by a KV connector) or the engine core is not
    instrumented: the usage ledger has them either way."""
    totals = None
    for engine in engines:
        if not engine.engine_cost:
            continue
        values, _, preemptions = _cost_summary(engine.engine_cost)
        totals = values if totals is None else [t + v for t, v in zip(totals, values)]
        for at, waited in preemptions:
            span.add_event(semconv.EVENT_PREEMPTED, {semconv.COST_PREEMPTED_NS: waited}, timestamp=at)
    if totals is not None:
        attrs.update(zip(_COST_FIELDS, totals))


def _cost_summary(summary: str) -> tuple[list[int], int, list[tuple[int, int]]]:
    """engine_cost.py's summary: the _COST_FIELDS figures, the prefix-cache hit tokens a KV connector
    loaded (0 from an engine that sends none), and (at, waited) per preemption."""
    figures, *preemptions = summary.split(";")
    values = [int(v) for v in figures.split(",")]
    count = len(_COST_FIELDS)
    external = values[count] if len(values) > count else 0
    return values[:count], external, [(int(at), int(waited)) for at, waited in (p.split(":") for p in preemptions)]


_COST_FIELDS = (
    semconv.COST_COMPUTE_NS,
    semconv.COST_PREFILL_COMPUTE_NS,
    semconv.COST_KV_BLOCK_NS,
    semconv.COST_KV_HIT_BLOCK_NS,
    semconv.COST_PREEMPTED_NS,
    semconv.COST_SCHEDULED_TOKENS,
)


class _Ending:
    """What the steps of a request's end (RequestTelemetry._end) share."""

    __slots__ = (
        "end_ns",
        "error_type",
        "response",
        "engines",
        "usage",
        "finish_reasons",
        "prefill_leg",
        "request_model",
        "response_model",
        "spec",
        "timing",
        "attrs",
    )


class _Timing:
    __slots__ = ("attributes", "ttft", "tpot", "scheduled_ttft")

    def __init__(self):
        self.attributes: dict[str, Any] = {}
        self.ttft: float | None = None
        self.tpot: float | None = None
        self.scheduled_ttft: float | None = None


def _earliest(current: float, candidate: float) -> float:
    """The earlier of two engine timestamps, 0 meaning none yet."""
    return candidate if not current or (candidate and candidate < current) else current


def _phase_bounds(stats: contract.EngineTiming):
    """(queued, scheduled, first_token, last_token) engine-monotonic seconds; 0 = not reached."""
    if not stats.queued:
        return None
    scheduled = stats.scheduled or 0.0
    first = stats.first_token if scheduled and stats.first_token else 0.0
    last = stats.last_token if first and stats.last_token else 0.0
    return stats.queued, scheduled, first, last


_NO_ENGINE_EVENTS = (
    "otel-llm: vLLM's engine core records no queue/schedule timestamps (it was started with "
    "--disable-log-stats); spans keep tokens, TTFT and decode time but have no queue/prefill "
    "child spans. Drop --disable-log-stats to get them."
)


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
    return otel_context.attach(record.context), CURRENT.set(record)


def detach(tokens) -> None:
    ctx_token, var_token = tokens
    CURRENT.reset(var_token)
    otel_context.detach(ctx_token)
