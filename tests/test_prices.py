"""Price table (built-ins merged with RLM_PRICES), model lookup and the cost of one call."""

from __future__ import annotations

import json
import math

import pytest

from rlm_workers.config import Settings
from rlm_workers.errors import ConfigError
from rlm_workers.llm.prices import BUILTIN_PRICES, Price, cost_usd, parse_prices, price_for, prices


def test_builtins_cover_the_default_models():
    s = Settings()
    table = parse_prices(None)
    for model in {s.primary_model, s.subcall_model, s.synthesizer_model, "extractive"}:
        assert price_for(model, table) is not None, model
    assert table["gpt-5.2-2025-12-11"] == Price(1.75, 0.175, 14.00)
    assert table["gpt-5-mini"] == Price(0.25, 0.025, 2.00)
    assert parse_prices("") == parse_prices("   ") == BUILTIN_PRICES


def test_json_object_and_list_forms_merge_over_builtins():
    table = parse_prices(
        json.dumps(
            {
                "my-model": {"input": 2, "output": 8},
                "other": [1.0, 0.5, 3.0],
                "gpt-5": {"input": 1, "cached_input": 0.1, "output": 9},
            }
        )
    )
    assert table["my-model"] == Price(2.0, 2.0, 8.0)  # cached_input defaults to input
    assert table["other"] == Price(1.0, 0.5, 3.0)
    assert table["gpt-5"] == Price(1.0, 0.1, 9.0)  # overridden
    assert table["gpt-5-mini"] == BUILTIN_PRICES["gpt-5-mini"]  # the rest kept
    assert BUILTIN_PRICES["gpt-5"] == Price(1.25, 0.125, 10.00)  # the built-ins themselves untouched


def test_a_path_is_read_and_tilde_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "prices.json").write_text('{"local-llm": [0, 0, 0]}')
    assert parse_prices("~/prices.json")["local-llm"] == Price(0.0, 0.0, 0.0)
    assert parse_prices(str(tmp_path / "prices.json"))["local-llm"] == Price(0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("{not json", "not valid JSON"),
        ('{"m": {"input": -1, "output": 1}}', ">= 0"),
        ('{"m": {"input": NaN, "output": 1}}', "finite"),
        ('{"m": {"input": Infinity, "output": 1}}', "finite"),
        ('{"m": {"input": "1.5", "output": 1}}', "must be a number"),
        ('{"m": {"input": true, "output": 1}}', "must be a number"),
        ('{"m": {"input": 1}}', "lacks output"),
        ('{"m": {"input": 1, "ouput": 2}}', "unknown key(s) ouput"),
        ('{"m": [1, 2]}', "3 numbers"),
        ('{"m": 3}', "must be an object"),
        ('{"": [1, 1, 1]}', "empty"),
        ("/no/such/prices.json", "no such file"),
    ],
)
def test_bad_values_are_one_line_config_errors(value, words):
    with pytest.raises(ConfigError) as ei:
        parse_prices(value)
    msg = str(ei.value)
    assert msg.startswith("invalid setting RLM_PRICES: ") and words in msg and "\n" not in msg


def test_a_file_must_hold_an_object(tmp_path):
    f = tmp_path / "list.json"
    f.write_text("[1, 2, 3]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        parse_prices(str(f))
    f.write_text('{"m": [1, 2, 3],}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_prices(str(f))


def test_unreadable_file_is_a_config_error(tmp_path):
    # a directory: exists, yet cannot be read as a file
    with pytest.raises(ConfigError, match="cannot read"):
        parse_prices(str(tmp_path))
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"m\xe9": [1, 1, 1]}')
    with pytest.raises(ConfigError, match="cannot read"):
        parse_prices(str(bad))


def test_price_for_exact_then_longest_dash_prefix():
    table = parse_prices(None)
    assert price_for("gpt-5-mini", table) == BUILTIN_PRICES["gpt-5-mini"]
    # a later snapshot of a known model: the longest key that is a prefix followed by "-"
    assert price_for("gpt-5-mini-2026-02-01", table) == BUILTIN_PRICES["gpt-5-mini"]
    assert price_for("gpt-5-mini-2025-08-07-ft", table) == BUILTIN_PRICES["gpt-5-mini-2025-08-07"]
    assert price_for("gpt-5.2-2026-01-15", table) == BUILTIN_PRICES["gpt-5.2"]
    assert price_for("gpt-5-2025-08-07", table) == BUILTIN_PRICES["gpt-5"]
    # a prefix without the dash is another model
    assert price_for("gpt-5x", table) is None
    assert price_for("gpt-5.1", table) is None
    assert price_for("llama-3", table) is None


def test_cost_prices_cached_input_apart():
    table = parse_prices(None)
    # 1M in of which 400k cached, 100k out on gpt-5.2: 0.6*1.75 + 0.4*0.175 + 0.1*14
    got = cost_usd("gpt-5.2", 1_000_000, 400_000, 100_000, table)
    assert math.isclose(got, 1.05 + 0.07 + 1.4)
    uncached = cost_usd("gpt-5.2", 1_000_000, 0, 100_000, table)
    assert math.isclose(uncached, 1.75 + 1.4) and uncached > got
    assert cost_usd("extractive", 5000, 0, 300, table) == 0.0
    assert cost_usd("unknown-model", 10, 0, 10, table) is None


def test_cost_clips_cached_tokens_into_input():
    table = {"m": Price(1.0, 0.5, 2.0)}
    # a gateway reporting more cached tokens than input: all input counts as cached, never negative uncached
    assert math.isclose(cost_usd("m", 1000, 5000, 0, table), 1000 * 0.5 / 1e6)
    assert math.isclose(cost_usd("m", 1000, -7, 0, table), 1000 * 1.0 / 1e6)
    assert cost_usd("m", -5, 0, -5, table) == 0.0


def test_prices_from_settings_is_cached_per_value_and_a_copy(tmp_path):
    f = tmp_path / "p.json"
    f.write_text('{"a": [1, 1, 1]}')
    s = Settings(prices=str(f))
    first = prices(s.prices)
    assert first["a"] == Price(1.0, 1.0, 1.0)
    f.write_text('{"a": [2, 2, 2]}')
    # parsed once per process for one value: the file is not re-read on every call
    assert prices(s.prices)["a"] == Price(1.0, 1.0, 1.0)
    first["a"] = Price(9, 9, 9)
    assert prices(s.prices)["a"] == Price(1.0, 1.0, 1.0)
    assert prices(Settings(prices='{"a": [3, 3, 3]}').prices)["a"] == Price(3.0, 3.0, 3.0)
    assert prices(Settings(prices=None).prices) == BUILTIN_PRICES


def test_a_bad_rlm_prices_fails_at_start_up_with_one_line(monkeypatch):
    from rlm_workers.config import load_settings
    from rlm_workers.errors import ConfigError

    monkeypatch.setenv("RLM_PRICES", '{"m": [1, 2')
    with pytest.raises(ConfigError) as err:
        load_settings()
    assert err.value.message.startswith("invalid setting RLM_PRICES: not valid JSON") and "\n" not in err.value.message
    monkeypatch.setenv("RLM_PRICES", '{"m": [1, 0.1, 2]}')
    assert load_settings().prices == '{"m": [1, 0.1, 2]}'
