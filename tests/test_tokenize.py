"""Tokenizer: exact outputs for prose, identifiers, unicode, stopwords; speed sanity."""

from __future__ import annotations

import pytest

from rlm_workers.search.tokenize import STOPWORDS, tokenize


def test_prose_lowercases_and_drops_stopwords_and_punctuation() -> None:
    assert tokenize("The quick brown Fox -- jumps over the lazy dog!") == [
        "quick",
        "brown",
        "fox",
        "jumps",
        "lazy",
        "dog",
    ]


def test_single_characters_and_underscores_are_dropped() -> None:
    assert tokenize("a b c x _ __ ___ 7 ok") == ["ok"]


def test_numbers_are_kept() -> None:
    assert tokenize("error 404 in 2024") == ["error", "404", "2024"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("snake_case_name", ["snake_case_name", "snake", "case", "name"]),
        ("camelCaseName", ["camelcasename", "camel", "case", "name"]),
        ("HTTPServer", ["httpserver", "http", "server"]),
        ("getHTTPResponse", ["gethttpresponse", "get", "http", "response"]),
        ("XMLHttpRequest", ["xmlhttprequest", "xml", "http", "request"]),
        ("HTTP2Server", ["http2server", "http2", "server"]),
        ("parseJSON", ["parsejson", "parse", "json"]),
        ("__init__", ["__init__", "init"]),
        ("_private_helper", ["_private_helper", "private", "helper"]),
        ("MAX_RETRY_COUNT", ["max_retry_count", "max", "retry", "count"]),
        ("load_HTTPConfig", ["load_httpconfig", "load", "http", "config"]),
    ],
)
def test_identifiers_emit_whole_then_parts(text: str, expected: list[str]) -> None:
    assert tokenize(text) == expected


def test_single_part_identifiers_are_not_duplicated() -> None:
    # "Hello" splits into just "hello": emitting it twice would double its tf
    assert tokenize("Hello HTTP") == ["hello", "http"]


def test_stopword_parts_and_short_parts_are_dropped() -> None:
    assert tokenize("is_the_value x_y") == ["is_the_value", "value", "x_y"]
    assert tokenize("IS The") == []


def test_unicode_words_stay_whole() -> None:
    assert tokenize("Café au lait, 日本語 und Straße") == ["café", "au", "lait", "日本語", "und", "straße"]


def test_unicode_camel_case_is_split() -> None:
    assert tokenize("ÉtatUnis") == ["étatunis", "état", "unis"]


def test_stopwords_are_a_small_english_list() -> None:
    assert {"the", "a", "of", "and", "to", "in", "is", "it", "that", "for", "with", "was", "be"} <= STOPWORDS
    assert 80 <= len(STOPWORDS) <= 200
    assert not {"return", "def", "class", "import", "error"} & STOPWORDS


def test_tokens_survive_space_join_and_split() -> None:
    # the loader stores " ".join(tokens) and the index reads it back with split()
    toks = tokenize("def load_config(path):\n    return HTTPServer(path, retries=3)  # café\tx")
    assert toks == [
        "def",
        "load_config",
        "load",
        "config",
        "path",
        "return",
        "httpserver",
        "http",
        "server",
        "path",
        "retries",
        "café",
    ]
    assert " ".join(toks).split() == toks


def test_empty_and_whitespace() -> None:
    assert tokenize("") == []
    assert tokenize(" \n\t ... !!! ") == []
