"""What an LLM call costs in USD: a price table per model, with cached input tokens priced apart.

The table is the built-in list prices below with ``RLM_PRICES`` merged over them (docs/contract.md#costs).
A model the table does not know has no price: its calls report ``cost_usd`` as None rather than a guess.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError


@dataclass(frozen=True)
class Price:
    """USD per 1M tokens."""

    input: float
    cached_input: float
    output: float


#: OpenAI's list prices as of late 2025 for the default models and their siblings (USD per 1M tokens:
#: input, cached input, output).  Prices change and accounts get discounts: RLM_PRICES overrides any entry.
#: "extractive" is the offline provider, which costs nothing.
BUILTIN_PRICES: dict[str, Price] = {
    "gpt-5.2-2025-12-11": Price(1.75, 0.175, 14.00),
    "gpt-5.2": Price(1.75, 0.175, 14.00),
    "gpt-5-mini-2025-08-07": Price(0.25, 0.025, 2.00),
    "gpt-5-mini": Price(0.25, 0.025, 2.00),
    "gpt-5": Price(1.25, 0.125, 10.00),
    "gpt-5-nano": Price(0.05, 0.005, 0.40),
    "extractive": Price(0.0, 0.0, 0.0),
}

#: what the OpenAI Batch API charges of the list price, input and output alike (its documented 50% discount)
BATCH_API_DISCOUNT = 0.5

_FIELDS = ("input", "cached_input", "output")


def _bad(why: str) -> ConfigError:
    return ConfigError(f"invalid setting RLM_PRICES: {why}")


def _amount(model: str, field: str, value: Any) -> float:
    # bool is an int to Python, and JSON's NaN/Infinity parse as floats: neither is a price
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"{model!r} {field} must be a number of USD per 1M tokens, got {json.dumps(value)[:40]}")
    if not math.isfinite(value) or value < 0:
        raise _bad(f"{model!r} {field} must be a finite number >= 0, got {value}")
    return float(value)


def _entry(model: str, spec: Any) -> Price:
    if isinstance(spec, list):
        if len(spec) != 3:
            raise _bad(f"{model!r} must be [input, cached_input, output] (3 numbers), got {len(spec)} items")
        return Price(*(_amount(model, f, v) for f, v in zip(_FIELDS, spec, strict=True)))
    if isinstance(spec, dict):
        unknown = sorted(set(spec) - set(_FIELDS))
        if unknown:  # a typo such as "ouput" would otherwise price that side at nothing
            raise _bad(f"{model!r} has unknown key(s) {', '.join(unknown)}; expected input, cached_input, output")
        missing = [f for f in ("input", "output") if f not in spec]
        if missing:
            raise _bad(f"{model!r} lacks {' and '.join(missing)}")
        inp = _amount(model, "input", spec["input"])
        cached = _amount(model, "cached_input", spec["cached_input"]) if "cached_input" in spec else inp
        return Price(inp, cached, _amount(model, "output", spec["output"]))
    raise _bad(f"{model!r} must be an object {{input, cached_input, output}} or a list [input, cached, output]")


def parse_prices(value: str | None) -> dict[str, Price]:
    """The price table for an ``RLM_PRICES`` value: JSON (starting with "{") or the path of a JSON file,
    merged over ``BUILTIN_PRICES``; None or "" gives the built-ins.  ``ConfigError`` (one line) when bad."""
    table = dict(BUILTIN_PRICES)
    text = (value or "").strip()
    if not text:
        return table
    if not text.startswith("{"):
        path = Path(text).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise _bad(
                f"no such file {str(path)!r} (give JSON starting with '{{' or the path of a JSON file)"
            ) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise _bad(f"cannot read {str(path)!r}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _bad(f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if not isinstance(data, dict):
        raise _bad('expected a JSON object {"model": {"input": x, "cached_input": y, "output": z}}')
    for model, spec in data.items():
        if not model.strip():
            raise _bad("a model name is empty")
        table[model] = _entry(model, spec)
    return table


def price_for(model: str, table: dict[str, Price]) -> Price | None:
    """The price of ``model``: its exact entry, else the longest entry ``K`` such that the name starts with
    ``K + "-"`` (so a dated snapshot "gpt-5.2-2026-01-15" is priced as "gpt-5.2"), else None.

    The prefix rule is deliberately simple: a sibling the table lacks (say "gpt-5-pro") would be priced as
    its prefix ("gpt-5"), so give such models their own RLM_PRICES entry."""
    exact = table.get(model)
    if exact is not None:
        return exact
    best: str | None = None
    for key in table:
        if model.startswith(key + "-") and (best is None or len(key) > len(best)):
            best = key
    return table[best] if best is not None else None


def cost_usd(
    model: str,
    tokens_in: int,
    cached_tokens: int,
    tokens_out: int,
    table: dict[str, Price],
    *,
    batch_api: bool = False,
) -> float | None:
    """USD for one call: uncached input, cached input and output each at their own rate; None when the model
    has no price.  ``cached_tokens`` is part of ``tokens_in`` (as the provider reports it), clipped into it.
    ``batch_api``: a line of an OpenAI Batch API file, at ``BATCH_API_DISCOUNT`` of the list price."""
    price = price_for(model, table)
    if price is None:
        return None
    tokens_in, tokens_out = max(0, int(tokens_in)), max(0, int(tokens_out))
    cached = min(max(0, int(cached_tokens)), tokens_in)
    usd = ((tokens_in - cached) * price.input + cached * price.cached_input + tokens_out * price.output) / 1e6
    return usd * BATCH_API_DISCOUNT if batch_api else usd


@functools.lru_cache(maxsize=16)
def _parsed(value: str | None) -> dict[str, Price]:
    return parse_prices(value)


def prices(value: str | None) -> dict[str, Price]:
    """The table for an ``RLM_PRICES`` value (``settings.prices``), parsed once per distinct value (a file is
    read once per process).  The value, not the settings: ``config.py`` checks it with ``parse_prices``, so this
    module must not need ``config.py`` back.  A copy, so a caller that edits it cannot change what other
    callers see."""
    return dict(_parsed(value))
