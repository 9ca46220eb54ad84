"""What the report's sources share: a row of token totals (`Row`, filled from Prometheus by
otel_llm/billing/report.py or from the usage ledger by otel_llm/billing/ledger.py), the time range a
command reads (--start / --end / --range) and the UTC formats it prints times in. It imports nothing
of billing but promql, so the modules that read rows never import each other for them."""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field

from otel_llm import semconv
from otel_llm.billing.promql import TOKEN_TYPES, ReportError, iso_time

UNSET = "-"
# ledger-only token columns, after TOKEN_TYPES and shown only when some row has one: the breakdowns
# (docs/ledger.md, "Which totals include which": each is part of a token type's total) and the
# speculative-decoding draft tokens proposed and accepted
SPEC_DECODE_COLUMNS = ("draft_tokens", "accepted_tokens")
TOKEN_DETAILS = (*(column for _, column in semconv.USAGE_DETAIL_TOKEN_FIELDS), *SPEC_DECODE_COLUMNS)
DAY = 86400


@dataclass
class Row:
    key: tuple[str, ...]
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOKEN_TYPES, 0))
    cost: float | None = None
    savings: float | None = None
    requests: int | None = None  # known from the ledger, not from Prometheus
    # from the ledger's engine records (otel_llm/billing/costs.py): engine figures, and the cost of the engine
    # time they used (`cost` above is the price of the tokens)
    compute_ns: int = 0
    prefill_compute_ns: int = 0
    kv_block_ns: int = 0
    orphans: int = 0  # bills made from an engine record whose API server's record never arrived
    engine_cost: float | None = None
    engine_cost_input: float | None = None  # the part of engine_cost spent prefilling


# --- time range ---------------------------------------------------------------------------------

_DURATION = re.compile(r"^(\d+)([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": DAY, "w": 7 * DAY}


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
        return iso_time(text)
    except ValueError:
        raise ReportError(f"bad time {text!r}: use 2026-12-01, 2026-12-01T08:00:00Z or Unix seconds") from None


def time_range(start: str | None, end: str | None, range_: str | None, now: float) -> tuple[float, float]:
    if range_ and start:
        raise ReportError("give --range or --start, not both")
    end_ts = parse_time(end) if end else now
    if start:
        start_ts = parse_time(start)
    else:
        start_ts = end_ts - parse_duration(range_ or "24h")
    if start_ts >= end_ts:
        raise ReportError(f"the range is empty: start {utc_iso(start_ts)} is not before end {utc_iso(end_ts)}")
    if end_ts > now + 60:
        raise ReportError(f"end {utc_iso(end_ts)} is in the future")
    return start_ts, end_ts


def add_window_arguments(parser) -> None:
    """--range / --start / --end, as `reconcile` and `export` take them (for time_range)."""
    parser.add_argument("--range", dest="range_", metavar="DURATION", help="window ending at --end (default 24h)")
    parser.add_argument("--start")
    parser.add_argument("--end")


def utc_iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def utc_day(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d")
