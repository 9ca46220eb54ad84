"""Every telemetry name otel-llm emits, with its spec: attributes (type, who emits them), metrics
(kind, unit, description, buckets), span names, values, and the Prometheus names derived from them.

GenAI names follow OpenTelemetry semantic conventions v1.41.0 (the last release published in
open-telemetry/semantic-conventions); `convention=True` marks the names those conventions define,
and tests check them against the installed `opentelemetry-semantic-conventions` constants. Names
of our own are visibly ours: engine detail under `vllm.*`, tenant attribution under `tenant.*`,
everything else under `otel_llm.*`. Instruments are created from METRICS (`create_instrument`);
dashboards, rules, reports, the collector config check, tests and docs derive names from here.

Post-v1.41 names (open-telemetry/semantic-conventions-genai, unreleased, still breaking; listed in
GENAI_LATEST_NAMES and GENAI_LATEST_METRICS), emitted only with
`OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental`: spans carry the renamed
`gen_ai.usage.cache_write.input_tokens` instead of `gen_ai.usage.cache_creation.input_tokens`
(what opentelemetry-util-genai already emits). On the client side, inference calls record
`gen_ai.client.inference.duration` / `.time_to_first_chunk` / `.time_per_output_chunk` instead of
the `gen_ai.client.operation.*` ones (embeddings keep `gen_ai.client.operation.duration`), and
token counters by `gen_ai.token.modality` plus per-operation token histograms instead of
`gen_ai.client.token.usage`, failed calls included (0, modality unknown, when no usage came
back); client spans carry the cache/reasoning breakdowns only when non-zero. Server metric names
are the same under either setting. See docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from dataclasses import dataclass

# --- The spec ------------------------------------------------------------------------------
# Who emits an attribute (a test compares these with what each layer really emits)
VLLM = "vllm"  # spans of the vLLM server instrumentation (otel_llm/vllm)
CLIENT = "client"  # spans of the OpenAI client instrumentation (otel_llm/openai)
METRIC = "metric"  # attribute of our metric points (both layers)
USAGE = "usage"  # field of a usage (billing) record (otel_llm/usage.py)
RESOURCE = "resource"  # resource attribute otel-llm sets (otel_llm/sdk/distro.py)
COLLECTOR = "collector"  # only read or removed by collector-config/, set by the collector or peers
GATEWAY = "gateway"  # the example gateway's metering (examples/gateway)
BUDGETS = "budgets"  # the budget tracker's metrics (otel_llm/ops/budget_tracker.py) and the gateway's refusals

STRING, INT, DOUBLE, BOOLEAN, STRING_ARRAY = "string", "int", "double", "boolean", "string[]"
PYTHON_TYPES = {STRING: (str,), INT: (int,), DOUBLE: (float, int), BOOLEAN: (bool,), STRING_ARRAY: (list, tuple)}


@dataclass(frozen=True)
class AttributeSpec:
    name: str
    type: str
    emitted_by: frozenset[str]
    convention: bool  # defined by the OpenTelemetry semantic conventions (v1.41)


ATTRIBUTES: dict[str, AttributeSpec] = {}


def _attribute(name: str, type_: str, *emitted_by: str, convention: bool = False) -> str:
    assert name not in ATTRIBUTES, name
    ATTRIBUTES[name] = AttributeSpec(name, type_, frozenset(emitted_by), convention)
    return name


HISTOGRAM, COUNTER, OBSERVABLE_COUNTER = "histogram", "counter", "observable_counter"
VALUE = "value"  # a current value (Prometheus gauge), served by the budget tracker's own exposition


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str
    unit: str
    description: str
    emitted_by: frozenset[str]
    buckets: tuple[float, ...] | None = None
    convention: bool = False

    @property
    def prometheus(self) -> str:
        """The series name an OTel Prometheus exporter (the SDK's or the collector's) gives it."""
        name = self.name.replace(".", "_")
        if self.unit == UNIT_SECONDS:
            name += "_seconds"
        if self.kind not in (HISTOGRAM, VALUE):
            name += "_total"
        return name


METRICS: dict[str, MetricSpec] = {}


def _metric(
    name: str, kind: str, unit: str, description: str, emitted_by, buckets=None, convention: bool = False
) -> str:
    assert name not in METRICS, name
    emitted_by = frozenset((emitted_by,) if isinstance(emitted_by, str) else emitted_by)
    METRICS[name] = MetricSpec(name, kind, unit, description, emitted_by, buckets, convention)
    return name


def create_instrument(meter, name: str, callbacks=None):
    """The instrument METRICS[name] describes, on `meter`."""
    spec = METRICS[name]
    if spec.kind == HISTOGRAM:
        return meter.create_histogram(
            spec.name, unit=spec.unit, description=spec.description, explicit_bucket_boundaries_advisory=spec.buckets
        )
    if spec.kind == OBSERVABLE_COUNTER:
        return meter.create_observable_counter(
            spec.name, callbacks=callbacks, unit=spec.unit, description=spec.description
        )
    return meter.create_counter(spec.name, unit=spec.unit, description=spec.description)


def prometheus_metric(name: str) -> str:
    """Prometheus series name of one of our metrics (histograms: add _bucket/_sum/_count)."""
    return METRICS[name].prometheus


def prometheus_label(attribute: str) -> str:
    """Prometheus label name of a metric attribute or resource attribute."""
    return attribute.replace(".", "_")


# --- GenAI semantic conventions (v1.41.0) -------------------------------------------------
_BOTH = (VLLM, CLIENT)
GEN_AI_OPERATION_NAME = _attribute("gen_ai.operation.name", STRING, *_BOTH, METRIC, USAGE, convention=True)
GEN_AI_PROVIDER_NAME = _attribute("gen_ai.provider.name", STRING, *_BOTH, METRIC, convention=True)
GEN_AI_REQUEST_MODEL = _attribute("gen_ai.request.model", STRING, *_BOTH, METRIC, USAGE, convention=True)
GEN_AI_REQUEST_MAX_TOKENS = _attribute("gen_ai.request.max_tokens", INT, *_BOTH, convention=True)
GEN_AI_REQUEST_TEMPERATURE = _attribute("gen_ai.request.temperature", DOUBLE, *_BOTH, convention=True)
GEN_AI_REQUEST_TOP_P = _attribute("gen_ai.request.top_p", DOUBLE, *_BOTH, convention=True)
GEN_AI_REQUEST_TOP_K = _attribute("gen_ai.request.top_k", DOUBLE, *_BOTH, convention=True)
GEN_AI_REQUEST_SEED = _attribute("gen_ai.request.seed", INT, *_BOTH, convention=True)
GEN_AI_REQUEST_STREAM = _attribute("gen_ai.request.stream", BOOLEAN, *_BOTH, convention=True)
GEN_AI_REQUEST_CHOICE_COUNT = _attribute("gen_ai.request.choice.count", INT, *_BOTH, USAGE, convention=True)
GEN_AI_REQUEST_FREQUENCY_PENALTY = _attribute("gen_ai.request.frequency_penalty", DOUBLE, *_BOTH, convention=True)
GEN_AI_REQUEST_PRESENCE_PENALTY = _attribute("gen_ai.request.presence_penalty", DOUBLE, *_BOTH, convention=True)
GEN_AI_REQUEST_STOP_SEQUENCES = _attribute("gen_ai.request.stop_sequences", STRING_ARRAY, CLIENT, convention=True)
GEN_AI_REQUEST_ENCODING_FORMATS = _attribute("gen_ai.request.encoding_formats", STRING_ARRAY, CLIENT, convention=True)
GEN_AI_RESPONSE_ID = _attribute("gen_ai.response.id", STRING, *_BOTH, USAGE, convention=True)
GEN_AI_RESPONSE_MODEL = _attribute("gen_ai.response.model", STRING, *_BOTH, METRIC, USAGE, convention=True)
GEN_AI_RESPONSE_FINISH_REASONS = _attribute(
    "gen_ai.response.finish_reasons", STRING_ARRAY, *_BOTH, USAGE, convention=True
)
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK = _attribute("gen_ai.response.time_to_first_chunk", DOUBLE, CLIENT, convention=True)
GEN_AI_USAGE_INPUT_TOKENS = _attribute("gen_ai.usage.input_tokens", INT, *_BOTH, USAGE, convention=True)
GEN_AI_USAGE_OUTPUT_TOKENS = _attribute("gen_ai.usage.output_tokens", INT, *_BOTH, USAGE, convention=True)
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = _attribute(
    "gen_ai.usage.cache_read.input_tokens", INT, *_BOTH, USAGE, convention=True
)
GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS = _attribute(
    "gen_ai.usage.cache_creation.input_tokens", INT, *_BOTH, USAGE, convention=True
)
# its name in semantic-conventions-genai (unreleased): spans use it under gen_ai_latest_experimental
GEN_AI_USAGE_CACHE_WRITE_INPUT_TOKENS = _attribute("gen_ai.usage.cache_write.input_tokens", INT, *_BOTH)
# the client's inference.usage.* counters (semantic-conventions-genai, unreleased): TOKEN_MODALITY_* values
GEN_AI_TOKEN_MODALITY = _attribute("gen_ai.token.modality", STRING, METRIC)
# names from semantic-conventions-genai after v1.41 (no release yet): emitted only on opt-in
GENAI_LATEST_NAMES = frozenset({GEN_AI_USAGE_CACHE_WRITE_INPUT_TOKENS, GEN_AI_TOKEN_MODALITY})
GEN_AI_USAGE_REASONING_OUTPUT_TOKENS = _attribute(
    "gen_ai.usage.reasoning.output_tokens", INT, *_BOTH, USAGE, convention=True
)
GEN_AI_OUTPUT_TYPE = _attribute("gen_ai.output.type", STRING, CLIENT, convention=True)
GEN_AI_INPUT_MESSAGES = _attribute("gen_ai.input.messages", STRING, *_BOTH, convention=True)
GEN_AI_OUTPUT_MESSAGES = _attribute("gen_ai.output.messages", STRING, *_BOTH, convention=True)
# not set by otel-llm (system messages stay in gen_ai.input.messages); peers set it and the
# collector's content policy removes it with the other two
GEN_AI_SYSTEM_INSTRUCTIONS = _attribute("gen_ai.system_instructions", STRING, COLLECTOR, convention=True)
GEN_AI_EMBEDDINGS_DIMENSION_COUNT = _attribute("gen_ai.embeddings.dimension.count", INT, CLIENT, convention=True)
GEN_AI_TOKEN_TYPE = _attribute("gen_ai.token.type", STRING, METRIC, convention=True)
ERROR_TYPE = _attribute("error.type", STRING, *_BOTH, METRIC, USAGE, convention=True)
SERVER_ADDRESS = _attribute("server.address", STRING, CLIENT, METRIC, convention=True)
SERVER_PORT = _attribute("server.port", INT, CLIENT, METRIC, convention=True)
# OpenAI-specific attributes (semconv v1.41 openai.md)
OPENAI_API_TYPE = _attribute("openai.api.type", STRING, *_BOTH, convention=True)
OPENAI_REQUEST_SERVICE_TIER = _attribute("openai.request.service_tier", STRING, CLIENT, convention=True)
OPENAI_RESPONSE_SERVICE_TIER = _attribute("openai.response.service_tier", STRING, CLIENT, convention=True)
OPENAI_RESPONSE_SYSTEM_FINGERPRINT = _attribute("openai.response.system_fingerprint", STRING, CLIENT, convention=True)
SERVICE_NAME = _attribute("service.name", STRING, RESOURCE, USAGE, convention=True)
SERVICE_INSTANCE_ID = _attribute("service.instance.id", STRING, RESOURCE, USAGE, convention=True)

# gen_ai.operation.name values
OP_CHAT = "chat"
OP_TEXT_COMPLETION = "text_completion"
OP_EMBEDDINGS = "embeddings"
# vLLM endpoints the conventions name no operation for (custom values are allowed): pooling ones
# produce no output tokens
OP_SCORE = "score"
OP_RERANK = "rerank"
OP_CLASSIFY = "classify"
OP_POOLING = "pooling"
OP_TRANSCRIPTION = "transcription"
OP_TRANSLATION = "translation"
OP_GENERATIVE_SCORING = "generative_scoring"  # scores from the logprobs of one generated token
POOLING_OPERATIONS = frozenset({OP_EMBEDDINGS, OP_SCORE, OP_RERANK, OP_CLASSIFY, OP_POOLING})

PROVIDER_VLLM = "vllm"
PROVIDER_OPENAI = "openai"

OPENAI_API_TYPE_CHAT = "chat_completions"
OPENAI_API_TYPE_RESPONSES = "responses"

# gen_ai.token.type values on our token counter. "input" includes "cached_input".
TOKEN_TYPE_INPUT = "input"
TOKEN_TYPE_CACHED_INPUT = "cached_input"
TOKEN_TYPE_OUTPUT = "output"
TOKEN_TYPES = (TOKEN_TYPE_INPUT, TOKEN_TYPE_CACHED_INPUT, TOKEN_TYPE_OUTPUT)
# gen_ai.token.modality values (gen_ai_latest_experimental): our client calls are text; "unknown" marks the
# 0 recorded for a call that received no usage
TOKEN_MODALITY_TEXT = "text"
TOKEN_MODALITY_UNKNOWN = "unknown"

# error.type values of our own (otherwise the exception class or the HTTP status code)
ERROR_CLIENT_ABORTED = "client_aborted"
# error.type of a client stream the caller stopped reading (break, close, cancel, GC)
ERROR_STREAM_ABANDONED = "stream_abandoned"

# finish reason reported for a request the client abandoned
FINISH_REASON_ABORT = "abort"
# finish reason for a choice whose stream ended before its final event (semconv-genai rule)
FINISH_REASON_ERROR = "error"

# --- Client side of our own (no convention exists) ----------------------------------------
OTEL_LLM_STREAM_CHUNKS = _attribute("otel_llm.stream.chunks", INT, CLIENT)
OTEL_LLM_USAGE_MISSING = _attribute("otel_llm.usage.missing", BOOLEAN, CLIENT)

# --- vLLM engine detail (no convention exists) --------------------------------------------
VLLM_REQUEST_ID = _attribute("vllm.request.id", STRING, VLLM, USAGE)
VLLM_QUEUE_SECONDS = _attribute("vllm.latency.queue", DOUBLE, VLLM)
VLLM_PREFILL_SECONDS = _attribute("vllm.latency.prefill", DOUBLE, VLLM)
VLLM_DECODE_SECONDS = _attribute("vllm.latency.decode", DOUBLE, VLLM)
VLLM_TTFT_SECONDS = _attribute("vllm.latency.time_to_first_token", DOUBLE, VLLM)
VLLM_TPOT_SECONDS = _attribute("vllm.latency.time_per_output_token", DOUBLE, VLLM)
VLLM_PREEMPTIONS = _attribute("vllm.request.preemptions", INT, VLLM, USAGE)
VLLM_ABORTED = _attribute("vllm.request.aborted", BOOLEAN, VLLM)
VLLM_ENGINE_REQUESTS = _attribute("vllm.request.engine_requests", INT, VLLM)
VLLM_EXTERNAL_CACHED_TOKENS = _attribute("vllm.usage.cache_read.external_input_tokens", INT, VLLM, USAGE)
VLLM_STREAM_TTFT_SECONDS = _attribute("vllm.latency.time_to_first_chunk_sent", DOUBLE, VLLM)
# Two times to first token, named apart (docs/request-data.md, "Two times to first token"): VLLM_TTFT_SECONDS and
# gen_ai.server.time_to_first_token run from the request's arrival (queue + prefill, as the conventions
# define TTFT); this one from the engine's first scheduling of it, the `time_to_first_token_ms` of vLLM's
# per-request `metrics` object (--enable-per-request-metrics), in seconds
VLLM_SCHEDULED_TTFT_SECONDS = _attribute("vllm.latency.scheduled_to_first_token", DOUBLE, VLLM)
# speculative decoding, per request (vLLM --per-request-spec-decode-metrics summary|detailed): draft tokens
# proposed and accepted, accepted / proposed, and 1 + accepted per verify step (the bonus token included)
VLLM_SPEC_DRAFT_TOKENS = _attribute("vllm.spec_decode.draft_tokens", INT, VLLM, USAGE)
VLLM_SPEC_ACCEPTED_TOKENS = _attribute("vllm.spec_decode.accepted_tokens", INT, VLLM, USAGE)
VLLM_SPEC_ACCEPTANCE_RATE = _attribute("vllm.spec_decode.acceptance_rate", DOUBLE, VLLM)
VLLM_SPEC_ACCEPTANCE_LENGTH = _attribute("vllm.spec_decode.mean_acceptance_length", DOUBLE, VLLM)
VLLM_PHASE_TIMING_UNAVAILABLE = _attribute("vllm.latency.unavailable", BOOLEAN, VLLM)
# engine requests of an n > 1 request whose queue/prefill/decode child spans were not made
VLLM_PHASE_SPANS_OMITTED = _attribute("vllm.latency.phase_spans_omitted", INT, VLLM)
# disaggregated prefill/decode (--kv-transfer-config): which leg of a logical request this node served
VLLM_PD_ROLE = _attribute("vllm.pd.role", STRING, VLLM, USAGE)
PD_ROLE_PREFILL = "prefill"  # kv_transfer_params.do_remote_decode: never billed (its decode leg is)
PD_ROLE_DECODE = "decode"  # kv_transfer_params.do_remote_prefill
VLLM_LORA_NAME = _attribute("vllm.lora.name", STRING, USAGE)
RESOURCE_SERVED_MODEL = _attribute("vllm.served_model", STRING, RESOURCE)

# Tenant attribution (spans carry the full value; metric labels are capped, see config)
TENANT_ID = _attribute("tenant.id", STRING, VLLM, METRIC, USAGE, GATEWAY)
TENANT_SCENE = _attribute("tenant.scene", STRING, VLLM, METRIC, USAGE, GATEWAY)
TENANT_COST_CENTER = _attribute("tenant.cost_center", STRING, VLLM, METRIC, USAGE)
LABEL_OTHER = "other"
# Below the tenant, on spans and usage records only (unbounded: never metric labels): the id the API-key
# map (OTEL_LLM_API_KEYS_FILE) gives the request's key (never the key, nor its hash), and the end user
# the OpenAI request names (its `safety_identifier`, else `user`), as the client sent it
API_KEY_ID = _attribute("otel_llm.api_key.id", STRING, VLLM, USAGE)
USER_ID = _attribute("user.id", STRING, VLLM, USAGE, convention=True)
# the conversation (chat session) a request belongs to: vLLM's session id (the body's `session_id`, the
# X-Session-ID header, or vllm_xargs.session_id), else the first header of OTEL_LLM_CONVERSATION_HEADERS;
# on spans and usage records only (unbounded: never a metric label)
GEN_AI_CONVERSATION_ID = _attribute("gen_ai.conversation.id", STRING, VLLM, USAGE, convention=True)

SERVICE_NAME_DEFAULT = "vllm"
# instrumentation scopes of our tracers and meters (server layer, client layer)
VLLM_SCOPE = "otel_llm.vllm"
CLIENT_SCOPE = "otel_llm.openai"
SCOPES = (VLLM_SCOPE, CLIENT_SCOPE)

# requests by outcome (no convention exists): finished, aborted (client gone), error
REQUEST_OUTCOME = _attribute("otel_llm.request.outcome", STRING, METRIC, USAGE)
OUTCOME_FINISHED = "finished"
OUTCOME_ABORTED = "aborted"
OUTCOME_ERROR = "error"

# --- Usage ledger (billing): one record per request that reached the engine ----------------
# A record is a flat JSON object in the spool (otel_llm/usage.py) and the attributes of an OTel
# log record (event USAGE_EVENT) over OTLP; in ClickHouse's otel_logs table they are LogAttributes.
USAGE_EVENT = "otel_llm.usage"
USAGE_ID = _attribute("otel_llm.usage.id", STRING, USAGE)  # idempotency key: instance + "/" + vLLM's request id
USAGE_DURATION = _attribute("otel_llm.usage.duration", DOUBLE, USAGE)  # seconds from arrival to the end
USAGE_SCHEMA_VERSION = _attribute("otel_llm.usage.schema", INT, USAGE)
# 1: API-server records only. 2: API-server records list their engine requests (USAGE_ENGINE_REQUEST_IDS), and
# the engine core writes records of its own (USAGE_KIND), joined to them by engine request id (docs/ledger.md).
USAGE_SCHEMA = 2
# which process wrote a record: absent (or "request") for the API server's bill of one logical request;
# "engine" for one engine request's record written by vLLM's engine core (otel_llm/vllm/engine_cost.py);
# "engine_window" for an engine's busy and idle time over a window (its rows tile the engine's wall time);
# "progress" for the tokens so far of a request still in flight (API server, spool only, every
# OTEL_LLM_LIVE_INTERVAL): cumulative, superseded by the bill with its USAGE_ID, never billed
USAGE_KIND = _attribute("otel_llm.usage.kind", STRING, USAGE)
USAGE_KIND_REQUEST = "request"
USAGE_KIND_PROGRESS = "progress"
USAGE_KIND_ENGINE = "engine"
USAGE_KIND_ENGINE_WINDOW = "engine_window"
# an API-server record: vLLM's internal ids of the engine requests it bills (n > 1: one per choice)
USAGE_ENGINE_REQUEST_IDS = _attribute("vllm.engine.request_ids", STRING_ARRAY, USAGE)
# an engine record: its engine request's id (the join key), and whether an instrumented Python frontend
# bills it (then the engine record only adds its cost figures to that bill; otherwise it is the bill)
VLLM_ENGINE_REQUEST_ID = _attribute("vllm.engine.request_id", STRING, USAGE)
USAGE_FRONTEND_BILLED = _attribute("otel_llm.usage.frontend_billed", BOOLEAN, USAGE)
# the engine instance an engine record comes from: service.instance.id + "/engine" + the engine index
VLLM_ENGINE_INSTANCE = _attribute("vllm.engine.instance", STRING, USAGE)
# --- What a request cost the engine (engine records; integers, so sums over any window are exact)
# its share of the engine's busy time: each step's wall time split over the requests scheduled in it
# in proportion to their scheduled tokens (prefill chunk, decode token, speculative drafts)
COST_COMPUTE_NS = _attribute("otel_llm.cost.compute_ns", INT, VLLM, USAGE)
# tokens the engine computed for it (prompt tokens not hit in the prefix cache, recomputed after a
# preemption, generated, drafts)
COST_SCHEDULED_TOKENS = _attribute("otel_llm.cost.scheduled_tokens", INT, VLLM, USAGE)
# KV-cache blocks it allocated x the nanoseconds it held them (blocks it found in the prefix cache are
# paid by the request that allocated them: HIT_BLOCK_NS, not billed)
# the part of COMPUTE_NS spent while the request was prefilling (its steps before its prompt was computed)
COST_PREFILL_COMPUTE_NS = _attribute("otel_llm.cost.prefill_compute_ns", INT, VLLM, USAGE)
COST_KV_BLOCK_NS = _attribute("otel_llm.cost.kv_block_ns", INT, VLLM, USAGE)
COST_KV_HIT_BLOCK_NS = _attribute("otel_llm.cost.kv_hit_block_ns", INT, VLLM, USAGE)
COST_PREEMPTED_NS = _attribute("otel_llm.cost.preempted_ns", INT, VLLM, USAGE)  # time spent preempted, waiting again
# an engine_window record: [start, end) in Unix ns, its busy and idle time (busy + idle = end - start),
# the KV pool's usable blocks and block size
ENGINE_WINDOW_START = _attribute("otel_llm.engine.window.start_unix_nano", INT, USAGE)
ENGINE_BUSY_NS = _attribute("otel_llm.engine.busy_ns", INT, USAGE)
ENGINE_IDLE_NS = _attribute("otel_llm.engine.idle_ns", INT, USAGE)
ENGINE_KV_CAPACITY_BLOCKS = _attribute("otel_llm.engine.kv.capacity_blocks", INT, USAGE)
ENGINE_KV_BLOCK_SIZE = _attribute("otel_llm.engine.kv.block_size", INT, USAGE)
ENGINE_KV_BLOCK_NS = _attribute("otel_llm.engine.kv.block_ns", INT, USAGE)  # requests' blocks held in the window
# spool-only fields (over OTLP they are the log record's own timestamp and trace context)
USAGE_TIME = _attribute("time_unix_nano", INT, USAGE)
USAGE_TRACE_ID = _attribute("trace_id", STRING, USAGE)
USAGE_SPAN_ID = _attribute("span_id", STRING, USAGE)
# token fields of a record, in the report's order: (record field, report token type)
USAGE_TOKEN_FIELDS = (
    (GEN_AI_USAGE_INPUT_TOKENS, TOKEN_TYPE_INPUT),
    (GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, TOKEN_TYPE_CACHED_INPUT),
    (GEN_AI_USAGE_OUTPUT_TOKENS, TOKEN_TYPE_OUTPUT),
)
# The breakdowns of a record's tokens, in the report's order: (record field, report column). One rule for
# every total (docs/ledger.md, "Which totals include which"): inclusive, as the conventions define them.
# input includes cached_input; cached_input includes external_cached_input (the part a KV connector or a
# P/D prefill node supplied); cache_write_input is part of input (computed, then written to the prefix
# cache); output includes reasoning_output.
USAGE_DETAIL_TOKEN_FIELDS = (
    (GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS, "cache_write_input"),
    (VLLM_EXTERNAL_CACHED_TOKENS, "external_cached_input"),
    (GEN_AI_USAGE_REASONING_OUTPUT_TOKENS, "reasoning_output"),
)
# error.type values of USAGE_RECORDS_DROPPED
DROP_OPEN = "open"  # no spool file could be opened (unwritable directory)
DROP_DISK_FULL = "disk_full"
DROP_WRITE = "write"  # any other write error
DROP_ERROR = "error"  # building the record failed
# error.type values of EXPORT_DROPPED (otel_llm/vllm/export/channel.py)
EXPORT_DROP_QUEUE_FULL = "queue_full"  # the export process does not keep up
EXPORT_DROP_EXPORTER_DOWN = "exporter_down"  # the export process is gone (restarting) or cannot start

# --- Failures of otel-llm's own code, caught where they happened (otel_llm/warn.py) --------------
# where: the guard's `what` (a fixed set, named in our code: "DeferredSpan.end", "starting the chat span", ...)
FAILURE_POINT = _attribute("otel_llm.failure.point", STRING, METRIC)

# --- Content redaction (otel_llm/redaction.py) ---------------------------------------------
REDACTION_RULE = _attribute("otel_llm.redaction.rule", STRING, METRIC)
REDACTION_RULE_SECRET = "secret"  # API keys, tokens, private keys, credentials: the family below
# A secret is counted by its format: REDACTION_RULE_SECRET + "." + a row name of otel_llm/secret_rules.py's
# table (secret.openai_api_key, secret.github_token, secret.password_assignment, ...): redaction.secret_rule_name.
REDACTION_RULE_EMAIL = "email"
REDACTION_RULE_PAYMENT_CARD = "payment_card"  # Luhn-checked
REDACTION_RULE_PRC_ID = "prc_resident_id"  # check digit verified
REDACTION_RULE_PHONE = "phone"
REDACTION_RULE_IP_ADDRESS = "ip_address"

# a span event on the GenAI span: the engine preempted the request (freed its KV cache) at the event's
# time; COST_PREEMPTED_NS says how long it waited to be scheduled again
EVENT_PREEMPTED = "vllm.request.preempted"
EVENTS = frozenset({USAGE_EVENT, EVENT_PREEMPTED})  # event names (log records', span events')

# --- Span names ---------------------------------------------------------------------------
SPAN_QUEUE = "queue"
SPAN_PREFILL = "prefill"
SPAN_DECODE = "decode"
PHASE_SPANS = (SPAN_QUEUE, SPAN_PREFILL, SPAN_DECODE)
# a decode leg's first phase: queued, then waiting for the prefill node's KV cache (vLLM records no
# timestamp between the two)
SPAN_KV_TRANSFER_WAIT = "queue_and_kv_transfer"


def genai_span_name(operation: str, model: str | None) -> str:
    return f"{operation} {model}" if model else operation


# --- Metrics ------------------------------------------------------------------------------
UNIT_SECONDS = "s"
UNIT_TOKEN = "{token}"
UNIT_REQUEST = "{request}"
UNIT_RECORD = "{record}"
UNIT_REDACTION = "{redaction}"
UNIT_FAILURE = "{failure}"

# Bucket boundaries from the semconv metric definitions
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# per-chunk gaps of a stream are far shorter than whole operations
CHUNK_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)

SERVER_REQUEST_DURATION = _metric(
    "gen_ai.server.request.duration",
    HISTOGRAM,
    UNIT_SECONDS,
    "Time from the request reaching vLLM to its response's last byte (a stream: its last output token), or abort.",
    VLLM,
    DURATION_BUCKETS,
    convention=True,
)
SERVER_TIME_TO_FIRST_TOKEN = _metric(
    "gen_ai.server.time_to_first_token",
    HISTOGRAM,
    UNIT_SECONDS,
    "Time from request arrival to the first generated token (queue + prefill).",
    VLLM,
    TTFT_BUCKETS,
    convention=True,
)
SERVER_TIME_PER_OUTPUT_TOKEN = _metric(
    "gen_ai.server.time_per_output_token",
    HISTOGRAM,
    UNIT_SECONDS,
    "Decode time divided by the output tokens after the first.",
    VLLM,
    TPOT_BUCKETS,
    convention=True,
)
SERVER_SCHEDULED_TIME_TO_FIRST_TOKEN = _metric(
    "otel_llm.server.scheduled_to_first_token",
    HISTOGRAM,
    UNIT_SECONDS,
    "Time from the engine first scheduling a request to its first token (prefill, without the queue): vLLM's "
    "per-request metrics.time_to_first_token_ms. gen_ai.server.time_to_first_token runs from arrival.",
    VLLM,
    TTFT_BUCKETS,
)
SERVER_SPEC_DRAFT_TOKENS = _metric(
    "otel_llm.server.spec_decode.draft_tokens",
    OBSERVABLE_COUNTER,
    UNIT_TOKEN,
    "Draft tokens the speculator proposed for requests, by model and tenant (vLLM --per-request-spec-decode-metrics).",
    VLLM,
)
SERVER_SPEC_ACCEPTED_TOKENS = _metric(
    "otel_llm.server.spec_decode.accepted_tokens",
    OBSERVABLE_COUNTER,
    UNIT_TOKEN,
    "Draft tokens the target model accepted (divided by draft_tokens: the acceptance rate), by model and tenant.",
    VLLM,
)
# the conventions define no server token counter (only gen_ai.client.token.usage, a histogram)
SERVER_TOKEN_USAGE = _metric(
    "otel_llm.server.token.usage",
    OBSERVABLE_COUNTER,
    UNIT_TOKEN,
    "Tokens by type (input includes cached_input), as the engine counted them.",
    VLLM,
)
SERVER_COMPUTE_TIME = _metric(
    "otel_llm.server.compute.time",
    OBSERVABLE_COUNTER,
    UNIT_SECONDS,
    "Engine busy time charged to requests (each step's time split over its requests by scheduled tokens), by "
    "model and tenant, as each request's final engine output reported it (the usage ledger's engine records are "
    "exact: a request whose figures came after its output is missing here).",
    VLLM,
)
SERVER_REQUESTS = _metric(
    "otel_llm.server.requests",
    COUNTER,
    UNIT_REQUEST,
    "Requests by outcome (finished, aborted, error), model, tenant and scene.",
    VLLM,
)
USAGE_RECORDS_DROPPED = _metric(
    "otel_llm.usage.records.dropped",
    COUNTER,
    UNIT_RECORD,
    "Usage (billing) records that could not be written, by error.type.",
    USAGE,
)
EXPORT_DROPPED = _metric(
    "otel_llm.export.dropped",
    COUNTER,
    UNIT_REQUEST,
    "Requests whose telemetry (HTTP and GenAI spans, request metrics, usage event) the API server could not "
    "hand to its export process, by error.type (usage spool records are written in the API server, not dropped).",
    VLLM,
)
INSTRUMENTATION_FAILURES = _metric(
    "otel_llm.instrumentation.failures",
    OBSERVABLE_COUNTER,
    UNIT_FAILURE,
    "Failures of otel-llm's own code in this process, each caught where it happened (the request was served, "
    "some of its telemetry lost; the first of each point is logged with its traceback), by otel_llm.failure.point.",
    VLLM,
)
REDACTIONS = _metric(
    "otel_llm.redactions",
    COUNTER,
    UNIT_REDACTION,
    "Replacements made in captured prompt and completion content, by rule.",
    _BOTH,
)
CLIENT_OPERATION_DURATION = _metric(
    "gen_ai.client.operation.duration",
    HISTOGRAM,
    UNIT_SECONDS,
    "GenAI operation duration",
    CLIENT,
    DURATION_BUCKETS,
    convention=True,
)
CLIENT_TOKEN_USAGE = _metric(
    "gen_ai.client.token.usage",
    HISTOGRAM,
    UNIT_TOKEN,
    "Number of input and output tokens used",
    CLIENT,
    TOKEN_BUCKETS,
    convention=True,
)
CLIENT_TIME_TO_FIRST_CHUNK = _metric(
    "gen_ai.client.operation.time_to_first_chunk",
    HISTOGRAM,
    UNIT_SECONDS,
    "Time from the request to the first chunk of a streamed response",
    CLIENT,
    DURATION_BUCKETS,
    convention=True,
)
CLIENT_TIME_PER_OUTPUT_CHUNK = _metric(
    "gen_ai.client.operation.time_per_output_chunk",
    HISTOGRAM,
    UNIT_SECONDS,
    "Time between consecutive chunks of a streamed response, recorded for each chunk after the first",
    CLIENT,
    CHUNK_BUCKETS,
    convention=True,
)
# Their post-v1.41 names (semantic-conventions-genai, unreleased), emitted instead under
# gen_ai_latest_experimental: inference calls (chat, text_completion, Responses) get the inference.*
# duration and chunk histograms (embeddings keep gen_ai.client.operation.duration), and token counters
# by gen_ai.token.modality plus per-operation histograms replace gen_ai.client.token.usage.
CLIENT_INFERENCE_DURATION = _metric(
    "gen_ai.client.inference.duration",
    HISTOGRAM,
    UNIT_SECONDS,
    "GenAI inference operation duration",
    CLIENT,
    DURATION_BUCKETS,
)
CLIENT_INFERENCE_TIME_TO_FIRST_CHUNK = _metric(
    "gen_ai.client.inference.time_to_first_chunk",
    HISTOGRAM,
    UNIT_SECONDS,
    "Time from the request to the first chunk of a streamed response",
    CLIENT,
    DURATION_BUCKETS,
)
CLIENT_INFERENCE_TIME_PER_OUTPUT_CHUNK = _metric(
    "gen_ai.client.inference.time_per_output_chunk",
    HISTOGRAM,
    UNIT_SECONDS,
    "Time between consecutive chunks of a streamed response, recorded for each chunk after the first",
    CLIENT,
    CHUNK_BUCKETS,
)
CLIENT_USAGE_INPUT_TOKENS = _metric(
    "gen_ai.client.inference.usage.input_tokens",
    COUNTER,
    UNIT_TOKEN,
    "Input (prompt) tokens used, cached tokens included",
    CLIENT,
)
CLIENT_USAGE_OUTPUT_TOKENS = _metric(
    "gen_ai.client.inference.usage.output_tokens",
    COUNTER,
    UNIT_TOKEN,
    "Output (completion) tokens used, reasoning tokens included",
    CLIENT,
)
CLIENT_USAGE_CACHE_READ_INPUT_TOKENS = _metric(
    "gen_ai.client.inference.usage.cache_read.input_tokens",
    COUNTER,
    UNIT_TOKEN,
    "Input tokens read from the provider's cache",
    CLIENT,
)
CLIENT_USAGE_CACHE_WRITE_INPUT_TOKENS = _metric(
    "gen_ai.client.inference.usage.cache_write.input_tokens",
    COUNTER,
    UNIT_TOKEN,
    "Input tokens written to the provider's cache",
    CLIENT,
)
CLIENT_USAGE_REASONING_OUTPUT_TOKENS = _metric(
    "gen_ai.client.inference.usage.reasoning.output_tokens",
    COUNTER,
    UNIT_TOKEN,
    "Output tokens spent on reasoning",
    CLIENT,
)
CLIENT_OPERATION_INPUT_TOKENS = _metric(
    "gen_ai.client.inference.operation.input_tokens",
    HISTOGRAM,
    UNIT_TOKEN,
    "Input tokens per inference operation",
    CLIENT,
    TOKEN_BUCKETS,
)
CLIENT_OPERATION_OUTPUT_TOKENS = _metric(
    "gen_ai.client.inference.operation.output_tokens",
    HISTOGRAM,
    UNIT_TOKEN,
    "Output tokens per inference operation",
    CLIENT,
    TOKEN_BUCKETS,
)
# metric names from semantic-conventions-genai after v1.41 (no release yet): emitted only on opt-in
GENAI_LATEST_METRICS = frozenset(
    {
        CLIENT_INFERENCE_DURATION,
        CLIENT_INFERENCE_TIME_TO_FIRST_CHUNK,
        CLIENT_INFERENCE_TIME_PER_OUTPUT_CHUNK,
        CLIENT_USAGE_INPUT_TOKENS,
        CLIENT_USAGE_OUTPUT_TOKENS,
        CLIENT_USAGE_CACHE_READ_INPUT_TOKENS,
        CLIENT_USAGE_CACHE_WRITE_INPUT_TOKENS,
        CLIENT_USAGE_REASONING_OUTPUT_TOKENS,
        CLIENT_OPERATION_INPUT_TOKENS,
        CLIENT_OPERATION_OUTPUT_TOKENS,
    }
)
# The example gateway's metering counter (examples/gateway): tokens by tenant, scene, model, type
GATEWAY_TOKEN_USAGE = _metric(
    "otel_llm.gateway.token.usage",
    COUNTER,
    UNIT_TOKEN,
    "Tokens billed by the gateway, from the upstream response's usage",
    GATEWAY,
)
GATEWAY_SERVICE_NAME = "llm-gateway"

# Budgets (otel_llm/ops/budgets.py): the budget tracker counts every budget of its budget file exactly, from
# the usage ledger (no metric label cap applies), and serves these for Prometheus (`otel-llm budget-server`)
BUDGET_PERIOD = _attribute("otel_llm.budget.period", STRING, BUDGETS)
BUDGET_PERIOD_DAY, BUDGET_PERIOD_MONTH, BUDGET_PERIOD_PREPAID = "day", "month", "prepaid"  # UTC calendar periods
BUDGET_UNIT = _attribute("otel_llm.budget.unit", STRING, BUDGETS)  # "tokens", or the price file's currency
BUDGET_UNIT_TOKENS = "tokens"
BUDGET_STATE = _attribute("otel_llm.budget.state", STRING, GATEWAY)  # on the span of a request the gateway checked
BUDGET_STATE_OK, BUDGET_STATE_NEAR, BUDGET_STATE_OVER = "ok", "near", "over"
ERROR_BUDGET_EXCEEDED = "budget_exceeded"  # error.type (and the OpenAI-style error code) of a refused request
BUDGET_USED = _metric(
    "otel_llm.budget.used",
    VALUE,
    "1",
    "What a budget's tenant (and scene) used in its current period (tokens, or money at the price file's prices), "
    "from the usage ledger, streams in flight included.",
    BUDGETS,
)
BUDGET_LIMIT = _metric(
    "otel_llm.budget.limit",
    VALUE,
    "1",
    "A budget's limit in its current period (a prepaid balance: its amount plus the top-ups made so far).",
    BUDGETS,
)
BUDGET_WARN_RATIO = _metric(
    "otel_llm.budget.warn_ratio", VALUE, "1", "The share of a budget's limit over which it is near.", BUDGETS
)
BUDGET_TRACKER_LAG = _metric(
    "otel_llm.budget.tracker.lag",
    VALUE,
    UNIT_SECONDS,
    "Seconds since the budget tracker last read its ledger through (its figures are this old).",
    BUDGETS,
)
BUDGET_UNPRICED_TOKENS = _metric(
    "otel_llm.budget.unpriced.tokens",
    VALUE,
    UNIT_TOKEN,
    "Tokens of money-budgeted tenants whose model the price file does not price (not counted in money).",
    BUDGETS,
)


# --- Set by the OpenTelemetry Collector, not by otel-llm (collector-config/) -------------------
# With --feature-gates=processor.tailsamplingprocessor.recordpolicy, contrib's tail_sampling
# processor names the policy that sampled a trace (the first in config order that did) in an
# attribute of the instrumentation SCOPE of the trace's spans, not of the spans (OTTL:
# scope.attributes[...]). The collector configs keep prompt/completion content only where it names
# a policy other than the baseline.
TAILSAMPLING_POLICY = _attribute("tailsampling.policy", STRING, COLLECTOR)


# --- Names vLLM itself exports (not ours) -------------------------------------------------------
# vLLM's Prometheus metrics (vllm/v1/metrics/loggers.py, prometheus_client names: a Counter "x" is
# served as "x_total"), as the rules, dashboards and `otel-llm reconcile` read them; a test checks
# them against the installed vLLM. Labels: model_name, engine.
GAUGE = "gauge"
VLLM_PROMETHEUS_METRICS: dict[str, str] = {}  # name -> kind (GAUGE, COUNTER, HISTOGRAM)


def _vllm_metric(name: str, kind: str) -> str:
    VLLM_PROMETHEUS_METRICS[name] = kind
    return name


VLLM_METRIC_RUNNING = _vllm_metric("vllm:num_requests_running", GAUGE)
VLLM_METRIC_WAITING = _vllm_metric("vllm:num_requests_waiting", GAUGE)
VLLM_METRIC_KV_CACHE_USAGE = _vllm_metric("vllm:kv_cache_usage_perc", GAUGE)  # 1 = 100 %
VLLM_METRIC_PREEMPTIONS = _vllm_metric("vllm:num_preemptions_total", COUNTER)
# per request; bucket family "request_tokens" (--custom-histogram-buckets)
VLLM_METRIC_PROMPT_TOKENS = _vllm_metric("vllm:request_prompt_tokens", HISTOGRAM)
VLLM_METRIC_GENERATION_TOKENS = _vllm_metric("vllm:request_generation_tokens", HISTOGRAM)
VLLM_METRIC_QUEUE_TIME = _vllm_metric("vllm:request_queue_time_seconds", HISTOGRAM)
VLLM_METRIC_PREFILL_TIME = _vllm_metric("vllm:request_prefill_time_seconds", HISTOGRAM)
VLLM_METRIC_DECODE_TIME = _vllm_metric("vllm:request_decode_time_seconds", HISTOGRAM)
# the engine's own token counters (per engine request), which `otel-llm reconcile` compares the usage ledger with
VLLM_METRIC_PROMPT_TOKENS_TOTAL = _vllm_metric("vllm:prompt_tokens_total", COUNTER)
VLLM_METRIC_GENERATION_TOKENS_TOTAL = _vllm_metric("vllm:generation_tokens_total", COUNTER)
VLLM_METRIC_PROMPT_TOKENS_CACHED_TOTAL = _vllm_metric("vllm:prompt_tokens_cached_total", COUNTER)
VLLM_LABEL_MODEL = "model_name"  # the served model name, on every vLLM metric
