"""Static checks of the collector configs in collector-config/ (no otelcol binary exists here).

- every YAML under collector-config/ (except prometheus/) parses and is wired: each component a
  pipeline references is defined, each defined one is used, connectors are exporter in one
  pipeline and receiver in another, with the signals their metadata allows;
- component types exist in otelcol-contrib (schemas in tests/fixtures/collector_schemas, else the contrib
  component list), and the names are the current ones for the stated range (v0.144+);
- component config keys exist in the component's upstream config schema (recursively, following
  $ref / allOf), tail_sampling policy blocks included;
- every attribute a tail_sampling policy, the span_metrics dimensions or the noise filter reads is
  one otel-llm emits (a name in otel_llm/semconv.py; HTTP names from the OTel HTTP semconv), with
  the type the policy needs (numeric_attribute: int, boolean_attribute: bool, OTTL literal of the
  attribute's type);
- a small evaluator applies the policies to synthetic traces: each special case is kept by its
  policy, a normal request only by the probabilistic baseline. The real processor decides; this
  only checks our policy logic against our attribute names.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml
from opentelemetry.semconv.attributes import http_attributes, url_attributes

from otel_llm import semconv

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "collector-config"
# a copy of shared/collector_schemas (Apache-2.0; provenance in its README), so a clone is self-contained
SCHEMAS = Path(__file__).resolve().parent / "fixtures" / "collector_schemas"

CONFIG_FILES = sorted(
    p for p in CONFIG_DIR.rglob("*.y*ml") if "prometheus" not in p.relative_to(CONFIG_DIR).parts
)

KINDS = ("receivers", "processors", "exporters", "connectors", "extensions")
KIND_CLASS = {"receivers": "receiver", "processors": "processor", "exporters": "exporter",
              "connectors": "connector", "extensions": "extension"}

# Attribute types as otel-llm sets them (otel_llm/vllm/request_telemetry.py, openai/telemetry.py):
# token counts are ints, latencies float seconds, flags bool, error.type a string.
EMITTED_TYPES: dict[str, type] = {
    semconv.GEN_AI_USAGE_INPUT_TOKENS: int,
    semconv.GEN_AI_USAGE_OUTPUT_TOKENS: int,
    semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: int,
    semconv.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS: int,
    semconv.GEN_AI_REQUEST_MAX_TOKENS: int,
    semconv.VLLM_PREEMPTIONS: int,
    semconv.VLLM_LOCAL_CACHED_TOKENS: int,
    semconv.VLLM_EXTERNAL_CACHED_TOKENS: int,
    semconv.VLLM_QUEUE_SECONDS: float,
    semconv.VLLM_PREFILL_SECONDS: float,
    semconv.VLLM_DECODE_SECONDS: float,
    semconv.VLLM_TTFT_SECONDS: float,
    semconv.VLLM_TPOT_SECONDS: float,
    semconv.VLLM_E2E_SECONDS: float,
    semconv.VLLM_STREAM_TTFT_SECONDS: float,
    semconv.VLLM_ABORTED: bool,
    semconv.VLLM_PHASE_TIMING_UNAVAILABLE: bool,
    semconv.GEN_AI_REQUEST_STREAM: bool,
    semconv.ERROR_TYPE: str,
    semconv.GEN_AI_OPERATION_NAME: str,
    semconv.GEN_AI_REQUEST_MODEL: str,
    semconv.GEN_AI_RESPONSE_MODEL: str,
    semconv.GEN_AI_PROVIDER_NAME: str,
    semconv.TENANT_ID: str,
    semconv.TENANT_SCENE: str,
}
SEMCONV_NAMES = {v for k, v in vars(semconv).items() if k.isupper() and isinstance(v, str)}
# Names the HTTP server spans carry (opentelemetry-instrumentation-fastapi), used by the noise filter.
HTTP_NAMES = {url_attributes.URL_PATH: str, http_attributes.HTTP_ROUTE: str}

# Deprecated type names we still use on purpose, with the reason.
ALLOWED_DEPRECATED = {
    # renamed to load_balancing by PR #48533 (2026-05), after v0.144: the old name loads on the
    # whole supported range, the new one only on recent releases.
    "loadbalancing",
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
    (SCHEMAS / "contrib/connector/spanmetricsconnector/internal/metrics", "unit"):
        {"type": "string", "enum": ["ms", "s"]},
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
        target = SCHEMAS / "core" / pkg[len("go.opentelemetry.io/collector/"):]
    elif pkg.startswith("github.com/open-telemetry/opentelemetry-collector-contrib/"):
        target = SCHEMAS / "contrib" / pkg[len("github.com/open-telemetry/opentelemetry-collector-contrib/"):]
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
            errors.append(f"{where}: {value!r} is not a valid {node.get('format') or node['type']}"
                          + (f" (one of {node['enum']})" if "enum" in node else ""))
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
            errors.append(f"connector {c!r} must be an exporter in one pipeline and a receiver in "
                          f"another (exporter in {conn_as_exporter.get(c)}, receiver in {conn_as_receiver.get(c)})")
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
                    for key, op, lit in (term for ands in parsed for term in ands):
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
    return errors


def check_all(cfg: dict) -> list[str]:
    return check_wiring(cfg) + check_components(cfg) + check_policy_attributes(cfg) + check_other_attributes(cfg)


# --------------------------------------------------------------------------------------------
# Policy evaluator (our reading of the policy semantics; the real processor decides)
# --------------------------------------------------------------------------------------------

_OPS = {
    "==": lambda a, b: a == b, "!=": lambda a, b: a != b,
    ">": lambda a, b: a > b, ">=": lambda a, b: a >= b, "<": lambda a, b: a < b, "<=": lambda a, b: a <= b,
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
        hit = any(isinstance(s["attributes"].get(block["key"]), bool)
                  and s["attributes"][block["key"]] == block["value"] for s in trace)
        return hit != bool(block.get("invert_match"))
    if t == "numeric_attribute":  # int attributes only
        hit = any(_type_ok(int, s["attributes"].get(block["key"]))
                  and block.get("min_value", 0) <= s["attributes"][block["key"]] <= block["max_value"]
                  for s in trace)
        return hit != bool(block.get("invert_match"))
    if t == "string_attribute":
        hit = any(s["attributes"].get(block["key"]) in block["values"] for s in trace)
        return hit != bool(block.get("invert_match"))
    if t == "ottl_condition":
        conds = [parse_ottl(c) for c in block.get("span") or []]
        return any(any(all(_ottl_term(s["attributes"], *term) for term in ands) for ands in cond)
                   for cond in conds for s in trace)
    if t == "and":
        results = [policy_matches(p, trace) for p in block["and_sub_policy"]]
        return all(r is not False for r in results) if None in results else all(results)
    raise AssertionError(f"evaluator does not know policy type {t!r}")


def keeping_policies(policies: list[dict], trace: list[dict]) -> set[str]:
    """Names of the policies that would sample the trace (probabilistic ones always listed)."""
    return {p["name"] for p in policies if policy_matches(p, trace) is not False}


def synthetic_trace(genai_attrs: dict | None = None, *, status: str = "UNSET",
                    duration_ms: int = 1200, http_status: str = "UNSET") -> list[dict]:
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
        {"name": "POST /v1/chat/completions", "status": http_status, "start_ms": 0, "end_ms": end,
         "attributes": {url_attributes.URL_PATH: "/v1/chat/completions"}},
        {"name": "chat llama-3-8b", "status": status, "start_ms": 1, "end_ms": end - 1,
         "attributes": base},
        {"name": semconv.SPAN_QUEUE, "start_ms": 1, "end_ms": 11, "attributes": {}},
        {"name": semconv.SPAN_PREFILL, "start_ms": 11, "end_ms": 120, "attributes": {}},
        {"name": semconv.SPAN_DECODE, "start_ms": 120, "end_ms": end - 2, "attributes": {}},
    ]


CASES = {
    "normal": synthetic_trace(),
    "error": synthetic_trace({semconv.ERROR_TYPE: "500"}, status="ERROR", http_status="ERROR"),
    "rejected_4xx": synthetic_trace({semconv.ERROR_TYPE: "400", semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 0}),
    "aborted": synthetic_trace({semconv.VLLM_ABORTED: True, semconv.ERROR_TYPE: semconv.ERROR_CLIENT_ABORTED}),
    "slow": synthetic_trace(duration_ms=45_000),
    "slow_ttft": synthetic_trace({semconv.VLLM_TTFT_SECONDS: 7.5}),
    "big_input": synthetic_trace({semconv.GEN_AI_USAGE_INPUT_TOKENS: 60_000,
                                  semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 58_000}),
    "big_output": synthetic_trace({semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 12_000}, duration_ms=25_000),
    "cache_miss": synthetic_trace({semconv.GEN_AI_USAGE_INPUT_TOKENS: 9_000,
                                   semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 0}),
}
# case -> the policies that must keep it (besides the baseline)
EXPECTED = {
    "normal": set(),
    "error": {"errors-status", "errors-type"},
    "rejected_4xx": {"errors-type"},
    "aborted": {"aborted", "errors-type"},
    "slow": {"slow-requests"},
    "slow_ttft": {"slow-ttft"},
    "big_input": {"big-input"},
    "big_output": {"big-output"},
    "cache_miss": {"cache-miss-long-prompt"},
}
BASELINE = "baseline"


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------

def load(name: str) -> dict:
    return yaml.safe_load((CONFIG_DIR / name).read_text())


def tail_sampling_policies(cfg: dict) -> list[dict]:
    return cfg["processors"]["tail_sampling"]["policies"]


def test_config_files_present():
    names = {p.relative_to(CONFIG_DIR).as_posix() for p in CONFIG_FILES}
    assert {"otelcol.yaml", "agent.yaml", "sampler.yaml"} <= names
    assert SCHEMAS.is_dir(), f"component schemas not found at {SCHEMAS}"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.relative_to(CONFIG_DIR).as_posix())
def test_config_is_valid(path):
    cfg = yaml.safe_load(path.read_text())
    assert isinstance(cfg, dict) and "service" in cfg
    errors = check_all(cfg)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", ["otelcol.yaml", "sampler.yaml"])
def test_span_metrics_before_sampling(name):
    cfg = load(name)
    pipes = cfg["service"]["pipelines"]
    entry = [pid for pid, p in pipes.items() if "otlp" in p["receivers"] and pid.startswith("traces")]
    assert len(entry) == 1
    assert set(pipes[entry[0]]["exporters"]) == {"span_metrics", "forward"}
    assert "tail_sampling" not in pipes[entry[0]].get("processors", [])
    sampled = [pid for pid, p in pipes.items() if "forward" in p["receivers"]]
    assert len(sampled) == 1 and pipes[sampled[0]]["processors"][0] == "tail_sampling"
    assert any(e.startswith("otlp_grpc/") or e.startswith("otlp_http/") for e in pipes[sampled[0]]["exporters"])
    metrics = [p for pid, p in pipes.items() if pid.startswith("metrics") and "span_metrics" in p["receivers"]]
    assert metrics and any(ctype(e) in ("prometheus", "prometheus_remote_write") for e in metrics[0]["exporters"])
    assert cfg["connectors"]["span_metrics"]["exemplars"]["enabled"] is True
    assert cfg["exporters"]["prometheus"]["enable_open_metrics"] is True


def test_sampler_policies_match_all_in_one():
    assert load("sampler.yaml")["processors"]["tail_sampling"] == load("otelcol.yaml")["processors"]["tail_sampling"]


def test_decision_wait_covers_long_streams():
    ts = load("otelcol.yaml")["processors"]["tail_sampling"]
    wait = ts["decision_wait"]
    seconds = int(wait[:-1]) * {"s": 1, "m": 60}[wait[-1]]
    assert seconds >= 300  # > longest streaming request (see comment in the file)
    assert ts["num_traces"] >= ts["expected_new_traces_per_sec"] * seconds


def test_agent_routes_by_trace_id():
    cfg = load("agent.yaml")
    lb = cfg["exporters"]["loadbalancing"]
    assert lb["routing_key"] == "traceID"
    assert set(lb["resolver"]) & {"dns", "static", "k8s"}
    assert "tail_sampling" not in cfg.get("processors", {})
    assert cfg["service"]["pipelines"]["traces"]["exporters"] == ["loadbalancing"]


def test_metrics_pipeline_receives_our_otlp_metrics():
    for name in ("otelcol.yaml", "agent.yaml"):
        pipes = load(name)["service"]["pipelines"]
        assert any("otlp" in p["receivers"] for pid, p in pipes.items() if pid.startswith("metrics")), name


@pytest.mark.parametrize("case", sorted(CASES))
def test_policy_evaluator(case):
    policies = tail_sampling_policies(load("otelcol.yaml"))
    kept_by = keeping_policies(policies, CASES[case])
    assert BASELINE in kept_by  # probabilistic may keep anything
    assert kept_by - {BASELINE} == EXPECTED[case], f"{case}: kept by {sorted(kept_by)}"


def test_every_policy_is_exercised():
    policies = tail_sampling_policies(load("otelcol.yaml"))
    hit = set().union(*(keeping_policies(policies, t) for t in CASES.values()))
    assert hit == {p["name"] for p in policies}


def test_numeric_attribute_ignores_floats():
    """Why TTFT uses OTTL: a numeric_attribute policy on a float attribute never matches."""
    policy = {"name": "x", "type": "numeric_attribute",
              "numeric_attribute": {"key": semconv.VLLM_TTFT_SECONDS, "min_value": 1, "max_value": 100}}
    assert policy_matches(policy, synthetic_trace({semconv.VLLM_TTFT_SECONDS: 7.5})) is False


# ---- negative tests: mutated copies must fail ---------------------------------------------------

@pytest.fixture
def cfg():
    return copy.deepcopy(load("otelcol.yaml"))


def test_negative_dangling_exporter(cfg):
    cfg["service"]["pipelines"]["traces/sampled"]["exporters"].append("otlp_http/missing")
    assert any("'otlp_http/missing' is not defined" in e for e in check_wiring(cfg))


def test_negative_unused_component(cfg):
    cfg["exporters"]["otlp_http/unused"] = {"endpoint": "http://x:4318"}
    assert any("'otlp_http/unused' is defined but not used" in e for e in check_wiring(cfg))


def test_negative_dangling_forward(cfg):
    del cfg["service"]["pipelines"]["traces/sampled"]
    cfg["exporters"].pop("otlp_grpc/tempo")
    cfg["processors"].pop("tail_sampling")
    errors = check_wiring(cfg)
    assert any("connector 'forward' must be an exporter in one pipeline and a receiver" in e for e in errors)


def test_negative_connector_signal_mismatch(cfg):
    # span_metrics makes metrics: feeding it into a traces pipeline is wrong
    cfg["service"]["pipelines"]["traces/sampled"]["receivers"].append("span_metrics")
    assert any("traces_to_traces" in e for e in check_wiring(cfg))


def test_negative_unknown_attribute(cfg):
    policies = tail_sampling_policies(cfg)
    policies.append({"name": "bogus", "type": "numeric_attribute",
                     "numeric_attribute": {"key": "gen_ai.usage.prompt_tokens", "min_value": 1, "max_value": 2}})
    policies.append({"name": "bogus-ottl", "type": "ottl_condition",
                     "ottl_condition": {"span": ['attributes["vllm.ttft"] > 1.0']}})
    errors = check_policy_attributes(cfg)
    assert any("'gen_ai.usage.prompt_tokens' is not a name in otel_llm/semconv.py" in e for e in errors)
    assert any("'vllm.ttft' is not a name" in e for e in errors)


def test_negative_wrong_attribute_type(cfg):
    policies = tail_sampling_policies(cfg)
    policies.append({"name": "ttft-numeric", "type": "numeric_attribute",
                     "numeric_attribute": {"key": semconv.VLLM_TTFT_SECONDS, "min_value": 5, "max_value": 100}})
    policies.append({"name": "ttft-int-literal", "type": "ottl_condition",
                     "ottl_condition": {"span": [f'attributes["{semconv.VLLM_TTFT_SECONDS}"] > 5']}})
    policies.append({"name": "aborted-string", "type": "boolean_attribute",
                     "boolean_attribute": {"key": semconv.VLLM_ABORTED, "value": "true"}})
    errors = check_policy_attributes(cfg)
    assert any("[ttft-numeric]" in e and "is float, policy needs int" in e for e in errors)
    assert any("[ttft-int-literal]" in e and "is float, policy needs int" in e for e in errors)
    assert any("[aborted-string]" in e and "value must be a bool" in e for e in errors)


def test_negative_unknown_policy_field(cfg):
    for p in tail_sampling_policies(cfg):
        if p["type"] == "latency":
            p["latency"]["threshold_msec"] = p["latency"].pop("threshold_ms")
    errors = check_components(cfg)
    assert any("policies[" in e and "unknown key 'threshold_msec'" in e for e in errors), errors


def test_negative_unknown_component_key(cfg):
    cfg["connectors"]["span_metrics"]["exemplar"] = {"enabled": True}
    cfg["processors"]["memory_limiter"]["limit_mb"] = 100
    cfg["exporters"]["otlp_grpc/tempo"]["tls"]["insecur"] = True
    errors = check_components(cfg)
    assert any("connectors.span_metrics: unknown key 'exemplar'" in e for e in errors), errors
    assert any("processors.memory_limiter: unknown key 'limit_mb'" in e for e in errors), errors
    assert any("exporters.otlp_grpc/tempo.tls: unknown key 'insecur'" in e for e in errors), errors


def test_negative_unknown_or_deprecated_type(cfg):
    cfg["connectors"]["spanmetrics"] = cfg["connectors"].pop("span_metrics")
    cfg["processors"]["tailsamplin"] = {}
    errors = check_components(cfg)
    assert any("'spanmetrics' is a deprecated name, use 'span_metrics'" in e for e in errors), errors
    assert any("no component type 'tailsamplin'" in e for e in errors), errors


def test_negative_loadbalancing_schema():
    cfg = copy.deepcopy(load("agent.yaml"))
    cfg["exporters"]["loadbalancing"]["resolver"]["dns"]["hostnames"] = ["a"]
    errors = check_components(cfg)
    assert any("resolver.dns: unknown key 'hostnames'" in e for e in errors), errors


def test_negative_scalar_types(cfg):
    ts = cfg["processors"]["tail_sampling"]
    ts["decision_wait"] = 600  # a bare number is not a duration
    ts["sampling_strategy"] = "trace-completed"
    cfg["connectors"]["span_metrics"]["exemplars"]["enabled"] = "yes"
    errors = check_components(cfg)
    assert any("decision_wait: 600 is not a valid" in e for e in errors), errors
    assert any("sampling_strategy: 'trace-completed'" in e for e in errors), errors
    assert any("exemplars.enabled: 'yes' is not a valid boolean" in e for e in errors), errors
