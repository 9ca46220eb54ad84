"""The collector config validator behind collector/test_collector_config.py, test_compose.py and
e2e/test_sampling_e2e.py (no otelcol binary exists here): the configs' wiring, component types and
keys against the upstream schemas (tests/fixtures/collector_schemas), the attributes policies read
against otel-llm's names spec, the usage (billing) and content pipelines; and small models of what
the collector does with them: the tail_sampling policy evaluator, the content transforms (OTTL
delete_key / replace_pattern) and the spool receiver's stanza operators. Our reading of upstream:
the real collector decides. `check_all(cfg)` lists every problem of one config."""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import yaml
from opentelemetry.semconv.attributes import http_attributes, url_attributes

from otel_llm import semconv

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "collector-config"
# a copy of shared/collector_schemas (Apache-2.0; provenance in its README), so a clone is self-contained
SCHEMAS = Path(__file__).resolve().parents[1] / "fixtures" / "collector_schemas"

CONFIG_FILES = sorted(p for p in CONFIG_DIR.rglob("*.y*ml") if "prometheus" not in p.relative_to(CONFIG_DIR).parts)

KINDS = ("receivers", "processors", "exporters", "connectors", "extensions")
KIND_CLASS = {
    "receivers": "receiver",
    "processors": "processor",
    "exporters": "exporter",
    "connectors": "connector",
    "extensions": "extension",
}

# Attribute types as otel-llm's spec says it sets them (otel_llm/semconv.py): only names some layer
# emits on spans count (a policy on a name nothing emits never matches).
EMITTED_TYPES: dict[str, type] = {
    spec.name: semconv.PYTHON_TYPES[spec.type][0]
    for spec in semconv.ATTRIBUTES.values()
    if spec.emitted_by & {semconv.VLLM, semconv.CLIENT, semconv.COLLECTOR}
}
SEMCONV_NAMES = set(semconv.ATTRIBUTES)
# Names the HTTP server spans carry (opentelemetry-instrumentation-fastapi), used by the noise filter.
HTTP_NAMES = {url_attributes.URL_PATH: str, http_attributes.HTTP_ROUTE: str}

# Deprecated type names we still use on purpose, with the reason.
ALLOWED_DEPRECATED = {
    # renamed to load_balancing by PR #48533 (2026-05), after v0.144: the old name loads on the
    # whole supported range, the new one only on recent releases.
    "loadbalancing",
    # renamed file_log by PR #46750 (2026, after v0.144): the same reason. Keep the receiver ID
    # filelog/usage: its read offsets in file_storage are stored under it.
    "filelog",
}


# --------------------------------------------------------------------------------------------
# Upstream schemas
# --------------------------------------------------------------------------------------------


def _load_schema_file(path: Path) -> dict:
    if path.suffix == ".json":
        return json.loads(path.read_text())
    return yaml.safe_load(path.read_text())


_SCHEMA_CACHE: dict[Path, dict | None] = {}


def schema_in(directory: Path) -> tuple[dict, Path] | None:
    """The config schema of one Go package directory, or None."""
    if directory not in _SCHEMA_CACHE:
        for name in ("config.schema.yaml", "config.keys.json"):
            if (directory / name).is_file():
                _SCHEMA_CACHE[directory] = _load_schema_file(directory / name)
                break
        else:
            _SCHEMA_CACHE[directory] = None
    s = _SCHEMA_CACHE[directory]
    return (s, directory) if s is not None else None


def _module_root(directory: Path) -> Path:
    rel = directory.relative_to(SCHEMAS)
    return SCHEMAS / rel.parts[0]  # core/ or contrib/


OPEN = object()  # a schema node whose keys we cannot enumerate (maps, custom types, unknown refs)


# Go types that unmarshal from text although the generated schema shows their underlying kind.
TEXT_TYPES = {
    # spanmetrics internal/metrics.Unit is an int8 enum with UnmarshalText: "ms" or "s"
    (SCHEMAS / "contrib/connector/spanmetricsconnector/internal/metrics", "unit"): {
        "type": "string",
        "enum": ["ms", "s"],
    }
}


def resolve_ref(ref: str, directory: Path) -> tuple[dict, Path] | object:
    if "/" not in ref and "." not in ref:
        file_schema = schema_in(directory)
        defs = (file_schema[0] if file_schema else {}).get("$defs", {})
        return (defs[ref], directory) if ref in defs else OPEN
    pkg, _, name = ref.rpartition(".")
    if pkg.startswith("./"):
        target = directory / pkg[2:]
    elif pkg.startswith("/"):
        target = _module_root(directory) / pkg[1:]
    elif pkg.startswith("go.opentelemetry.io/collector/"):
        target = SCHEMAS / "core" / pkg[len("go.opentelemetry.io/collector/") :]
    elif pkg.startswith("github.com/open-telemetry/opentelemetry-collector-contrib/"):
        target = SCHEMAS / "contrib" / pkg[len("github.com/open-telemetry/opentelemetry-collector-contrib/") :]
    else:
        return OPEN
    if (target, name) in TEXT_TYPES:
        return TEXT_TYPES[(target, name)], target
    found = schema_in(target)
    if not found:
        return OPEN
    defs = found[0].get("$defs", {})
    if name in defs:
        return defs[name], target
    if name == "config":  # the package's Config struct is the file's top level
        return found
    return OPEN


def node_properties(node: dict, directory: Path) -> dict | object:
    """key -> (sub-node, dir) for an object node, following $ref and allOf; OPEN if unknowable."""
    if "$ref" in node:
        target = resolve_ref(node["$ref"], directory)
        if target is OPEN:
            return OPEN
        return node_properties(*target)
    if node.get("additionalProperties") is not None:
        return OPEN
    if "x-customType" in node and "properties" not in node and "allOf" not in node:
        return OPEN
    props = {k: (v, directory) for k, v in (node.get("properties") or {}).items()}
    for part in node.get("allOf", []):
        sub = node_properties(part, directory)
        if sub is OPEN:
            return OPEN
        props.update(sub)
    return props


DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")
SCALAR_TYPES = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
}


def check_against_schema(value, node: dict, directory: Path, where: str, errors: list[str]) -> None:
    if "$ref" in node:
        target = resolve_ref(node["$ref"], directory)
        if target is OPEN:
            return
        node, directory = target
        if "$ref" in node:
            return check_against_schema(value, node, directory, where, errors)
    if isinstance(value, dict) and "x-discriminator" in node:
        # a list of alternatives chosen by one key (stanza operators by `type`; config.keys.json)
        key, variants = node["x-discriminator"], node["x-types"]
        if value.get(key) not in variants:
            errors.append(f"{where}: {key} {value.get(key)!r} is not one of {sorted(variants)}")
            return
        return check_against_schema(value, variants[value[key]], directory, where, errors)
    if isinstance(value, dict):
        props = node_properties(node, directory)
        if props is OPEN:
            return
        if not props and node.get("type") not in (None, "object"):
            return
        for key, sub in value.items():
            if key not in props:
                errors.append(f"{where}: unknown key {key!r} (schema has {sorted(props)})")
            elif sub is not None:
                check_against_schema(sub, props[key][0], props[key][1], f"{where}.{key}", errors)
    elif not isinstance(value, list) and node.get("type") in SCALAR_TYPES:
        ok = SCALAR_TYPES[node["type"]](value)
        if ok and node.get("format") == "duration":
            ok = bool(DURATION.match(value))
        if ok and "enum" in node:
            ok = value in node["enum"]
        if not ok:
            errors.append(
                f"{where}: {value!r} is not a valid {node.get('format') or node['type']}"
                + (f" (one of {node['enum']})" if "enum" in node else "")
            )
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            if isinstance(item, dict):  # lists of plain strings are allowed for OTTL statements
                check_against_schema(item, node["items"], directory, f"{where}[{i}]", errors)


def component_index() -> dict[tuple[str, str], dict]:
    """(class, type or deprecated type) -> {dir, type, deprecated, stability} from metadata.yaml."""
    index = {}
    for meta_path in SCHEMAS.rglob("metadata.yaml"):
        meta = yaml.safe_load(meta_path.read_text())
        status = meta.get("status", {})
        signals = {s for lst in (status.get("stability") or {}).values() for s in lst}
        entry = {"dir": meta_path.parent, "type": meta["type"], "signals": signals}
        index[(status.get("class"), meta["type"])] = {**entry, "deprecated": False}
        if meta.get("deprecated_type"):
            index[(status.get("class"), meta["deprecated_type"])] = {**entry, "deprecated": True}
    return index


COMPONENTS = component_index()
CONTRIB_LIST = yaml.safe_load((SCHEMAS / "otelcol-contrib-components.yaml").read_text())


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def ctype(component_id: str) -> str:
    return component_id.split("/", 1)[0]


def signal_of(pipeline_id: str) -> str:
    return pipeline_id.split("/", 1)[0]


def check_wiring(cfg: dict) -> list[str]:
    errors = []
    pipelines = (cfg.get("service") or {}).get("pipelines") or {}
    if not pipelines:
        return ["service.pipelines is empty"]
    defined = {kind: set((cfg.get(kind) or {}).keys()) for kind in KINDS}
    used = {kind: set() for kind in KINDS}
    conn_as_exporter: dict[str, list[str]] = {}
    conn_as_receiver: dict[str, list[str]] = {}
    for pid, p in pipelines.items():
        if signal_of(pid) not in ("traces", "metrics", "logs", "profiles"):
            errors.append(f"pipeline {pid}: unknown signal")
        if not p.get("receivers") or not p.get("exporters"):
            errors.append(f"pipeline {pid}: needs receivers and exporters")
        for r in p.get("receivers") or []:
            if r in defined["connectors"]:
                used["connectors"].add(r)
                conn_as_receiver.setdefault(r, []).append(pid)
            elif r in defined["receivers"]:
                used["receivers"].add(r)
            else:
                errors.append(f"pipeline {pid}: receiver {r!r} is not defined")
        for x in p.get("processors") or []:
            if x in defined["processors"]:
                used["processors"].add(x)
            else:
                errors.append(f"pipeline {pid}: processor {x!r} is not defined")
        for e in p.get("exporters") or []:
            if e in defined["connectors"]:
                used["connectors"].add(e)
                conn_as_exporter.setdefault(e, []).append(pid)
            elif e in defined["exporters"]:
                used["exporters"].add(e)
            else:
                errors.append(f"pipeline {pid}: exporter {e!r} is not defined")
    for ext in (cfg.get("service") or {}).get("extensions") or []:
        if ext in defined["extensions"]:
            used["extensions"].add(ext)
        else:
            errors.append(f"service.extensions: {ext!r} is not defined")
    for kind in KINDS:
        for unused in sorted(defined[kind] - used[kind]):
            errors.append(f"{kind}: {unused!r} is defined but not used in any pipeline")
    for c in sorted(defined["connectors"]):
        if c in used["connectors"] and (c not in conn_as_exporter or c not in conn_as_receiver):
            errors.append(
                f"connector {c!r} must be an exporter in one pipeline and a receiver in "
                f"another (exporter in {conn_as_exporter.get(c)}, receiver in {conn_as_receiver.get(c)})"
            )
            continue
        meta = COMPONENTS.get(("connector", ctype(c)))
        if meta:
            for src in conn_as_exporter.get(c, []):
                for dst in conn_as_receiver.get(c, []):
                    pair = f"{signal_of(src)}_to_{signal_of(dst)}"
                    if pair not in meta["signals"]:
                        errors.append(f"connector {c!r}: {src} -> {dst} ({pair}) not supported")
    # receivers, processors, exporters: signal must be supported by the component
    for pid, p in pipelines.items():
        sig = signal_of(pid)
        for kind, key in (("receivers", "receiver"), ("processors", "processor"), ("exporters", "exporter")):
            for comp in p.get(kind) or []:
                meta = COMPONENTS.get((key, ctype(comp)))
                if meta and meta["signals"] and sig not in meta["signals"]:
                    errors.append(f"pipeline {pid}: {key} {comp!r} does not support {sig}")
    return errors


def check_components(cfg: dict) -> list[str]:
    """Types exist, names are current, and config keys are in the upstream schema."""
    errors = []
    for kind in KINDS:
        for cid, conf in (cfg.get(kind) or {}).items():
            t = ctype(cid)
            meta = COMPONENTS.get((KIND_CLASS[kind], t))
            if meta is None:
                if t.replace("_", "") not in {n.replace("_", "") for n in CONTRIB_LIST.get(kind, [])}:
                    errors.append(f"{kind}.{cid}: no component type {t!r} in otelcol-contrib")
                continue
            if meta["deprecated"] and t not in ALLOWED_DEPRECATED:
                errors.append(f"{kind}.{cid}: {t!r} is a deprecated name, use {meta['type']!r}")
            found = schema_in(meta["dir"])
            if found is None:
                continue
            check_against_schema(conf or {}, found[0], found[1], f"{kind}.{cid}", errors)
    return errors


# ---- attributes read by policies ------------------------------------------------------------

OTTL_ATTR = re.compile(r'attributes\["([^"]+)"\]')
OTTL_CMP = re.compile(
    r'^\s*attributes\["(?P<key>[^"]+)"\]\s*(?P<op>==|!=|>=|<=|>|<)\s*(?P<lit>nil|true|false|"[^"]*"|-?\d+\.\d+|-?\d+)\s*$'
)


def parse_literal(lit: str):
    if lit == "nil":
        return None
    if lit in ("true", "false"):
        return lit == "true"
    if lit.startswith('"'):
        return lit[1:-1]
    return float(lit) if "." in lit else int(lit)


def parse_ottl(condition: str) -> list[list[tuple[str, str, object]]]:
    """A small OTTL subset: comparisons of attributes["k"] with literals, joined by and / or.
    Returns OR-of-ANDs. Anything else raises ValueError (so the test notices new syntax)."""
    ors = []
    for disjunct in re.split(r"\s+or\s+", condition):
        ands = []
        for term in re.split(r"\s+and\s+", disjunct):
            m = OTTL_CMP.match(term)
            if not m:
                raise ValueError(f"OTTL term outside the checked subset: {term!r}")
            ands.append((m["key"], m["op"], parse_literal(m["lit"])))
        ors.append(ands)
    return ors


def iter_policies(policies: list[dict]):
    """Every policy and sub-policy (and / not / drop / composite)."""
    for p in policies:
        yield p
        t = p.get("type")
        if t == "and":
            yield from iter_policies(p.get("and", {}).get("and_sub_policy", []))
        elif t == "drop":
            yield from iter_policies(p.get("drop", {}).get("drop_sub_policy", []))
        elif t == "composite":
            yield from iter_policies(p.get("composite", {}).get("composite_sub_policy", []))
        elif t == "not":
            yield from iter_policies([p.get("not", {}).get("not_sub_policy", {})])


def _type_ok(expected: type, value) -> bool:
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def check_attribute(key: str, needed: type | None, where: str, errors: list[str]) -> None:
    if key not in SEMCONV_NAMES:
        errors.append(f"{where}: attribute {key!r} is not a name in otel_llm/semconv.py")
        return
    actual = EMITTED_TYPES.get(key)
    if actual is None:
        errors.append(f"{where}: attribute {key!r} has no known type (add it to EMITTED_TYPES)")
    elif needed is not None and actual is not needed:
        errors.append(f"{where}: attribute {key!r} is {actual.__name__}, policy needs {needed.__name__}")


def check_policy_attributes(cfg: dict) -> list[str]:
    errors = []
    for pid, conf in (cfg.get("processors") or {}).items():
        if ctype(pid) != "tail_sampling":
            continue
        for p in iter_policies(conf.get("policies") or []):
            where = f"processors.{pid}.policies[{p.get('name')}]"
            t = p.get("type")
            if t not in ("always_sample", "trace_flags") and t not in p:
                errors.append(f"{where}: type {t!r} but no {t!r} block")
                continue
            block = p.get(t) or {}
            if t == "numeric_attribute":
                check_attribute(block.get("key"), int, where, errors)
                for k in ("min_value", "max_value"):
                    if k in block and not _type_ok(int, block[k]):
                        errors.append(f"{where}: {k} must be an int")
            elif t == "boolean_attribute":
                check_attribute(block.get("key"), bool, where, errors)
                if not isinstance(block.get("value"), bool):
                    errors.append(f"{where}: value must be a bool")
            elif t == "string_attribute":
                check_attribute(block.get("key"), str, where, errors)
            elif t == "ottl_condition":
                for cond in (block.get("span") or []) + (block.get("spanevent") or []):
                    try:
                        parsed = parse_ottl(cond)
                    except ValueError as exc:
                        errors.append(f"{where}: {exc}")
                        continue
                    for key, _op, lit in (term for ands in parsed for term in ands):
                        if lit is None:  # presence test: any type
                            check_attribute(key, None, where, errors)
                        else:
                            check_attribute(key, type(lit), where, errors)
            elif t == "status_code":
                for code in block.get("status_codes") or []:
                    if code not in ("OK", "ERROR", "UNSET"):
                        errors.append(f"{where}: unknown status code {code!r}")
            elif t == "latency":
                if not _type_ok(int, block.get("threshold_ms")):
                    errors.append(f"{where}: threshold_ms must be an int")
    return errors


def check_other_attributes(cfg: dict) -> list[str]:
    """span_metrics dimensions and filter conditions read names we (or the HTTP semconv) emit."""
    errors = []
    for cid, conf in (cfg.get("connectors") or {}).items():
        if ctype(cid) in ("span_metrics", "spanmetrics"):
            for dim in (conf or {}).get("dimensions") or []:
                check_attribute(dim["name"], None, f"connectors.{cid}.dimensions", errors)
    for pid, conf in (cfg.get("processors") or {}).items():
        if ctype(pid) != "filter":
            continue
        for cond in ((conf or {}).get("traces") or {}).get("span") or []:
            for key in OTTL_ATTR.findall(cond):
                if key not in HTTP_NAMES and key not in SEMCONV_NAMES:
                    errors.append(f"processors.{pid}: attribute {key!r} is neither ours nor HTTP semconv")
        for cond in ((conf or {}).get("logs") or {}).get("log_record") or []:
            for key in OTTL_ATTR.findall(cond):
                if key not in SEMCONV_NAMES:
                    errors.append(f"processors.{pid}: attribute {key!r} is not a name in otel_llm/semconv.py")
    return errors


# ---- the usage ledger (billing) pipeline ------------------------------------------------------
# Usage records (otel_llm/usage.py) reach ClickHouse's otel_logs from the spool (filelog receiver)
# or over OTLP (log event otel_llm.usage). They are never sampled, and the spool path must give
# LogAttributes equal to the OTLP record's: the spool-only fields become the timestamp and trace
# context and are removed.

SAMPLING_TYPES = {"tail_sampling", "probabilistic_sampler"}
SPOOL_ONLY = (semconv.USAGE_TIME, semconv.USAGE_TRACE_ID, semconv.USAGE_SPAN_ID)
FILELOG_TYPES = {"filelog", "file_log"}
# stanza field syntax, the subset the configs use: attributes.key, attributes["a.b"], resource[...], body
STANZA_FIELD = re.compile(
    r'^(?P<root>attributes|resource|body)(?:\.(?P<plain>[A-Za-z0-9_]+)|\["(?P<quoted>[^"]+)"\])?$'
)
STANZA_IF = re.compile(r'^"(?P<key>[^"]+)" in attributes$')


def parse_field(text: str) -> tuple[str, str | None]:
    """(root, key) of a stanza field. A dot in a plain key would mean nesting, so it is refused."""
    m = STANZA_FIELD.match(text)
    if not m:
        raise ValueError(f"field outside the checked subset: {text!r}")
    return m["root"], m["plain"] or m["quoted"]


def operator_fields(op: dict):
    """(where, field text) of every field an operator reads or writes."""
    for key in ("parse_from", "parse_to", "field", "from", "to"):
        if isinstance(op.get(key), str):
            yield key, op[key]
    for key in ("timestamp", "severity", "scope_name"):
        if isinstance(op.get(key), dict) and "parse_from" in op[key]:
            yield f"{key}.parse_from", op[key]["parse_from"]
    trace = op.get("trace") if op.get("type") != "trace_parser" else op
    for key in ("trace_id", "span_id", "trace_flags"):
        if isinstance((trace or {}).get(key), dict) and "parse_from" in trace[key]:
            yield f"{key}.parse_from", trace[key]["parse_from"]


def usage_pipelines(cfg: dict) -> dict[str, dict]:
    """The pipelines that carry usage records: a filelog receiver in, or a clickhouse exporter out."""
    pipelines = (cfg.get("service") or {}).get("pipelines") or {}
    return {
        pid: p
        for pid, p in pipelines.items()
        if any(ctype(r) in FILELOG_TYPES for r in p.get("receivers") or [])
        or any(ctype(e) == "clickhouse" for e in p.get("exporters") or [])
    }


def filter_drops(conf: dict, attributes: dict) -> bool:
    """Our reading of a filter processor's logs.log_record conditions: True if the record is dropped."""
    conds = [parse_ottl(c) for c in ((conf or {}).get("logs") or {}).get("log_record") or []]
    return any(all(_ottl_term(attributes, *term) for term in ands) for cond in conds for ands in cond)


def check_spool_receiver(rid: str, conf: dict, cfg: dict) -> list[str]:
    """A filelog receiver on the spool: checkpoints on disk, every line read, the spool-only
    fields mapped onto timestamp / trace context and removed, fields named as in semconv."""
    errors, where = [], f"receivers.{rid}"
    storage = conf.get("storage")
    if not storage or ctype(storage) != "file_storage" or storage not in (cfg.get("extensions") or {}):
        errors.append(f"{where}: storage must be a file_storage extension (read offsets survive restarts)")
    if conf.get("start_at") != "beginning":
        errors.append(f"{where}: start_at must be beginning (a new spool file is read from its first line)")
    if conf.get("include_file_name", True) or conf.get("include_file_path", False):
        errors.append(f"{where}: include_file_name/include_file_path add log.file.* to LogAttributes")
    ops = conf.get("operators") or []
    mapped: dict[str, tuple[str, str | None]] = {}  # record part -> field it is taken from
    removed: set[tuple[str, str | None]] = set()
    for i, op in enumerate(ops):
        at = f"{where}.operators[{i}]"
        fields = {}
        for name, text in operator_fields(op):
            try:
                fields[name] = parse_field(text)
            except ValueError as exc:
                errors.append(f"{at}.{name}: {exc}")
        if op.get("if") is not None:
            m = STANZA_IF.match(op["if"])
            if m:
                fields["if"] = ("attributes", m["key"])
            else:
                errors.append(f"{at}.if: outside the checked subset: {op['if']!r}")
        for name, (root, key) in fields.items():
            if root in ("attributes", "resource") and key is not None and key not in SEMCONV_NAMES:
                errors.append(f"{at}.{name}: {root} key {key!r} is not a name in otel_llm/semconv.py")
        if op.get("type") == "json_parser":
            if not op.get("parse_ints"):
                errors.append(f"{at}: parse_ints must be true (epoch nanoseconds do not fit a float64)")
            ts = op.get("timestamp") or {}
            if (ts.get("layout_type"), ts.get("layout")) != ("epoch", "ns"):
                errors.append(
                    f"{at}.timestamp: {semconv.USAGE_TIME} is epoch nanoseconds (layout_type epoch, layout ns)"
                )
        if "timestamp.parse_from" in fields:
            mapped["timestamp"] = fields["timestamp.parse_from"]
        for part in ("trace_id", "span_id"):
            if f"{part}.parse_from" in fields:
                mapped[part] = fields[f"{part}.parse_from"]
        if op.get("type") == "remove" and "field" in fields:
            removed.add(fields["field"])
    for part, name in (
        ("timestamp", semconv.USAGE_TIME),
        ("trace_id", semconv.USAGE_TRACE_ID),
        ("span_id", semconv.USAGE_SPAN_ID),
    ):
        if mapped.get(part) != ("attributes", name):
            errors.append(
                f"{where}: the record's {part} must be taken from attributes {name!r}, got {mapped.get(part)}"
            )
        if ("attributes", name) not in removed:
            errors.append(f"{where}: spool-only field {name!r} is not removed (it would stay in LogAttributes)")
    return errors


def check_usage(cfg: dict) -> list[str]:
    errors = []
    processors = cfg.get("processors") or {}
    for pid, p in usage_pipelines(cfg).items():
        where = f"pipeline {pid} (usage ledger)"
        if signal_of(pid) != "logs":
            errors.append(f"{where}: usage records are logs")
        for x in p.get("processors") or []:
            if ctype(x) in SAMPLING_TYPES:
                errors.append(f"{where}: {x!r} samples; usage records are invoices and are never sampled")
            elif ctype(x) == "batch":
                errors.append(
                    f"{where}: {x!r} acknowledges records before they are on disk; batch in the "
                    "exporter's sending_queue instead"
                )
        for e in p.get("exporters") or []:
            if ctype(e) != "clickhouse":
                errors.append(f"{where}: exports to {e!r}; usage records go straight to ClickHouse")
        if "otlp" in (p.get("receivers") or []):
            filters = [processors.get(x) for x in p.get("processors") or [] if ctype(x) == "filter"]
            usage, other = {semconv.USAGE_ID: "i/1"}, {semconv.SERVICE_NAME: "vllm"}
            try:
                keeps_usage = not any(filter_drops(f, usage) for f in filters)
                drops_other = any(filter_drops(f, other) for f in filters)
            except ValueError as exc:
                errors.append(f"{where}: {exc}")
                continue
            if not (keeps_usage and drops_other):
                errors.append(f"{where}: OTLP logs need a filter that keeps only records with {semconv.USAGE_ID!r}")
    for rid, conf in (cfg.get("receivers") or {}).items():
        if ctype(rid) in FILELOG_TYPES:
            errors += check_spool_receiver(rid, conf or {}, cfg)
    return errors


# ---- prompt and completion content: kept only where a reason kept the trace, redacted again -----
# The servers put content on the GenAI span only when opted in, redacted (otel_llm/content.py,
# otel_llm/redaction.py). In the collector, tail_sampling records the policy that sampled a trace
# (feature gate processor.tailsamplingprocessor.recordpolicy; contrib processor.go makeDecision: the
# first policy in config order whose decision is Sampled, written with SetAttrOnScopeSpans into the
# instrumentation scope's attributes, semconv.TAILSAMPLING_POLICY; processCachedTrace writes the
# cached name on spans that arrive after the decision). A transform after it deletes the content
# attributes where that policy keeps traces for no reason of its own (the baseline), or where no
# policy was recorded; a second transform runs RE2 versions of the servers' redaction rules on the
# content that is left. Below: the checks, and a small model of both transforms (our reading of
# OTTL's delete_key / replace_pattern; the real collector decides).

RECORD_POLICY_GATE = "processor.tailsamplingprocessor.recordpolicy"
CONTENT_ATTRIBUTES = (semconv.GEN_AI_INPUT_MESSAGES, semconv.GEN_AI_OUTPUT_MESSAGES, semconv.GEN_AI_SYSTEM_INSTRUCTIONS)
# Policy types that keep traces without looking at them: being kept by one is no reason to keep content.
UNSELECTIVE_TYPES = {"probabilistic", "always_sample", "rate_limiting", "bytes_limiting"}

_OTTL_STRING = r'"(?:[^"\\]|\\.)*"'
DELETE_KEY = re.compile(rf"^delete_key\(span\.attributes, (?P<key>{_OTTL_STRING})\)$")
REPLACE_PATTERN = re.compile(
    rf"^replace_pattern\(span\.attributes\[(?P<key>{_OTTL_STRING})\], "
    rf"(?P<regex>{_OTTL_STRING}), (?P<repl>{_OTTL_STRING})\)$"
)
SCOPE_EQUALS = re.compile(rf"^scope\.attributes\[(?P<key>{_OTTL_STRING})\] == (?P<value>nil|{_OTTL_STRING})$")


def ottl_string(literal: str) -> str:
    """The value of an OTTL string literal. OTTL unquotes like Go's strconv.Unquote, where `\\.` is
    an error: a regex backslash is written `\\\\`. Only the escapes `\\\\` and `\\"` are accepted."""
    out, i, body = [], 0, literal[1:-1]
    while i < len(body):
        if body[i] == "\\":
            if body[i + 1 : i + 2] not in ("\\", '"'):
                raise ValueError(f"OTTL string {literal}: escape \\{body[i + 1 : i + 2]} (a regex backslash is \\\\)")
            out.append(body[i + 1])
            i += 2
        else:
            out.append(body[i])
            i += 1
    return "".join(out)


def confmap_unescape(text: str) -> str:
    """The collector's config resolution of a string: `$$` is a `$`, `${...}` would be expanded; a
    single `$` is refused here (write `$$1` for a regex group in a replacement)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$":
            if text[i + 1 : i + 2] != "$":
                raise ValueError(f"a single $ in {text!r}: the collector resolves $ in config strings; write $$")
            i += 1
        out.append(text[i])
        i += 1
    return "".join(out)


RE2_ESCAPES = set("dDwWbBAnrtfvx")  # \s differs (Python's also matches \v), \z \Z \G \p \Q ... differ or are missing
RE2_CLASS_ESCAPES = set("dDwWnrtfvx")


def re2_problems(regex: str) -> list[str]:
    """What keeps `regex` from meaning the same in Go's RE2 (the collector) and in Python's re with
    re.ASCII (this model): lookarounds, backreferences, atomic groups, possessive quantifiers, `$`
    (Python's also matches before a final newline), escapes the two read differently, repeat counts
    over RE2's 1000, and patterns that can match the empty string (Go and Python differ there)."""
    problems, i, in_class, after_quantifier = [], 0, False, False
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            n = regex[i + 1 : i + 2]
            if n.isdigit():
                problems.append(f"\\{n}: backreference or octal escape (not RE2)")
            elif n.isalpha() and n not in (RE2_CLASS_ESCAPES if in_class else RE2_ESCAPES):
                problems.append(f"\\{n}: not RE2, or not the same in RE2 and Python re")
            i, after_quantifier = i + 2, False
            continue
        if in_class:
            in_class = c != "]"
            i += 1
            continue
        if c == "[":
            i += 1 + (regex[i + 1 : i + 2] == "^")
            i += regex[i : i + 1] == "]"  # a ] first in a class is literal
            in_class, after_quantifier = True, False
            continue
        if (
            c == "("
            and regex[i + 1 : i + 2] == "?"
            and not re.match(r"\(\?(?:[imsU]*(?:-[imsU]+)?[:)]|P<[A-Za-z_]\w*>)", regex[i:])
        ):
            problems.append(f"{regex[i : i + 4]}...: lookaround, atomic group, backreference or conditional (not RE2)")
        if c == "$":
            problems.append("$: Python's also matches before a final newline")
        if c == "+" and after_quantifier:
            problems.append("possessive quantifier (not RE2)")
        if c == "{":
            m = re.match(r"\{(\d+)(?:,(\d*))?\}", regex[i:])
            if m and max(int(m[1]), int(m[2] or 0)) > 1000:
                problems.append(f"{m[0]}: RE2 allows repeat counts up to 1000")
        after_quantifier = c in "*+?}" and not (c in "+?" and after_quantifier)
        i += 1
    try:
        compiled = re.compile(regex, re.ASCII)
    except re.error as exc:
        problems.append(f"does not compile: {exc}")
    else:
        if compiled.fullmatch("") is not None:
            problems.append("matches the empty string")
    return problems


def go_expand(template: str, m: re.Match) -> str:
    """Go's regexp Expand, which ReplaceAllString applies to each match: `$name` or `${name}`, name
    the longest run of letters, digits and `_`, a number for a group index; an unknown or unmatched
    group is empty; `$$` is `$` (so `$1x` means group "1x", which does not exist)."""
    out, i = [], 0
    while i < len(template):
        if template[i] != "$":
            out.append(template[i])
            i += 1
            continue
        if template[i + 1 : i + 2] == "$":
            out.append("$")
            i += 2
            continue
        braced = re.match(r"\{(\w+)\}", template[i + 1 :], re.ASCII)
        name = braced[1] if braced else re.match(r"\w*", template[i + 1 :], re.ASCII)[0]
        if not name:
            out.append("$")
            i += 1
            continue
        i += 1 + (len(braced[0]) if braced else len(name))
        if name.isdigit():
            value = m.group(int(name)) if int(name) <= m.re.groups else None
        else:
            value = m.group(name) if name in m.re.groupindex else None
        out.append(value or "")
    return "".join(out)


def go_replace_all(regex: str, template: str, text: str) -> str:
    """ReplaceAllString, for patterns re2_problems accepts (no empty matches): run by RE2 itself
    (google-re2, the engine Go's regexp follows), leftmost-first like Go."""
    return _re2_compiled(regex).sub(lambda m: go_expand(template, m), text)


@functools.lru_cache(maxsize=256)
def _re2_compiled(regex: str):
    import re2

    return re2.compile(regex)


def template_groups(template: str) -> set[str]:
    return set(re.findall(r"\$\{?(\w+)", template.replace("$$", ""), re.ASCII))


def transform_groups(conf: dict) -> list[tuple[list[str], list[str]]]:
    """(conditions, statements) of each statement group of a transform's trace_statements."""
    groups = []
    for item in (conf or {}).get("trace_statements") or []:
        if isinstance(item, str):
            groups.append(([], [item]))
        else:
            if item.get("context") not in (None, "span"):
                raise ValueError(f"context {item['context']!r} outside the checked subset")
            groups.append((list(item.get("conditions") or []), list(item.get("statements") or [])))
    if (conf or {}).get("metric_statements") or (conf or {}).get("log_statements"):
        raise ValueError("metric/log statements outside the checked subset")
    return groups


def parse_condition(condition: str) -> tuple[str, str | None]:
    """(scope attribute, value or None for nil) of `scope.attributes["k"] == "v"` / `== nil`."""
    m = SCOPE_EQUALS.match(confmap_unescape(condition))
    if not m:
        raise ValueError(f"condition outside the checked subset: {condition!r}")
    return ottl_string(m["key"]), None if m["value"] == "nil" else ottl_string(m["value"])


@functools.lru_cache(maxsize=1024)  # (a pure function of the text; the secret statement is long)
def parse_statement(statement: str) -> tuple:
    """("delete", key) or ("replace", key, regex, replacement) of a statement in the checked subset."""
    text = confmap_unescape(statement)
    if m := DELETE_KEY.match(text):
        return ("delete", ottl_string(m["key"]))
    if m := REPLACE_PATTERN.match(text):
        return ("replace", ottl_string(m["key"]), ottl_string(m["regex"]), ottl_string(m["repl"]))
    raise ValueError(f"statement outside the checked subset: {statement!r}")


def apply_transform(conf: dict, attributes: dict, scope: dict) -> dict:
    """A span's attributes after a transform of the checked subset (conditions are ORed)."""
    attributes = dict(attributes)
    for conditions, statements in transform_groups(conf):
        if conditions and not any(scope.get(key) == value for key, value in map(parse_condition, conditions)):
            continue
        for parsed in map(parse_statement, statements):
            if parsed[0] == "delete":
                attributes.pop(parsed[1], None)
            elif isinstance(attributes.get(parsed[1]), str):  # replace_pattern ignores nil and non-strings
                attributes[parsed[1]] = go_replace_all(parsed[2], parsed[3], attributes[parsed[1]])
    return attributes


def sampled_pipeline(cfg: dict) -> tuple[str, list[str]]:
    """(pipeline id, processors after tail_sampling) of the pipeline that tail-samples."""
    (pid,) = [
        pid
        for pid, p in cfg["service"]["pipelines"].items()
        if any(ctype(x) == "tail_sampling" for x in p.get("processors") or [])
    ]
    procs = cfg["service"]["pipelines"][pid]["processors"]
    return pid, procs[[ctype(x) for x in procs].index("tail_sampling") + 1 :]


def release(cfg: dict, spans: list[dict], policy: str | None) -> list[dict]:
    """The spans as tail_sampling releases them (scope attribute: the recorded policy, if any) after
    the processors that follow it."""
    scope = {} if policy is None else {semconv.TAILSAMPLING_POLICY: policy}
    _, after = sampled_pipeline(cfg)
    out = []
    for span in spans:
        attributes = span["attributes"]
        for x in after:
            if ctype(x) == "transform":
                attributes = apply_transform(cfg["processors"][x], attributes, scope)
        out.append({**span, "attributes": attributes, "scope": dict(scope)})
    return out


def content_transforms(cfg: dict) -> tuple[list[tuple[str, set, list[str]]], list[tuple[str, list[tuple]]]]:
    """([(id, values of the recorded policy that strip content, deleted keys)],
    [(id, [(key, regex, replacement)])]) of the transforms after tail_sampling."""
    _, after = sampled_pipeline(cfg)
    strips, redactions = [], []
    for x in after:
        if ctype(x) != "transform":
            continue
        replaced = []
        for conditions, statements in transform_groups(cfg["processors"].get(x)):
            parsed = [parse_statement(s) for s in statements]
            deletes = [p[1] for p in parsed if p[0] == "delete"]
            replaces = [p[1:] for p in parsed if p[0] == "replace"]
            if deletes:
                keys = {key for key, _ in map(parse_condition, conditions)}
                if keys != {semconv.TAILSAMPLING_POLICY}:
                    raise ValueError(
                        f"{x}: deletes content on a condition other than {semconv.TAILSAMPLING_POLICY!r}: {keys}"
                    )
                strips.append((x, {value for _, value in map(parse_condition, conditions)}, deletes))
            if replaces:
                if conditions:
                    raise ValueError(f"{x}: conditional redaction is outside the checked subset")
                replaced += replaces
        if replaced:
            redactions.append((x, replaced))
    return strips, redactions


def check_content(cfg: dict) -> list[str]:
    errors = []
    pipelines = (cfg.get("service") or {}).get("pipelines") or {}
    connectors = set(cfg.get("connectors") or {})
    tail_sampled = [
        pid for pid, p in pipelines.items() if any(ctype(x) == "tail_sampling" for x in p.get("processors") or [])
    ]
    for pid, p in pipelines.items():
        leaving = [
            e
            for e in p.get("exporters") or []
            if e not in connectors and ctype(e) not in ("loadbalancing", "load_balancing")
        ]
        if signal_of(pid) == "traces" and leaving and pid not in tail_sampled:
            errors.append(
                f"pipeline {pid}: exports to {leaving} without tail_sampling: content would leave on every trace"
            )
    if not tail_sampled:
        return errors
    if len(tail_sampled) > 1:
        return errors + [f"tail_sampling in several pipelines: {tail_sampled}"]
    pid = tail_sampled[0]
    (ts_id,) = [x for x in pipelines[pid]["processors"] if ctype(x) == "tail_sampling"]
    ts = (cfg.get("processors") or {}).get(ts_id) or {}
    policies = ts.get("policies") or []
    unselective = [p["name"] for p in policies if p.get("type") in UNSELECTIVE_TYPES]
    selective = [p["name"] for p in policies if p.get("type") not in UNSELECTIVE_TYPES and p.get("type") != "drop"]
    names = [p["name"] for p in policies]
    last_selective = max((names.index(n) for n in selective), default=-1)
    for name in unselective:
        if names.index(name) < last_selective:
            errors.append(
                f"processors.{ts_id}: policy {name!r} comes before {names[last_selective]!r}: the recorded "
                "policy is the first that sampled a trace, so a trace kept for a reason could be recorded "
                f"as kept by {name!r} (and lose its content)"
            )
    if not ((ts.get("decision_cache") or {}).get("sampled_cache_size") or 0) > 0:
        errors.append(
            f"processors.{ts_id}: decision_cache.sampled_cache_size must be > 0 (late spans carry the "
            "recorded policy only from that cache)"
        )
    try:
        strips, redactions = content_transforms(cfg)
    except ValueError as exc:
        return errors + [f"pipeline {pid}: {exc}"]
    if len(strips) != 1:
        errors.append(
            f"pipeline {pid}: needs one transform after tail_sampling deleting content by recorded policy, "
            f"found {[s[0] for s in strips]}"
        )
    for x, when, deletes in strips:
        if None not in when:
            errors.append(
                f"processors.{x}: keeps content on spans without a recorded policy (add the nil condition: "
                f"gate off or a late span): it must fail closed"
            )
        unknown = sorted(v for v in when - {None} if v not in names)
        if unknown:
            errors.append(f"processors.{x}: names policies tail_sampling does not have: {unknown}")
        if when - {None} != set(unselective):
            errors.append(
                f"processors.{x}: deletes content on traces recorded as kept by {sorted(when - {None})}, "
                f"must be exactly the unselective policies {sorted(unselective)}"
            )
        for key in CONTENT_ATTRIBUTES:
            if key not in deletes:
                errors.append(f"processors.{x}: does not delete {key!r}")
        for key in deletes:
            if key not in SEMCONV_NAMES:
                errors.append(f"processors.{x}: attribute {key!r} is not a name in otel_llm/semconv.py")
    if len(redactions) != 1:
        errors.append(
            f"pipeline {pid}: needs one redaction transform after tail_sampling, found {[r[0] for r in redactions]}"
        )
    from otel_llm import redaction

    tokens = {rule.replacement for rule in redaction.BUILTIN_RULES}
    for x, replaces in redactions:
        per_key = {key: [(rx, repl) for k, rx, repl in replaces if k == key] for key in {k for k, _, _ in replaces}}
        for key in per_key:
            if key not in CONTENT_ATTRIBUTES:
                errors.append(f"processors.{x}: redacts {key!r}, not a content attribute {CONTENT_ATTRIBUTES}")
        rules = per_key.get(CONTENT_ATTRIBUTES[0], [])
        for key in CONTENT_ATTRIBUTES:
            if per_key.get(key) != rules:
                errors.append(
                    f"processors.{x}: {key!r} does not get the same rules, in the same order, "
                    f"as {CONTENT_ATTRIBUTES[0]!r}"
                )
        used = {t for _, repl in rules for t in re.findall(r"<[A-Z_]+>", repl)}
        if used != tokens:
            errors.append(
                f"processors.{x}: replacement tokens {sorted(used)} are not otel_llm/redaction.py's {sorted(tokens)}"
            )
        for regex, repl in rules:
            for problem in re2_problems(regex):
                errors.append(f"processors.{x}: regex {regex[:40]!r}...: {problem}")
            try:
                groups = re.compile(regex, re.ASCII).groups
            except re.error:
                continue
            for name in template_groups(repl):
                if not name.isdigit() or not 1 <= int(name) <= groups:
                    errors.append(f"processors.{x}: replacement {repl!r} refers to ${name}, not a group of its regex")
    return errors


def check_all(cfg: dict) -> list[str]:
    return (
        check_wiring(cfg)
        + check_components(cfg)
        + check_policy_attributes(cfg)
        + check_other_attributes(cfg)
        + check_usage(cfg)
        + check_content(cfg)
    )


# --------------------------------------------------------------------------------------------
# Policy evaluator (our reading of the policy semantics; the real processor decides)
# --------------------------------------------------------------------------------------------

_OPS = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
}


def _ottl_term(attrs: dict, key: str, op: str, lit) -> bool:
    value = attrs.get(key)
    if op in ("==", "!="):
        if isinstance(value, bool) != isinstance(lit, bool) and value is not None and lit is not None:
            return op == "!="
        return _OPS[op](value, lit)
    if value is None or isinstance(value, (bool, str)) or isinstance(lit, (bool, str)) or lit is None:
        return False  # OTTL: ordering comparisons with nil / other types are false
    return _OPS[op](value, lit)


def policy_matches(policy: dict, trace: list[dict]) -> bool | None:
    """True / False for deterministic policies; None for probabilistic (may keep any trace)."""
    t = policy["type"]
    block = policy.get(t) or {}
    if t == "probabilistic":
        return None
    if t == "status_code":
        return any(s.get("status", "UNSET") in block["status_codes"] for s in trace)
    if t == "latency":
        duration = max(s["end_ms"] for s in trace) - min(s["start_ms"] for s in trace)
        upper = block.get("upper_threshold_ms")
        return duration >= block["threshold_ms"] and (not upper or duration <= upper)
    if t == "boolean_attribute":
        hit = any(
            isinstance(s["attributes"].get(block["key"]), bool) and s["attributes"][block["key"]] == block["value"]
            for s in trace
        )
        return hit != bool(block.get("invert_match"))
    if t == "numeric_attribute":  # int attributes only
        hit = any(
            _type_ok(int, s["attributes"].get(block["key"]))
            and block.get("min_value", 0) <= s["attributes"][block["key"]] <= block["max_value"]
            for s in trace
        )
        return hit != bool(block.get("invert_match"))
    if t == "string_attribute":
        hit = any(s["attributes"].get(block["key"]) in block["values"] for s in trace)
        return hit != bool(block.get("invert_match"))
    if t == "ottl_condition":
        conds = [parse_ottl(c) for c in block.get("span") or []]
        return any(
            any(all(_ottl_term(s["attributes"], *term) for term in ands) for ands in cond)
            for cond in conds
            for s in trace
        )
    if t == "and":
        results = [policy_matches(p, trace) for p in block["and_sub_policy"]]
        return all(r is not False for r in results) if None in results else all(results)
    raise AssertionError(f"evaluator does not know policy type {t!r}")


def keeping_policies(policies: list[dict], trace: list[dict]) -> set[str]:
    """Names of the policies that would sample the trace (probabilistic ones always listed)."""
    return {p["name"] for p in policies if policy_matches(p, trace) is not False}


def recorded_policy(policies: list[dict], trace: list[dict], baseline_samples: bool) -> str | None:
    """The policy tail_sampling records for a trace (recordpolicy gate): the first, in config order,
    that samples it (contrib processor.go makeDecision keeps the first policy per decision); None if
    none does. `baseline_samples`: what the probabilistic policies decide for this trace id."""
    for p in policies:
        if p["type"] == "drop":
            raise AssertionError("drop policies are evaluated first and may drop the trace: not modelled")
        hit = policy_matches(p, trace)
        if hit is True or (hit is None and baseline_samples):
            return p["name"]
    return None


def synthetic_trace(
    genai_attrs: dict | None = None, *, status: str = "UNSET", duration_ms: int = 1200, http_status: str = "UNSET"
) -> list[dict]:
    base = {
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
        semconv.GEN_AI_PROVIDER_NAME: semconv.PROVIDER_VLLM,
        semconv.GEN_AI_REQUEST_MODEL: "llama-3-8b",
        semconv.GEN_AI_USAGE_INPUT_TOKENS: 600,
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 512,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 150,
        semconv.VLLM_TTFT_SECONDS: 0.12,
        semconv.VLLM_QUEUE_SECONDS: 0.01,
    }
    base.update(genai_attrs or {})
    end = duration_ms
    return [
        {
            "name": "POST /v1/chat/completions",
            "status": http_status,
            "start_ms": 0,
            "end_ms": end,
            "attributes": {url_attributes.URL_PATH: "/v1/chat/completions"},
        },
        {"name": "chat llama-3-8b", "status": status, "start_ms": 1, "end_ms": end - 1, "attributes": base},
        {"name": semconv.SPAN_QUEUE, "start_ms": 1, "end_ms": 11, "attributes": {}},
        {"name": semconv.SPAN_PREFILL, "start_ms": 11, "end_ms": 120, "attributes": {}},
        {"name": semconv.SPAN_DECODE, "start_ms": 120, "end_ms": end - 2, "attributes": {}},
    ]


BASELINE = "baseline"  # the name of the probabilistic policy that keeps traces for no reason of its own


# --------------------------------------------------------------------------------------------
# Reading the configs
# --------------------------------------------------------------------------------------------


def load(name: str) -> dict:
    return yaml.safe_load((CONFIG_DIR / name).read_text())


def tail_sampling_policies(cfg: dict) -> list[dict]:
    return cfg["processors"]["tail_sampling"]["policies"]


# ---- durations ---------------------------------------------------------------------------------

DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}


def duration_seconds(text: str) -> float:
    assert DURATION.match(text), text
    return sum(float(n) * DURATION_UNITS[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", text))


# A small model of the stanza operators the spool receiver uses: our reading of upstream
# (pkg/stanza/operator/parser/json, helper/time.go epoch layouts, helper/trace.go,
# transformer/remove, transformer/copy, fileconsumer attrs). The real receiver decides.

EPOCH_NS = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}


def _field_get(entry: dict, text: str):
    root, key = parse_field(text)
    if root == "body":
        return (entry["body"], entry["body"] is not None) if key is None else (None, False)
    return entry[root].get(key), key in entry[root]


def _apply_trace(entry: dict, conf: dict) -> None:
    for part in ("trace_id", "span_id"):
        value, found = _field_get(entry, (conf.get(part) or {}).get("parse_from") or f"body.{part}")
        if found:
            entry[part] = bytes.fromhex(str(value)).hex()


def run_operators(line: str, receiver: dict, path: str) -> dict | None:
    """The log record a spool line becomes (None: dropped)."""
    entry = {"body": line, "attributes": {}, "resource": {}, "timestamp": None, "trace_id": None, "span_id": None}
    if receiver.get("include_file_name", True):
        entry["attributes"]["log.file.name"] = os.path.basename(path)
    if receiver.get("include_file_path", False):
        entry["attributes"]["log.file.path"] = path
    for op in receiver.get("operators") or []:
        if op.get("if") is not None and STANZA_IF.match(op["if"])["key"] not in entry["attributes"]:
            continue
        try:
            if op["type"] == "json_parser":
                value, _ = _field_get(entry, op.get("parse_from", "body"))
                parsed = json.loads(value, parse_int=None if op.get("parse_ints") else float)
                if not isinstance(parsed, dict):
                    raise ValueError("not a JSON object")
                assert parse_field(op.get("parse_to", "attributes")) == ("attributes", None)
                entry["attributes"].update(parsed)  # stanza merges a map into the attributes
                if op.get("timestamp"):
                    ts = op["timestamp"]
                    assert ts["layout_type"] == "epoch", "the model knows epoch layouts only"
                    stamp, found = _field_get(entry, ts["parse_from"])
                    if not found:
                        raise ValueError("no timestamp field")
                    entry["timestamp"] = int(stamp) * EPOCH_NS[ts["layout"]]
                if op.get("trace"):
                    _apply_trace(entry, op["trace"])
            elif op["type"] == "trace_parser":
                _apply_trace(entry, op)
            elif op["type"] == "remove":
                root, key = parse_field(op["field"])
                if root == "body":
                    entry["body"] = None
                elif entry[root].pop(key, KeyError) is KeyError:
                    raise ValueError(f"remove: field does not exist: {op['field']}")
            elif op["type"] == "copy":
                value, found = _field_get(entry, op["from"])
                if not found:
                    raise ValueError(f"copy: no {op['from']}")
                root, key = parse_field(op["to"])
                entry[root][key] = value
            else:
                raise AssertionError(f"the model does not know operator type {op['type']!r}")
        except ValueError:
            if op.get("on_error", "send").startswith("drop"):
                return None
    return entry


# ---- the content transforms applied to one value ------------------------------------------------


def collector_redact(cfg: dict, value: str) -> str:
    """A content attribute's value after the config's redaction transform(s), whatever its policy."""
    (span,) = release(cfg, [{"attributes": {semconv.GEN_AI_INPUT_MESSAGES: value}}], "errors-status")
    return span["attributes"][semconv.GEN_AI_INPUT_MESSAGES]


def redaction_rules(cfg: dict) -> list[tuple[str, str]]:
    ((_, replaces),) = content_transforms(cfg)[1]
    return [(rx, repl) for key, rx, repl in replaces if key == semconv.GEN_AI_INPUT_MESSAGES]
