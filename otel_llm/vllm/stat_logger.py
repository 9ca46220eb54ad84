"""A `vllm.stat_logger_plugins` entry: its presence keeps vLLM's per-request stats on.

AsyncLLM collects per-request timestamps (queued, scheduled, first and last token) only when
stats are on; with `--disable-log-stats` they are off, and the phase spans would be lost. A
custom stat logger turns collection back on without vLLM's default loggers, so the flag still
silences vLLM's own stats logging and Prometheus metrics.

vLLM calls these methods (`record` on every engine step of the API server): each is guarded
(otel_llm/warn.py), though none does anything; `record` guards itself, without a wrapper's frame on
every step, and takes any arguments, so that a new one from vLLM cannot fail its call.
"""

from vllm.v1.metrics.loggers import StatLoggerBase

from otel_llm.warn import entry, failed, inline_entry


class KeepRequestStats(StatLoggerBase):
    @entry("KeepRequestStats.__init__")
    def __init__(self, vllm_config, engine_index: int = 0):
        pass

    @inline_entry("KeepRequestStats.record")
    def record(self, *args, **kwargs):  # (scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)
        try:
            return None
        except Exception:  # noqa: BLE001
            failed("KeepRequestStats.record")

    @entry("KeepRequestStats.log_engine_initialized")
    def log_engine_initialized(self):
        pass
