"""What all requests of one API-server process share: tracer, settings, the usage ledger, content
capture, instruments (created from otel_llm/semconv.py), metric label guards, token totals, tenant
attribution and the registry of engine requests in flight.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.metrics import Observation

from otel_llm import content, semconv
from otel_llm.config import Settings
from otel_llm.usage import UsageLedger
from otel_llm.vllm.attribution import Attribution, LabelGuard


@dataclass
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    # prefix-cache hits that came from another node's KV transfer (P/D), where vLLM says so
    external_cached_input_tokens: int | None = None


class Telemetry:
    """Tracer, instruments and settings shared by all requests of one process."""

    def __init__(self, tracer: trace.Tracer, meter, settings: Settings, resource_attributes=None):
        self.tracer = tracer
        self.settings = settings
        resource_attributes = resource_attributes or {}
        self.ledger = UsageLedger(
            meter, directory=settings.usage_dir, events=settings.usage_events,
            instance=str(resource_attributes.get(semconv.SERVICE_INSTANCE_ID) or socket.gethostname()),
            service=str(resource_attributes.get(semconv.SERVICE_NAME) or semconv.SERVICE_NAME_DEFAULT),
            fsync_interval_s=settings.usage_fsync_interval_s, max_bytes=settings.usage_max_bytes,
            max_age_s=settings.usage_max_age_s)
        # opt-in prompt / completion capture, redacted and capped (otel_llm/content.py)
        self.capture = content.Capture(meter) if settings.capture_content else None
        self.attribution = Attribution(settings)
        # v1.41's name, or its post-v1.41 rename under OTEL_SEMCONV_STABILITY_OPT_IN (semconv.py)
        self.cache_write_attribute = semconv.GEN_AI_USAGE_CACHE_WRITE_INPUT_TOKENS \
            if settings.genai_latest_experimental else semconv.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS
        # with an API-key map, only the tenants, scenes and cost centers it names get metric labels
        vouched = self.attribution.vouched()
        self.label_tenant = LabelGuard(settings.label_allow_list, settings.label_limit, vouched[0])
        self.label_scene = LabelGuard(settings.label_allow_list, settings.label_limit, vouched[1])
        self.label_cost_center = LabelGuard(settings.label_allow_list, settings.label_limit, vouched[2])
        self.requests = semconv.create_instrument(meter, semconv.SERVER_REQUESTS)
        self.label_failed_model = LabelGuard(limit=20)
        self.request_duration = semconv.create_instrument(meter, semconv.SERVER_REQUEST_DURATION)
        self.time_to_first_token = semconv.create_instrument(meter, semconv.SERVER_TIME_TO_FIRST_TOKEN)
        self.time_per_output_token = semconv.create_instrument(meter, semconv.SERVER_TIME_PER_OUTPUT_TOKEN)
        # Token totals are summed here and read by the SDK at collection time: three synchronous
        # counter adds per request cost more than all our spans' attributes together.
        self._token_totals: dict[tuple, int] = {}
        self.token_usage = semconv.create_instrument(meter, semconv.SERVER_TOKEN_USAGE, [self._observe_tokens])
        self._metric_attributes: dict[tuple, dict[str, Any]] = {}
        # internal engine request id -> its RequestTelemetry, while the engine holds the request
        self._by_engine_id: dict[str, Any] = {}

    def metric_attributes(self, key: tuple) -> dict[str, Any]:
        """Attributes of an (operation, request model, response model, tenant, scene, cost center)
        series, cached."""
        attrs = self._metric_attributes.get(key)
        if attrs is None:
            operation, model, response_model, tenant, scene, cost_center = key
            attrs = {semconv.GEN_AI_OPERATION_NAME: operation, semconv.GEN_AI_PROVIDER_NAME: semconv.PROVIDER_VLLM}
            for name, value in ((semconv.GEN_AI_REQUEST_MODEL, model), (semconv.GEN_AI_RESPONSE_MODEL, response_model),
                                (semconv.TENANT_ID, tenant), (semconv.TENANT_SCENE, scene),
                                (semconv.TENANT_COST_CENTER, cost_center)):
                if value is not None:
                    attrs[name] = value
            if len(self._metric_attributes) > 10_000:  # models x guarded tenants never get here
                self._metric_attributes.clear()
            self._metric_attributes[key] = attrs
        return attrs

    def add_tokens(self, key: tuple, usage: "Usage") -> None:
        totals = self._token_totals
        for token_type, value in (
            (semconv.TOKEN_TYPE_INPUT, usage.input_tokens),
            (semconv.TOKEN_TYPE_CACHED_INPUT, usage.cached_input_tokens),
            (semconv.TOKEN_TYPE_OUTPUT, usage.output_tokens),
        ):
            series = (key, token_type)
            totals[series] = totals.get(series, 0) + value

    def _observe_tokens(self, options):
        for (key, token_type), value in list(self._token_totals.items()):
            yield Observation(value, {**self.metric_attributes(key), semconv.GEN_AI_TOKEN_TYPE: token_type})

    # --- engine requests in flight (the registry engine hooks find a request's record by) ------
    def track_engine_request(self, engine_id: str, record) -> None:
        self._by_engine_id[engine_id] = record

    def untrack_engine_request(self, engine_id: str):
        """Forget an engine request; its record, if it was tracked."""
        return self._by_engine_id.pop(engine_id, None)

    def engine_request_tracked(self, engine_id: str) -> bool:
        return engine_id in self._by_engine_id

    def engine_request_record(self, engine_id: str):
        return self._by_engine_id.get(engine_id)

    def engine_requests_in_flight(self) -> int:
        return len(self._by_engine_id)
