"""What all requests of one API-server process share: settings, the sink their telemetry goes to
(otel_llm/vllm/sink.py: the SDK here, or the export process), the usage ledger, content capture, metric
label guards, tenant attribution and the registry of engine requests in flight.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from opentelemetry.metrics import Observation

from otel_llm import content, semconv, warn
from otel_llm.config import Settings
from otel_llm.usage import UsageLedger
from otel_llm.vllm.attribution import Attribution, LabelGuard
from otel_llm.vllm.live import LiveCounter


@warn.entry("observe_failures", fallback=())
def observe_failures(options=None):
    """The metric reader's callback (on its thread, or in a /metrics scrape)."""
    return [Observation(count, {semconv.FAILURE_POINT: what}) for what, count in warn.failures().items()]


@dataclass
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    # prefix-cache hits that came from another node's KV transfer (P/D), where vLLM says so
    external_cached_input_tokens: int | None = None


class Telemetry:
    """The sink, instruments and settings shared by all requests of one process."""

    def __init__(self, sink, meter, settings: Settings, resource_attributes=None):
        self.sink = sink
        self.settings = settings
        resource_attributes = resource_attributes or {}
        self.ledger = UsageLedger(
            meter,
            directory=settings.usage_dir,
            events=settings.usage_events,
            instance=str(resource_attributes.get(semconv.SERVICE_INSTANCE_ID) or socket.gethostname()),
            service=str(resource_attributes.get(semconv.SERVICE_NAME) or semconv.SERVICE_NAME_DEFAULT),
            fsync_interval_s=settings.usage_fsync_interval_s,
            max_bytes=settings.usage_max_bytes,
            max_age_s=settings.usage_max_age_s,
            event_logger=sink.usage_events,
        )
        # opt-in prompt / completion capture, redacted and capped (otel_llm/content.py)
        self.capture = content.Capture(meter) if settings.capture_content else None
        self.attribution = Attribution(settings)
        # with an API-key map, only the tenants, scenes and cost centers it names get metric labels
        vouched = self.attribution.vouched()
        self.label_tenant = LabelGuard(settings.label_allow_list, settings.label_limit, vouched[0])
        self.label_scene = LabelGuard(settings.label_allow_list, settings.label_limit, vouched[1])
        self.label_cost_center = LabelGuard(settings.label_allow_list, settings.label_limit, vouched[2])
        self.label_failed_model = LabelGuard(limit=20)
        # failures of our own code this process caught (otel_llm/warn.py), by where they happened
        semconv.create_instrument(meter, semconv.INSTRUMENTATION_FAILURES, [observe_failures])
        # set when the hook that reads the engine's figures off a request's final output is in place
        self.reads_final_outputs = False
        # internal engine request id -> its RequestTelemetry, while the engine holds the request: the
        # registry the engine hooks find a request's record by (its own dict methods on the request path:
        # no method of ours per lookup)
        self.engine_records: dict[str, Any] = {}
        # long requests' tokens so far, every OTEL_LLM_LIVE_INTERVAL (otel_llm/vllm/live.py)
        self.live = LiveCounter(settings.live_interval_s, sink.count_progress)

    def engine_requests_in_flight(self) -> int:
        return len(self.engine_records)
