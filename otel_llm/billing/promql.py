"""What the commands that write or read PromQL share (rules, dashboards, report, budgets): the token
counter's Prometheus names, the metrics a query may read, the error a user can fix and the reading
of their JSON/YAML config files. It imports nothing of theirs, so none of them import each other
for it."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

from otel_llm import semconv

TOKEN_METRIC = semconv.prometheus_metric(semconv.SERVER_TOKEN_USAGE)
# --by dimension -> Prometheus label of the token counter
DIMENSIONS = {
    "tenant": semconv.prometheus_label(semconv.TENANT_ID),
    "scene": semconv.prometheus_label(semconv.TENANT_SCENE),
    "cost_center": semconv.prometheus_label(semconv.TENANT_COST_CENTER),
    "model": semconv.prometheus_label(semconv.GEN_AI_REQUEST_MODEL),
    "operation": semconv.prometheus_label(semconv.GEN_AI_OPERATION_NAME),
    "instance": "instance",
}
TYPE_LABEL = semconv.prometheus_label(semconv.GEN_AI_TOKEN_TYPE)
TOKEN_TYPES = semconv.TOKEN_TYPES


class ReportError(Exception):
    """A problem the user can fix (server, range, price file); printed without a traceback."""


def read_config(path: Path, what: str):
    """A JSON or YAML (by suffix) file's content; ReportError naming `what` when unreadable."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ReportError(f"{what} {path}: {exc.strerror or exc}") from None
    yaml_file = path.suffix in (".yaml", ".yml")
    if not yaml_file:
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ReportError(f"{what} {path} is not valid JSON: {exc}") from None
    try:
        import yaml
    except ImportError:
        raise ReportError(
            f"{what} {path}: reading YAML needs PyYAML (pip install pyyaml); or write it as JSON"
        ) from None
    try:
        return yaml.safe_load(text)
    except Exception as exc:  # noqa: BLE001 - any parse error is the file's
        raise ReportError(f"{what} {path} is not valid YAML: {exc}") from None


def iso_time(text: str) -> float:
    """An RFC 3339 / ISO 8601 time as Unix seconds (without a zone: UTC). Raises ValueError."""
    value = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.timezone.utc)
    return value.timestamp()


def series_names(name: str, kind: str) -> set[str]:
    """The series Prometheus holds for one metric: a histogram's _bucket, _sum and _count."""
    return {f"{name}_{s}" for s in ("bucket", "sum", "count")} if kind == semconv.HISTOGRAM else {name}


def known_metrics(recorded=()) -> set[str]:
    """Every series a query may read: our metrics (semconv.METRICS), vLLM's own (semconv's
    VLLM_PROMETHEUS_METRICS), and the recording rules named in `recorded`."""
    names = set(recorded)
    for spec in semconv.METRICS.values():
        names |= series_names(spec.prometheus, spec.kind)
    for name, kind in semconv.VLLM_PROMETHEUS_METRICS.items():
        names |= series_names(name, kind)
    return names


_KEYWORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "inf",
    "nan",
}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (Grafana template variables removed first)."""
    e = re.sub(r"\$\{?\w+\}?", "0", expr)
    e = re.sub(r'"(\\.|[^"\\])*"', '""', e)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    found = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(\s*\()?", e):
        if not m.group(2) and m.group(1).lower() not in _KEYWORDS:
            found.add(m.group(1))
    return found


def unknown_metrics(expr: str, recorded=()) -> set[str]:
    """The metrics `expr` reads that nothing emits or records."""
    return metric_names(expr) - known_metrics(recorded)


# --- Prometheus rule files --------------------------------------------------------------------
# YAML 1.1 words a plain scalar would be read as (bool, null): such strings are quoted
_YAML_WORDS = {"y", "n", "yes", "no", "true", "false", "on", "off", "null"}
_PLAIN = re.compile(r"[A-Za-z_(][^\n]*")


def yaml_text(data) -> str:
    """Rule groups (dicts, lists and strings) as block YAML that any YAML parser reads back equal,
    without PyYAML (the product does not depend on it). Keys are written plain: ours are names."""
    return "".join(_yaml_lines(data, 0))


def _yaml_lines(value, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, str):
        return [f"{pad}{_scalar(value)}\n"]
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            if isinstance(item, str) or not item:
                lines.append(f"{pad}{key}: {_scalar(item) if isinstance(item, str) else json.dumps(item)}\n")
            else:  # a list goes at the key's indent (as PyYAML writes it), a mapping under it
                lines.append(f"{pad}{key}:\n")
                lines += _yaml_lines(item, indent if isinstance(item, list) else indent + 2)
        return lines
    if isinstance(value, list):
        lines = []
        for item in value:
            first, *rest = _yaml_lines(item, indent + 2)
            lines += [f"{pad}- {first[indent + 2 :]}", *rest]
        return lines
    raise TypeError(f"rule files hold strings, lists and mappings, not {type(value).__name__}")


def _scalar(text: str) -> str:
    if not text.isprintable():
        return json.dumps(text)  # a double-quoted YAML scalar, escapes included
    if (
        _PLAIN.fullmatch(text)
        and ": " not in text
        and " #" not in text
        and not text.endswith((":", " "))
        and text.lower() not in _YAML_WORDS
    ):
        return text
    return "'" + text.replace("'", "''") + "'"


# Where each alert's runbook is: the README's "## Alerts" section, one "### Alert: NAME" each
RUNBOOK_URL = "https://github.com/otel-llm/otel-llm"


def runbook_anchor(alert: str) -> str:
    """The anchor GitHub gives the heading "### Alert: NAME" (lower case, ':' dropped, ' ' -> '-')."""
    return f"alert-{alert.lower()}"


def runbook_url(alert: str) -> str:
    return f"{RUNBOOK_URL}#{runbook_anchor(alert)}"
