"""The server's per-request metrics: one `Measurement` per request, recorded into instruments
created from otel_llm/semconv.py.

The same recorder runs in the API server (when telemetry is exported in process) or in the
export process (otel_llm/vllm/export/process.py), which receives the Measurement as a plain
tuple; so this module imports nothing of vLLM and nothing that needs the API server.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from opentelemetry.metrics import Observation

from otel_llm import semconv, warn


class MetricKey(NamedTuple):
    """A request's metric series: its label values (already guarded)."""

    operation: str
    request_model: str | None
    response_model: str | None
    tenant: str | None
    scene: str | None
    cost_center: str | None


class Measurement(NamedTuple):
    """What one request adds to the metrics."""

    key: MetricKey
    error_type: str | None
    ttft: float | None
    tpot: float | None
    duration: float
    # (input, cached input, output) tokens, or None (a P/D prefill leg: counted on its decode node)
    tokens: tuple[int, int, int] | None
    # engine busy seconds charged to it, when the engine's figures came with its final output
    compute: float | None = None
    # first scheduling -> first token (vLLM's per-request metrics.time_to_first_token_ms, in seconds)
    scheduled_ttft: float | None = None
    # speculative decoding: (draft tokens proposed, accepted), when vLLM recorded them
    spec_decode: tuple[int, int] | None = None


class RequestMetrics:
    """The instruments of the server's request metrics, and token totals read at collection time."""

    def __init__(self, meter):
        self.requests = semconv.create_instrument(meter, semconv.SERVER_REQUESTS)
        self.request_duration = semconv.create_instrument(meter, semconv.SERVER_REQUEST_DURATION)
        self.time_to_first_token = semconv.create_instrument(meter, semconv.SERVER_TIME_TO_FIRST_TOKEN)
        self.time_per_output_token = semconv.create_instrument(meter, semconv.SERVER_TIME_PER_OUTPUT_TOKEN)
        # Token totals are summed here and read by the SDK at collection time: three synchronous
        # counter adds per request cost more than all our spans' attributes together. Requests in
        # flight add theirs as they grow (add_tokens from a live sweep, otel_llm/vllm/live.py), and
        # their Measurement the rest: every add is >= 0, so the counter never dips.
        self._token_totals: dict[tuple, int] = {}
        self.token_usage = semconv.create_instrument(meter, semconv.SERVER_TOKEN_USAGE, [self._observe_tokens])
        self._compute_totals: dict[tuple, float] = {}
        self.compute_time = semconv.create_instrument(meter, semconv.SERVER_COMPUTE_TIME, [self._observe_compute])
        self.scheduled_time_to_first_token = semconv.create_instrument(
            meter, semconv.SERVER_SCHEDULED_TIME_TO_FIRST_TOKEN
        )
        self._spec_totals: dict[tuple, list[int]] = {}  # key -> [drafts, accepted]
        self.spec_draft_tokens = semconv.create_instrument(
            meter, semconv.SERVER_SPEC_DRAFT_TOKENS, [self._observe_spec_drafts]
        )
        self.spec_accepted_tokens = semconv.create_instrument(
            meter, semconv.SERVER_SPEC_ACCEPTED_TOKENS, [self._observe_spec_accepted]
        )
        self._metric_attributes: dict[tuple, dict[str, Any]] = {}

    def record(self, m: Measurement, context=None) -> None:
        """`context` holds the request's span: exemplars link the points to its trace."""
        attrs = self.metric_attributes(m.key)
        self.requests.add(1, {**attrs, semconv.REQUEST_OUTCOME: outcome(m.error_type)}, context=context)
        if m.error_type is None:
            if m.ttft is not None:
                self.time_to_first_token.record(m.ttft, attrs, context=context)
            if m.tpot is not None:
                self.time_per_output_token.record(m.tpot, attrs, context=context)
            if m.scheduled_ttft is not None:
                self.scheduled_time_to_first_token.record(m.scheduled_ttft, attrs, context=context)
        else:
            attrs = {**attrs, semconv.ERROR_TYPE: m.error_type}
        if m.tokens is not None:
            self.add_tokens(m.key, m.tokens)
        if m.compute is not None:
            self._compute_totals[m.key] = self._compute_totals.get(m.key, 0.0) + m.compute
        if m.spec_decode is not None:
            totals = self._spec_totals.setdefault(m.key, [0, 0])
            totals[0] += m.spec_decode[0]
            totals[1] += m.spec_decode[1]
        self.request_duration.record(m.duration, attrs, context=context)

    def metric_attributes(self, key: MetricKey) -> dict[str, Any]:
        """Attributes of an (operation, request model, response model, tenant, scene, cost center)
        series, cached."""
        attrs = self._metric_attributes.get(key)
        if attrs is None:
            operation, model, response_model, tenant, scene, cost_center = key
            attrs = {semconv.GEN_AI_OPERATION_NAME: operation, semconv.GEN_AI_PROVIDER_NAME: semconv.PROVIDER_VLLM}
            for name, value in (
                (semconv.GEN_AI_REQUEST_MODEL, model),
                (semconv.GEN_AI_RESPONSE_MODEL, response_model),
                (semconv.TENANT_ID, tenant),
                (semconv.TENANT_SCENE, scene),
                (semconv.TENANT_COST_CENTER, cost_center),
            ):
                if value is not None:
                    attrs[name] = value
            if len(self._metric_attributes) > 10_000:  # models x guarded tenants never get here
                self._metric_attributes.clear()
            self._metric_attributes[key] = attrs
        return attrs

    def add_tokens(self, key: MetricKey, tokens: tuple[int, int, int]) -> None:
        totals = self._token_totals
        for token_type, value in zip(semconv.TOKEN_TYPES, tokens):
            series = (key, token_type)
            totals[series] = totals.get(series, 0) + value

    @warn.entry("observing the token totals", fallback=())
    def _observe_tokens(self, options):
        return [
            Observation(value, {**self.metric_attributes(key), semconv.GEN_AI_TOKEN_TYPE: token_type})
            for (key, token_type), value in list(self._token_totals.items())
        ]

    @warn.entry("observing the draft token totals", fallback=())
    def _observe_spec_drafts(self, options):
        return [
            Observation(drafts, self.metric_attributes(key)) for key, (drafts, _) in list(self._spec_totals.items())
        ]

    @warn.entry("observing the accepted draft token totals", fallback=())
    def _observe_spec_accepted(self, options):
        return [
            Observation(accepted, self.metric_attributes(key)) for key, (_, accepted) in list(self._spec_totals.items())
        ]

    @warn.entry("observing the compute totals", fallback=())
    def _observe_compute(self, options):
        return [Observation(value, self.metric_attributes(key)) for key, value in list(self._compute_totals.items())]


class _Outcomes(dict):
    def __missing__(self, error_type) -> str:  # (any other error type; nothing kept)
        return semconv.OUTCOME_ERROR


# outcome(error type or None) -> the request's outcome: a dict lookup in C, no frame per request
outcome = _Outcomes({None: semconv.OUTCOME_FINISHED, semconv.ERROR_CLIENT_ABORTED: semconv.OUTCOME_ABORTED}).__getitem__
