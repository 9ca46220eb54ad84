"""config.py: every environment variable otel-llm reads is a constant there with one default; the
README's configuration tables list each of ours with that default."""

import dataclasses
import logging
import re
from pathlib import Path

from otel_llm import config

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
ROW = re.compile(r"^\| `([A-Z0-9_]+)` \| ([^|]*) \|", re.M)
OURS = {v for k, v in vars(config).items() if k.startswith("ENV_") and v.startswith("OTEL_LLM_")} | {
    config.ENV_CAPTURE_CONTENT,
    config.ENV_SEMCONV_OPT_IN,
}


def documented_default(field) -> str:
    value = field.default
    if value is None or value == ():
        return "(none)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return "`" + ",".join(value) + "`"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"


def env_fields():
    for cls in (config.Settings, config.ClientSettings, config.ContentLimits):
        for field in dataclasses.fields(cls):
            if "env" in field.metadata:
                yield field.metadata["env"], field


def test_every_variable_of_ours_has_a_readme_row():
    rows = dict(ROW.findall(README))
    assert sorted(OURS - set(rows)) == []


def test_readme_defaults_are_the_config_defaults():
    rows = {}
    for name, default in ROW.findall(README):
        rows.setdefault(name, default.strip())
    wrong = {
        name: (rows.get(name), documented_default(field))
        for name, field in env_fields()
        if rows.get(name) != documented_default(field)
    }
    assert wrong == {}


def test_settings_read_each_variable_and_fall_back_on_bad_values(monkeypatch, caplog):
    monkeypatch.setenv(config.ENV_TENANT_HEADERS, "X-Org, x-team")
    monkeypatch.setenv(config.ENV_METRIC_LABEL_LIMIT, "lots")
    monkeypatch.setenv(config.ENV_PHASE_SPANS, "false")
    monkeypatch.setenv(config.ENV_USAGE_FSYNC_INTERVAL, "0.25")
    monkeypatch.setenv(config.ENV_USAGE_EVENTS, "maybe")
    monkeypatch.setenv(config.ENV_SEMCONV_OPT_IN, "http,gen_ai_latest_experimental")
    with caplog.at_level(logging.WARNING, logger="otel_llm"):
        settings = config.Settings.from_env()
    assert settings.tenant_headers == ("X-Org", "x-team")
    assert settings.label_limit == config.Settings.label_limit == 50
    assert settings.phase_spans is False
    assert settings.usage_fsync_interval_s == 0.25
    assert settings.usage_events is config.Settings.usage_events is False
    assert settings.genai_latest_experimental is True
    assert any(config.ENV_METRIC_LABEL_LIMIT in m for m in caplog.messages)
    assert any(config.ENV_USAGE_EVENTS in m for m in caplog.messages)


def test_client_settings_kwargs_win_over_the_environment(monkeypatch):
    monkeypatch.setenv(config.ENV_OPENAI_PROPAGATE, "false")
    monkeypatch.setenv(config.ENV_OPENAI_PROVIDER_NAME, "azure.ai.openai")
    assert config.ClientSettings.from_env() == config.ClientSettings(propagate=False, provider_name="azure.ai.openai")
    assert config.ClientSettings.from_env(propagate=True, include_usage=True).propagate is True
    assert config.ClientSettings.from_env(include_usage=True).include_usage is True


def test_shutdown_timeout():
    assert config.shutdown_timeout({}) == config.DEFAULT_SHUTDOWN_TIMEOUT_S
    assert config.shutdown_timeout({config.ENV_SHUTDOWN_TIMEOUT: "2.5"}) == 2.5
    assert config.shutdown_timeout({config.ENV_SHUTDOWN_TIMEOUT: "0"}) is None
    assert config.shutdown_timeout({config.ENV_SHUTDOWN_TIMEOUT: "nan"}) == config.DEFAULT_SHUTDOWN_TIMEOUT_S
