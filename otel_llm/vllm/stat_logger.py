"""A `vllm.stat_logger_plugins` entry: its presence keeps vLLM's per-request stats on.

AsyncLLM collects per-request timestamps (queued, scheduled, first and last token) only when
stats are on; with `--disable-log-stats` they are off, and the phase spans would be lost. A
custom stat logger turns collection back on without vLLM's default loggers, so the flag still
silences vLLM's own stats logging and Prometheus metrics.
"""

from vllm.v1.metrics.loggers import StatLoggerBase


class KeepRequestStats(StatLoggerBase):
    def __init__(self, vllm_config, engine_index: int = 0):
        pass

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        pass

    def log_engine_initialized(self):
        pass
