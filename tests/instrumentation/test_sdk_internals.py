"""otel_llm/sdk/internals.py on the installed OpenTelemetry packages: one test per function, on real
SDK objects, asserting the exact value read. A release that moves a private attribute, function or
module fails the test named after the function that reads it."""

import asyncio
import logging
import subprocess
import sys
import threading
import traceback
from collections import deque

import pytest
from opentelemetry import _logs, metrics, trace
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import (
    BatchLogRecordProcessor,
    ConsoleLogRecordExporter,
    InMemoryLogRecordExporter,
    LogRecordExporter,
    LogRecordExportResult,
    SimpleLogRecordProcessor,
)
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    ConsoleMetricExporter,
    InMemoryMetricReader,
    MetricExporter,
    MetricExportResult,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from otel_llm.sdk import internals

ATTRS = {"a": "b", "n": 1}


def histogram_on(*readers, views=(), boundaries=(0.1, 1.0, 10.0)):
    provider = MeterProvider(metric_readers=list(readers), views=list(views))
    return provider.get_meter("t").create_histogram("h", explicit_bucket_boundaries_advisory=list(boundaries))


def point_of(reader):
    (point,) = [
        p
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        for p in m.data.data_points
    ]
    return point.count, point.sum, tuple(point.bucket_counts), point.min, point.max, dict(point.attributes)


# ---- providers ---------------------------------------------------------------------------------


def test_is_sdk_tracer_provider():
    assert internals.is_sdk_tracer_provider(TracerProvider()) is True
    assert internals.is_sdk_tracer_provider(trace.ProxyTracerProvider()) is False
    assert internals.is_sdk_tracer_provider(trace.NoOpTracerProvider()) is False


def test_is_sdk_meter_provider():
    assert internals.is_sdk_meter_provider(MeterProvider()) is True
    assert internals.is_sdk_meter_provider(metrics.NoOpMeterProvider()) is False


def test_is_sdk_logger_provider():
    assert internals.is_sdk_logger_provider(LoggerProvider()) is True
    assert internals.is_sdk_logger_provider(_logs.NoOpLoggerProvider()) is False


def test_is_api_logger_provider():
    from opentelemetry._logs._internal import ProxyLoggerProvider

    assert internals.is_api_logger_provider(_logs.NoOpLoggerProvider()) is True
    assert internals.is_api_logger_provider(ProxyLoggerProvider()) is True
    assert internals.is_api_logger_provider(LoggerProvider()) is False


def test_global_logger_provider():
    assert internals.global_logger_provider() is _logs.get_logger_provider()


def test_sdk_logger_provider():
    resource = Resource({"service.name": "s"})
    provider = internals.sdk_logger_provider(resource)
    assert type(provider) is LoggerProvider
    assert provider.resource is resource


def test_is_sdk_sampler():
    class Custom(Sampler):
        def should_sample(self, *args, **kwargs):
            raise NotImplementedError

        def get_description(self):
            return "custom"

    assert internals.is_sdk_sampler(ParentBased(ALWAYS_ON)) is True
    assert internals.is_sdk_sampler(TraceIdRatioBased(0.5)) is True
    assert internals.is_sdk_sampler(ALWAYS_ON) is True
    assert internals.is_sdk_sampler(Custom()) is False


def test_tracer_provider_disabled(monkeypatch):
    assert internals.tracer_provider_disabled(TracerProvider()) is False
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    provider = TracerProvider()
    assert internals.tracer_provider_disabled(provider) is True
    assert not provider.get_tracer("t").start_span("s").is_recording()


def test_provider_shut_down():
    meter_provider = MeterProvider()
    assert internals.provider_shut_down(meter_provider) is False
    meter_provider.shutdown()
    assert internals.provider_shut_down(meter_provider) is True
    tracer_provider = TracerProvider()
    tracer_provider.shutdown()
    assert internals.provider_shut_down(tracer_provider) is False  # (it keeps no such flag)


EXIT_HOOK_SCRIPT = """
import sys
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from otel_llm.sdk import internals

def announcing(cls):
    class Announcing(cls):
        def shutdown(self, *args, **kwargs):
            print("shutdown", cls.__name__, flush=True)
            return super().shutdown(*args, **kwargs)
    return Announcing()

providers = [announcing(cls) for cls in (TracerProvider, MeterProvider, LoggerProvider)]
if sys.argv[1] == "unregister":
    for provider in providers:
        internals.unregister_exit_hook(provider)
"""


@pytest.mark.parametrize("unregister", [False, True])
def test_unregister_exit_hook(unregister):
    out = subprocess.run(
        [sys.executable, "-c", EXIT_HOOK_SCRIPT, "unregister" if unregister else "keep"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    expected = [] if unregister else ["shutdown LoggerProvider", "shutdown MeterProvider", "shutdown TracerProvider"]
    assert sorted(out.splitlines()) == expected


# ---- processors, readers, exporters ------------------------------------------------------------


def test_span_processors():
    provider = TracerProvider()
    first, second = SimpleSpanProcessor(InMemorySpanExporter()), BatchSpanProcessor(InMemorySpanExporter())
    provider.add_span_processor(first)
    provider.add_span_processor(second)
    assert internals.span_processors(provider) == (first, second)
    provider.shutdown()


def test_log_record_processors():
    provider = LoggerProvider()
    first, second = (
        SimpleLogRecordProcessor(InMemoryLogRecordExporter()),
        BatchLogRecordProcessor(InMemoryLogRecordExporter()),
    )
    provider.add_log_record_processor(first)
    provider.add_log_record_processor(second)
    assert internals.log_record_processors(provider) == (first, second)
    provider.shutdown()


def test_metric_readers():
    first, second = InMemoryMetricReader(), InMemoryMetricReader()
    assert internals.metric_readers(MeterProvider(metric_readers=[first, second])) == (first, second)
    assert internals.metric_readers(MeterProvider()) == ()


def test_batch_processor_queue():
    spans = BatchSpanProcessor(InMemorySpanExporter(), schedule_delay_millis=600_000)
    provider = TracerProvider()
    provider.add_span_processor(spans)
    provider.get_tracer("t").start_span("s").end()
    queue = internals.batch_processor_queue(spans)
    assert type(queue) is deque and len(queue) == 1
    logs = BatchLogRecordProcessor(InMemoryLogRecordExporter(), schedule_delay_millis=600_000)
    assert type(internals.batch_processor_queue(logs)) is deque and len(internals.batch_processor_queue(logs)) == 0
    assert internals.batch_processor_queue(SimpleSpanProcessor(InMemorySpanExporter())) is None
    provider.shutdown()
    logs.shutdown()


def test_batch_processor_exporter():
    span_exporter, log_exporter = InMemorySpanExporter(), InMemoryLogRecordExporter()
    spans, logs = BatchSpanProcessor(span_exporter), BatchLogRecordProcessor(log_exporter)
    assert internals.batch_processor_exporter(spans) is span_exporter
    assert internals.batch_processor_exporter(logs) is log_exporter
    assert internals.batch_processor_exporter(SimpleSpanProcessor(span_exporter)) is None
    spans.shutdown()
    logs.shutdown()


def test_reader_exporter():
    exporter = ConsoleMetricExporter()
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=600_000)
    assert internals.reader_exporter(reader) is exporter
    assert internals.reader_exporter(InMemoryMetricReader()) is None
    reader.shutdown()


class RecordingMetricExporter(MetricExporter):
    def __init__(self):
        super().__init__()
        self.exported = []

    def export(self, metrics_data, timeout_millis=10_000, **kwargs):
        self.exported.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis=10_000):
        return True

    def shutdown(self, timeout_millis=30_000, **kwargs):
        pass


def test_set_reader_exporter():
    first, second = RecordingMetricExporter(), RecordingMetricExporter()
    reader = PeriodicExportingMetricReader(first, export_interval_millis=600_000)
    provider = MeterProvider(metric_readers=[reader])
    provider.get_meter("t").create_counter("c").add(3)
    internals.set_reader_exporter(reader, second)
    assert internals.reader_exporter(reader) is second
    reader.force_flush()
    assert first.exported == []
    (data,) = second.exported
    (point,) = data.resource_metrics[0].scope_metrics[0].metrics[0].data.data_points
    assert point.value == 3
    provider.shutdown()


def test_batch_log_record_processor():
    exporter = InMemoryLogRecordExporter()
    processor = internals.batch_log_record_processor(exporter)
    assert type(processor) is BatchLogRecordProcessor
    assert internals.batch_processor_exporter(processor) is exporter
    processor.shutdown()


def test_log_record_export_types():
    assert internals.log_record_export_types() == (LogRecordExporter, LogRecordExportResult)
    assert isinstance(ConsoleLogRecordExporter(), LogRecordExporter)
    assert LogRecordExportResult.FAILURE.name == "FAILURE"


# ---- configuration -----------------------------------------------------------------------------


def test_sdk_configurator_class(monkeypatch):
    import inspect

    from opentelemetry.sdk import _configuration

    configurator = internals.sdk_configurator_class()
    assert configurator is _configuration._OTelSDKConfigurator
    taken = set(inspect.signature(_configuration._initialize_components).parameters)
    assert {
        "resource_attributes",
        "export_span_processor",
        "export_log_record_processor",
        "span_processors",
        "log_record_processors",
        "exporter_args_map",
    } <= taken
    calls = []
    monkeypatch.delenv("OTEL_CONFIG_FILE", raising=False)
    monkeypatch.setattr(_configuration, "_initialize_components", lambda **kwargs: calls.append(kwargs))
    configurator()._configure(resource_attributes={"process.pid": 1}, export_span_processor=SimpleSpanProcessor)
    assert calls == [{"resource_attributes": {"process.pid": 1}, "export_span_processor": SimpleSpanProcessor}]


def test_exporters_from_environment(monkeypatch):
    from otel_llm.sdk.prometheus import VLLMSharedPrometheusReader

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "console,prometheus_vllm")
    monkeypatch.setenv("OTEL_LOGS_EXPORTER", "console")
    assert internals.exporters_from_environment(traces=True, metrics=True, logs=True) == (
        {"console": ConsoleSpanExporter},
        {"console": ConsoleMetricExporter, "prometheus_vllm": VLLMSharedPrometheusReader},
        {"console": ConsoleLogRecordExporter},
    )
    assert internals.exporters_from_environment(metrics=True) == (
        {},
        {"console": ConsoleMetricExporter, "prometheus_vllm": VLLMSharedPrometheusReader},
        {},
    )
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert internals.exporters_from_environment(traces=True) == ({}, {}, {})


# ---- tracing -----------------------------------------------------------------------------------


def test_parent_based_answers():
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    assert internals.parent_based_answers(ParentBased(ALWAYS_ON)) == (True, True, False, True, False)
    ratio = ParentBased(TraceIdRatioBased(0.1), remote_parent_not_sampled=ALWAYS_ON)
    assert internals.parent_based_answers(ratio) == (None, True, True, True, False)
    assert internals.parent_based_answers(ALWAYS_ON) is None


def test_children_follow_sampled_parent():
    assert internals.children_follow_sampled_parent(ParentBased(ALWAYS_ON)) is True
    assert internals.children_follow_sampled_parent(ParentBased(ALWAYS_OFF)) is True  # (its root sampler)
    assert internals.children_follow_sampled_parent(ParentBased(ALWAYS_ON, local_parent_sampled=ALWAYS_OFF)) is False
    assert internals.children_follow_sampled_parent(ALWAYS_ON) is False


def test_default_propagation():
    """The API's default propagator (as OTEL_PROPAGATORS unset makes it) is recognised, and extracts an
    empty Context from headers without traceparent or baggage; any other composition is not."""
    from opentelemetry import propagate
    from opentelemetry.baggage.propagation import W3CBaggagePropagator
    from opentelemetry.context import Context
    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    default = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
    assert internals.default_propagation(default) is True
    assert default.extract({"x-tenant-id": "t"}) == Context()
    assert internals.default_propagation(CompositePropagator([TraceContextTextMapPropagator()])) is False
    reversed_order = CompositePropagator([W3CBaggagePropagator(), TraceContextTextMapPropagator()])
    assert internals.default_propagation(reversed_order) is False
    assert internals.default_propagation(TraceContextTextMapPropagator()) is False
    # (this test process: no OTEL_PROPAGATORS)
    assert internals.default_propagation(propagate.get_global_textmap()) is True


def test_sdk_record_exception():
    class Events:
        def __init__(self):
            self.events = []

        def add_event(self, name, attributes=None, timestamp=None):
            self.events.append((name, dict(attributes), timestamp))

    try:
        raise ValueError("boom")
    except ValueError as caught:
        exception = caught
    span = Events()
    internals.sdk_record_exception(span, exception, {"extra": 1}, 123, True)
    assert span.events == [
        (
            "exception",
            {
                "exception.type": "ValueError",
                "exception.message": "boom",
                "exception.stacktrace": "".join(traceback.format_exception(exception)),
                "exception.escaped": "True",
                "extra": 1,
            },
            123,
        )
    ]


# ---- metrics -----------------------------------------------------------------------------------


def test_meter_instrumentation_scope():
    meter = MeterProvider().get_meter("n", "1.0", schema_url="https://s")
    assert internals.meter_instrumentation_scope(meter) == InstrumentationScope("n", "1.0", "https://s")
    assert internals.meter_instrumentation_scope(metrics.NoOpMeter("n")) is None


def test_conflicting_instrument_name(caplog):
    meter = MeterProvider().get_meter("t")
    meter.create_histogram("h", explicit_bucket_boundaries_advisory=[1.0])
    with caplog.at_level(logging.WARNING, logger=internals.INSTRUMENT_CONFLICT_LOGGER):
        meter.create_histogram("h", explicit_bucket_boundaries_advisory=[2.0])
    (record,) = [r for r in caplog.records if r.name == internals.INSTRUMENT_CONFLICT_LOGGER]
    assert internals.conflicting_instrument_name(record) == "h"
    plain = logging.LogRecord("x", logging.WARNING, __file__, 1, "no arguments", None, None)
    assert internals.conflicting_instrument_name(plain) is None


def test_instrument_enabled():
    from opentelemetry.sdk.metrics._internal import _disable_meter_configurator

    assert internals.instrument_enabled(histogram_on(InMemoryMetricReader())) is True
    provider = MeterProvider(metric_readers=[InMemoryMetricReader()], _meter_configurator=_disable_meter_configurator)
    assert internals.instrument_enabled(provider.get_meter("t").create_histogram("h")) is False


def test_view_instrument_matches():
    from opentelemetry.sdk.metrics._internal._view_instrument_match import _ViewInstrumentMatch

    histogram = histogram_on(InMemoryMetricReader(), InMemoryMetricReader())
    matches = internals.view_instrument_matches(histogram)
    assert len(matches) == 2 and all(type(m) is _ViewInstrumentMatch for m in matches)
    assert internals.view_instrument_matches(histogram_on()) == []


def test_match_filters_attributes():
    (plain,) = internals.view_instrument_matches(histogram_on(InMemoryMetricReader()))
    assert internals.match_filters_attributes(plain) is False
    keeping = histogram_on(InMemoryMetricReader(), views=[View(instrument_name="h", attribute_keys={"a"})])
    (filtering,) = internals.view_instrument_matches(keeping)
    assert internals.match_filters_attributes(filtering) is True


def test_aggregation_key():
    histogram = histogram_on(InMemoryMetricReader())
    histogram.record(0.5, ATTRS)
    (match,) = internals.view_instrument_matches(histogram)
    assert list(match._attributes_aggregation) == [internals.aggregation_key(ATTRS)]


def test_match_aggregation():
    reader = InMemoryMetricReader(preferred_temporality={Histogram: AggregationTemporality.DELTA})
    histogram = histogram_on(reader)
    histogram.record(0.5, ATTRS)
    (match,) = internals.view_instrument_matches(histogram)
    key = internals.aggregation_key(ATTRS)
    recorded = internals.match_aggregation(match, key, ATTRS)
    assert recorded is match._attributes_aggregation[key]
    point_of(reader)  # a delta collection discards the aggregation
    made = internals.match_aggregation(match, key, ATTRS)
    assert made is not recorded and made is match._attributes_aggregation[key]
    internals.add_to_histogram(made, [0, 0, 1, 0], [5.0], 5.0, 5.0)
    assert point_of(reader) == (1, 5.0, (0, 0, 1, 0), 5.0, 5.0, ATTRS)


def test_match_collect_lock():
    delta = InMemoryMetricReader(preferred_temporality={Histogram: AggregationTemporality.DELTA})
    (match,) = internals.view_instrument_matches(histogram_on(delta))
    assert internals.match_collect_lock(match) is match._lock
    (match,) = internals.view_instrument_matches(histogram_on(InMemoryMetricReader()))
    assert internals.match_collect_lock(match) is None


def aggregation_of(histogram):
    histogram.record(0.5, ATTRS)
    (match,) = internals.view_instrument_matches(histogram)
    return internals.match_aggregation(match, internals.aggregation_key(ATTRS), ATTRS)


def test_is_explicit_bucket_histogram():
    assert internals.is_explicit_bucket_histogram(aggregation_of(histogram_on(InMemoryMetricReader()))) is True
    exponential = View(instrument_name="h", aggregation=ExponentialBucketHistogramAggregation())
    assert (
        internals.is_explicit_bucket_histogram(
            aggregation_of(histogram_on(InMemoryMetricReader(), views=[exponential]))
        )
        is False
    )


def test_histogram_boundaries():
    aggregation = aggregation_of(histogram_on(InMemoryMetricReader(), boundaries=(0.1, 1.0, 10.0)))
    assert tuple(internals.histogram_boundaries(aggregation)) == (0.1, 1.0, 10.0)


def test_add_to_histogram():
    reader = InMemoryMetricReader()
    aggregation = aggregation_of(histogram_on(reader))  # 0.5 recorded
    internals.add_to_histogram(aggregation, [1, 0, 1, 1], [0.05, 5.0, 20.0], 0.05, 20.0, threading.Lock())
    assert point_of(reader) == (4, 0.5 + 0.05 + 5.0 + 20.0, (1, 1, 1, 1), 0.05, 20.0, ATTRS)


# ---- the ASGI and FastAPI instrumentations -------------------------------------------------------


def test_fastapi_app_instrumented():
    from fastapi import FastAPI
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    app = FastAPI()
    assert internals.fastapi_app_instrumented(app) is False
    FastAPIInstrumentor.instrument_app(app)
    assert internals.fastapi_app_instrumented(app) is True
    FastAPIInstrumentor.uninstrument_app(app)
    assert internals.fastapi_app_instrumented(app) is False


HTTP_SCOPE = {
    "type": "http",
    "method": "GET",
    "scheme": "http",
    "http_version": "1.1",
    "path": "/v1/models",
    "query_string": b"",
    "headers": [(b"host", b"h:8000")],
    "server": ("10.0.0.1", 8000),
    "client": ("1.2.3.4", 5),
}


def test_asgi_private_functions():
    from opentelemetry.instrumentation import asgi
    from opentelemetry.instrumentation._semconv import _StabilityMode

    parse, decode = internals.asgi_private_functions()
    assert (parse, decode) == (asgi._parse_active_request_count_attrs, asgi._decode_header_item)
    mode = _StabilityMode.DEFAULT
    assert parse(asgi.collect_request_attributes(HTTP_SCOPE, mode), mode) == {
        "http.scheme": "http",
        "http.host": "10.0.0.1:8000",
        "http.flavor": "1.1",
        "http.method": "GET",
        "http.server_name": "h:8000",
    }
    assert decode(b"abc") == "abc"
    assert decode(b"a\xffb") == "a\xffb"  # (not UTF-8: read as Latin-1)


async def _app(scope, receive, send):
    await send({"type": "http.response.start", "status": 201, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def _receive():
    return {"type": "http.request", "body": b"", "more_body": False}


def test_asgi_sem_conv_mode():
    from opentelemetry.instrumentation._semconv import (
        _OpenTelemetrySemanticConventionStability,
        _OpenTelemetryStabilitySignalType,
    )
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    _OpenTelemetrySemanticConventionStability._initialize()
    expected = _OpenTelemetrySemanticConventionStability._get_opentelemetry_stability_opt_in_mode(
        _OpenTelemetryStabilitySignalType.HTTP
    )
    assert internals.asgi_sem_conv_mode(OpenTelemetryMiddleware(_app)) is expected


def test_asgi_otel_send():
    """The maintained `__call__` gets its send wrapper from `self._get_otel_send` (LeanMiddleware
    overrides it by that name), and asgi_otel_send is the maintained one."""
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    calls = []

    class Overriding(OpenTelemetryMiddleware):
        def _get_otel_send(self, server_span, server_span_name, scope, send, duration_attrs):
            calls.append(server_span_name)
            return internals.asgi_otel_send(self, server_span, server_span_name, scope, send, duration_attrs)

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sent = []

    async def send(message):
        sent.append(message["type"])

    middleware = Overriding(_app, tracer_provider=provider, meter_provider=MeterProvider(), exclude_spans=["receive"])
    asyncio.run(middleware(dict(HTTP_SCOPE), _receive, send))
    assert calls == ["GET /v1/models"]
    assert sent == ["http.response.start", "http.response.body"]
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["GET /v1/models"].attributes["http.status_code"] == 201
    send_events = [s.attributes["asgi.event.type"] for s in exporter.get_finished_spans() if s.name.endswith("send")]
    assert send_events == ["http.response.start", "http.response.body"]


def test_asgi_set_server_span():
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    span = TracerProvider().get_tracer("t").start_span("s", kind=trace.SpanKind.SERVER)
    duration_attrs = {}
    message = {"type": "http.response.start", "status": 404, "headers": []}
    internals.asgi_set_server_span(OpenTelemetryMiddleware(_app), span, message, 404, duration_attrs)
    assert dict(span.attributes) == {"http.status_code": 404}
    assert duration_attrs == {"http.status_code": 404}
    assert span.status.status_code == trace.StatusCode.UNSET  # (a server's 4xx is not its error)


def test_a_span_context_is_the_tuple_of_its_fields_in_order():
    """The request path unpacks a SpanContext (internals.SPAN_CONTEXT_FIELDS) instead of reading its
    properties: the layout it relies on."""
    from opentelemetry.trace import SpanContext, TraceFlags, TraceState

    from otel_llm.sdk import internals

    for ctx in (
        SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(3), trace_state=TraceState([("k", "v")])),
        SpanContext(0, 0, is_remote=False),
    ):
        assert tuple(ctx) == tuple(getattr(ctx, name) for name in internals.SPAN_CONTEXT_FIELDS)


def test_global_propagator_readers():
    """They answer as the public getters, before and after a propagator is set globally, without a
    Python frame of their own."""
    import types

    from opentelemetry import propagate
    from opentelemetry.instrumentation import propagators
    from opentelemetry.instrumentation.propagators import TraceResponsePropagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    response, textmap = internals.global_propagator_readers()
    assert not isinstance(response, types.FunctionType) and not isinstance(textmap, types.FunctionType)
    saved = (propagators.get_global_response_propagator(), propagate.get_global_textmap())
    try:
        assert (response(), textmap()) == saved
        replaced = (TraceResponsePropagator(), TraceContextTextMapPropagator())
        propagators.set_global_response_propagator(replaced[0])
        propagate.set_global_textmap(replaced[1])
        assert response() is replaced[0] and textmap() is replaced[1]
    finally:
        propagators.set_global_response_propagator(saved[0])
        propagate.set_global_textmap(saved[1])
    assert (response(), textmap()) == saved
