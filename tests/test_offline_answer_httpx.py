"""The offline answer quotes the line that answers, on httpx's source (tests/support/offline_answer.py)."""

from __future__ import annotations

import pytest

from tests.support.offline_answer import check_corpus, env, loaded, worker

__all__ = ["env", "loaded", "worker"]  # fixtures, used by name

pytestmark = pytest.mark.slow

CORPUS = "httpx"


def test_the_first_quote_is_the_line_that_answers(conn, worker):
    check_corpus(conn, CORPUS)
