"""`otel-llm report`: token usage and cost per tenant / scene / model / day, from Prometheus.

Billing must equal what the engine counted, to the token, so totals are not taken from PromQL's
`increase()` (which extrapolates to the window's edges and returns fractions). Each series' increments
between raw samples of `otel_llm.server.token.usage` are added up instead (`increments()`): a counter
reset (a restarted server) starts from zero again, and a series first seen inside the window (a server
started inside it) counts from zero. `exact_increase()` gets those sums from a few values per series
and chunk of the window, without fetching the samples. The usage ledger (`--ledger`) is what bills
come from; without it the report warns where Prometheus' numbers fall short (`prometheus_warnings()`).
With `--ledger` and `--costs`, what the engines cost, shared out over the rows (otel_llm/billing/costs.py).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from otel_llm import semconv
from otel_llm.billing.prices import Price, load_prices  # noqa: F401 - load_prices: part of the report's API
from otel_llm.billing.promql import DIMENSIONS, TOKEN_METRIC, TOKEN_TYPES, TYPE_LABEL, ReportError
from otel_llm.billing.rows import DAY, TOKEN_DETAILS, UNSET, Row, parse_duration, time_range, utc_day, utc_iso

BASE_LOOKBACK = "35d"


# --- Prometheus ---------------------------------------------------------------------------------

_MAX_GET = 6000  # longer queries go in a POST body (proxies cap URLs)


class Prometheus:
    """The few calls of the Prometheus HTTP API we need (any PromQL-compatible server)."""

    def __init__(self, url: str, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def query(self, expr: str, at: float) -> list[dict]:
        params = urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"})
        headers = {"Accept": "application/json"}
        if len(params) <= _MAX_GET:
            request = urllib.request.Request(f"{self.url}/api/v1/query?{params}", headers=headers)
        else:
            request = urllib.request.Request(
                f"{self.url}/api/v1/query",
                data=params.encode(),
                headers={**headers, "Content-Type": "application/x-www-form-urlencoded"},
            )
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


def _quote(value: str) -> str:
    """A PromQL string literal."""
    return json.dumps(value, ensure_ascii=False)


def _re_escape(value: str) -> str:
    """value as a literal in an RE2 regular expression (PromQL's =~)."""
    return re.sub(r"[][\\.+*?(){}|^$]", lambda m: "\\" + m.group(), value)


def _selector(metric: str, label_sets: list[dict]) -> str:
    """A selector matching (at least) the series with these label sets: per label the values they have,
    leaving out labels with many values, which only widens the match."""
    matchers = []
    for name in sorted({n for labels in label_sets for n in labels if n != "__name__"}):
        values = sorted({labels.get(name, "") for labels in label_sets})
        if len(values) == 1:
            matchers.append(f"{name}={_quote(values[0])}")
        elif len(values) <= 16:
            matchers.append(f"{name}=~{_quote('|'.join(map(_re_escape, values)))}")
    return f"{metric}{{{', '.join(matchers)}}}" if matchers else metric


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


# `increments()` over every raw sample is the definition; fetching them all costs memory and time in
# proportion to the samples (a day of 9,000 series at 15 s is 52 M). The same sums come from a few
# range functions per series and window (lo, hi], one value each:
#   last = last_over_time, low = min_over_time, resets = resets (drops between consecutive samples),
#   peak = max_over_time where it is above last (only after a drop)
# With base the series' value before the window (None: it had none) and the samples s1..last:
#   increments() adds last - base, plus at each drop the value it dropped from (the counter started
#   from zero again), base too when s1 < base (a drop at the window's edge; with no base, from 0)
#   resets == 0: s1 is low, so: low >= base (or no base): last - base; low < base: last
#   resets == 1, peak present: the samples rose to peak, dropped, rose to last: last - base + peak
#               (+ base for a drop at the edge: no drop when low >= base; else known only inside)
# Any other window is halved and each half settled the same way: the halves' resets and the whole
# window's give the drops at their shared edge. A reset falls on an edge after ~log2(window / scrape
# interval) halvings at most, each a query for the series with resets only; one restart in a window
# (the usual case) mostly settles in one or two.
# A sample on a window's lower edge (Prometheus 2 range selectors include it, 3 not) changes none of
# this: its value is base, a first step of 0. Where no method that reads counters can see a reset
# (the counter restarted and grew past its old value between two scrapes) this one, like
# increments(), counts the difference.

_STAT, _PART = "otel_llm_stat", "otel_llm_part"  # labels telling apart the parts of one query's answer


@dataclass
class _Window:
    labels: dict
    last: float = 0.0
    low: float = 0.0
    resets: float = 0.0
    peak: float | None = None

    def settle(self, base: float | None, drop: bool | None) -> float | None:
        """Tokens added in the window from base, or None when this window's values can't tell.
        drop: whether the first sample is below base (None: not known)."""
        if not self.resets:
            return self.last if base is None or self.low < base else self.last - base
        if base is None or self.low >= base:
            drop = False
        if self.resets == 1 and self.peak is not None and drop is not None:
            return self.last - (base or 0.0) + (base if drop else 0.0) + self.peak
        return None


def _ms(ts: float) -> int:
    return int(round(ts * 1000))


def _windows(
    prom: Prometheus, selector: str, parts: list[tuple[int, int]], peaks: bool = True
) -> list[dict[tuple, _Window]]:
    """Per part (a, b] (ms, in order): last value, minimum, resets and (peaks) peak of each series with
    samples there."""
    at = parts[-1][1]
    exprs = []
    for index, (a, b) in enumerate(parts):
        window = f"{selector}[{b - a}ms]" + (f" offset {at - b}ms" if b != at else "")
        stats = [
            ("last", f"last_over_time({window})"),
            ("low", f"min_over_time({window})"),
            ("resets", f"resets({window}) > 0"),
        ]
        if peaks:
            stats.append(("peak", f"max_over_time({window}) > last_over_time({window})"))
        for stat, expr in stats:
            exprs.append(
                f'label_replace(label_replace({expr}, "{_STAT}", "{stat}", "", ""), "{_PART}", "{index}", "", "")'
            )
    found: list[dict[tuple, _Window]] = [{} for _ in parts]
    for series in prom.query(" or ".join(exprs), at / 1000):
        labels = {k: v for k, v in series["metric"].items() if k not in (_STAT, _PART, "__name__")}
        window = found[int(series["metric"][_PART])].setdefault(_series_id(labels), _Window(labels))
        setattr(window, series["metric"][_STAT], float(series["value"][1]))
    return found


# series id -> (labels, base, drop at the window's edge (None: not known), resets in the window)
_Open = dict[tuple, tuple[dict, "float | None", "bool | None", float]]


def _split(prom: Prometheus, metric: str, a: int, b: int, series: _Open) -> dict[tuple, float]:
    """Tokens added in (a, b] to series whose window did not settle."""
    if not series:
        return {}
    if b - a < 2:  # can't halve a millisecond: at most the samples on its two edges
        return {sid: _raw_increase(prom, metric, labels, a, b, base) for sid, (labels, base, _, _) in series.items()}
    halves = [(a, (a + b) // 2), ((a + b) // 2, b)]
    found = _windows(prom, _selector(metric, [labels for labels, *_ in series.values()]), halves)
    added = dict.fromkeys(series, 0.0)
    inner: list[_Open] = [{}, {}]
    for sid, (labels, base, drop, resets) in series.items():
        first, second = (windows.get(sid) for windows in found)
        # a drop at the halves' shared edge is one of the window's resets that neither half has
        edges = (drop, drop if first is None else resets > (first.resets + (second.resets if second else 0)))
        for index, window in enumerate((first, second)):
            if window is None:
                continue
            settled = window.settle(base, edges[index])
            if settled is None:
                inner[index][sid] = (labels, base, edges[index], window.resets)
            else:
                added[sid] += settled
            base = window.last
    for (lo, hi), unsettled in zip(halves, inner):
        for sid, tokens in _split(prom, metric, lo, hi, unsettled).items():
            added[sid] += tokens
    return added


def _raw_increase(prom: Prometheus, metric: str, labels: dict, a: int, b: int, base: float | None) -> float:
    sid = _series_id(labels)
    samples = [
        (ts, float(v))
        for series in prom.query(f"{_selector(metric, [labels])}[{b - a}ms]", b / 1000)
        if _series_id(series["metric"]) == sid
        for ts, v in series["values"]
        if a < _ms(float(ts)) <= b
    ]
    return sum(added for _, added in increments(base, samples))


def _chunks(start: int, end: int, chunk: int, split_days: bool) -> list[tuple[int, int]]:
    """(lo, hi] windows in ms covering (start, end]. split_days: none spans two UTC days, so each holds
    samples of one day (they are cut 1 ms before midnight: a sample at 00:00:00 is the new day's)."""
    if split_days:
        day = DAY * 1000
        midnight = start - start % day
        cuts = {t - 1 if t % day == 0 else t for t in range(midnight + chunk, end + 1, chunk)}
        cuts |= set(range(midnight + day - 1, end, day))
    else:
        cuts = set(range(start + chunk, end, chunk))
    points = [start, *sorted(t for t in cuts if start < t < end), end]
    return list(zip(points, points[1:]))


def exact_increase(
    prom: Prometheus, metric: str, start: float, end: float, by: list[str], *, chunk: int = DAY, progress=None
) -> dict[tuple[str, ...], float]:
    """What counter `metric` counted in (start, end], per `by` key, exactly as increments() adds up its
    raw samples (a reset counts from zero, a series first seen in the window from zero) at a cost that
    grows with series and chunks, not samples.

    by: label names, and "day" (the UTC date of each increment's sample); keys are tuples of label values
    (UNSET where a series lacks the label); only keys with tokens added. progress(step, steps, lo, hi)
    is called before each chunk."""
    start_ms, end_ms = _ms(start), _ms(end)
    # each series' value at the window's start: its last sample before it, looking further back than
    # PromQL's 5-minute staleness, so a scrape gap before the window does not make an old series look
    # new (and count its whole total again)
    values: dict[tuple, float] = {
        _series_id(r["metric"]): float(r["value"][1])
        for r in prom.query(f"last_over_time({metric}[{BASE_LOOKBACK}])", start_ms / 1000)
    }
    totals: dict[tuple[str, ...], float] = {}

    def add(labels: dict, day: str, tokens: float) -> None:
        if tokens:
            key = tuple(day if name == "day" else labels.get(name, UNSET) for name in by)
            totals[key] = totals.get(key, 0.0) + tokens

    chunks = _chunks(start_ms, end_ms, max(1, _ms(chunk)), "day" in by)
    for step, (lo, hi) in enumerate(chunks, 1):
        if progress:
            progress(step, len(chunks), lo / 1000, hi / 1000)
        day = utc_day((lo + 1) / 1000)
        reset: _Open = {}
        # no peaks here: they'd cost the server two more passes over every sample, and rarely settle a
        # window whose edge is not known
        for sid, window in _windows(prom, metric, [(lo, hi)], peaks=False)[0].items():
            base = values.get(sid)
            settled = window.settle(base, None)
            if settled is None:
                reset[sid] = (window.labels, base, None, window.resets)
            else:
                add(window.labels, day, settled)
            values[sid] = window.last
        for sid, tokens in _split(prom, metric, lo, hi, reset).items():
            add(reset[sid][0], day, tokens)
    return totals


def collect(
    prom: Prometheus, start: float, end: float, by: list[str], chunk: int = DAY, progress=None
) -> dict[tuple[str, ...], Row]:
    """Exact token totals per `by` key over (start, end] (see exact_increase), a chunk at a time."""
    labels = ["day" if d == "day" else DIMENSIONS[d] for d in by]
    rows: dict[tuple[str, ...], Row] = {}
    for key, tokens in exact_increase(
        prom, TOKEN_METRIC, start, end, [*labels, TYPE_LABEL], chunk=chunk, progress=progress
    ).items():
        *row_key, token_type = key
        if token_type in TOKEN_TYPES:
            row = rows.setdefault(tuple(row_key), Row(tuple(row_key)))
            row.tokens[token_type] += int(round(tokens))
    return rows


def _series_id(metric: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in metric.items() if k != "__name__"))


def prometheus_warnings(prom: Prometheus, start: float, end: float, metric: str = TOKEN_METRIC) -> list[str]:
    """Why a report of (start, end] from Prometheus can fall short of the bills: the window starts before
    the oldest sample it holds of `metric`, or tenants went over the label cap. A few one-value queries."""
    found = []
    first = _first_sample(prom, metric, start, end)
    if first is not None:
        if first == math.inf:
            found.append(
                f"Prometheus holds no data for {metric} from {utc_iso(start - parse_duration(BASE_LOOKBACK))}"
                f" to {utc_iso(end)}: the report is empty; use --ledger for bills"
            )
        else:
            found.append(
                f"Prometheus holds data for {metric} only from {utc_iso(first)}: the report covers "
                f"{utc_iso(first)}..{utc_iso(end)}; use --ledger for bills"
            )
    tenant = DIMENSIONS["tenant"]
    if _has_samples(prom, f"{metric}{{{tenant}={_quote(semconv.LABEL_OTHER)}}}", _ms(start), _ms(end)):
        found.append(
            f"{tenant}={_quote(semconv.LABEL_OTHER)} in {metric}: tenants past "
            f"OTEL_LLM_METRIC_LABEL_LIMIT are merged into it and cannot be billed from metrics; "
            f"use --ledger for bills"
        )
    return found


def _has_samples(prom: Prometheus, selector: str, a: int, b: int) -> bool:
    """Whether any series of selector has a sample in (a, b] (ms; a sample exactly at a may count)."""
    return bool(prom.query(f"count(last_over_time({selector}[{b - a}ms]))", b / 1000))


def _first_sample(prom: Prometheus, metric: str, start: float, end: float) -> float | None:
    """None when Prometheus holds a sample of metric up to BASE_LOOKBACK before start; else the time of
    its first sample in (start, end], to the second (inf when there is none)."""
    start_ms, end_ms = _ms(start), _ms(end)
    for lookback in (3600, DAY, parse_duration(BASE_LOOKBACK)):  # short first: usually enough
        if _has_samples(prom, metric, start_ms - lookback * 1000, start_ms):
            return None
    lo, hi = start_ms, end_ms  # no sample at or before lo, the first one in (lo, hi]
    if not _has_samples(prom, metric, lo, hi):
        return math.inf
    while hi - lo > 1000:
        mid = (lo + hi) // 2
        if _has_samples(prom, metric, lo, mid):
            hi = mid
        else:
            lo = mid
    return hi / 1000


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
        row.cost = price.cost(uncached, t[semconv.TOKEN_TYPE_CACHED_INPUT], t[semconv.TOKEN_TYPE_OUTPUT])
        row.savings = t[semconv.TOKEN_TYPE_CACHED_INPUT] * (price.input - price.cached_input) / 1e6
    return sorted(missing)


# --- output -------------------------------------------------------------------------------------

RANKS = ("tokens", "cost")


def top_rows(rows: dict[tuple, Row], by: list[str], n: int, rank: str = "tokens") -> dict[tuple, Row]:
    """The n rows that used the most, largest first (ties in key order): by tokens (input + output) or by
    cost (the `cost` column: the engines' cost with --costs, else the tokens' price). The other rows are
    summed into one last row, its first dimension `(K others)`."""

    def used(row: Row) -> float:
        if rank == "cost":
            return _figures(row)["cost"] or 0.0
        return row.tokens[semconv.TOKEN_TYPE_INPUT] + row.tokens[semconv.TOKEN_TYPE_OUTPUT]

    ordered = sorted(rows.values(), key=lambda row: (-used(row), row.key))
    top = {row.key: row for row in ordered[:n]}
    rest = ordered[n:]
    if rest:
        from otel_llm.billing.costs import add_row

        key = (f"({len(rest)} others)", *[""] * (len(by) - 1))
        others = top[key] = Row(key)
        for row in rest:
            add_row(others, row)
        if all(row.requests is None for row in rest):  # from Prometheus: not known
            others.requests = None
        if any(row.engine_cost is not None and row.engine_cost_input is None for row in rest):
            others.engine_cost_input = None  # an idle row among them: no input/output split
    return top


def render(
    rows: dict[tuple, Row],
    by: list[str],
    fmt: str,
    currency: str | None,
    start: float,
    end: float,
    priced: bool | None = None,
    costed: bool = False,
    ranked: bool = False,
) -> str:
    """priced: with --prices (default: currency is set); costed: with --costs (then `cost` is what the
    engines cost and `revenue` the tokens' price); ranked: rows in their given order (top_rows), else
    in key order."""
    priced = currency is not None if priced is None else priced
    ordered = list(rows.values()) if ranked else [rows[k] for k in sorted(rows)]
    columns = _figure_columns(priced, costed)
    token_columns = [*TOKEN_TYPES, *(d for d in TOKEN_DETAILS if any(row.tokens.get(d) for row in ordered))]
    header = [*by, *token_columns, *columns]
    total = Row(("TOTAL",), cost=0.0, savings=0.0)
    if costed:
        total.engine_cost = total.engine_cost_input = 0.0
    cost_output = 0.0
    for row in ordered:
        for t in token_columns:
            total.tokens[t] = total.tokens.get(t, 0) + row.tokens.get(t, 0)
        total.cost += row.cost or 0.0
        total.savings += row.savings or 0.0
        total.compute_ns += row.compute_ns
        total.kv_block_ns += row.kv_block_ns
        if costed:
            total.engine_cost += row.engine_cost or 0.0
            if row.engine_cost is not None and row.engine_cost_input is not None:  # not an idle row
                total.engine_cost_input += row.engine_cost_input
                cost_output += row.engine_cost - row.engine_cost_input
    figures = {r.key: _figures(r) for r in ordered}
    totals = _figures(total)
    totals["cost_per_million_output"] = _per_million(cost_output, total.tokens[semconv.TOKEN_TYPE_OUTPUT])

    def counts(row: Row) -> dict[str, int]:
        return {t: row.tokens.get(t, 0) for t in token_columns}

    def cells(row: Row) -> list:
        return [*row.key, *counts(row).values(), *(_cell(c, figures[row.key][c]) for c in columns)]

    if fmt == "json":
        return json.dumps(
            {
                "start": utc_iso(start),
                "end": utc_iso(end),
                "by": by,
                "currency": currency,
                "rows": [
                    {
                        **dict(zip(by, r.key)),
                        "tokens": counts(r),
                        **({"requests": r.requests} if r.requests is not None else {}),
                        **{c: figures[r.key][c] for c in columns},
                    }
                    for r in ordered
                ],
                "total": {"tokens": counts(total), **{c: totals[c] for c in columns}},
            },
            separators=(",", ":"),
        )  # indent would make json use its slow pure-Python encoder (4x)
    total_row = ["TOTAL", *[""] * (len(by) - 1), *counts(total).values(), *(_cell(c, totals[c]) for c in columns)]
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(cells(r) for r in ordered)
        writer.writerow(total_row)
        return out.getvalue()
    table = [header, *(list(map(str, cells(r))) for r in ordered), list(map(str, total_row))]
    widths = [max(len(str(line[i])) for line in table) for i in range(len(header))]
    units = ([f"costs in {currency}"] if costed else []) + (
        [f"prices in {currency} per million tokens"] if priced else []
    )
    lines = [f"token usage {utc_iso(start)} .. {utc_iso(end)}" + (f" ({'; '.join(units)})" if units else "")]
    for index, line in enumerate(table):
        if index == len(table) - 1:
            lines.append("  ".join("-" * w for w in widths))
        lines.append(
            "  ".join(
                str(c).rjust(w) if i >= len(by) else str(c).ljust(w) for i, (c, w) in enumerate(zip(line, widths))
            )
        )
    return "\n".join(lines)


COST_COLUMNS = ("compute_seconds", "kv_block_seconds", "cost", "cost_per_million_input", "cost_per_million_output")


def _figure_columns(priced: bool, costed: bool) -> list[str]:
    if not costed:
        return ["cost", "cache_savings"] if priced else []
    return [*COST_COLUMNS, *(["revenue", "margin", "cache_savings"] if priced else [])]


def _figures(row: Row) -> dict:
    """A row's figures by column: `cost` is the price of its tokens without --costs, its engine cost with
    (the price is then `revenue`). An idle row has no input/output split."""
    engine, cost_in = row.engine_cost, row.engine_cost_input
    split = engine is not None and cost_in is not None
    return {
        "compute_seconds": row.compute_ns / 1e9,
        "kv_block_seconds": row.kv_block_ns / 1e9,
        "cost": engine if engine is not None else row.cost,
        "cost_per_million_input": _per_million(cost_in if split else None, row.tokens[semconv.TOKEN_TYPE_INPUT]),
        "cost_per_million_output": _per_million(
            engine - cost_in if split else None, row.tokens[semconv.TOKEN_TYPE_OUTPUT]
        ),
        "revenue": row.cost,
        "margin": None if row.cost is None or engine is None else row.cost - engine,
        "cache_savings": row.savings,
    }


def _per_million(cost: float | None, tokens: int) -> float | None:
    return None if cost is None or not tokens else cost / tokens * 1e6


def _cell(column: str, value: float | None) -> str:
    if value is not None and column.endswith("_seconds"):
        return f"{value:.9f}"
    return _money(value)


def _money(value: float | None) -> str:
    return "" if value is None else f"{value:.6f}"


# --- command line -------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument(
        "--ledger",
        metavar="DIR|URL",
        help="read the usage ledger (the billing source of truth) instead of Prometheus: a spool "
        "directory (OTEL_LLM_USAGE_DIR), clickhouse://HOST:8123/DATABASE[?table=otel_logs] "
        "or chdb://SESSION_DIR",
    )
    parser.add_argument(
        "--prometheus",
        default="http://127.0.0.1:9090",
        help="Prometheus (or any PromQL API) base URL (default %(default)s)",
    )
    parser.add_argument(
        "--by",
        default="tenant,model",
        help=f"comma-separated, from: {', '.join(_all_dimensions())} (default %(default)s)",
    )
    parser.add_argument(
        "--range", dest="range_", metavar="DURATION", help="window ending at --end (or now), e.g. 24h, 7d (default 24h)"
    )
    parser.add_argument("--start", help="window start: 2026-12-01, 2026-12-01T08:00:00Z or Unix seconds")
    parser.add_argument("--end", help="window end (default now)")
    parser.add_argument(
        "--prices", help="price file (JSON or YAML): per model, input / cached_input / output per million tokens"
    )
    parser.add_argument(
        "--costs",
        help="cost file (JSON or YAML, with --ledger): engine instances' hourly rates, "
        "shared out over the requests by compute or KV share; adds compute_seconds, "
        "kv_block_seconds, cost (and with --prices revenue, margin) and idle rows",
    )
    parser.add_argument(
        "--budgets",
        help="budget file (otel_llm/ops/budgets.py): each budget's use in its current "
        "period (UTC day, month, or since its prepaid balance began), as of --end "
        "(or now), or over --start/--range; money budgets need --prices",
    )
    parser.add_argument("--format", choices=("table", "csv", "json"), default="table")
    parser.add_argument(
        "--top",
        type=int,
        metavar="N",
        help="the N rows that used the most, largest first (see --rank); the rest summed in one row `(K others)`",
    )
    parser.add_argument(
        "--rank",
        choices=RANKS,
        default="tokens",
        help="what --top ranks by: tokens (input + output) or cost (needs --prices or --costs) (default %(default)s)",
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per Prometheus query")


def _all_dimensions() -> list[str]:
    from otel_llm.billing import ledger

    return [*dict.fromkeys([*DIMENSIONS, *ledger.DIMENSIONS]), "day", "hour"]


def usage_rows(args, start: float, end: float, by: list[str], err) -> dict[tuple[str, ...], Row]:
    """Token totals per `by` key: from the ledger with --ledger, else from Prometheus."""
    if getattr(args, "ledger", None):
        from otel_llm.billing import ledger

        source = ledger.open_ledger(args.ledger, args.timeout)
        skipped = source.unreadable_lines()
        if skipped:
            err.write(
                f"warning: {skipped} unreadable line(s) in the spool skipped (torn by a machine crash or a "
                f"full disk; whole records are all counted)\n"
            )
        rows = source.usage(start, end, by)
        orphans = sum(row.orphans for row in rows.values())
        if orphans:
            err.write(
                f"warning: {orphans} request(s) billed from the engine's record alone: their API server's "
                f"record never arrived (a killed API server?), so tenant and operation may be unset\n"
            )
        return rows
    unknown = [d for d in by if d not in DIMENSIONS and d != "day"]
    if unknown:
        raise ReportError(
            f"--by {','.join(unknown)} needs --ledger (Prometheus labels: {', '.join([*DIMENSIONS, 'day'])})"
        )
    return collect(Prometheus(args.prometheus, args.timeout), start, end, by, progress=_progress(err))


def parse_by(text: str) -> list[str]:
    """--by's dimensions."""
    by = [d.strip() for d in text.split(",") if d.strip()]
    unknown = [d for d in by if d not in _all_dimensions()]
    if not by or unknown:
        raise ReportError(f"--by {text!r}: choose from {', '.join(_all_dimensions())}")
    return by


def run(args, now: float, out=sys.stdout, err=sys.stderr) -> int:
    """The usage report; `--budgets` is otel_llm/ops/budget_view.py's."""
    try:
        by = parse_by(args.by)
        top, rank = getattr(args, "top", None), getattr(args, "rank", "tokens")
        if top is not None and top < 1:
            raise ReportError(f"--top {top}: give a number of rows, 1 or more")
        if top is not None and rank == "cost" and not (args.prices or getattr(args, "costs", None)):
            raise ReportError("--rank cost needs --prices or --costs")
        start, end = time_range(args.start, args.end, args.range_, now)
        prices, currency = load_prices(args.prices) if args.prices else ({}, None)
        costs = _load_costs(args, currency)

        fine_by = by if costs is None or "engine_instance" in by else [*by, "engine_instance"]
        rows = usage_rows(args, start, end, fine_by, err)
        warn_prometheus(args, start, end, err)
        idle_rows = []
        if costs is not None:
            from otel_llm.billing import costs as cost_file
            from otel_llm.billing import ledger

            units = ["engine_instance", *(["day"] if "day" in by else [])]
            windows = ledger.open_ledger(args.ledger, args.timeout).windows(start, end, units)
            rows, idle_rows, warnings = cost_file.allocate(rows, fine_by, by, windows, costs)
            for line in warnings:
                err.write(f"warning: {line}\n")
        if prices:
            missing = price_rows(rows, by, prices)
            if missing:
                err.write(f"warning: no price for model(s) {', '.join(missing)}; their cost is left empty\n")
        for idle in idle_rows:  # no tokens, so no revenue
            idle.cost, idle.savings = (0.0, 0.0) if prices else (None, None)
            cost_file.add_row(rows.setdefault(idle.key, Row(idle.key)), idle)
        if top is not None:
            rows = top_rows(rows, by, top, rank)
        out.write(
            render(
                rows,
                by,
                args.format,
                costs.currency if costs else currency,
                start,
                end,
                priced=bool(prices),
                costed=costs is not None,
                ranked=top is not None,
            )
            + "\n"
        )
        return 0
    except ReportError as exc:
        err.write(f"otel-llm report: {exc}\n")
        return 2


def _load_costs(args, currency: str | None):
    if not getattr(args, "costs", None):
        return None
    from otel_llm.billing import costs as cost_file

    if not getattr(args, "ledger", None):
        raise ReportError("--costs needs --ledger (engine time is in the usage ledger's engine records)")
    costs = cost_file.load(args.costs)
    if currency is not None and currency != costs.currency:
        raise ReportError(
            f"the price file's currency {currency} is not the cost file's {costs.currency}: margins need one currency"
        )
    return costs


def warn_prometheus(args, start: float, end: float, err) -> None:
    """Without --ledger: what makes the Prometheus numbers fall short of the bills (prometheus_warnings)."""
    if not getattr(args, "ledger", None):
        for line in prometheus_warnings(Prometheus(args.prometheus, args.timeout), start, end):
            err.write(f"warning: {line}\n")


def _progress(err):
    def progress(step, steps, lo, hi):
        if steps > 1:
            err.write(f"\rreading {utc_day(lo + 0.001)} ({step}/{steps})")
            err.flush()
            if step == steps:
                err.write("\n")

    return progress
