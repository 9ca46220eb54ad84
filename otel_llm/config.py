"""Settings read from the environment (OTEL_LLM_* and the standard OTEL_* variables)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from otel_llm import semconv
from otel_llm.content import CAPTURE_CONTENT_ENV, capture_mode


def _env_list(name: str, default: str = "") -> tuple[str, ...]:
    raw = os.environ.get(name, default)
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return raw.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Settings:
    # Request headers (case-insensitive) and W3C baggage keys that name the tenant and scene.
    # A header wins over baggage.
    tenant_headers: tuple[str, ...] = ("x-tenant-id",)
    scene_headers: tuple[str, ...] = ("x-scene",)
    tenant_baggage_keys: tuple[str, ...] = (semconv.TENANT_ID,)
    scene_baggage_keys: tuple[str, ...] = (semconv.TENANT_SCENE,)
    cost_center_headers: tuple[str, ...] = ("x-cost-center",)
    cost_center_baggage_keys: tuple[str, ...] = (semconv.TENANT_COST_CENTER,)
    # JSON {"keys": [{"sha256": hex, "tenant": .., "scene": .., "cost_center": ..}]}: the API key in
    # `Authorization: Bearer` names the tenant (before headers and baggage); keys are stored hashed
    api_keys_file: str | None = None
    # Metric label guard: values in the allow-list keep their name; otherwise the first
    # `label_limit` distinct values seen keep theirs and the rest become "other".
    label_allow_list: tuple[str, ...] = ()
    label_limit: int = 50
    # Tenant / scene / cost-center values from headers or baggage longer than this, or holding
    # control characters, are ignored (see attribution_value)
    attribution_max_length: int = 128
    phase_spans: bool = True
    http_excluded_urls: str = "/metrics,/health,/ping,/load,/version,/server_info"
    # Usage ledger (otel_llm/usage.py): spool directory, OTLP log events, fsync batching, rotation
    usage_dir: str | None = None
    usage_events: bool = False
    usage_fsync_interval_s: float = 1.0
    usage_max_bytes: int = 64 << 20
    usage_max_age_s: float = 3600.0
    # prompts and completions on spans (OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT, as for
    # the OpenAI client); redacted and capped by otel_llm/content.py
    capture_content: bool = False

    @classmethod
    def from_env(cls) -> "Settings":
        return cls(
            tenant_headers=_env_list("OTEL_LLM_TENANT_HEADERS", "x-tenant-id"),
            scene_headers=_env_list("OTEL_LLM_SCENE_HEADERS", "x-scene"),
            tenant_baggage_keys=_env_list("OTEL_LLM_TENANT_BAGGAGE_KEYS", semconv.TENANT_ID),
            scene_baggage_keys=_env_list("OTEL_LLM_SCENE_BAGGAGE_KEYS", semconv.TENANT_SCENE),
            cost_center_headers=_env_list("OTEL_LLM_COST_CENTER_HEADERS", "x-cost-center"),
            cost_center_baggage_keys=_env_list("OTEL_LLM_COST_CENTER_BAGGAGE_KEYS", semconv.TENANT_COST_CENTER),
            api_keys_file=os.environ.get("OTEL_LLM_API_KEYS_FILE") or None,
            label_allow_list=_env_list("OTEL_LLM_METRIC_LABEL_ALLOW_LIST"),
            label_limit=_env_int("OTEL_LLM_METRIC_LABEL_LIMIT", 50),
            attribution_max_length=_env_int("OTEL_LLM_ATTRIBUTION_MAX_LENGTH", 128),
            phase_spans=_env_bool("OTEL_LLM_PHASE_SPANS", True),
            usage_dir=os.environ.get("OTEL_LLM_USAGE_DIR") or None,
            usage_events=_env_bool("OTEL_LLM_USAGE_EVENTS", False),
            usage_fsync_interval_s=_env_float("OTEL_LLM_USAGE_FSYNC_INTERVAL", 1.0),
            usage_max_bytes=_env_int("OTEL_LLM_USAGE_MAX_FILE_BYTES", 64 << 20),
            usage_max_age_s=_env_float("OTEL_LLM_USAGE_MAX_FILE_AGE", 3600.0),
            capture_content=capture_mode(os.environ.get(CAPTURE_CONTENT_ENV)),
            http_excluded_urls=os.environ.get(
                "OTEL_PYTHON_FASTAPI_EXCLUDED_URLS",
                os.environ.get("OTEL_PYTHON_EXCLUDED_URLS", cls.http_excluded_urls),
            ),
        )


def attribution_value(raw, max_length: int) -> str | None:
    """A tenant / scene / cost-center value as a client sent it, or None when it is not one.

    HTTP headers arrive decoded as latin-1 (the ASGI rule): UTF-8 sent by the client is decoded as
    UTF-8 again (`租户-é`, not `ç§\x9fæ\x88·-Ã©`). Surrounding blanks are dropped. A value longer
    than max_length characters or holding control / format characters is refused whole (cut, two
    tenants could become one bill)."""
    if not isinstance(raw, str):
        return None
    value = raw.strip()
    if not value.isascii():
        try:
            value = value.encode("latin-1").decode("utf-8")
        except UnicodeError:
            pass  # not UTF-8 sent as bytes: keep it as it came
    if not value or len(value) > max_length:
        return None
    if not value.isprintable():  # control, format, separators other than the plain space
        return None
    return value


@dataclass
class LabelGuard:
    """Keeps a metric label low-cardinality: values in the allow-list keep their name; without one,
    the first N distinct values do, among those the API-key map vouches for when there is one (so
    clients sending made-up tenant headers cannot take the slots of real tenants); the rest 'other'."""

    allow_list: tuple[str, ...] = ()
    limit: int = 50
    vouched: frozenset[str] | None = None
    _seen: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, value: str | None) -> str | None:
        if value is None:
            return None
        if self.allow_list:
            return value if value in self.allow_list else semconv.LABEL_OTHER
        if self.vouched is not None and value not in self.vouched:
            return semconv.LABEL_OTHER
        if value in self._seen:
            return value
        with self._lock:
            if len(self._seen) < self.limit:
                self._seen.add(value)
                return value
        return semconv.LABEL_OTHER


def load_api_keys(path: str) -> dict[str, tuple[str, str | None, str | None]]:
    """sha256 hex digest of an API key -> (tenant, scene, cost center). Raises ValueError."""
    import json

    with open(path) as f:
        entries = json.load(f)["keys"]
    keys = {}
    for entry in entries:
        digest = str(entry["sha256"]).lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"not a sha256 hex digest: {digest[:12]}...")
        keys[digest] = (str(entry["tenant"]), entry.get("scene"), entry.get("cost_center"))
    return keys
