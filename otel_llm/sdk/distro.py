"""OpenTelemetry distro and configurator for `opentelemetry-instrument`.

The distro only sets defaults (the user's environment always wins): OTLP for traces and
metrics, and for a vLLM server `service.name=vllm` plus the served model and the instance
(`host:port`) as resource attributes, so a fleet reads well in Tempo. Children that vLLM
spawns inherit these through the environment.

The configurator also bounds the SDK's shutdown by `OTEL_LLM_SHUTDOWN_TIMEOUT` (default 10 s):
with the collector down, the SDK's own exit hooks took 38 s, past Kubernetes' grace period
(see otel_llm/sdk/shutdown.py).
"""

from __future__ import annotations

import logging
import os
import socket
import sys

from opentelemetry.instrumentation.distro import BaseDistro

from otel_llm import config, semconv
from otel_llm.config import (
    ENV_CONFIG_FILE,
    ENV_METRICS_EXPORTER,
    ENV_RESOURCE_ATTRIBUTES,
    ENV_SERVICE_NAME,
    ENV_TRACES_EXPORTER,
)
from otel_llm.sdk import internals, shutdown


class OtelLLMDistro(BaseDistro):
    def _configure(self, **kwargs):
        os.environ.setdefault(ENV_TRACES_EXPORTER, "otlp")
        os.environ.setdefault(ENV_METRICS_EXPORTER, "otlp")
        server = vllm_server_args(sys.argv)
        if server is not None:
            apply_vllm_resource_defaults(os.environ, *server)


_configured_from_environment = False


def configured_from_environment() -> bool:
    """True once our configurator set the SDK up from OTEL_* variables alone (no config file, no
    processors or exporter arguments passed in code): another process can make the same exporters."""
    return _configured_from_environment


class OtelLLMConfigurator(internals.sdk_configurator_class()):
    def _configure(self, **kwargs):
        global _configured_from_environment
        from_environment = not os.environ.get(ENV_CONFIG_FILE) and not any(
            kwargs.get(k) for k in ("span_processors", "log_record_processors", "exporter_args_map")
        )
        # process.pid tells the API servers of `--api-server-count N` apart; the SDK's process
        # detector is not used because it exports the command line, which may hold an API key.
        if not os.environ.get(ENV_CONFIG_FILE):  # a config file declares its own resource
            attributes = dict(kwargs.pop("resource_attributes", None) or {})
            attributes.setdefault("process.pid", os.getpid())
            kwargs["resource_attributes"] = attributes
        timeout_s = config.shutdown_timeout()
        if timeout_s is not None and not os.environ.get(ENV_CONFIG_FILE):
            # the SDK's default batch processors, with exporters that count what shutdown drops
            kwargs.setdefault("export_span_processor", shutdown.span_processor_factory)
            kwargs.setdefault("export_log_record_processor", shutdown.log_record_processor_factory)
        super()._configure(**kwargs)
        _configured_from_environment = from_environment
        if timeout_s is not None:
            try:
                shutdown.install_bounded_shutdown(timeout_s)
            except Exception:  # noqa: BLE001 - never break telemetry setup; the SDK's hooks remain
                logging.getLogger("otel_llm").warning(
                    "otel-llm: could not bound the telemetry shutdown (%s)", config.ENV_SHUTDOWN_TIMEOUT, exc_info=True
                )


def vllm_server_args(argv: list[str]) -> tuple[str | None, int] | None:
    """(served model, port) when argv is `vllm serve ...`, else None."""
    if not argv or os.path.basename(argv[0]) != "vllm" or "serve" not in argv[1:]:
        return None
    args = argv[argv.index("serve", 1) + 1 :]
    model = served = None
    port = 8000
    i = 0
    while i < len(args):
        arg = args[i]
        key, _, inline = arg.partition("=")
        value = inline or (args[i + 1] if i + 1 < len(args) else None)
        step = 1 if inline else 2
        if key in ("--model",):
            model = value
        elif key in ("--served-model-name",):
            served = value
        elif key == "--port" and value and value.isdigit():
            port = int(value)
        elif not arg.startswith("-") and model is None:
            model, step = arg, 1
        else:
            step = 1
        i += step
    return (served or model), port


def apply_vllm_resource_defaults(environ, model: str | None, port: int) -> None:
    has_name = ENV_SERVICE_NAME in environ or f"{semconv.SERVICE_NAME}=" in environ.get(ENV_RESOURCE_ATTRIBUTES, "")
    if not has_name:
        environ[ENV_SERVICE_NAME] = semconv.SERVICE_NAME_DEFAULT
    existing = environ.get(ENV_RESOURCE_ATTRIBUTES, "")
    extra = []
    if f"{semconv.SERVICE_INSTANCE_ID}=" not in existing:
        extra.append(f"{semconv.SERVICE_INSTANCE_ID}={socket.gethostname()}:{port}")
    if model and f"{semconv.RESOURCE_SERVED_MODEL}=" not in existing:
        extra.append(f"{semconv.RESOURCE_SERVED_MODEL}={_encode(model)}")
    if extra:
        environ[ENV_RESOURCE_ATTRIBUTES] = ",".join(filter(None, [existing, *extra]))


def _encode(value: str) -> str:
    from urllib.parse import quote

    return quote(value, safe="/:-_.~@")
