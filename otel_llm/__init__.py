"""OpenTelemetry instrumentation for LLM serving on vLLM."""

__version__ = "0.1.0"
