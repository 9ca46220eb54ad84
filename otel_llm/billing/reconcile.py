"""`otel-llm reconcile`: the usage ledger's totals against vLLM's own token counters.

Per instance and model (or per model, `--by model`, when the ledger's `service.instance.id` and
Prometheus' `instance` label name servers differently), over one window:

    ledger input tokens        vs  vllm:prompt_tokens_total
    ledger cached input tokens vs  vllm:prompt_tokens_cached_total
    ledger output tokens       vs  vllm:generation_tokens_total

Known, explained differences: vLLM counts the prompt of an n > 1 request once per choice (each
choice is an engine request), `usage` and the ledger once; the ledger knows n, so the expected
engine figure is input + input x (n - 1). Anything else is flagged and the command exits 1: a
dropped record, a server without OTEL_LLM_USAGE_DIR, or a request in flight across the window's
edges (the engine counts tokens as it computes them, the ledger when the request ends: choose
windows whose edges are quiet, or allow for it with --tolerance).

Ledger instances are matched to Prometheus instances by name, else by port when that port is
unique on both sides (`host:8000` vs `10.0.0.5:8000`).

When the ledger holds engine records (schema 2), a second check per engine instance: the compute_ns
of its engine records vs the busy_ns of its engine_window records, both ended in the window. They
differ by the requests in flight at the window's edges (a request's record holds all its compute, a
window the busy time inside it): ok within 1 % or 1 s, else MISMATCH. Records that ended after an
engine's last window are not compared (a running engine writes a window when it is next busy after
OTEL_LLM_ENGINE_COST_WINDOW seconds, and at shutdown); an engine with no window yet is `pending`, not a
failure.
"""

from __future__ import annotations

import json
import sys

from otel_llm import semconv
from otel_llm.billing import ledger as ledger_module
from otel_llm.billing.promql import ReportError
from otel_llm.billing.report import Prometheus, exact_increase
from otel_llm.billing.rows import UNSET, add_window_arguments, time_range, utc_iso

ENGINE_COUNTERS = (  # (ledger token type, vLLM counter)
    ("input", semconv.VLLM_METRIC_PROMPT_TOKENS_TOTAL),
    ("cached_input", semconv.VLLM_METRIC_PROMPT_TOKENS_CACHED_TOTAL),
    ("output", semconv.VLLM_METRIC_GENERATION_TOKENS_TOTAL),
)
BY_CHOICES = ("instance,model", "model")


def _match_instances(ledger_instances: set[str], engine_instances: set[str]) -> dict[str, str]:
    """ledger instance -> Prometheus instance."""
    mapping = {i: i for i in ledger_instances & engine_instances}
    left = ledger_instances - set(mapping)
    right = engine_instances - set(mapping.values())

    def port(name: str) -> str:
        return name.rpartition(":")[2]

    for name in left:
        same_port = [r for r in right if port(r) == port(name)]
        if len(same_port) == 1 and sum(port(n) == port(name) for n in left) == 1:
            mapping[name] = same_port[0]
    return mapping


def reconcile(
    ledger: ledger_module.Ledger, prom: Prometheus, start: float, end: float, by_instance: bool, tolerance: int = 0
) -> list[dict]:
    by = ["instance", "model"] if by_instance else ["model"]
    ours = ledger.reconcile_totals(start, end, by)
    engine_by = ["instance", semconv.VLLM_LABEL_MODEL] if by_instance else [semconv.VLLM_LABEL_MODEL]
    engine = {
        token_type: exact_increase(prom, counter, start, end, engine_by) for token_type, counter in ENGINE_COUNTERS
    }
    if by_instance:
        mapping = _match_instances({k[0] for k in ours}, {k[0] for c in engine.values() for k in c})
        ours = {(mapping.get(k[0], k[0]), *k[1:]): v for k, v in ours.items()}
    keys = sorted(set(ours) | {k for counter in engine.values() for k in counter})
    rows = []
    for key in keys:
        item = ours.get(key, {})
        for token_type, counter in ENGINE_COUNTERS:
            billed = int(item.get(token_type, 0))
            counted = int(round(engine[token_type].get(key, 0)))
            explained, why = 0, ""
            if token_type == "input" and int(item.get("extra_choice_prompts", 0)):
                explained = int(item["extra_choice_prompts"])
                why = (
                    f"vLLM counts the prompt once per choice: {item['multi_choice_requests']} "
                    f"request(s) with n > 1 add {explained}"
                )
            unexplained = counted - billed - explained
            state = "ok" if abs(unexplained) <= tolerance else "MISMATCH"
            if not item and counted:
                why = "no ledger records for this server/model (is OTEL_LLM_USAGE_DIR set there?)"
            rows.append(
                {
                    **dict(zip(by, key)),
                    "tokens": token_type,
                    "ledger": billed,
                    "engine": counted,
                    "engine_metric": counter,
                    "explained": explained,
                    "unexplained": unexplained,
                    "state": state,
                    "note": why,
                }
            )
    return rows


ENGINE_TOLERANCE = (0.01, 1e9)  # an engine's compute vs busy time: ok within 1 %, or 1 s (in ns)


def engine_check(ledger: ledger_module.Ledger, start: float, end: float) -> list[dict]:
    """Per engine instance, its engine records' compute_ns vs its engine_window records' busy_ns;
    empty when the window holds no engine records."""
    found = ledger.engine_check(start, end)
    if not any(int(item["engine_records"]) + int(item["pending"]) for item in found):
        return []
    rows = []
    for item in found:
        compute, busy, pending = int(item["compute_ns"]), int(item["busy_ns"]), int(item["pending"])
        ok = abs(compute - busy) <= max(ENGINE_TOLERANCE[0] * busy, ENGINE_TOLERANCE[1])
        if not int(item["windows"]):  # a running engine writes its first window once next busy after a window's time
            state, note = "pending", f"no engine_window record yet ({pending} engine records wait for one)"
        else:
            state = "ok" if ok else "MISMATCH"
            note = f"{pending} engine records after the last window, not compared" if pending else ""
        rows.append(
            {
                "engine_instance": item["engine_instance"],
                "engine_records": int(item["engine_records"]),
                "compute_s": compute / 1e9,
                "busy_s": busy / 1e9,
                "difference_s": (compute - busy) / 1e9,
                "state": state,
                "note": note,
            }
        )
    return rows


def render(rows: list[dict], by: list[str], fmt: str, start: float, end: float, engines: list[dict] = ()) -> str:
    if fmt == "json":
        return json.dumps(
            {"start": utc_iso(start), "end": utc_iso(end), "rows": rows, **({"engines": engines} if engines else {})},
            indent=2,
        )
    columns = [*by, "tokens", "ledger", "engine", "explained", "unexplained", "state", "note"]
    lines = [f"ledger vs engine counters {utc_iso(start)} .. {utc_iso(end)}", *_table(columns, rows)]
    if engines:
        columns = ["engine_instance", "engine_records", "compute_s", "busy_s", "difference_s", "state", "note"]
        lines += [
            "",
            f"engine records' compute vs engine_window busy time {utc_iso(start)} .. {utc_iso(end)}",
            *_table(
                columns, [{**r, **{c: f"{r[c]:.3f}" for c in ("compute_s", "busy_s", "difference_s")}} for r in engines]
            ),
        ]
    return "\n".join(lines)


def _table(columns: list[str], rows: list[dict]) -> list[str]:
    table = [columns] + [[str(r.get(c, UNSET)) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    return ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table]


def add_arguments(parser) -> None:
    ledger_module.add_ledger_argument(parser)
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus scraping vLLM's /metrics")
    parser.add_argument("--by", choices=BY_CHOICES, default="instance,model")
    add_window_arguments(parser)
    parser.add_argument(
        "--tolerance",
        type=int,
        default=0,
        help="tokens of difference per row still called ok (requests in flight at the edges)",
    )
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.add_argument("--timeout", type=float, default=30.0)


def run(args, now: float, out=sys.stdout, err=sys.stderr) -> int:
    try:
        start, end = time_range(args.start, args.end, args.range_, now)
        ledger = ledger_module.open_ledger(args.ledger, args.timeout)
        by_instance = args.by == "instance,model"
        rows = reconcile(ledger, Prometheus(args.prometheus, args.timeout), start, end, by_instance, args.tolerance)
        engines = engine_check(ledger, start, end)
    except ReportError as exc:
        err.write(f"otel-llm reconcile: {exc}\n")
        return 2
    out.write(render(rows, args.by.split(","), args.format, start, end, engines) + "\n")
    return 1 if any(r["state"] not in ("ok", "pending") for r in [*rows, *engines]) else 0
