"""Every place otel-llm reads or writes what the OpenTelemetry packages do not publish: private
attributes and functions, private modules, module names and logger names of opentelemetry-api,
-sdk, -instrumentation, -instrumentation-asgi and -instrumentation-fastapi.

Each reach is one small function here, and tests/instrumentation/test_sdk_internals.py checks each
on the installed packages, so a release that moves one fails a test named after it. pyproject.toml
allows the releases where all of them pass: opentelemetry-api/-sdk 1.45.2 with the instrumentation
packages 0.66b2. Each docstring says where else it was checked (1.45.0/0.66b0 and 1.45.1/0.66b1,
in throwaway environments). Imports are made inside the functions: importing this module costs
nothing, and a caller keeps its own fallback where a release lacks something.
"""

from __future__ import annotations

import atexit
from contextlib import nullcontext

# ---- providers: which kind a global provider is ----------------------------------------------


def is_sdk_tracer_provider(provider) -> bool:
    """The SDK's TracerProvider (its class lives in `opentelemetry.sdk.trace`), not the API's
    proxy or no-op. Checked: sdk 1.45.0-1.45.2."""
    return type(provider).__module__.startswith("opentelemetry.sdk.trace")


def is_sdk_meter_provider(provider) -> bool:
    """The SDK's MeterProvider (class in `opentelemetry.sdk.metrics._internal`). Checked: sdk
    1.45.0-1.45.2."""
    return type(provider).__module__.startswith("opentelemetry.sdk.metrics")


def is_sdk_logger_provider(provider) -> bool:
    """The SDK's LoggerProvider (class in the private `opentelemetry.sdk._logs._internal`).
    Checked: sdk 1.45.0-1.45.2."""
    return type(provider).__module__.startswith("opentelemetry.sdk._logs")


def is_api_logger_provider(provider) -> bool:
    """The API's proxy or no-op LoggerProvider (classes in the private `opentelemetry._logs`):
    no SDK set up for logs. Checked: api 1.45.0-1.45.2."""
    return type(provider).__module__.startswith("opentelemetry._logs")


def global_logger_provider():
    """The global LoggerProvider (the logs API is the private module `opentelemetry._logs`).
    Checked: api 1.45.0-1.45.2."""
    from opentelemetry import _logs

    return _logs.get_logger_provider()


def sdk_logger_provider(resource):
    """A new SDK LoggerProvider (from the private module `opentelemetry.sdk._logs`). Checked: sdk
    1.45.0-1.45.2."""
    from opentelemetry.sdk._logs import LoggerProvider

    return LoggerProvider(resource=resource)


def is_sdk_sampler(sampler) -> bool:
    """One of the SDK's own samplers (classes in `opentelemetry.sdk.trace.sampling`), which read no
    span attributes. Checked: sdk 1.45.0-1.45.2."""
    return type(sampler).__module__ == "opentelemetry.sdk.trace.sampling"


def tracer_provider_disabled(provider) -> bool:
    """`TracerProvider._disabled`: OTEL_SDK_DISABLED was set, its tracers make no spans. Checked:
    sdk 1.45.0-1.45.2."""
    return getattr(provider, "_disabled", False)


def provider_shut_down(provider) -> bool:
    """`MeterProvider._shutdown` is True once it was shut down (the TracerProvider and
    LoggerProvider keep no such flag: False for them). Checked: sdk 1.45.0-1.45.2."""
    return getattr(provider, "_shutdown", False) is True


def unregister_exit_hook(provider) -> None:
    """Remove the provider's own atexit hook: the SDK's providers register their bound `shutdown`
    (`atexit.register(self.shutdown)`), so unregistering an equal bound method removes it.
    Checked: sdk 1.45.0-1.45.2."""
    atexit.unregister(provider.shutdown)


# ---- the processors, readers and exporters inside the providers ------------------------------


def span_processors(tracer_provider) -> tuple:
    """The span processors added to an SDK TracerProvider
    (`_active_span_processor._span_processors`). Checked: sdk 1.45.0-1.45.2."""
    return tuple(tracer_provider._active_span_processor._span_processors)


def log_record_processors(logger_provider) -> tuple:
    """The log record processors added to an SDK LoggerProvider
    (`_multi_log_record_processor._log_record_processors`). Checked: sdk 1.45.0-1.45.2."""
    return tuple(logger_provider._multi_log_record_processor._log_record_processors)


def metric_readers(meter_provider) -> tuple:
    """The metric readers of an SDK MeterProvider (`_metric_readers`). Checked: sdk 1.45.0-1.45.2."""
    return tuple(meter_provider._metric_readers)


def batch_processor_queue(processor):
    """The queue (a deque) of a BatchSpanProcessor or BatchLogRecordProcessor
    (`_batch_processor._queue`); None for any other processor. Checked: sdk 1.45.0-1.45.2."""
    return getattr(getattr(processor, "_batch_processor", None), "_queue", None)


def batch_processor_exporter(processor):
    """The exporter of a BatchSpanProcessor or BatchLogRecordProcessor
    (`_batch_processor._exporter`); None for any other processor. Checked: sdk 1.45.0-1.45.2."""
    return getattr(getattr(processor, "_batch_processor", None), "_exporter", None)


def reader_exporter(reader):
    """The exporter of a PeriodicExportingMetricReader (`_exporter`, which has no public
    accessor); None for a reader without one. Checked: sdk 1.45.0-1.45.2."""
    return getattr(reader, "_exporter", None)


def set_reader_exporter(reader, exporter) -> None:
    """Replace a PeriodicExportingMetricReader's exporter (`_exporter`: the reader exports through
    whatever it holds there at each collection). Checked: sdk 1.45.0-1.45.2."""
    reader._exporter = exporter


def batch_log_record_processor(exporter):
    """The SDK's BatchLogRecordProcessor (private module `opentelemetry.sdk._logs.export`).
    Checked: sdk 1.45.0-1.45.2."""
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor

    return BatchLogRecordProcessor(exporter)


def log_record_export_types() -> tuple:
    """(LogRecordExporter, LogRecordExportResult) from the private module
    `opentelemetry.sdk._logs.export`. Checked: sdk 1.45.0-1.45.2."""
    from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult

    return LogRecordExporter, LogRecordExportResult


# ---- configuration from the environment ------------------------------------------------------


def sdk_configurator_class():
    """The SDK's configurator to subclass (`opentelemetry.sdk._configuration._OTelSDKConfigurator`,
    which its docstring asks distros to subclass). Its `_configure(**kwargs)` passes the keywords on
    to `_initialize_components`; ours sets `resource_attributes`, `export_span_processor` and
    `export_log_record_processor` and reads `span_processors`, `log_record_processors` and
    `exporter_args_map`. Checked: sdk 1.45.0-1.45.2."""
    from opentelemetry.sdk._configuration import _OTelSDKConfigurator

    return _OTelSDKConfigurator


def exporters_from_environment(traces: bool = False, metrics: bool = False, logs: bool = False) -> tuple:
    """(span exporter classes, metric exporter or reader classes, log exporter classes), each a
    {name: class} of the signals asked for, as the SDK's configurator finds them from
    OTEL_{TRACES,METRICS,LOGS}_EXPORTER (`_get_exporter_names`, `_import_exporters`). Checked: sdk
    1.45.0-1.45.2."""
    from opentelemetry.sdk._configuration import _get_exporter_names, _import_exporters

    span_names = _get_exporter_names("traces") if traces else []
    metric_names = _get_exporter_names("metrics") if metrics else []
    log_names = _get_exporter_names("logs") if logs else []
    return _import_exporters(span_names, metric_names, log_names)


# ---- tracing ---------------------------------------------------------------------------------


# ParentBased's delegate per kind of parent, in the order of parent_based_answers
_PARENT_BASED_DELEGATES = (
    "_root",
    "_remote_parent_sampled",
    "_remote_parent_not_sampled",
    "_local_parent_sampled",
    "_local_parent_not_sampled",
)


def parent_based_answers(sampler) -> tuple | None:
    """The answers of the SDK's ParentBased known without asking it, per kind of parent (no parent, a
    remote sampled, remote unsampled, local sampled, local unsampled one): True where its delegate is
    the static ALWAYS_ON, False where ALWAYS_OFF (each answers so whatever the span, with the attributes
    as given and the parent's trace state), None where it must be asked. None for any other sampler.
    Checked: sdk 1.45.0-1.45.2."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

    if not isinstance(sampler, ParentBased):
        return None
    delegates = [getattr(sampler, name, None) for name in _PARENT_BASED_DELEGATES]
    return tuple(True if d is ALWAYS_ON else False if d is ALWAYS_OFF else None for d in delegates)


def children_follow_sampled_parent(sampler) -> bool:
    """The SDK's ParentBased with its default ALWAYS_ON for a sampled local parent
    (`ParentBased._local_parent_sampled`): every child of a sampled local span is sampled."""
    answers = parent_based_answers(sampler)
    return answers is not None and answers[3] is True


def default_propagation(propagator) -> bool:
    """The API's default global propagator (OTEL_PROPAGATORS unset or `tracecontext,baggage`): a
    CompositePropagator of W3C trace context and W3C baggage alone (its private `_propagators`). Such a
    propagator extracts, from a carrier with neither a `traceparent` nor a `baggage` header, an empty
    Context. Checked: api 1.45.0-1.45.2."""
    from opentelemetry.baggage.propagation import W3CBaggagePropagator
    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if type(propagator) is not CompositePropagator:
        return False
    kinds = [type(p) for p in getattr(propagator, "_propagators", None) or ()]
    return kinds == [TraceContextTextMapPropagator, W3CBaggagePropagator]


def global_propagator_readers() -> tuple:
    """(the global response propagator, the global text map propagator) readers: C callables (no Python
    frame per request) reading the module globals `get_global_response_propagator` and
    `get_global_textmap` return (the private `opentelemetry.instrumentation.propagators._RESPONSE_PROPAGATOR`
    and `opentelemetry.propagate._HTTP_TEXT_FORMAT`), both set by a `set_global_...` call, never
    cached; where a release lacks one, the public function. Checked: api 1.45.0-1.45.2,
    instrumentation 0.66b0-0.66b2."""
    from functools import partial

    from opentelemetry import propagate
    from opentelemetry.instrumentation import propagators

    readers = []
    for module, name, public in (
        (propagators, "_RESPONSE_PROPAGATOR", propagators.get_global_response_propagator),
        (propagate, "_HTTP_TEXT_FORMAT", propagate.get_global_textmap),
    ):
        reader = partial(getattr, module, name)
        try:
            same = reader() is public()
        except AttributeError:
            same = False
        readers.append(reader if same else public)
    return tuple(readers)


# SpanContext (opentelemetry-api) is a tuple of these, in this order, each read through a Python property;
# the request path unpacks it once instead of calling a property per field
SPAN_CONTEXT_FIELDS = ("trace_id", "span_id", "is_remote", "trace_flags", "trace_state", "is_valid")


# ---- the current Context and span, read and set by the request path without the API's frames ------------


def context_variable():
    """The ContextVar the API keeps the current Context in: that of its default runtime context
    (`opentelemetry.context._RUNTIME_CONTEXT`, a ContextVarsRuntimeContext, in its `_current_context`),
    whose attach, get_current and detach are the variable's set, get and reset. None where
    OTEL_PYTHON_CONTEXT chose another runtime context. Checked: api 1.45.0-1.45.2."""
    from contextvars import ContextVar

    from opentelemetry import context
    from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext

    runtime = getattr(context, "_RUNTIME_CONTEXT", None)
    if type(runtime) is not ContextVarsRuntimeContext:
        return None
    variable = getattr(runtime, "_current_context", None)
    return variable if isinstance(variable, ContextVar) else None


def span_key() -> str:
    """The Context key set_span_in_context and get_current_span keep a span under (the private
    `opentelemetry.trace.propagation._SPAN_KEY`). Checked: api 1.45.0-1.45.2."""
    from opentelemetry.trace import propagation

    return propagation._SPAN_KEY


def baggage_key() -> str:
    """The Context key the baggage API keeps its entries under (the private
    `opentelemetry.baggage._BAGGAGE_KEY`). Checked: api 1.45.0-1.45.2."""
    from opentelemetry import baggage

    return baggage._BAGGAGE_KEY


def sdk_record_exception(span, exception, attributes=None, timestamp=None, escaped=False) -> None:
    """The SDK Span's `record_exception` run on another span: it builds the exception event's
    attributes and calls only `span.add_event(name="exception", attributes=..., timestamp=...)`.
    Checked: sdk 1.45.0-1.45.2."""
    from opentelemetry.sdk.trace import Span

    Span.record_exception(span, exception, attributes, timestamp, escaped)


# ---- metrics ---------------------------------------------------------------------------------


def meter_instrumentation_scope(meter):
    """The InstrumentationScope of an SDK Meter (`_instrumentation_scope`); None for another meter.
    Checked: sdk 1.45.0-1.45.2."""
    return getattr(meter, "_instrumentation_scope", None)


# the logger of the API's Meter, which warns of an instrument registered again (`_internal`)
INSTRUMENT_CONFLICT_LOGGER = "opentelemetry.metrics._internal"


def conflicting_instrument_name(record):
    """The instrument name of a registration-conflict warning on INSTRUMENT_CONFLICT_LOGGER (its
    first argument); None for a record without arguments. Checked: api 1.45.0-1.45.2."""
    return record.args[0] if record.args else None


def instrument_enabled(instrument) -> bool:
    """An SDK instrument's `_is_enabled()`: False when its meter is disabled. Checked: sdk
    1.45.0-1.45.2."""
    return instrument._is_enabled()


def view_instrument_matches(instrument) -> list:
    """Every view-instrument match of an SDK synchronous instrument, over all readers
    (`_measurement_consumer._reader_storages`, `_get_or_init_view_instrument_match`). Checked: sdk
    1.45.0-1.45.2."""
    storages = list(instrument._measurement_consumer._reader_storages.values())
    return [m for s in storages for m in s._get_or_init_view_instrument_match(instrument)]


def match_filters_attributes(match) -> bool:
    """The match's view keeps only some attribute keys (`_view._attribute_keys`). Checked: sdk
    1.45.0-1.45.2."""
    return match._view._attribute_keys is not None


def aggregation_key(attributes: dict):
    """The key a view-instrument match files `attributes` under (`_hash_attributes`). Checked: sdk
    1.45.0-1.45.2."""
    from opentelemetry.sdk.metrics._internal._view_instrument_match import _hash_attributes

    return _hash_attributes(dict(attributes))


def match_aggregation(match, key, attributes: dict):
    """The aggregation of one attribute set in a view-instrument match
    (`_attributes_aggregation`), made as recording makes it when a collection discarded it
    (`_get_or_create_aggregation`), under the match's `_lock`. Checked: sdk 1.45.2 (1.45.0 and
    1.45.1 read the same, but their delta collections keep the aggregations)."""
    with match._lock:
        return match._attributes_aggregation.get(key) or match._get_or_create_aggregation(key, dict(attributes))


def match_collect_lock(match):
    """The match's `_lock` when a collection discards its aggregations (`_reset_on_collect`: a
    delta reader), else None. Checked: sdk 1.45.2 (not in 1.45.0 and 1.45.1: AttributeError, and
    histogram_batch records every value through the API)."""
    return match._lock if match._reset_on_collect else None


def is_explicit_bucket_histogram(aggregation) -> bool:
    """The aggregation is the SDK's explicit-bucket histogram (`_ExplicitBucketHistogramAggregation`,
    exactly). Checked: sdk 1.45.0-1.45.2."""
    from opentelemetry.sdk.metrics._internal.aggregation import _ExplicitBucketHistogramAggregation

    return type(aggregation) is _ExplicitBucketHistogramAggregation


def histogram_boundaries(aggregation):
    """An explicit-bucket histogram aggregation's bucket boundaries (`_boundaries`). Checked: sdk
    1.45.0-1.45.2."""
    return aggregation._boundaries


def add_to_histogram(aggregation, counts: list, values, low: float, high: float, lock=None) -> None:
    """Add values to an explicit-bucket histogram aggregation as recording each would: `counts` per
    bucket to `_value` (made on the first value), each value to `_sum` in order, `low` and `high`
    to `_min` and `_max` where it keeps them (`_record_min_max`); under `lock` (if any) and the
    aggregation's `_lock`. Checked: sdk 1.45.0-1.45.2."""
    with lock or nullcontext(), aggregation._lock:
        if aggregation._value is None:
            aggregation._value = [0] * len(counts)
        buckets = aggregation._value
        for i, n in enumerate(counts):
            if n:
                buckets[i] += n
        total = aggregation._sum
        for value in values:  # in order, as recording each adds it: the same float sum
            total += value
        aggregation._sum = total
        if aggregation._record_min_max:
            aggregation._min = min(aggregation._min, low)
            aggregation._max = max(aggregation._max, high)


# ---- the ASGI and FastAPI instrumentations -------------------------------------------------------


def fastapi_app_instrumented(app) -> bool:
    """FastAPIInstrumentor.instrument_app marked the app (`_is_instrumented_by_opentelemetry`).
    Checked: instrumentation-fastapi 0.66b0-0.66b2."""
    return getattr(app, "_is_instrumented_by_opentelemetry", False)


def asgi_private_functions() -> tuple:
    """(`_parse_active_request_count_attrs`, `_decode_header_item`) of
    opentelemetry.instrumentation.asgi; ImportError when a release lacks one. Checked:
    instrumentation-asgi 0.66b0-0.66b2."""
    from opentelemetry.instrumentation.asgi import _decode_header_item, _parse_active_request_count_attrs

    return _parse_active_request_count_attrs, _decode_header_item


def asgi_sem_conv_mode(middleware):
    """The HTTP semantic-convention mode an OpenTelemetryMiddleware was made with
    (`_sem_conv_opt_in_mode`). Checked: instrumentation-asgi 0.66b0-0.66b2."""
    return middleware._sem_conv_opt_in_mode


def asgi_otel_send(middleware, server_span, server_span_name, scope, send, duration_attrs):
    """OpenTelemetryMiddleware's own `_get_otel_send` (the send wrapper its `__call__` gets from
    `self._get_otel_send(...)`, which a subclass may override), run for `middleware`. Checked:
    instrumentation-asgi 0.66b0-0.66b2."""
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    return OpenTelemetryMiddleware._get_otel_send(
        middleware, server_span, server_span_name, scope, send, duration_attrs
    )


def asgi_set_server_span(middleware, server_span, message, status_code, duration_attrs) -> None:
    """What the middleware's send wrapper does with the response start (`_set_server_span`: the
    status and captured response headers on the span, the status code in `duration_attrs`).
    Checked: instrumentation-asgi 0.66b0-0.66b2."""
    middleware._set_server_span(server_span, message, status_code, duration_attrs)
