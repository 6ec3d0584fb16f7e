"""The offline answer quotes the line that answers, on httpx's source (tests/support/offline_answer.py)."""

from __future__ import annotations

import pytest

from tests.support.offline_answer import answers, ask, check_corpus, check_loaded, env, loaded, worker
from tests.support.offline_gold import CORPORA

__all__ = ["answers", "env", "loaded", "worker"]  # fixtures, used by name

pytestmark = pytest.mark.slow

CORPUS = "httpx"
GOLD = CORPORA[CORPUS].gold


def test_the_corpus_loads_whole(loaded):
    check_loaded(loaded)


@pytest.mark.parametrize("gold", GOLD, ids=[f"q{i:02d}" for i in range(1, len(GOLD) + 1)])
def test_each_question_is_answered_offline(conn, worker, answers, gold):
    ask(conn, CORPUS, gold, answers)


def test_the_first_quote_is_the_line_that_answers(conn, worker, answers):
    check_corpus(conn, CORPUS, answers)
