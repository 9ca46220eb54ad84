"""histogram_batch.record_all: the same exported points as one Histogram.record() per value, on
the installed SDK, with cumulative and delta readers, collections between batches, and views that
make it fall back to per-value recording."""

import random

import pytest
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View

from otel_llm import semconv
from otel_llm.sdk import histogram_batch

ATTRS = {semconv.GEN_AI_OPERATION_NAME: "chat", semconv.SERVER_PORT: 8000}


def points(reader):
    return [
        (p.count, p.sum, tuple(getattr(p, "bucket_counts", ())), p.min, p.max, dict(p.attributes))
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        for p in m.data.data_points
    ]


def run(merged: bool, temporality, views=(), seed=7):
    rng = random.Random(seed)
    reader = InMemoryMetricReader(preferred_temporality={Histogram: temporality})
    histogram = semconv.create_instrument(
        MeterProvider(metric_readers=[reader], views=list(views)).get_meter("t"), semconv.CLIENT_TIME_PER_OUTPUT_CHUNK
    )
    collected = []
    for batch in range(6):
        values = [rng.expovariate(20) for _ in range(rng.choice((1, 2, 50, 300)))]
        attrs = ATTRS if batch % 2 else {**ATTRS, semconv.SERVER_ADDRESS: "h"}
        if merged:
            histogram_batch.record_all(histogram, values, attrs)
        else:
            for value in values:
                histogram.record(value, attrs)
        if batch in (2, 4):
            collected.append(points(reader))
    collected.append(points(reader))
    return collected


def test_the_fast_path_is_on_with_the_installed_sdk():
    """If this fails, the SDK's internals moved: every value is recorded through the API (correct,
    about 30x slower per chunk); adapt histogram_batch to the new SDK."""
    assert histogram_batch._fast_path_usable() is True


@pytest.mark.parametrize("temporality", [AggregationTemporality.CUMULATIVE, AggregationTemporality.DELTA])
def test_merged_points_equal_per_value_points(temporality):
    expected = run(False, temporality)
    assert sum(p[0] for p in expected[-1]) > 0
    assert run(True, temporality) == expected


@pytest.mark.parametrize(
    "view",
    [
        View(instrument_name=semconv.CLIENT_TIME_PER_OUTPUT_CHUNK, attribute_keys={semconv.GEN_AI_OPERATION_NAME}),
        View(instrument_name=semconv.CLIENT_TIME_PER_OUTPUT_CHUNK, aggregation=ExponentialBucketHistogramAggregation()),
    ],
    ids=["attribute filter", "exponential histogram"],
)
def test_views_it_cannot_merge_into_get_every_value_recorded(view):
    assert run(True, AggregationTemporality.CUMULATIVE, [view]) == run(False, AggregationTemporality.CUMULATIVE, [view])


def test_no_reader_takes_the_values_and_nothing_fails():
    histogram = semconv.create_instrument(MeterProvider().get_meter("t"), semconv.CLIENT_TIME_PER_OUTPUT_CHUNK)
    histogram_batch.record_all(histogram, [0.1, 0.2, 0.3], ATTRS)
    assert histogram_batch._merge(histogram, [0.1, 0.2], ATTRS) is True
