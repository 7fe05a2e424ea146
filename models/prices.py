"""Prices per model (MODEL_PRICES_FILE): what a model call costs in USD, from its token usage
(docs/usage.md, "Prices"). The file is TOML or JSON, one table per model as the provider names
it, each with three prices in USD per million tokens: ``input`` (prompt tokens not served from
cache), ``cached_input`` (prompt tokens served from cache) and ``output`` (completion tokens,
reasoning included). A model the file does not name costs nothing (no USD is known)."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from models.errors import ModelError
from settings import get_settings

#: The three prices of a model, in the file's keys.
PRICE_KEYS = ("input", "cached_input", "output")


class PricesError(ModelError):
    """Raised when MODEL_PRICES_FILE cannot be read or a model's prices are not three
    non-negative numbers."""


@dataclass(frozen=True)
class Price:
    """USD per million tokens of one model."""

    input: float
    cached_input: float
    output: float

    def usd(self, *, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        """What a call with this usage costs (cached tokens are part of the prompt's)."""
        cached = min(max(cached_tokens, 0), prompt_tokens)
        return (
            (prompt_tokens - cached) * self.input + cached * self.cached_input + completion_tokens * self.output
        ) / 1e6


def parse_prices(path: Path) -> dict[str, Price]:
    """The prices in ``path`` (``.json``: JSON, else TOML), by model name."""
    try:
        text = path.read_text(encoding="utf-8")
        raw: Any = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
    except (OSError, ValueError) as exc:
        raise PricesError(f"MODEL_PRICES_FILE {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise PricesError(f"MODEL_PRICES_FILE {path}: expected a table of models")
    out: dict[str, Price] = {}
    for model, entry in raw.items():
        if not isinstance(entry, dict) or set(entry) != set(PRICE_KEYS):
            raise PricesError(f"MODEL_PRICES_FILE {path}: {model} must have exactly {', '.join(PRICE_KEYS)}")
        values = [entry[k] for k in PRICE_KEYS]
        if any(isinstance(v, bool) or not isinstance(v, int | float) or v < 0 for v in values):
            raise PricesError(f"MODEL_PRICES_FILE {path}: {model}'s prices must be non-negative numbers")
        out[str(model)] = Price(*(float(v) for v in values))
    return out


@lru_cache(maxsize=1)
def load_prices() -> dict[str, Price] | None:
    """MODEL_PRICES_FILE's prices, read once per process; None when it is not set."""
    name = get_settings().MODEL_PRICES_FILE
    return parse_prices(Path(name)) if name else None


def price_of(model: str | None) -> Price | None:
    """The prices of ``model``; None without a prices file or when it does not name the model."""
    prices = load_prices()
    if prices is None or model is None:
        return None
    return prices.get(model)
