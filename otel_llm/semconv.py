"""Every telemetry name otel-llm emits: attributes, spans, metrics, units and buckets.

GenAI names follow OpenTelemetry semantic conventions v1.41.0 (the last release published in
open-telemetry/semantic-conventions). Engine detail that no convention covers lives under
`vllm.*`. Dashboards, rules, tests and docs import names from here; never retype them.
"""

# --- GenAI semantic conventions (v1.41.0) -------------------------------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
GEN_AI_REQUEST_FREQUENCY_PENALTY = "gen_ai.request.frequency_penalty"
GEN_AI_REQUEST_PRESENCE_PENALTY = "gen_ai.request.presence_penalty"
GEN_AI_REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS = "gen_ai.usage.cache_creation.input_tokens"
GEN_AI_USAGE_REASONING_OUTPUT_TOKENS = "gen_ai.usage.reasoning.output_tokens"
GEN_AI_REQUEST_ENCODING_FORMATS = "gen_ai.request.encoding_formats"
GEN_AI_OUTPUT_TYPE = "gen_ai.output.type"
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"
GEN_AI_SYSTEM_INSTRUCTIONS = "gen_ai.system_instructions"
GEN_AI_EMBEDDINGS_DIMENSION_COUNT = "gen_ai.embeddings.dimension.count"
GEN_AI_TOKEN_TYPE = "gen_ai.token.type"
ERROR_TYPE = "error.type"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"

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

# OpenAI-specific attributes (semconv v1.41 openai.md)
OPENAI_API_TYPE = "openai.api.type"
OPENAI_API_TYPE_CHAT = "chat_completions"
OPENAI_API_TYPE_RESPONSES = "responses"
OPENAI_REQUEST_SERVICE_TIER = "openai.request.service_tier"
OPENAI_RESPONSE_SERVICE_TIER = "openai.response.service_tier"
OPENAI_RESPONSE_SYSTEM_FINGERPRINT = "openai.response.system_fingerprint"

# gen_ai.token.type values on our token counter. "input" includes "cached_input".
TOKEN_TYPE_INPUT = "input"
TOKEN_TYPE_CACHED_INPUT = "cached_input"
TOKEN_TYPE_OUTPUT = "output"

# error.type values of our own (otherwise the exception class or the HTTP status code)
ERROR_CLIENT_ABORTED = "client_aborted"
ERROR_OTHER = "_OTHER"

# finish reason reported for a request the client abandoned
FINISH_REASON_ABORT = "abort"
# finish reason for a choice whose stream ended before its final event (semconv-genai rule)
FINISH_REASON_ERROR = "error"
# error.type of a client stream the caller stopped reading (break, close, cancel, GC)
ERROR_STREAM_ABANDONED = "stream_abandoned"

# --- Client side of our own (no convention exists) ----------------------------------------
OTEL_LLM_STREAM_CHUNKS = "otel_llm.stream.chunks"
OTEL_LLM_USAGE_MISSING = "otel_llm.usage.missing"

# --- vLLM engine detail (no convention exists) --------------------------------------------
VLLM_REQUEST_ID = "vllm.request.id"
VLLM_QUEUE_SECONDS = "vllm.latency.queue"
VLLM_PREFILL_SECONDS = "vllm.latency.prefill"
VLLM_DECODE_SECONDS = "vllm.latency.decode"
VLLM_TTFT_SECONDS = "vllm.latency.time_to_first_token"
VLLM_E2E_SECONDS = "vllm.latency.e2e"
VLLM_TPOT_SECONDS = "vllm.latency.time_per_output_token"
VLLM_PREEMPTIONS = "vllm.request.preemptions"
VLLM_ABORTED = "vllm.request.aborted"
VLLM_ENGINE_REQUESTS = "vllm.request.engine_requests"
VLLM_LOCAL_CACHED_TOKENS = "vllm.usage.cache_read.local_input_tokens"
VLLM_EXTERNAL_CACHED_TOKENS = "vllm.usage.cache_read.external_input_tokens"
VLLM_STREAM_TTFT_SECONDS = "vllm.latency.time_to_first_chunk_sent"
VLLM_PHASE_TIMING_UNAVAILABLE = "vllm.latency.unavailable"
# engine requests of an n > 1 request whose queue/prefill/decode child spans were not made
VLLM_PHASE_SPANS_OMITTED = "vllm.latency.phase_spans_omitted"
# disaggregated prefill/decode (--kv-transfer-config): which leg of a logical request this node served
VLLM_PD_ROLE = "vllm.pd.role"
PD_ROLE_PREFILL = "prefill"  # kv_transfer_params.do_remote_decode: never billed (its decode leg is)
PD_ROLE_DECODE = "decode"  # kv_transfer_params.do_remote_prefill

# Tenant attribution (spans carry the full value; metric labels are capped, see config)
TENANT_ID = "tenant.id"
TENANT_SCENE = "tenant.scene"
TENANT_COST_CENTER = "tenant.cost_center"
LABEL_OTHER = "other"

# Resource attributes
SERVICE_NAME_DEFAULT = "vllm"
RESOURCE_SERVED_MODEL = "vllm.served_model"

# --- Usage ledger (billing): one record per request that reached the engine ----------------
# A record is a flat JSON object in the spool (otel_llm/usage.py) and the attributes of an OTel
# log record (event USAGE_EVENT) over OTLP; in ClickHouse's otel_logs table they are LogAttributes.
USAGE_EVENT = "otel_llm.usage"
USAGE_ID = "otel_llm.usage.id"  # idempotency key: instance + "/" + vLLM's internal request id
USAGE_DURATION = "otel_llm.usage.duration"  # seconds from arrival to the end of the request
USAGE_SCHEMA_VERSION = "otel_llm.usage.schema"
USAGE_SCHEMA = 1
SERVICE_NAME = "service.name"
SERVICE_INSTANCE_ID = "service.instance.id"
VLLM_LORA_NAME = "vllm.lora.name"
# spool-only fields (over OTLP they are the log record's own timestamp and trace context)
USAGE_TIME = "time_unix_nano"
USAGE_TRACE_ID = "trace_id"
USAGE_SPAN_ID = "span_id"
# token fields of a record, in the report's order: (record field, report token type)
USAGE_TOKEN_FIELDS = (
    (GEN_AI_USAGE_INPUT_TOKENS, TOKEN_TYPE_INPUT),
    (GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, TOKEN_TYPE_CACHED_INPUT),
    (GEN_AI_USAGE_OUTPUT_TOKENS, TOKEN_TYPE_OUTPUT),
)
# records that could not be written (disk full, unwritable directory)
USAGE_RECORDS_DROPPED = "otel_llm.usage.records.dropped"
UNIT_RECORD = "{record}"

# --- Content redaction (otel_llm/redaction.py) ---------------------------------------------
# replacements made in captured content, by rule
REDACTIONS = "otel_llm.redactions"
REDACTION_RULE = "otel_llm.redaction.rule"
UNIT_REDACTION = "{redaction}"
REDACTION_RULE_SECRET = "secret"  # API keys, bearer tokens, JWTs
REDACTION_RULE_EMAIL = "email"
REDACTION_RULE_PAYMENT_CARD = "payment_card"  # Luhn-checked
REDACTION_RULE_PRC_ID = "prc_resident_id"  # check digit verified
REDACTION_RULE_PHONE = "phone"
REDACTION_RULE_IP_ADDRESS = "ip_address"

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
SERVER_REQUEST_DURATION = "gen_ai.server.request.duration"
SERVER_TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"
SERVER_TIME_PER_OUTPUT_TOKEN = "gen_ai.server.time_per_output_token"
SERVER_TOKEN_USAGE = "gen_ai.server.token.usage"
# requests by outcome (no convention exists): finished, aborted (client gone), error
SERVER_REQUESTS = "otel_llm.server.requests"
UNIT_REQUEST = "{request}"
REQUEST_OUTCOME = "otel_llm.request.outcome"
OUTCOME_FINISHED = "finished"
OUTCOME_ABORTED = "aborted"
OUTCOME_ERROR = "error"
CLIENT_OPERATION_DURATION = "gen_ai.client.operation.duration"
CLIENT_TOKEN_USAGE = "gen_ai.client.token.usage"
CLIENT_TIME_TO_FIRST_CHUNK = "gen_ai.client.operation.time_to_first_chunk"
CLIENT_TIME_PER_OUTPUT_CHUNK = "gen_ai.client.operation.time_per_output_chunk"

# The example gateway's metering counter (examples/gateway): tokens by tenant, scene, model, type
GATEWAY_TOKEN_USAGE = "otel_llm.gateway.token.usage"
GATEWAY_SERVICE_NAME = "llm-gateway"

UNIT_SECONDS = "s"
UNIT_TOKEN = "{token}"

# Bucket boundaries from the semconv metric definitions
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


def prometheus_name(otel_name: str, unit: str = "", counter: bool = False) -> str:
    """The name a Prometheus exporter gives an OTel metric (dots to underscores, unit suffix)."""
    name = otel_name.replace(".", "_")
    if unit == UNIT_SECONDS:
        name += "_seconds"
    if counter:
        name += "_total"
    return name


# --- Set by the OpenTelemetry Collector, not by otel-llm (collector-config/) -------------------
# With --feature-gates=processor.tailsamplingprocessor.recordpolicy, contrib's tail_sampling
# processor names the policy that sampled a trace (the first in config order that did) in an
# attribute of the instrumentation SCOPE of the trace's spans, not of the spans (OTTL:
# scope.attributes[...]). The collector configs keep prompt/completion content only where it names
# a policy other than the baseline.
TAILSAMPLING_POLICY = "tailsampling.policy"
# true on spans released by the sampled-decision cache (they arrived after their trace's decision)
TAILSAMPLING_CACHED_DECISION = "tailsampling.cached_decision"
