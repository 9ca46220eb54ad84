"""Recording many values into one OpenTelemetry SDK histogram series at once.

`gen_ai.client.operation.time_per_output_chunk` takes one value per chunk of a stream. Through the
API each value is a `Histogram.record()` call, which costs the SDK 5 to 15 us (a Measurement,
attribute copying and hashing, the exemplar filter, locks): more than the openai client spends on
a chunk. `record_all` records the first value through the API (so the SDK makes the series,
applies views, enablement and exemplars as usual) and adds the others to the same explicit-bucket
aggregations in one step: bucket counts, sum, min and max exactly as recording each would make
them, at about 0.1 us per value.

That step reads SDK internals (otel_llm/sdk/internals.py). It is used only after a self-check on a private MeterProvider
finds it produces exactly the points per-value recording does; otherwise, and for any aggregation
it does not recognise (a view choosing another aggregation or filtering attributes), every value
is recorded through the API.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Sequence

from otel_llm.sdk import internals

_usable: bool | None = None
_check_lock = threading.Lock()


def record_all(histogram, values: Sequence[float], attributes: dict) -> None:
    if len(values) > 1 and _fast_path_usable():
        _merge(histogram, values, attributes)
    else:
        for value in values:
            histogram.record(value, attributes)


def _merge(histogram, values: Sequence[float], attributes: dict) -> bool:
    """Record every value: the first through the API, the rest merged into the aggregations it went
    to (True), or through the API too where they cannot be (False)."""
    histogram.record(values[0], attributes)
    rest = values[1:]
    try:
        aggregations = _aggregations(histogram, attributes)
    except Exception:  # noqa: BLE001 - SDK internals changed
        aggregations = None
    if aggregations is None:
        for value in rest:
            histogram.record(value, attributes)
        return False
    for aggregation, lock in aggregations:
        boundaries = internals.histogram_boundaries(aggregation)
        counts = [0] * (len(boundaries) + 1)
        for value in rest:
            counts[bisect_left(boundaries, value)] += 1
        internals.add_to_histogram(aggregation, counts, rest, min(rest), max(rest), lock)
    return True


def _aggregations(histogram, attributes: dict):
    """The (aggregation, lock to hold) pairs a value just recorded with `attributes` went to; None
    when one of them is not an explicit-bucket histogram this module can merge into."""
    if not internals.instrument_enabled(histogram):
        return None
    matches = internals.view_instrument_matches(histogram)
    if any(internals.match_filters_attributes(m) for m in matches):
        return None
    key = internals.aggregation_key(attributes)
    found = []
    for match in matches:
        # (made by the value just recorded, unless a collection with reset_on_collect came between)
        aggregation = internals.match_aggregation(match, key, attributes)
        lock = internals.match_collect_lock(match)  # collect() discards these aggregations
        if not internals.is_explicit_bucket_histogram(aggregation):
            return None
        found.append((aggregation, lock))
    return found  # empty: no reader takes this instrument, the values go nowhere as recorded ones would


def _fast_path_usable() -> bool:
    global _usable
    if _usable is None:
        with _check_lock:
            if _usable is None:
                _usable = _self_check()
    return _usable


def _self_check() -> bool:
    """The merge gives the points per-value recording gives, on this SDK."""
    try:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        values = [0.002, 0.03, 0.03, 0.7, 4.0, 0.0001, 100.0]
        attributes = {"a": "b", "n": 1}
        points = []
        for merged in (False, True):
            reader = InMemoryMetricReader()
            histogram = (
                MeterProvider(metric_readers=[reader])
                .get_meter("check")
                .create_histogram("check", unit="s", explicit_bucket_boundaries_advisory=[0.001, 0.01, 0.1, 1.0, 10.0])
            )
            for _ in range(2):  # a series made by the first call, then one that exists
                if merged:
                    if not _merge(histogram, values, attributes):
                        return False  # (every value recorded through the API: the check proves nothing)
                else:
                    for value in values:
                        histogram.record(value, attributes)
            (metric,) = [
                m for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics for m in sm.metrics
            ]
            (point,) = metric.data.data_points
            points.append(
                (point.count, point.sum, tuple(point.bucket_counts), point.min, point.max, dict(point.attributes))
            )
        return points[0] == points[1]
    except Exception:  # noqa: BLE001
        return False
