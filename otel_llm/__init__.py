"""OpenTelemetry instrumentation for LLM serving on vLLM."""

__version__ = "0.1.0"


def ensure_log_handler() -> None:
    """Our warnings must be seen: give the `otel_llm` logger a stderr handler of its own.

    Auto-instrumentation may leave the root logger with only an OTLP log handler, which
    would swallow them. Set OTEL_LLM_LOG_PROPAGATE=1 to route them through your own logging.
    """
    import logging

    from otel_llm.config import log_propagate

    logger = logging.getLogger("otel_llm")
    if log_propagate() or logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [pid %(process)d] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
