"""The price file: what a million tokens of each model cost (the report's token prices, money budgets)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from otel_llm.billing.promql import ReportError, read_config


@dataclass(frozen=True)
class Price:
    input: float  # per million tokens, for input tokens that were not cached
    cached_input: float
    output: float

    def cost(self, uncached_input: int, cached_input: int, output: int) -> float:
        return (uncached_input * self.input + cached_input * self.cached_input + output * self.output) / 1e6


def load_prices(path: str | Path) -> tuple[dict[str, Price], str]:
    """{"currency": "USD", "models": {"MODEL": {"input": .., "cached_input": .., "output": ..}}}
    (per million tokens; a model "*" is the default). JSON, or YAML when PyYAML is installed."""
    path = Path(path)
    data = read_config(path, "price file")
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict) or not data["models"]:
        raise ReportError(
            f'price file {path}: expected {{"models": {{"MODEL": {{"input": .., "cached_input": .., "output": ..}}}}}}'
        )
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


def price_of(prices: dict[str, Price], model: str) -> Price | None:
    """A model's price, else the default ("*"), else None."""
    return prices.get(model) or prices.get("*")
