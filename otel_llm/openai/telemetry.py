"""What one OpenAI client call records: a GenAI CLIENT span and the semconv client metrics.

An `Invocation` is made before the request is sent and ended exactly once: with the response, with
the last chunk of a stream, or with the error that stopped it. Nothing here may raise into the
caller: every entry point from the wrappers is guarded there.

Metric names are v1.41's, or under gen_ai_latest_experimental (ClientSettings, read once) the
post-v1.41 ones: inference.* histograms and token counters by modality (semconv.py).
"""

from __future__ import annotations

import logging
import threading
from array import array
from time import perf_counter
from typing import Any

from opentelemetry import propagate
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

from otel_llm import content, redaction, semconv
from otel_llm.config import ClientSettings
from otel_llm.redaction import exception_attributes, redacted_error
from otel_llm.sdk import histogram_batch

_log = logging.getLogger("otel_llm.openai")

# openai's with_raw_response / with_streaming_response mark their calls with this header
RAW_RESPONSE_HEADER = "X-Stainless-Raw-Response"


class ClientTelemetry:
    def __init__(self, tracer, meter, settings: ClientSettings):
        self.tracer = tracer
        self.settings = settings
        self.latest = latest = settings.genai_latest_experimental
        create = semconv.create_instrument
        # embeddings (not inference) keep gen_ai.client.operation.duration in either mode
        self.duration = create(meter, semconv.CLIENT_OPERATION_DURATION)
        if latest:
            self.inference_duration = create(meter, semconv.CLIENT_INFERENCE_DURATION)
            self.ttfc = create(meter, semconv.CLIENT_INFERENCE_TIME_TO_FIRST_CHUNK)
            self.tpoc = create(meter, semconv.CLIENT_INFERENCE_TIME_PER_OUTPUT_CHUNK)
            self.tokens = None
            # (counter, histogram) of input and output tokens; the breakdown counters
            self.usage_io = (
                (
                    create(meter, semconv.CLIENT_USAGE_INPUT_TOKENS),
                    create(meter, semconv.CLIENT_OPERATION_INPUT_TOKENS),
                ),
                (
                    create(meter, semconv.CLIENT_USAGE_OUTPUT_TOKENS),
                    create(meter, semconv.CLIENT_OPERATION_OUTPUT_TOKENS),
                ),
            )
            self.usage_breakdown = tuple(
                create(meter, name)
                for name in (
                    semconv.CLIENT_USAGE_CACHE_READ_INPUT_TOKENS,
                    semconv.CLIENT_USAGE_CACHE_WRITE_INPUT_TOKENS,
                    semconv.CLIENT_USAGE_REASONING_OUTPUT_TOKENS,
                )
            )
            self.cache_write_attribute = semconv.GEN_AI_USAGE_CACHE_WRITE_INPUT_TOKENS
        else:
            self.inference_duration = self.duration
            self.ttfc = create(meter, semconv.CLIENT_TIME_TO_FIRST_CHUNK)
            self.tpoc = create(meter, semconv.CLIENT_TIME_PER_OUTPUT_CHUNK)
            self.tokens = create(meter, semconv.CLIENT_TOKEN_USAGE)
            self.cache_write_attribute = semconv.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS
        # captured content is redacted and capped before it is set on a span (otel_llm/content.py)
        self.capture = content.Capture(meter) if settings.capture_content else None


def _number(value) -> bool:
    return type(value) in (int, float)


def _int(value) -> int | None:
    return value if type(value) is int else None


# what _usage_attributes returns for a call that received no usage
_NO_USAGE = (None, None, None, None, None)


def server_of(instance) -> tuple[str | None, int | None]:
    """(host, port) of the client's base URL; never the path, query or credentials."""
    try:
        url = instance._client.base_url
        port = url.port or {"https": 443, "http": 80}.get(url.scheme)
        return url.host or None, port
    except Exception:
        return None, None


def error_type(exc: BaseException) -> str:
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):
        return str(status)
    return type(exc).__qualname__


# Responses API status -> a cross-provider finish reason (as the official instrumentation maps it)
_INCOMPLETE_REASONS = {"max_output_tokens": "length", "content_filter": "content_filter"}


def _finish_reason_of_response(response) -> list[str]:
    status = getattr(response, "status", None)
    if status == "completed":
        return ["stop"]
    if status in ("failed", "cancelled"):
        return [semconv.FINISH_REASON_ERROR]
    if status == "incomplete":
        reason = getattr(getattr(response, "incomplete_details", None), "reason", None)
        return [_INCOMPLETE_REASONS.get(reason, reason) if reason else status]
    return []


class Invocation:
    """One call: its span, its start time and what the response told us."""

    __slots__ = (
        "tel",
        "operation",
        "api_type",
        "span",
        "start",
        "metric_attrs",
        "request_model",
        "stream",
        "ended",
        "first",
        "last",
        "chunks",
        "finish_reasons",
        "usage",
        "response_id",
        "response_model",
        "injected_usage",
        "input_messages",
        "output_parts",
        "lock",
        "choice_count",
        "late",
        "gaps",
    )

    def __init__(self, tel: ClientTelemetry, operation: str, api_type: str | None, instance, kwargs: dict):
        self.tel = tel
        self.operation = operation
        self.api_type = api_type
        model = kwargs.get("model")
        self.request_model = model if isinstance(model, str) else None
        self.stream = kwargs.get("stream") is True
        n = kwargs.get("n")
        self.choice_count = n if type(n) is int and n > 0 else 1
        host, port = server_of(instance)
        attrs: dict[str, Any] = {
            semconv.GEN_AI_OPERATION_NAME: operation,
            semconv.GEN_AI_PROVIDER_NAME: tel.settings.provider_name,
        }
        if self.request_model:
            attrs[semconv.GEN_AI_REQUEST_MODEL] = self.request_model
        if host:
            attrs[semconv.SERVER_ADDRESS] = host
        if port:
            attrs[semconv.SERVER_PORT] = port
        self.metric_attrs = dict(attrs)
        if api_type:
            attrs[semconv.OPENAI_API_TYPE] = api_type
        attrs.update(request_attributes(operation, kwargs))
        self.span = tel.tracer.start_span(
            semconv.genai_span_name(operation, self.request_model), kind=SpanKind.CLIENT, attributes=attrs
        )
        self.start = perf_counter()
        self.ended = False
        self.first = self.last = None
        self.chunks = 0
        # time between consecutive output chunks, one per chunk after the first: recorded into
        # time_per_output_chunk when the call ends, so the chunk loop only appends a float
        self.gaps = array("d")
        self.finish_reasons: dict[int, str] = {}
        self.usage = None
        self.response_id = self.response_model = None
        self.injected_usage = False
        self.late: dict[str, Any] = {}  # attributes learnt from the response, set once at the end
        self.input_messages = content.input_messages(operation, kwargs) if tel.settings.capture_content else None
        self.output_parts: dict[int, list[str]] | None = {} if self.input_messages is not None else None
        self.lock = threading.Lock()

    # --- before the request -----------------------------------------------------------------
    def prepare(self, kwargs: dict) -> dict:
        """The kwargs to send: a copy with the trace context headers (and include_usage if asked)."""
        settings = self.tel.settings
        if settings.propagate:
            headers = kwargs.get("extra_headers")
            if not headers or not any(str(k).lower() == "traceparent" for k in headers):
                carrier = dict(headers) if headers else {}
                propagate.inject(carrier, context=set_span_in_context(self.span))
                kwargs = {**kwargs, "extra_headers": carrier}
        if (
            self.stream
            and settings.include_usage
            and self.operation != semconv.OP_EMBEDDINGS
            and self.api_type != semconv.OPENAI_API_TYPE_RESPONSES
        ):
            options = kwargs.get("stream_options")
            if not isinstance(options, dict) or "include_usage" not in options:
                base = options if isinstance(options, dict) else {}
                kwargs = {**kwargs, "stream_options": {**base, "include_usage": True}}
                self.injected_usage = True
        return kwargs

    # --- streams ----------------------------------------------------------------------------
    def on_chunk(self, chunk) -> bool:
        """Record one stream chunk; False when it is the usage chunk we asked for (hide it)."""
        now = perf_counter()
        if self.api_type == semconv.OPENAI_API_TYPE_RESPONSES:
            return self._on_event(chunk, now)
        if self.first is None:
            self.first = now
            self.response_id = getattr(chunk, "id", None)
            self.response_model = getattr(chunk, "model", None)
        usage = chunk.usage
        choices = chunk.choices
        if usage is not None:
            self.usage = usage
            if not choices and self.injected_usage:
                return False
        if self.last is not None:
            self.gaps.append(now - self.last)
        self.last = now
        self.chunks += 1
        for choice in choices:
            if choice.finish_reason is not None:
                self.finish_reasons[choice.index] = choice.finish_reason
        if self.output_parts is not None:
            content.add_stream_delta(self.output_parts, choices)
        return True

    def _on_event(self, event, now: float) -> bool:
        kind = getattr(event, "type", "")
        if kind.endswith(".delta"):
            if self.first is None:
                self.first = now
            if self.last is not None:
                self.gaps.append(now - self.last)
            self.last = now
            self.chunks += 1
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            self._read_response(event.response)
        elif kind == "response.created":
            self.response_id = getattr(event.response, "id", None)
            self.response_model = getattr(event.response, "model", None)
        return True

    def finished_all_choices(self) -> bool:
        return len(self.finish_reasons) >= self.choice_count

    def end_stream(self, exc: BaseException | None = None, abandoned: str | None = None) -> None:
        """End a streamed call: exhausted (no argument), failed (exc) or abandoned (why)."""
        if exc is not None:
            self.fail(exc)
            return
        if abandoned is not None:
            self._end(semconv.ERROR_STREAM_ABANDONED, abandoned)
            return
        self._end()

    # --- non-streamed responses --------------------------------------------------------------
    def end_with_response(self, response) -> None:
        self._read_response(response)
        if self.operation != semconv.OP_EMBEDDINGS and self.api_type != semconv.OPENAI_API_TYPE_RESPONSES:
            for choice in getattr(response, "choices", None) or ():
                reason = getattr(choice, "finish_reason", None)
                if reason is not None:
                    self.finish_reasons[getattr(choice, "index", len(self.finish_reasons))] = reason
            if self.output_parts is not None:
                content.add_response_choices(self.output_parts, response)
        elif self.operation == semconv.OP_EMBEDDINGS:
            data = getattr(response, "data", None)
            vector = getattr(data[0], "embedding", None) if data else None
            if isinstance(vector, list):
                self.late[semconv.GEN_AI_EMBEDDINGS_DIMENSION_COUNT] = len(vector)
        self._end()

    def _read_response(self, response) -> None:
        if response is None:
            return
        self.response_id = getattr(response, "id", None) or self.response_id
        self.response_model = getattr(response, "model", None) or self.response_model
        usage = getattr(response, "usage", None)
        if usage is not None:
            self.usage = usage
        if self.api_type == semconv.OPENAI_API_TYPE_RESPONSES:
            reasons = _finish_reason_of_response(response)
            if reasons:
                self.finish_reasons = dict(enumerate(reasons))
            if self.output_parts is not None:
                content.add_responses_output(self.output_parts, response)
        tier = getattr(response, "service_tier", None)
        if isinstance(tier, str):
            self.late[semconv.OPENAI_RESPONSE_SERVICE_TIER] = tier
        fingerprint = getattr(response, "system_fingerprint", None)
        if isinstance(fingerprint, str):
            self.late[semconv.OPENAI_RESPONSE_SYSTEM_FINGERPRINT] = fingerprint

    def fail(self, exc: BaseException) -> None:
        self._end(error_type(exc), str(exc) or type(exc).__name__, exc)

    def _redact_request_model(self, span, attrs: dict) -> None:
        """A failed call's model name is whatever the caller passed (a key pasted in the wrong place
        is one): redacted on the span (name and attribute) and the metrics. A call that succeeded
        named a model the provider serves."""
        model = self.request_model
        if not model:
            return
        safe = redaction.default().redact(model)
        if safe != model:
            attrs[semconv.GEN_AI_REQUEST_MODEL] = safe
            self.late[semconv.GEN_AI_REQUEST_MODEL] = safe
            span.update_name(semconv.genai_span_name(self.operation, safe))

    # --- the one place a span ends ------------------------------------------------------------
    def _end(self, error: str | None = None, description: str | None = None, exc: BaseException | None = None):
        with self.lock:
            if self.ended:
                return
            self.ended = True
        end = perf_counter()
        span = self.span
        attrs = self.metric_attrs
        out = self.late
        if self.response_model:
            attrs[semconv.GEN_AI_RESPONSE_MODEL] = self.response_model
            out[semconv.GEN_AI_RESPONSE_MODEL] = self.response_model
        if self.response_id:
            out[semconv.GEN_AI_RESPONSE_ID] = self.response_id
        reasons = self.finish_reasons
        if error is not None and self.stream and self.operation != semconv.OP_EMBEDDINGS:
            # semconv-genai: a choice whose stream ended before its finish reason reports "error"
            for index in range(self.choice_count):
                reasons.setdefault(index, semconv.FINISH_REASON_ERROR)
        if reasons:
            out[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = [reasons[i] for i in sorted(reasons)]
        tokens = self._usage_attributes(out)
        if self.stream:
            out[semconv.OTEL_LLM_STREAM_CHUNKS] = self.chunks
            if self.first is not None:
                out[semconv.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = self.first - self.start
        if self.input_messages is not None:
            self.tel.capture.set_attributes(out, self.input_messages, self.output_parts, reasons)
        if error is not None:
            # the error path only: what an error carries is redacted (redacted_error)
            self._redact_request_model(span, attrs)
            attrs[semconv.ERROR_TYPE] = error
            out[semconv.ERROR_TYPE] = error
        span.set_attributes(out)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, redacted_error(description) if description else None))
            if exc is not None:
                span.record_exception(exc, attributes=exception_attributes(exc))
        span.end()
        tel = self.tel
        inference = self.operation != semconv.OP_EMBEDDINGS
        (tel.inference_duration if inference else tel.duration).record(end - self.start, attrs)
        if tel.latest:
            if inference:  # the inference.usage.* metrics have no embeddings counterpart: the span has its tokens
                _record_usage(tel, attrs, tokens)
        else:
            input_tokens, output_tokens = tokens[0], tokens[1]
            if input_tokens is not None:
                tel.tokens.record(input_tokens, {**attrs, semconv.GEN_AI_TOKEN_TYPE: semconv.TOKEN_TYPE_INPUT})
            if output_tokens is not None and inference:
                tel.tokens.record(output_tokens, {**attrs, semconv.GEN_AI_TOKEN_TYPE: semconv.TOKEN_TYPE_OUTPUT})
        if self.first is not None:
            tel.ttfc.record(self.first - self.start, attrs)
            histogram_batch.record_all(tel.tpoc, self.gaps, attrs)

    def _usage_attributes(self, out: dict) -> tuple[int | None, ...]:
        """Sets the usage span attributes; returns (input, output, cache_read, cache_write, reasoning)
        tokens, None for each the response did not report."""
        usage = self.usage
        if usage is None:
            if self.operation != semconv.OP_EMBEDDINGS or self.stream:
                out[semconv.OTEL_LLM_USAGE_MISSING] = True
            return _NO_USAGE
        input_tokens = getattr(usage, "prompt_tokens", None)
        if input_tokens is None:
            input_tokens = getattr(usage, "input_tokens", None)
        output_tokens = getattr(usage, "completion_tokens", None)
        if output_tokens is None:
            output_tokens = getattr(usage, "output_tokens", None)
        details = getattr(usage, "prompt_tokens_details", None) or getattr(usage, "input_tokens_details", None)
        cached = _int(getattr(details, "cached_tokens", None))
        # OpenAI-compatible providers that report cache writes name them either way
        cache_write = _int(getattr(details, "cache_write_tokens", None))
        if cache_write is None:
            cache_write = _int(getattr(details, "cache_creation_tokens", None))
        out_details = getattr(usage, "completion_tokens_details", None) or getattr(usage, "output_tokens_details", None)
        reasoning = _int(getattr(out_details, "reasoning_tokens", None))
        if type(input_tokens) is int:
            out[semconv.GEN_AI_USAGE_INPUT_TOKENS] = input_tokens
        else:
            input_tokens = None
        if type(output_tokens) is int and self.operation != semconv.OP_EMBEDDINGS:
            out[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = output_tokens
        else:
            output_tokens = None
        # v1.41 mode states a reported 0 too (as it always has); latest mode sets the breakdown only when non-zero
        every = not self.tel.latest
        if cached or (cached is not None and every):
            out[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = cached
        if cache_write:
            out[self.tel.cache_write_attribute] = cache_write
        if reasoning or (reasoning is not None and every):
            out[semconv.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS] = reasoning
        return input_tokens, output_tokens, cached, cache_write, reasoning


def _record_usage(tel: ClientTelemetry, attrs: dict, tokens: tuple[int | None, ...]) -> None:
    """gen_ai_latest_experimental token metrics of one inference call, failed ones included: input and
    output on the counters (modality text) and the per-operation histograms; a direction the response
    did not report is recorded as 0, on the counter with modality unknown (semantic-conventions-genai).
    The breakdown counters only when non-zero."""
    text = {**attrs, semconv.GEN_AI_TOKEN_MODALITY: semconv.TOKEN_MODALITY_TEXT}
    for (counter, histogram), value in zip(tel.usage_io, tokens):
        if value is None:
            counter.add(0, {**attrs, semconv.GEN_AI_TOKEN_MODALITY: semconv.TOKEN_MODALITY_UNKNOWN})
            histogram.record(0, attrs)
        else:
            counter.add(value, text)
            histogram.record(value, attrs)
    for counter, value in zip(tel.usage_breakdown, tokens[2:]):
        if value:
            counter.add(value, text)


_OUTPUT_TYPES = {"text": "text", "json_object": "json", "json_schema": "json"}


def request_attributes(operation: str, kwargs: dict) -> dict[str, Any]:
    """GenAI request attributes from the call's keyword arguments (sentinels and bad types skipped)."""
    attrs: dict[str, Any] = {}
    get = kwargs.get
    if get("stream") is True:
        attrs[semconv.GEN_AI_REQUEST_STREAM] = True
    if operation == semconv.OP_EMBEDDINGS:
        fmt = get("encoding_format")
        if isinstance(fmt, str):
            attrs[semconv.GEN_AI_REQUEST_ENCODING_FORMATS] = [fmt]
        return attrs
    max_tokens = get("max_completion_tokens")
    if not _number(max_tokens):
        max_tokens = get("max_tokens")
    if not _number(max_tokens):
        max_tokens = get("max_output_tokens")
    if _number(max_tokens):
        attrs[semconv.GEN_AI_REQUEST_MAX_TOKENS] = max_tokens
    for key, name in (
        ("temperature", semconv.GEN_AI_REQUEST_TEMPERATURE),
        ("top_p", semconv.GEN_AI_REQUEST_TOP_P),
        ("frequency_penalty", semconv.GEN_AI_REQUEST_FREQUENCY_PENALTY),
        ("presence_penalty", semconv.GEN_AI_REQUEST_PRESENCE_PENALTY),
    ):
        value = get(key)
        if _number(value):
            attrs[name] = float(value)
    seed = get("seed")
    if type(seed) is int:
        attrs[semconv.GEN_AI_REQUEST_SEED] = seed
    n = get("n")
    if type(n) is int and n != 1:
        attrs[semconv.GEN_AI_REQUEST_CHOICE_COUNT] = n
    stop = get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, (list, tuple)) and stop and all(isinstance(s, str) for s in stop):
        # the caller's text, exported whether or not content is captured: redacted (only calls
        # that pass stop sequences pay for it)
        attrs[semconv.GEN_AI_REQUEST_STOP_SEQUENCES] = [redaction.default().redact(s) for s in stop]
    extra = get("extra_body")
    if isinstance(extra, dict) and _number(extra.get("top_k")):  # vLLM's sampling extension
        attrs[semconv.GEN_AI_REQUEST_TOP_K] = float(extra["top_k"])
    tier = get("service_tier")
    if isinstance(tier, str) and tier != "auto":
        attrs[semconv.OPENAI_REQUEST_SERVICE_TIER] = tier
    response_format = get("response_format")
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if isinstance(kind, str) and kind in _OUTPUT_TYPES:
        attrs[semconv.GEN_AI_OUTPUT_TYPE] = _OUTPUT_TYPES[kind]
    elif isinstance(response_format, type):  # parse(response_format=PydanticModel)
        attrs[semconv.GEN_AI_OUTPUT_TYPE] = "json"
    return attrs


def is_raw_response_call(kwargs: dict) -> str | None:
    headers = kwargs.get("extra_headers")
    if not headers:
        return None
    value = headers.get(RAW_RESPONSE_HEADER) if hasattr(headers, "get") else None
    return value if isinstance(value, str) else None
