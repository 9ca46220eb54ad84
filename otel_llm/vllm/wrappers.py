"""The wrappers the hook table (hooks.py) applies to vLLM: each factory takes the process-wide
Telemetry and returns a wrapt wrapper. Our own bookkeeping inside them runs in named functions under
`_safe` guards (otel_llm/warn.py): a failure there is logged once, counted under the guard's `what`,
and never reaches vLLM. What they read of vLLM's objects, contract.py reads.
"""

from __future__ import annotations

import logging

from opentelemetry import context as otel_context
from opentelemetry import trace

from otel_llm import redaction, semconv
from otel_llm.vllm import contract, routes
from otel_llm.vllm.attribution import first_values
from otel_llm.vllm.request_telemetry import CURRENT, RequestInfo, RequestTelemetry, request_info, start_request
from otel_llm.vllm.streams import _end_on_exception, _make_current, _restore_context, _StreamTelemetry, current_span
from otel_llm.vllm.telemetry import Telemetry
from otel_llm.warn import entry, failed
from otel_llm.warn import guard as _safe


def _request_info(operation: str, request, tel: Telemetry, raw_request, api_type: str | None = None) -> RequestInfo:
    """A handler's request (raw_request: the HTTP request it came with, None for a background response)."""
    get = contract.request_fields(request)
    headers = first_values(contract.read_headers(raw_request))  # (one view for the caller and the conversation)
    return request_info(
        operation,
        get,
        caller=tel.attribution.request_caller(headers, get),
        api_type=api_type,
        request=request if tel.capture is not None else None,
        conversation_id=_conversation(tel, headers),
    )


def _engine_request_info(engine, params) -> RequestInfo:
    """An AsyncLLM / LLMEngine request: its engine's model and its SamplingParams (PoolingParams: none)."""
    sampling = contract.read_sampling_params(params)
    fields = {**sampling, "model": contract.read_engine_model(engine)}
    return request_info(semconv.OP_TEXT_COMPLETION if sampling else semconv.OP_EMBEDDINGS, fields.get)


@_safe("reading a request's conversation header")
def _conversation(tel: Telemetry, headers) -> str | None:
    if not tel.settings.conversation_headers:
        return None
    return tel.attribution.conversation(headers)


def handler_wrapper(operation: str, api_type: str | None = None):
    def factory(tel: Telemetry):
        @_safe(f"starting the {operation} span")
        def start(request, raw_request):
            record = RequestTelemetry(tel, _request_info(operation, request, tel, raw_request, api_type))
            _claim(record)  # the route this request came by adds no span of its own
            return record

        async def wrapper(wrapped, instance, args, kwargs):
            request = args[0] if args else kwargs.get("request")
            raw_request = args[1] if len(args) > 1 else kwargs.get("raw_request")
            record = start(request, raw_request)
            if record is None:
                return await wrapped(*args, **kwargs)
            _mark_traced(raw_request)
            tokens = _make_current(record)  # (streams.current_span's steps, without its three methods' frames)
            try:
                result = await wrapped(*args, **kwargs)
            except BaseException as exc:
                _end_on_exception(record, exc)
                raise
            finally:
                _restore_context(tokens)
            wrapped_result = _read_response(record, result, raw_request)
            if wrapped_result is None:  # (our reading failed: the span ends with what it has)
                record.end()
                return result
            return wrapped_result

        return wrapper

    return factory


# (the guard around routes.claim itself: no frame of ours between them per request)
_claim = _safe("claiming a request for its route")(routes.claim)


@_safe("marking a request as traced")
def _mark_traced(raw_request) -> None:
    """The request has its GenAI span: an exception handler running for it records no rejection."""
    state = getattr(raw_request, "state", None)
    if state is not None:
        state.otel_llm_traced = True


@_safe("reading a vLLM response")
def _read_response(record, result, raw_request):
    # the id vLLM puts in the response (and every stream chunk) is kept for its middleware
    metadata, response_id = contract.read_response_metadata(raw_request)
    record.metadata = metadata
    if response_id is not None:
        record.response_id = response_id
    error, stream, response = contract.read_result(result)
    if error is not None:
        record.end(error_type=error[0], error_message=error[1])
        return result
    if stream:
        # its route watches its chunks where it can (routes.take_stream), else a proxy does
        try:  # (`guarded`'s, without its frame)
            taken = routes.take_stream(record)
        except Exception:  # noqa: BLE001
            failed("handing a stream to its route")
            taken = False
        return result if taken else _StreamTelemetry(result, record)
    record.end(response=response)
    return result


def attach_engine_request(tel: Telemetry):
    @_safe("attaching an engine request")
    def on_attach(output_processor, request) -> None:
        _attach(tel, output_processor, request)

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
    engine_id, state, transfer, session = contract.read_added_request(output_processor, request)
    if state is not None and engine_id not in tel.engine_records:
        record.attach_engine_request(state)
        if record.pd_role is None and transfer is not None:
            record.pd_role = _pd_role(transfer)
        if record.session_id is None and session is not None:
            record.session_id = tel.attribution.conversation_value(session)
        if tel.ledger.enabled:  # the engine core's record of it adds its cost to our bill (engine_cost.py)
            if tel.reads_final_outputs:
                contract.enable_final_outputs(output_processor)
            info = record.info
            trace_id, span_id, _, flags, _, valid = record.span.get_span_context()  # (internals.SPAN_CONTEXT_FIELDS)
            contract.mark_frontend_billed(
                request,
                f"00-{trace_id:032x}-{span_id:016x}-{int(flags):02x}" if valid else None,  # (its traceparent)
                tel.attribution.baggage(info.tenant, info.scene, info.cost_center),
                contract.ENGINE_BILLED_PD_PREFILL
                if record.pd_role == semconv.PD_ROLE_PREFILL
                else contract.ENGINE_BILLED,
            )


def _pd_role(params: dict) -> str | None:
    """The P/D leg an engine request is, from the kv_transfer_params vLLM passes in extra_args."""
    if params.get("do_remote_decode"):
        return semconv.PD_ROLE_PREFILL
    if params.get("do_remote_prefill"):
        return semconv.PD_ROLE_DECODE
    return None


def engine_finished(tel: Telemetry):
    @_safe("recording an engine finish")
    def on_finish(output_processor, req_state, finish_reason):
        record = tel.engine_records.get(contract.read_state_id(req_state))
        if record is not None:
            record.on_engine_finished(
                req_state, finish_reason, tel.reads_final_outputs and contract.final_outputs_enabled(output_processor)
            )

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        req_state = args[0] if args else kwargs.get("req_state")
        finish_reason = args[1] if len(args) > 1 else kwargs.get("finish_reason")
        on_finish(instance, req_state, finish_reason)
        return result

    return wrapper


def engine_aborted(tel: Telemetry):
    @_safe("recording an engine abort")
    def on_abort(aborted_ids):
        for request_id in aborted_ids or ():
            record = tel.engine_records.pop(request_id, None)
            if record is not None:
                record.on_engine_aborted()

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        on_abort(result)
        return result

    return wrapper


def native_tracing_off(tel: Telemetry):
    """vLLM's own `llm_request` span (--otlp-traces-endpoint) would trace every request twice. In its
    place: the engine core's figures for a finished request (engine_cost.py), on its final output,
    kept on its RequestState for the request's span (vLLM calls do_tracing once per finished request
    when its OutputProcessor's tracing_enabled is set: _attach sets it when this hook is in place)."""
    tel.reads_final_outputs = True

    @_safe("reading an engine request's final output")
    def on_final_output(engine_core_output, req_state):
        contract.stash_engine_cost(engine_core_output, req_state)
        record = tel.engine_records.get(contract.read_state_id(req_state))
        if record is not None:
            record.on_final_output(req_state)

    def wrapper(wrapped, instance, args, kwargs):
        if len(args) >= 2:
            on_final_output(args[0], args[1])
        return None

    return wrapper


def async_llm_generate(tel: Telemetry):
    """AsyncLLM used directly (no OpenAI handler around it): the generate() call is the request."""

    @_safe("starting an AsyncLLM span")
    def start(engine, params):
        return start_request(tel, _engine_request_info(engine, params))

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


def llm_engine_add_request(tel: Telemetry):
    """Offline LLMEngine (vllm.LLM): one span per engine request, ended when the engine finishes."""

    @_safe("starting an LLMEngine span")
    def start(engine, params):
        return start_request(tel, _engine_request_info(engine, params), engine_owned=True)

    def wrapper(wrapped, instance, args, kwargs):
        if CURRENT.get() is not None:
            return wrapped(*args, **kwargs)
        record = start(instance, args[2] if len(args) > 2 else kwargs.get("params"))
        if record is None:
            return wrapped(*args, **kwargs)
        with current_span(record):
            return wrapped(*args, **kwargs)

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
        caller = tel.attribution.request_caller(request.headers)
        record = start_request(
            tel, request_info(route.operation or semconv.OP_TEXT_COMPLETION, caller=caller, api_type=route.api_type)
        )
        if by_exception and exc is not None:
            error_type = type(exc).__qualname__
        else:
            error_type = contract.read_rejection_type(response)
        record.end(error_type=error_type, error_message="request rejected before reaching the engine")
        request.state.otel_llm_traced = True  # the route (routes.py) adds no error span of its own

    async def wrapper(wrapped, instance, args, kwargs):
        response = await wrapped(*args, **kwargs)
        record_rejection(
            args[0] if args else kwargs.get("req", kwargs.get("request")),
            args[1] if len(args) > 1 else kwargs.get("exc"),
            response,
        )
        return response

    return wrapper


def vllm_error_rejection(tel: Telemetry):
    """A VLLMError raised before a handler runs (a request model's validator: `prompt` missing) goes
    to vLLM's VLLMError handler; one raised inside a handler already ended that handler's span."""
    return validation_rejection(tel, by_exception=True)


def background_response(tel: Telemetry):
    """Responses API with background=true: the handler answers `queued` and a task generates later.
    That work is its own request (span, tokens, usage record), linked to the request that started it."""

    @_safe("starting a background response span")
    def start(request, origin):
        if origin is None:
            info, links = _request_info(semconv.OP_CHAT, request, tel, None, semconv.OPENAI_API_TYPE_RESPONSES), None
        else:
            info, links = origin.info, [trace.Link(origin.span.get_span_context())]
        # a trace of its own: the first one may be decided already
        return start_request(tel, info, links=links, context=otel_context.Context())

    async def wrapper(wrapped, instance, args, kwargs):
        record = start(args[0] if args else kwargs.get("request"), CURRENT.get())
        if record is None:
            return await wrapped(*args, **kwargs)
        with current_span(record):
            result = await wrapped(*args, **kwargs)
        _end_background(record)
        return result

    return wrapper


@_safe("ending a background response span")
def _end_background(record) -> None:
    record.end()


class RedactingLogFilter(logging.Filter):
    """vLLM's warnings and errors can quote a request: `Error with model ErrorInfo(message='The model
    `<what the client sent>` does not exist.')` on every chat or Responses 404, an exception's message
    and traceback. On each of vLLM's loggers this filter redacts such a record (redaction.default())
    before any handler writes it: its message, its exception (then held as text only: a handler that
    reads the exception itself, OTLP's, would export it whole) and its stack. Records below WARNING
    pass untouched: nothing runs per request."""

    # a record that cannot be redacted may hold a key: dropped (False) rather than written as it is
    @entry("redacting a vLLM log record", "that record is dropped", fallback=False)
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or getattr(record, "otel_llm_redacted", False):
            return True
        redact = redaction.default().redact
        record.msg, record.args = redact(record.getMessage()), None
        if record.exc_info:
            if not record.exc_text:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        record.otel_llm_redacted = True
        return True


_LOG_FILTER = RedactingLogFilter()


# uvicorn's error log: "Exception in ASGI application" and the traceback of every exception that
# escapes vLLM's app (its message can quote the request), once per such request
OTHER_REDACTED_LOGGERS = ("uvicorn.error",)


def redacting_loggers(tel: Telemetry):
    """Wraps vLLM's `init_logger`: each logger it hands out gets RedactingLogFilter (a logger's filters
    survive vLLM's later logging configuration; its handlers do not). The loggers made before the
    hook was applied get it now, and so do OTHER_REDACTED_LOGGERS."""
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if (name == "vllm" or name.startswith("vllm.")) and isinstance(logger, logging.Logger):
            logger.addFilter(_LOG_FILTER)
    for name in OTHER_REDACTED_LOGGERS:
        logging.getLogger(name).addFilter(_LOG_FILTER)

    def wrapper(wrapped, instance, args, kwargs):
        logger = wrapped(*args, **kwargs)
        _add_log_filter(logger)
        return logger

    return wrapper


@_safe("redacting a vLLM logger's warnings")
def _add_log_filter(logger) -> None:
    logger.addFilter(_LOG_FILTER)
