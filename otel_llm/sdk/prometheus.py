"""`OTEL_METRICS_EXPORTER=prometheus_vllm`: our metrics on vLLM's own /metrics.

The stock `prometheus` exporter starts an HTTP server (port 9464) in every process that
configures the SDK, and vLLM spawns several: the second bind fails. This reader registers
with prometheus_client's default registry, which vLLM's /metrics already serves, and starts
no server. (With --api-server-count > 1 vLLM serves /metrics from a multiprocess registry
that does not include it: use OTLP there.)
"""

from opentelemetry.exporter.prometheus import PrometheusMetricReader


class VLLMSharedPrometheusReader(PrometheusMetricReader):
    def __init__(self) -> None:
        super().__init__(disable_target_info=True)
