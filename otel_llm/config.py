"""Every setting otel-llm reads from the environment: each variable's name is a constant here, with
its meaning, and each default is stated once (the dataclass field). `Settings` is the vLLM server's,
`ClientSettings` the OpenAI client's; the few process-wide ones have a reader function each.

A value that does not parse logs one warning and the default applies: configuration never stops a
server from serving.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field, fields

from otel_llm import semconv
from otel_llm.warn import warn_once

_log = logging.getLogger("otel_llm")

# --- Environment variables -----------------------------------------------------------------
# Tenant attribution: comma-separated request headers (case-insensitive) and W3C baggage keys; a
# header wins over baggage, an API key (ENV_API_KEYS_FILE) over both.
ENV_TENANT_HEADERS = "OTEL_LLM_TENANT_HEADERS"
ENV_SCENE_HEADERS = "OTEL_LLM_SCENE_HEADERS"
ENV_COST_CENTER_HEADERS = "OTEL_LLM_COST_CENTER_HEADERS"
ENV_TENANT_BAGGAGE_KEYS = "OTEL_LLM_TENANT_BAGGAGE_KEYS"
ENV_SCENE_BAGGAGE_KEYS = "OTEL_LLM_SCENE_BAGGAGE_KEYS"
ENV_COST_CENTER_BAGGAGE_KEYS = "OTEL_LLM_COST_CENTER_BAGGAGE_KEYS"
# gen_ai.conversation.id: vLLM's session id (its `session_id` field, X-Session-ID header or
# vllm_xargs.session_id), else the first of these request headers (comma-separated, case-insensitive)
ENV_CONVERSATION_HEADERS = "OTEL_LLM_CONVERSATION_HEADERS"
# JSON {"keys": [{"sha256": hex, "tenant": .., "scene": .., "cost_center": ..}]}: the API key in
# `Authorization: Bearer` names the tenant; keys are stored hashed
ENV_API_KEYS_FILE = "OTEL_LLM_API_KEYS_FILE"
# values longer than this (characters), or holding control characters, are ignored
ENV_ATTRIBUTION_MAX_LENGTH = "OTEL_LLM_ATTRIBUTION_MAX_LENGTH"
# Metric label guard: values in the allow-list keep their name; otherwise the first N distinct
# values seen keep theirs and the rest become "other" (spans and usage records keep every value)
ENV_METRIC_LABEL_ALLOW_LIST = "OTEL_LLM_METRIC_LABEL_ALLOW_LIST"
ENV_METRIC_LABEL_LIMIT = "OTEL_LLM_METRIC_LABEL_LIMIT"
# queue / prefill / decode child spans of each GenAI server span
ENV_PHASE_SPANS = "OTEL_LLM_PHASE_SPANS"
# Usage ledger (otel_llm/usage.py): spool directory, OTLP log events, fsync batching (seconds),
# rotation by size (bytes) and age (seconds)
ENV_USAGE_DIR = "OTEL_LLM_USAGE_DIR"
ENV_USAGE_EVENTS = "OTEL_LLM_USAGE_EVENTS"
ENV_USAGE_FSYNC_INTERVAL = "OTEL_LLM_USAGE_FSYNC_INTERVAL"
ENV_USAGE_MAX_FILE_BYTES = "OTEL_LLM_USAGE_MAX_FILE_BYTES"
ENV_USAGE_MAX_FILE_AGE = "OTEL_LLM_USAGE_MAX_FILE_AGE"
# Live counting (otel_llm/vllm/live.py): every this many seconds, requests in flight longer than that add
# their tokens so far to the token counter and write a progress record to the spool; 0: off
ENV_LIVE_INTERVAL = "OTEL_LLM_LIVE_INTERVAL"
# Engine-side cost accounting in vLLM's engine core (otel_llm/vllm/engine_cost.py; needs ENV_USAGE_DIR):
# on or off, and how often (seconds) an engine writes its busy / idle totals (engine_window records)
ENV_ENGINE_COST = "OTEL_LLM_ENGINE_COST"
ENV_ENGINE_COST_WINDOW = "OTEL_LLM_ENGINE_COST_WINDOW"
# HTTP server spans: redact query-string values on them and in vLLM's access log
ENV_HTTP_REDACT_QUERY = "OTEL_LLM_HTTP_REDACT_QUERY"
# Prompts and completions on spans: opentelemetry-util-genai's variable (span_only,
# span_and_event, true; event_only, no_content, false), for the server and the client alike
ENV_CAPTURE_CONTENT = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
# caps on captured content, in characters: one text; all texts of one request together
ENV_CONTENT_MAX_TEXT_LENGTH = "OTEL_LLM_CONTENT_MAX_TEXT_LENGTH"
ENV_CONTENT_MAX_LENGTH = "OTEL_LLM_CONTENT_MAX_LENGTH"
# JSON list of {name, pattern, replacement} redaction rules, after the built-in ones
ENV_REDACTION_RULES = "OTEL_LLM_REDACTION_RULES"
# OpenAI client: add stream_options.include_usage to streamed calls; send W3C trace context with
# each request; gen_ai.provider.name to report
ENV_OPENAI_INCLUDE_USAGE = "OTEL_LLM_OPENAI_INCLUDE_USAGE"
ENV_OPENAI_PROPAGATE = "OTEL_LLM_OPENAI_PROPAGATE"
ENV_OPENAI_PROVIDER_NAME = "OTEL_LLM_OPENAI_PROVIDER_NAME"
# seconds the telemetry flush at exit may take (0 or negative: the SDK's own unbounded hooks)
ENV_SHUTDOWN_TIMEOUT = "OTEL_LLM_SHUTDOWN_TIMEOUT"
# true: under opentelemetry-instrument, vLLM request telemetry is built and exported by a child
# process of each API server (otel_llm/vllm/export/channel.py); false: by the SDK in the API server
ENV_EXPORT_PROCESS = "OTEL_LLM_EXPORT_PROCESS"
# 1: otel-llm's warnings go through the application's logging instead of a stderr handler of ours
ENV_LOG_PROPAGATE = "OTEL_LLM_LOG_PROPAGATE"
# Standard OpenTelemetry variables otel-llm reads too
ENV_SEMCONV_OPT_IN = "OTEL_SEMCONV_STABILITY_OPT_IN"  # gen_ai_latest_experimental: post-v1.41 names
ENV_DISABLED_INSTRUMENTATIONS = "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"
ENV_FASTAPI_EXCLUDED_URLS = "OTEL_PYTHON_FASTAPI_EXCLUDED_URLS"
ENV_EXCLUDED_URLS = "OTEL_PYTHON_EXCLUDED_URLS"
# ... and those the distro defaults (exporters: otlp) or reads (a declarative config file declares
# its own resource and processors)
ENV_TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"
ENV_METRICS_EXPORTER = "OTEL_METRICS_EXPORTER"
ENV_SERVICE_NAME = "OTEL_SERVICE_NAME"
ENV_RESOURCE_ATTRIBUTES = "OTEL_RESOURCE_ATTRIBUTES"
ENV_CONFIG_FILE = "OTEL_CONFIG_FILE"
# vLLM's own switch to its Rust frontend, which serves requests outside the Python server we trace
ENV_VLLM_RUST_FRONTEND = "VLLM_USE_RUST_FRONTEND"

GENAI_LATEST_EXPERIMENTAL = "gen_ai_latest_experimental"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


# --- Readers --------------------------------------------------------------------------------
def _bad(name: str, raw: str, default) -> None:
    warn_once(("config", name), "otel-llm: %s=%r is not valid; using %r", name, raw, default)


def env_str(name: str, default: str | None = None, environ=os.environ) -> str | None:
    raw = (environ.get(name) or "").strip()
    return raw or default


def env_list(name: str, default: tuple[str, ...] = (), environ=os.environ) -> tuple[str, ...]:
    raw = environ.get(name)
    if raw is None:
        return default
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def env_bool(name: str, default: bool, environ=os.environ) -> bool:
    raw = (environ.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE or raw in _FALSE:
        return raw in _TRUE
    _bad(name, raw, default)
    return default


def env_number(name: str, default, environ=os.environ, kind=float, minimum=None):
    raw = (environ.get(name) or "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        _bad(name, raw, default)
        return default
    if (isinstance(value, float) and math.isnan(value)) or (minimum is not None and value < minimum):
        _bad(name, raw, default)
        return default
    return value


def capture_mode(raw: str | None) -> bool:
    """True when ENV_CAPTURE_CONTENT asks for content on spans (util-genai's values, or true/false)."""
    value = (raw or "").strip().lower()
    if value in ("", "false", "0", "no", "no_content", "event_only"):
        if value == "event_only":
            warn_once(
                ("config", ENV_CAPTURE_CONTENT),
                "otel-llm: %s=event_only: GenAI events are not emitted; no content captured",
                ENV_CAPTURE_CONTENT,
            )
        return False
    if value in ("true", "1", "yes", "span_only", "span_and_event"):
        return True
    warn_once(
        ("config", ENV_CAPTURE_CONTENT),
        "otel-llm: %s=%r is not one of span_only, span_and_event, event_only, "
        "no_content, true, false; no content captured",
        ENV_CAPTURE_CONTENT,
        raw,
    )
    return False


def genai_latest_experimental(environ=os.environ) -> bool:
    """OTEL_SEMCONV_STABILITY_OPT_IN names gen_ai_latest_experimental (see semconv.py)."""
    return GENAI_LATEST_EXPERIMENTAL in {p.strip() for p in (environ.get(ENV_SEMCONV_OPT_IN) or "").split(",")}


def _from_env(cls, environ):
    """An instance of a settings dataclass: each field from the variable in its metadata, its
    default where the variable is unset or invalid."""
    values = {}
    for f in fields(cls):
        name = f.metadata.get("env")
        if name is None:
            continue
        default = f.default
        if f.type in ("bool",):
            values[f.name] = env_bool(name, default, environ)
        elif f.type in ("int", "float"):
            values[f.name] = env_number(
                name, default, environ, int if f.type == "int" else float, f.metadata.get("minimum")
            )
        elif f.type.startswith("tuple"):
            values[f.name] = env_list(name, default, environ)
        else:
            values[f.name] = env_str(name, default, environ)
    return values


def _env(name: str, default, minimum=None):
    return field(default=default, metadata={"env": name, "minimum": minimum})


@dataclass(frozen=True)
class Settings:
    """The vLLM server instrumentation's settings."""

    tenant_headers: tuple[str, ...] = _env(ENV_TENANT_HEADERS, ("x-tenant-id",))
    scene_headers: tuple[str, ...] = _env(ENV_SCENE_HEADERS, ("x-scene",))
    cost_center_headers: tuple[str, ...] = _env(ENV_COST_CENTER_HEADERS, ("x-cost-center",))
    tenant_baggage_keys: tuple[str, ...] = _env(ENV_TENANT_BAGGAGE_KEYS, (semconv.TENANT_ID,))
    scene_baggage_keys: tuple[str, ...] = _env(ENV_SCENE_BAGGAGE_KEYS, (semconv.TENANT_SCENE,))
    cost_center_baggage_keys: tuple[str, ...] = _env(ENV_COST_CENTER_BAGGAGE_KEYS, (semconv.TENANT_COST_CENTER,))
    conversation_headers: tuple[str, ...] = _env(ENV_CONVERSATION_HEADERS, ())
    api_keys_file: str | None = _env(ENV_API_KEYS_FILE, None)
    label_allow_list: tuple[str, ...] = _env(ENV_METRIC_LABEL_ALLOW_LIST, ())
    label_limit: int = _env(ENV_METRIC_LABEL_LIMIT, 50)
    attribution_max_length: int = _env(ENV_ATTRIBUTION_MAX_LENGTH, 128)
    phase_spans: bool = _env(ENV_PHASE_SPANS, True)
    http_redact_query: bool = _env(ENV_HTTP_REDACT_QUERY, True)
    usage_dir: str | None = _env(ENV_USAGE_DIR, None)
    usage_events: bool = _env(ENV_USAGE_EVENTS, False)
    export_process: bool = _env(ENV_EXPORT_PROCESS, True)
    usage_fsync_interval_s: float = _env(ENV_USAGE_FSYNC_INTERVAL, 1.0)
    usage_max_bytes: int = _env(ENV_USAGE_MAX_FILE_BYTES, 64 << 20)
    usage_max_age_s: float = _env(ENV_USAGE_MAX_FILE_AGE, 3600.0)
    live_interval_s: float = _env(ENV_LIVE_INTERVAL, 5.0, minimum=0.0)
    engine_cost: bool = _env(ENV_ENGINE_COST, True)
    engine_cost_window_s: float = _env(ENV_ENGINE_COST_WINDOW, 60.0, minimum=0.1)
    capture_content: bool = False  # ENV_CAPTURE_CONTENT (capture_mode)
    http_excluded_urls: str = "/metrics,/health,/ping,/load,/version,/server_info"  # ENV_(FASTAPI_)EXCLUDED_URLS
    genai_latest_experimental: bool = False  # ENV_SEMCONV_OPT_IN

    @classmethod
    def from_env(cls, environ=os.environ) -> Settings:
        return cls(
            **_from_env(cls, environ),
            capture_content=capture_mode(environ.get(ENV_CAPTURE_CONTENT)),
            http_excluded_urls=environ.get(
                ENV_FASTAPI_EXCLUDED_URLS, environ.get(ENV_EXCLUDED_URLS, cls.http_excluded_urls)
            ),
            genai_latest_experimental=genai_latest_experimental(environ),
        )


@dataclass(frozen=True)
class ClientSettings:
    """The OpenAI client instrumentation's settings; `instrument(**kwargs)` overrides each."""

    capture_content: bool = False  # ENV_CAPTURE_CONTENT (capture_mode)
    # add stream_options.include_usage to streamed chat/completions calls (the usage chunk the
    # server then sends is consumed by us, so the caller's loop sees the stream it asked for)
    include_usage: bool = _env(ENV_OPENAI_INCLUDE_USAGE, False)
    propagate: bool = _env(ENV_OPENAI_PROPAGATE, True)
    provider_name: str = _env(ENV_OPENAI_PROVIDER_NAME, semconv.PROVIDER_OPENAI)
    # post-v1.41 client metric and attribute names (semconv.py); read once, at instrument time
    genai_latest_experimental: bool = False  # ENV_SEMCONV_OPT_IN

    @classmethod
    def from_env(cls, environ=os.environ, **overrides) -> ClientSettings:
        values = {
            **_from_env(cls, environ),
            "capture_content": capture_mode(environ.get(ENV_CAPTURE_CONTENT)),
            "genai_latest_experimental": genai_latest_experimental(environ),
        }
        for name in ("capture_content", "include_usage", "propagate"):
            if overrides.get(name) is not None:
                values[name] = bool(overrides[name])
        if overrides.get("provider_name"):
            values["provider_name"] = str(overrides["provider_name"])
        return cls(**values)


@dataclass(frozen=True)
class ContentLimits:
    """Caps on captured content, in characters (otel_llm/content.py)."""

    # one text (a message's content, tool arguments); all texts of one request, input and output
    max_text: int = _env(ENV_CONTENT_MAX_TEXT_LENGTH, 16_384, minimum=0)
    max_total: int = _env(ENV_CONTENT_MAX_LENGTH, 65_536, minimum=0)

    @classmethod
    def from_env(cls, environ=os.environ) -> ContentLimits:
        return cls(**_from_env(cls, environ))


DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0


def shutdown_timeout(environ=os.environ) -> float | None:
    """Bound in seconds of the telemetry flush at exit; None when disabled (0 or negative)."""
    value = env_number(ENV_SHUTDOWN_TIMEOUT, DEFAULT_SHUTDOWN_TIMEOUT_S, environ)
    if value <= 0 or math.isinf(value):
        return None
    return value


def redaction_rules_file(environ=os.environ) -> str | None:
    return env_str(ENV_REDACTION_RULES, None, environ)


def log_propagate(environ=os.environ) -> bool:
    return (environ.get(ENV_LOG_PROPAGATE) or "").strip() == "1"


def disabled_instrumentations(environ=os.environ) -> set[str]:
    return {name.strip() for name in (environ.get(ENV_DISABLED_INSTRUMENTATIONS) or "").split(",") if name.strip()}
