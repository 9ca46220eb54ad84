"""`otel-llm export`: ledger records as billing-platform usage events, one JSON object per line.

- lago: the body of Lago's `POST /api/v1/events` (`{"event": {...}}`): `transaction_id` is the
  record's idempotency key, so re-sending an export never bills twice; `external_subscription_id`
  is the tenant (or its entry in --customers); the three token counts are `properties`, so one
  billable metric per token type is a `sum` over its property.
- stripe: Stripe billing meter events (`POST /v1/billing/meter_events`), one per token type with a
  non-zero count (input, cached_input, uncached_input, output): `event_name` = prefix + token type,
  `payload.value` the count (a string, as
  Stripe wants), `payload.stripe_customer_id` the tenant's customer, `identifier` derived from the
  idempotency key and the token type (hashed when longer than Stripe's 100 characters). Stripe
  enforces identifier uniqueness only within a rolling 24 hours and takes timestamps of the last
  35 days: export each window once (keep the last --end you sent), re-send only a recent one.
- csv: one row per record, for spreadsheets and other platforms.

Token counts are inclusive, as the conventions define them (docs/ledger.md, "Which totals include
which"): `input` includes `cached_input`. A platform that prices buckets separately prices
`uncached_input` and `cached_input` (Lago's `uncached_input_tokens` property, Stripe's
`uncached_input_tokens` meter), never `input` and `cached_input` together: that charges every cached
token twice.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json

from otel_llm.billing.promql import ReportError, read_config
from otel_llm.billing.rows import UNSET

FORMATS = ("lago", "stripe", "csv")
STRIPE_IDENTIFIER_MAX = 100
# one meter per bucket; uncached_input (input - cached_input) is the exclusive bucket of the two inclusive ones
STRIPE_TOKEN_TYPES = ("input", "cached_input", "uncached_input", "output")
CSV_COLUMNS = (
    "key",
    "time",
    "tenant",
    "scene",
    "cost_center",
    "model",
    "served_model",
    "operation",
    "outcome",
    "input",
    "cached_input",
    "output",
    "n",
    "response_id",
    "trace_id",
)


def load_customers(path: str | None) -> dict[str, str]:
    """{"customers": {"TENANT": "CUSTOMER OR SUBSCRIPTION ID"}} (JSON or YAML)."""
    if not path:
        return {}
    from pathlib import Path

    data = read_config(Path(path), "customer file")
    customers = data.get("customers") if isinstance(data, dict) else None
    if not isinstance(customers, dict) or not all(isinstance(v, str) and v for v in customers.values()):
        raise ReportError(f'customer file {path}: expected {{"customers": {{"TENANT": "ID", ...}}}}')
    return {str(k): v for k, v in customers.items()}


def _timestamp(record: dict) -> float:
    import datetime as dt

    value = dt.datetime.fromisoformat(str(record["ts"])).replace(tzinfo=dt.timezone.utc)
    return value.timestamp()


def _customer(record: dict, customers: dict[str, str], missing: set[str]) -> str | None:
    tenant = record.get("tenant") or ""
    if customers:
        customer = customers.get(tenant)
        if customer is None:
            missing.add(tenant or UNSET)
        return customer
    return tenant or None


def lago_events(records: list[dict], customers: dict[str, str], code: str, missing: set[str]):
    for record in records:
        customer = _customer(record, customers, missing)
        if customer is None:
            continue
        yield {
            "event": {
                "transaction_id": record["key"],
                "external_subscription_id": customer,
                "code": code,
                "timestamp": int(_timestamp(record)),
                "properties": {
                    "input_tokens": int(record["input"]),
                    "cached_input_tokens": int(record["cached_input"]),
                    "uncached_input_tokens": int(record["input"]) - int(record["cached_input"]),
                    "output_tokens": int(record["output"]),
                    "model": record.get("model") or UNSET,
                    "operation": record.get("operation") or UNSET,
                    **{k: record[k] for k in ("scene", "cost_center") if record.get(k)},
                },
            }
        }


def stripe_identifier(key: str, token_type: str) -> str:
    identifier = f"{key}:{token_type}"
    if len(identifier) > STRIPE_IDENTIFIER_MAX:  # deterministic, so a re-run sends the same one
        identifier = f"otel-llm-{hashlib.sha256(identifier.encode()).hexdigest()}"
    return identifier


def stripe_events(records: list[dict], customers: dict[str, str], prefix: str, missing: set[str]):
    for record in records:
        customer = _customer(record, customers, missing)
        if customer is None:
            continue
        for token_type in STRIPE_TOKEN_TYPES:
            value = (
                int(record["input"]) - int(record["cached_input"])
                if token_type == "uncached_input"
                else int(record[token_type])
            )
            if value:
                yield {
                    "event_name": f"{prefix}{token_type}_tokens",
                    "identifier": stripe_identifier(record["key"], token_type),
                    "timestamp": int(_timestamp(record)),
                    "payload": {"stripe_customer_id": customer, "value": str(value)},
                }


def csv_text(records: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for record in records:
        writer.writerow([record["ts"] if c == "time" else record.get(c, "") for c in CSV_COLUMNS])
    return out.getvalue()


def render(
    records: list[dict],
    fmt: str,
    customers: dict[str, str],
    *,
    lago_code: str = "llm_tokens",
    stripe_prefix: str = "llm_",
) -> tuple[str, set[str]]:
    """(text, tenants that had no customer in --customers and were left out)."""
    missing: set[str] = set()
    if fmt == "csv":
        return csv_text(records), missing
    events = (
        lago_events(records, customers, lago_code, missing)
        if fmt == "lago"
        else stripe_events(records, customers, stripe_prefix, missing)
    )
    lines = [json.dumps(event, separators=(",", ":"), ensure_ascii=False) for event in events]
    return "".join(line + "\n" for line in lines), missing
