"""One ended request's facts, and what is built from them: the GenAI span's end attributes, its phase
child spans and the request metrics' measurement.

RequestTelemetry (request_telemetry.py) reads everything that lives in the API server once when a
request ends (vLLM's request states and response, the caller's label values, the usage record, written
there) into a `RequestFacts` of plain values. `build` makes the rest from it, with the same code in
either process: in the API server when the SDK exports from there, in the export process otherwise
(otel_llm/vllm/export/process.py), so the API server, vLLM's bottleneck, does not pay for it.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

from opentelemetry.trace import Status, StatusCode

from otel_llm import semconv
from otel_llm.config import Settings
from otel_llm.vllm.contract import EngineTiming
from otel_llm.vllm.request_metrics import Measurement
from otel_llm.warn import guarded, warn_once

# Phase child spans are made for this many engine requests of one request at most (n > 1 makes one
# engine request per choice; n may be 16384): the rest are counted in VLLM_PHASE_SPANS_OMITTED.
MAX_PHASE_SPAN_CHAINS = 4


# A GenAI span's start attributes set when not None, in the order of RequestInfo.start_values after
# its operation (the stream flag and choice count follow them)
_START_OPTIONAL = (
    semconv.GEN_AI_REQUEST_MODEL,
    semconv.GEN_AI_REQUEST_MAX_TOKENS,
    semconv.GEN_AI_REQUEST_TEMPERATURE,
    semconv.GEN_AI_REQUEST_TOP_P,
    semconv.GEN_AI_REQUEST_TOP_K,
    semconv.GEN_AI_REQUEST_SEED,
    semconv.GEN_AI_REQUEST_FREQUENCY_PENALTY,
    semconv.GEN_AI_REQUEST_PRESENCE_PENALTY,
    semconv.TENANT_ID,
    semconv.TENANT_SCENE,
    semconv.TENANT_COST_CENTER,
    semconv.API_KEY_ID,
    semconv.USER_ID,
    semconv.OPENAI_API_TYPE,
)


def start_attributes(values: tuple) -> dict[str, Any]:
    """A GenAI span's start attributes from its RequestInfo.start_values: in the API server, or in the
    export process for a span whose start attributes the sampler did not need there."""
    operation, *optional, stream, choice_count = values
    attrs: dict[str, Any] = {
        semconv.GEN_AI_OPERATION_NAME: operation,
        semconv.GEN_AI_PROVIDER_NAME: semconv.PROVIDER_VLLM,
    }
    for key, value in zip(_START_OPTIONAL, optional, strict=True):
        if value is not None:
            attrs[key] = value
    if stream:
        attrs[semconv.GEN_AI_REQUEST_STREAM] = True
    if choice_count is not None and choice_count != 1:
        attrs[semconv.GEN_AI_REQUEST_CHOICE_COUNT] = choice_count
    return attrs


class EngineFacts(NamedTuple):
    """What the build reads of one engine request (contract.EngineRequest)."""

    request_id: str
    external_id: str | None
    generates: bool  # it has a detokenizer (pooling requests have none: no decode)
    timing: tuple | None  # EngineTiming's fields, or None (stats off)
    engine_cost: str | None  # engine_cost.py's summary, when it came


class RequestFacts(NamedTuple):
    """An ended request, in plain values (marshal carries them to the export process)."""

    operation: str
    request_model: str | None  # as the span started with it (the client's)
    start_ns: int
    end_ns: int
    # wall clock minus the engine's monotonic clock at the end: the engine core stamps time.monotonic(),
    # which one host's processes share, so wall = monotonic + offset
    clock_offset: float
    first_chunk_ns: int | None
    engines: list  # EngineFacts each
    usage: tuple | None  # (input, cached input, cache creation, external cached, output); None: no usage
    finish_reasons: list
    error_type: str | None  # redacted
    status_text: str | None  # the span status's description (redacted, cut), on an error
    failed_model: str | None  # the model name a failed request sent, redacted
    response_model: str | None
    response_id: str | None
    conversation_id: str | None
    reasoning_tokens: int | None
    spec: tuple | None  # (drafts, accepted, verify steps)
    aborted: bool
    pd_role: str | None
    metric_key: tuple | None  # request_metrics.MetricKey, label values guarded; None: no measurement
    tokens: tuple | None  # the token counter's increments (what live counting did not count yet)
    captured: dict | None  # opt-in content attributes (otel_llm/content.py)


# a named tuple made from a tuple of its values in C, without its Python __new__ (a frame per request)
new_engine_facts = partial(tuple.__new__, EngineFacts)
new_request_facts = partial(tuple.__new__, RequestFacts)


def engine_facts(engine) -> EngineFacts:
    """contract.EngineRequest -> EngineFacts (the text stays behind: content leaves only when captured)."""
    t = engine.timing
    timing = (
        None
        if t is None
        else (
            t.queued,
            t.scheduled,
            t.first_token,
            t.last_token,
            t.first_token_latency,
            t.generation_tokens,
            t.preemptions,
        )
    )
    generates = engine.output_tokens is not None
    return new_engine_facts((engine.request_id, engine.external_id, generates, timing, engine.engine_cost))


_ENGINES = RequestFacts._fields.index("engines")
END_NS = RequestFacts._fields.index("end_ns")
CAPTURED = RequestFacts._fields.index("captured")


def plain_facts(facts: RequestFacts) -> tuple:
    """The facts as the plain tuples marshal carries (no named tuples)."""
    return (*facts[:_ENGINES], list(map(tuple, facts.engines)), *facts[_ENGINES + 1 :])


def facts_from_plain(values) -> RequestFacts:
    """`plain_facts`'s tuple, read by name again (in the export process)."""
    engines = [EngineFacts(*engine) for engine in values[_ENGINES]]
    return RequestFacts(*values[:_ENGINES], engines, *values[_ENGINES + 1 :])


class Timing:
    __slots__ = ("attributes", "ttft", "tpot", "scheduled_ttft")

    def __init__(self):
        self.attributes: dict[str, Any] = {}
        self.ttft: float | None = None
        self.tpot: float | None = None
        self.scheduled_ttft: float | None = None


def build(facts: RequestFacts, span, context, sink, settings: Settings) -> None:
    """The span's end attributes, its phase child spans (sink.child_span), its end, and the request's
    measurement (sink.record_request); each step fails alone (counted), so the rest still arrives."""
    attrs: dict[str, Any] = {}
    generates = facts.operation not in semconv.POOLING_OPERATIONS
    # v1.41's name, or its post-v1.41 rename under OTEL_SEMCONV_STABILITY_OPT_IN (semconv.py)
    cache_write = (
        semconv.GEN_AI_USAGE_CACHE_WRITE_INPUT_TOKENS
        if settings.genai_latest_experimental
        else semconv.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS
    )
    _usage_attributes(facts, attrs, generates, cache_write)
    _response_attributes(facts, attrs, generates)
    timing = guarded(
        "reading a request's phase timing", _phases, facts, span, context, sink, settings.phase_spans, generates
    )
    timing = timing or Timing()
    attrs.update(timing.attributes)
    guarded("reading a request's engine cost", _engine_cost, span, attrs, facts.engines)
    if facts.error_type is not None:
        attrs[semconv.ERROR_TYPE] = facts.error_type
        span.set_status(Status(StatusCode.ERROR, facts.status_text or facts.error_type))
        if facts.failed_model and facts.failed_model != facts.request_model:
            attrs[semconv.GEN_AI_REQUEST_MODEL] = facts.failed_model
            span.update_name(semconv.genai_span_name(facts.operation, facts.failed_model))
    if facts.captured:
        attrs.update(facts.captured)
    span.set_attributes(attrs)
    span.end(end_time=facts.end_ns)
    if facts.metric_key is not None:
        guarded("recording a request's metrics", _record_metrics, facts, timing, attrs, span, context, sink)


def _usage_attributes(facts: RequestFacts, attrs: dict, generates: bool, cache_write_attribute: str) -> None:
    if facts.usage is None:
        return
    input_tokens, cached, cache_creation, external, output = facts.usage
    attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = input_tokens
    attrs[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = cached
    if cache_creation:  # where vLLM's request state tells them
        attrs[cache_write_attribute] = cache_creation
    if external:
        attrs[semconv.VLLM_EXTERNAL_CACHED_TOKENS] = external
    if generates:
        attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = output


def _response_attributes(facts: RequestFacts, attrs: dict, generates: bool) -> None:
    """Response id, model and finish reasons, vLLM's request id, the conversation; reasoning tokens,
    speculative decoding, the abort, the P/D role, the stream's wire TTFT."""
    engines = facts.engines
    if facts.response_id:
        attrs[semconv.GEN_AI_RESPONSE_ID] = facts.response_id
    if facts.response_model:
        attrs[semconv.GEN_AI_RESPONSE_MODEL] = facts.response_model
    if facts.finish_reasons and generates:
        attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = facts.finish_reasons
    if engines:
        attrs[semconv.VLLM_REQUEST_ID] = engines[0].external_id
        if len(engines) > 1:
            attrs[semconv.VLLM_ENGINE_REQUESTS] = len(engines)
    if facts.conversation_id:
        attrs[semconv.GEN_AI_CONVERSATION_ID] = facts.conversation_id
    if facts.reasoning_tokens and generates:  # breakdowns only when non-zero
        attrs[semconv.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS] = facts.reasoning_tokens
    if facts.spec is not None:
        drafts, accepted, steps = facts.spec
        attrs[semconv.VLLM_SPEC_DRAFT_TOKENS] = drafts
        attrs[semconv.VLLM_SPEC_ACCEPTED_TOKENS] = accepted
        attrs[semconv.VLLM_SPEC_ACCEPTANCE_RATE] = accepted / drafts if drafts else 0.0
        attrs[semconv.VLLM_SPEC_ACCEPTANCE_LENGTH] = 1.0 + accepted / steps if steps else 1.0
    if facts.aborted:
        attrs[semconv.VLLM_ABORTED] = True
    if facts.pd_role is not None:
        attrs[semconv.VLLM_PD_ROLE] = facts.pd_role
    if facts.first_chunk_ns is not None:
        attrs[semconv.VLLM_STREAM_TTFT_SECONDS] = (facts.first_chunk_ns - facts.start_ns) / 1e9


def _phases(facts: RequestFacts, span, context, sink, phase_spans: bool, generates: bool) -> Timing:
    """Queue / prefill / decode of the request, and child spans from the engine's monotonic
    timestamps. With n > 1 (one engine request per choice) the request's phases span its
    engine requests: queue until the first was scheduled, prefill until the first token,
    decode until the last token of any; child spans for the first MAX_PHASE_SPAN_CHAINS."""
    timing = Timing()
    engines = facts.engines
    timed = [e for e in engines if e.timing is not None]
    if len(timed) < len(engines) or not timed:
        if engines:
            timing.attributes[semconv.VLLM_PHASE_TIMING_UNAVAILABLE] = True
        return timing
    offset = facts.clock_offset
    queued = scheduled = first = last = 0.0
    ttft = scheduled_ttft = None
    preemptions = gen_tokens = 0
    have_events = True
    # an unsampled request (head sampling) pays for no child spans
    make_spans = phase_spans and span.is_recording()
    chains = 0
    for engine in timed:
        stats = EngineTiming(*engine.timing)
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
            _phase_spans(facts, engine, bounds, offset, span, context, sink, len(timed) > 1)
    if have_events:
        timing.attributes[semconv.VLLM_QUEUE_SECONDS] = scheduled - queued if scheduled else 0.0
        timing.attributes[semconv.VLLM_PREFILL_SECONDS] = first - scheduled if scheduled and first else 0.0
    else:
        timing.attributes[semconv.VLLM_PHASE_TIMING_UNAVAILABLE] = True
    decode = last - first if first else 0.0
    if generates:
        timing.attributes[semconv.VLLM_DECODE_SECONDS] = decode
    if make_spans and len(timed) > chains and have_events:
        timing.attributes[semconv.VLLM_PHASE_SPANS_OMITTED] = len(timed) - chains
    timing.attributes[semconv.VLLM_PREEMPTIONS] = preemptions
    if ttft is not None:
        timing.attributes[semconv.VLLM_TTFT_SECONDS] = ttft
        timing.ttft = ttft
    if scheduled_ttft is not None and generates:
        timing.attributes[semconv.VLLM_SCHEDULED_TTFT_SECONDS] = scheduled_ttft
        timing.scheduled_ttft = scheduled_ttft
    if len(timed) == 1 and gen_tokens > 1:
        timing.tpot = decode / (gen_tokens - 1)
        timing.attributes[semconv.VLLM_TPOT_SECONDS] = timing.tpot
    return timing


def _phase_spans(facts: RequestFacts, engine: EngineFacts, bounds, offset: float, span, context, sink, tag: bool):
    q0, q1, p1, d1 = bounds
    lo, hi = facts.start_ns, facts.end_ns
    attrs = {semconv.VLLM_REQUEST_ID: engine.request_id} if tag else None
    prev_end = lo
    first = semconv.SPAN_KV_TRANSFER_WAIT if facts.pd_role == semconv.PD_ROLE_DECODE else semconv.SPAN_QUEUE
    phases = [(first, q0, q1), (semconv.SPAN_PREFILL, q1, p1)]
    if engine.generates:  # pooling (embeddings) requests have no decode
        phases.append((semconv.SPAN_DECODE, p1, d1))
    for name, start, stop in phases:
        if not start:
            break
        start_ns = min(max(int((start + offset) * 1e9), prev_end), hi)
        stop_ns = hi if not stop else min(max(int((stop + offset) * 1e9), start_ns), hi)
        sink.child_span(span, context, name, start_ns, stop_ns, attrs)
        prev_end = stop_ns
        if not stop:
            break


def _record_metrics(facts: RequestFacts, timing: Timing, attrs: dict, span, context, sink) -> None:
    compute_ns = attrs.get(semconv.COST_COMPUTE_NS)
    # (a P/D prefill leg's speculative decoding is counted on its decode node, as its tokens are)
    spec = None if facts.pd_role == semconv.PD_ROLE_PREFILL else facts.spec
    sink.record_request(
        span,
        context,
        Measurement(
            facts.metric_key,
            facts.error_type,
            timing.ttft,
            timing.tpot,
            (facts.end_ns - facts.start_ns) / 1e9,
            facts.tokens,
            None if compute_ns is None else compute_ns / 1e9,
            timing.scheduled_ttft,
            None if spec is None else spec[:2],
        ),
    )


def _engine_cost(span, attrs: dict, engines: list) -> None:
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
        values, _, preemptions = cost_summary(engine.engine_cost)
        totals = values if totals is None else [t + v for t, v in zip(totals, values)]
        for at, waited in preemptions:
            span.add_event(semconv.EVENT_PREEMPTED, {semconv.COST_PREEMPTED_NS: waited}, timestamp=at)
    if totals is not None:
        attrs.update(zip(_COST_FIELDS, totals))


def cost_summary(summary: str) -> tuple[list[int], int, list[tuple[int, int]]]:
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


def _earliest(current: float, candidate: float) -> float:
    """The earlier of two engine timestamps, 0 meaning none yet."""
    return candidate if not current or (candidate and candidate < current) else current


def _phase_bounds(stats: EngineTiming):
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
