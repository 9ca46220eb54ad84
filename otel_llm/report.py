"""`otel-llm report`: token usage and cost per tenant / scene / model / day, from Prometheus.

Billing must equal what the engine counted, to the token, so totals are not taken from PromQL's
`increase()` (which extrapolates to the window's edges and returns fractions). The raw samples of
`gen_ai.server.token.usage` are fetched instead, and each series' increments are added up here:
a counter reset (a restarted server) starts from zero again, and a series first seen inside the
window (a server started inside it) counts from zero.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from otel_llm import semconv

TOKEN_METRIC = semconv.prometheus_name(semconv.SERVER_TOKEN_USAGE, semconv.UNIT_TOKEN, counter=True)
# --by dimension -> Prometheus label of the token counter
DIMENSIONS = {
    "tenant": semconv.prometheus_name(semconv.TENANT_ID),
    "scene": semconv.prometheus_name(semconv.TENANT_SCENE),
    "cost_center": semconv.prometheus_name(semconv.TENANT_COST_CENTER),
    "model": semconv.prometheus_name(semconv.GEN_AI_REQUEST_MODEL),
    "operation": semconv.prometheus_name(semconv.GEN_AI_OPERATION_NAME),
    "instance": "instance",
}
TYPE_LABEL = semconv.prometheus_name(semconv.GEN_AI_TOKEN_TYPE)
TOKEN_TYPES = (semconv.TOKEN_TYPE_INPUT, semconv.TOKEN_TYPE_CACHED_INPUT, semconv.TOKEN_TYPE_OUTPUT)
UNSET = "-"
BASE_LOOKBACK = "35d"
_DAY = 86400


class ReportError(Exception):
    """A problem the user can fix (server, range, price file); printed without a traceback."""


# --- time range ---------------------------------------------------------------------------------

_DURATION = re.compile(r"^(\d+)([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": _DAY, "w": 7 * _DAY}


def parse_duration(text: str) -> int:
    match = _DURATION.match(text.strip())
    if not match or int(match.group(1)) == 0:
        raise ReportError(f"bad duration {text!r}: use e.g. 30m, 24h, 7d, 2w")
    return int(match.group(1)) * _UNITS[match.group(2)]


def parse_time(text: str) -> float:
    """RFC 3339 / ISO 8601 (a date alone is midnight UTC) or Unix seconds."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        value = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ReportError(f"bad time {text!r}: use 2026-12-01, 2026-12-01T08:00:00Z or Unix seconds") from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.timezone.utc)
    return value.timestamp()


def time_range(start: str | None, end: str | None, range_: str | None, now: float) -> tuple[float, float]:
    if range_ and start:
        raise ReportError("give --range or --start, not both")
    end_ts = parse_time(end) if end else now
    if start:
        start_ts = parse_time(start)
    else:
        start_ts = end_ts - parse_duration(range_ or "24h")
    if start_ts >= end_ts:
        raise ReportError(f"the range is empty: start {_iso(start_ts)} is not before end {_iso(end_ts)}")
    if end_ts > now + 60:
        raise ReportError(f"end {_iso(end_ts)} is in the future")
    return start_ts, end_ts


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _day(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d")


# --- prices -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Price:
    input: float  # per million tokens, for input tokens that were not cached
    cached_input: float
    output: float


def read_config(path: Path, what: str):
    """A JSON or YAML (by suffix) file's content; ReportError naming `what` when unreadable."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ReportError(f"{what} {path}: {exc.strerror or exc}") from None
    yaml_file = path.suffix in (".yaml", ".yml")
    try:
        if yaml_file:
            import yaml

            return yaml.safe_load(text)
        return json.loads(text)
    except Exception as exc:  # noqa: BLE001 - any parse error is the file's
        raise ReportError(f"{what} {path} is not valid {'YAML' if yaml_file else 'JSON'}: {exc}") from None


def load_prices(path: str | Path) -> tuple[dict[str, Price], str]:
    """{"currency": "USD", "models": {"MODEL": {"input": .., "cached_input": .., "output": ..}}}
    (per million tokens; a model "*" is the default). JSON, or YAML when PyYAML is installed."""
    path = Path(path)
    data = read_config(path, "price file")
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict) or not data["models"]:
        raise ReportError(f'price file {path}: expected {{"models": {{"MODEL": {{"input": .., '
                          f'"cached_input": .., "output": ..}}}}}}')
    prices = {}
    for model, entry in data["models"].items():
        if not isinstance(entry, dict):
            raise ReportError(f"price file {path}: model {model!r} needs input, cached_input and output prices")
        values = {}
        for key in ("input", "cached_input", "output"):
            value = entry.get(key, entry.get("input") if key == "cached_input" else None)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ReportError(f"price file {path}: model {model!r}: {key} must be a number >= 0, got {value!r}")
            values[key] = float(value)
        prices[str(model)] = Price(**values)
    currency = data.get("currency", "USD")
    return prices, str(currency)


# --- Prometheus ---------------------------------------------------------------------------------

class Prometheus:
    """The few calls of the Prometheus HTTP API we need (any PromQL-compatible server)."""

    def __init__(self, url: str, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def query(self, expr: str, at: float) -> list[dict]:
        params = urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"})
        request = urllib.request.Request(f"{self.url}/api/v1/query?{params}", headers={"Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            body = _json_or_none(exc)
            detail = body.get("error") if isinstance(body, dict) else exc.reason
            raise ReportError(f"Prometheus at {self.url} answered {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ReportError(f"cannot reach Prometheus at {self.url}: {reason}") from None
        except ValueError:
            raise ReportError(f"{self.url} did not answer with Prometheus JSON (is it a Prometheus API?)") from None
        if body.get("status") != "success":
            raise ReportError(f"Prometheus query failed: {body.get('error', body)}")
        return body["data"]["result"]


def _json_or_none(exc):
    try:
        return json.load(exc)
    except Exception:  # noqa: BLE001
        return None


# --- the arithmetic -----------------------------------------------------------------------------

def increments(base: float | None, samples: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(time, tokens added) for each sample of one counter series.

    base: the series' value at the window's start, or None when it had none (it started inside).
    A value below the previous one is a reset: the counter started again from zero."""
    result = []
    previous = base if base is not None else 0.0
    for ts, value in samples:
        added = value - previous if value >= previous else value
        if added:
            result.append((ts, added))
        previous = value
    return result


@dataclass
class Row:
    key: tuple[str, ...]
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOKEN_TYPES, 0))
    cost: float | None = None
    savings: float | None = None
    requests: int | None = None  # known from the ledger, not from Prometheus


def collect(prom: Prometheus, start: float, end: float, by: list[str], chunk: int = _DAY,
            progress=None) -> dict[tuple[str, ...], Row]:
    """Exact token totals per `by` key over [start, end), from raw samples, a chunk at a time."""
    rows: dict[tuple[str, ...], Row] = {}
    # the value each series had at the start of the window: its last sample before it, looking
    # further back than PromQL's 5-minute staleness, so a scrape gap before the window does not
    # make an old series look new (and count its whole total again)
    bases = {_series_id(r["metric"]): float(r["value"][1])
             for r in prom.query(f"last_over_time({TOKEN_METRIC}[{BASE_LOOKBACK}])", start)}
    last: dict[tuple, float | None] = {}
    steps = max(1, int((end - start + chunk - 1) // chunk))
    for step in range(steps):
        lo, hi = start + step * chunk, min(end, start + (step + 1) * chunk)
        if progress:
            progress(step + 1, steps, lo, hi)
        # raw samples in (lo, hi]
        window = max(1, int(round(hi - lo)))
        for series in prom.query(f"{TOKEN_METRIC}[{window}s]", hi):
            metric = series["metric"]
            sid = _series_id(metric)
            samples = [(float(ts), float(v)) for ts, v in series["values"] if lo < float(ts) <= hi]
            base = last.get(sid, bases.get(sid))
            if samples:
                last[sid] = samples[-1][1]
            token_type = metric.get(TYPE_LABEL)
            if token_type not in TOKEN_TYPES:
                continue
            for ts, added in increments(base, samples):
                key = tuple(_day(ts) if d == "day" else metric.get(DIMENSIONS[d], UNSET) for d in by)
                row = rows.setdefault(key, Row(key))
                row.tokens[token_type] += int(round(added))
    return rows


def _series_id(metric: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in metric.items() if k != "__name__"))


def price_rows(rows: dict[tuple, Row], by: list[str], prices: dict[str, Price]) -> list[str]:
    """Adds cost and cache savings to rows; returns the models that had no price."""
    missing = set()
    model_at = by.index("model") if "model" in by else None
    for row in rows.values():
        model = row.key[model_at] if model_at is not None else "*"
        price = prices.get(model) or prices.get("*")
        if price is None:
            missing.add(model)
            continue
        t = row.tokens
        uncached = t[semconv.TOKEN_TYPE_INPUT] - t[semconv.TOKEN_TYPE_CACHED_INPUT]
        row.cost = (uncached * price.input + t[semconv.TOKEN_TYPE_CACHED_INPUT] * price.cached_input
                    + t[semconv.TOKEN_TYPE_OUTPUT] * price.output) / 1e6
        row.savings = t[semconv.TOKEN_TYPE_CACHED_INPUT] * (price.input - price.cached_input) / 1e6
    return sorted(missing)


# --- output -------------------------------------------------------------------------------------

def render(rows: dict[tuple, Row], by: list[str], fmt: str, currency: str | None, start: float, end: float) -> str:
    ordered = [rows[k] for k in sorted(rows)]
    header = [*by, *TOKEN_TYPES] + (["cost", "cache_savings"] if currency else [])
    totals = dict.fromkeys(TOKEN_TYPES, 0)
    cost = savings = 0.0
    for row in ordered:
        for t in TOKEN_TYPES:
            totals[t] += row.tokens[t]
        cost += row.cost or 0.0
        savings += row.savings or 0.0

    def cells(row: Row) -> list:
        money = [_money(row.cost), _money(row.savings)] if currency else []
        return [*row.key, *(row.tokens[t] for t in TOKEN_TYPES), *money]

    if fmt == "json":
        return json.dumps({
            "start": _iso(start), "end": _iso(end), "by": by, "currency": currency,
            "rows": [{**dict(zip(by, r.key)), "tokens": r.tokens,
                      **({"requests": r.requests} if r.requests is not None else {}),
                      **({"cost": r.cost, "cache_savings": r.savings} if currency else {})} for r in ordered],
            "total": {"tokens": totals, **({"cost": cost, "cache_savings": savings} if currency else {})},
        }, indent=2)
    total_row = ["TOTAL", *[""] * (len(by) - 1), *(totals[t] for t in TOKEN_TYPES),
                 *([_money(cost), _money(savings)] if currency else [])]
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(cells(r) for r in ordered)
        writer.writerow(total_row)
        return out.getvalue()
    table = [header, *(list(map(str, cells(r))) for r in ordered), list(map(str, total_row))]
    widths = [max(len(str(line[i])) for line in table) for i in range(len(header))]
    lines = [f"token usage {_iso(start)} .. {_iso(end)}" + (f" (prices in {currency} per million tokens)"
                                                              if currency else "")]
    for index, line in enumerate(table):
        if index == len(table) - 1:
            lines.append("  ".join("-" * w for w in widths))
        lines.append("  ".join(str(c).rjust(w) if i >= len(by) else str(c).ljust(w)
                               for i, (c, w) in enumerate(zip(line, widths))))
    return "\n".join(lines)


def _money(value: float | None) -> str:
    return "" if value is None else f"{value:.6f}"


# --- command line -------------------------------------------------------------------------------

def add_arguments(parser) -> None:
    parser.add_argument("--ledger", metavar="DIR|URL",
                        help="read the usage ledger (the billing source of truth) instead of Prometheus: a spool "
                             "directory (OTEL_LLM_USAGE_DIR), clickhouse://HOST:8123/DATABASE[?table=otel_logs] "
                             "or chdb://SESSION_DIR")
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090",
                        help="Prometheus (or any PromQL API) base URL (default %(default)s)")
    parser.add_argument("--by", default="tenant,model",
                        help=f"comma-separated, from: {', '.join(_all_dimensions())} (default %(default)s)")
    parser.add_argument("--range", dest="range_", metavar="DURATION", help="window ending at --end (or now), e.g. 24h, 7d (default 24h)")
    parser.add_argument("--start", help="window start: 2026-12-01, 2026-12-01T08:00:00Z or Unix seconds")
    parser.add_argument("--end", help="window end (default now)")
    parser.add_argument("--prices", help="price file (JSON or YAML): per model, input / cached_input / output "
                                         "per million tokens")
    parser.add_argument("--budgets", help="budget file: show consumption vs daily budget per tenant/scene "
                                          "(window: the current UTC day unless --start/--range)")
    parser.add_argument("--format", choices=("table", "csv", "json"), default="table")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per Prometheus query")


def _all_dimensions() -> list[str]:
    from otel_llm import ledger

    return [*dict.fromkeys([*DIMENSIONS, *ledger.DIMENSIONS]), "day"]


def usage_rows(args, start: float, end: float, by: list[str], err) -> dict[tuple[str, ...], Row]:
    """Token totals per `by` key: from the ledger with --ledger, else from Prometheus."""
    if getattr(args, "ledger", None):
        from otel_llm import ledger

        return ledger.open_ledger(args.ledger, args.timeout).usage(start, end, by)
    unknown = [d for d in by if d not in DIMENSIONS and d != "day"]
    if unknown:
        raise ReportError(f"--by {','.join(unknown)} needs --ledger (Prometheus labels: "
                          f"{', '.join([*DIMENSIONS, 'day'])})")
    return collect(Prometheus(args.prometheus, args.timeout), start, end, by, progress=_progress(err))


def run(args, now: float, out=sys.stdout, err=sys.stderr) -> int:
    try:
        by = [d.strip() for d in args.by.split(",") if d.strip()]
        unknown = [d for d in by if d not in _all_dimensions()]
        if not by or unknown:
            raise ReportError(f"--by {args.by!r}: choose from {', '.join(_all_dimensions())}")
        if getattr(args, "budgets", None):
            return _budget_view(args, now, out, err)
        start, end = time_range(args.start, args.end, args.range_, now)
        prices, currency = load_prices(args.prices) if args.prices else ({}, None)

        rows = usage_rows(args, start, end, by, err)
        if prices:
            missing = price_rows(rows, by, prices)
            if missing:
                err.write(f"warning: no price for model(s) {', '.join(missing)}; their cost is left empty\n")
        out.write(render(rows, by, args.format, currency, start, end) + "\n")
        return 0
    except ReportError as exc:
        err.write(f"otel-llm report: {exc}\n")
        return 2


def _progress(err):
    def progress(step, steps, lo, hi):
        if steps > 1:
            err.write(f"\rreading {_day(lo)} ({step}/{steps})")
            err.flush()
            if step == steps:
                err.write("\n")

    return progress


def _budget_view(args, now: float, out, err) -> int:
    from otel_llm import budgets as budget_file

    budgets = budget_file.load(args.budgets)
    if args.start or args.range_:
        start, end = time_range(args.start, args.end, args.range_, now)
    else:
        end = parse_time(args.end) if args.end else now
        start = end - end % _DAY  # the current UTC day
    rows = usage_rows(args, start, end, ["tenant", "scene"], err)
    result = budget_file.status(budgets, rows)
    columns = ["tenant", "scene", "used", "budget", "share", "state"]
    if args.format == "json":
        out.write(json.dumps({"start": _iso(start), "end": _iso(end), "budgets": result}, indent=2) + "\n")
    elif args.format == "csv":
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(result)
        out.write(buffer.getvalue())
    else:
        table = [columns] + [[str(r[c]) if c != "share" else f"{r[c]:.1%}" for c in columns] for r in result]
        widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
        out.write(f"daily token budgets {_iso(start)} .. {_iso(end)}\n")
        out.write("\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in table) + "\n")
    return 1 if any(r["state"] == "over" for r in result) else 0
