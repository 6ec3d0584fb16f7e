"""The offline answer quotes the line that answers, on httpx's source (tests/support/offline_answer.py)."""

from __future__ import annotations

import pytest

from tests.support.offline_answer import OfflineGate, answers, env, loaded, worker

__all__ = ["answers", "env", "loaded", "worker"]  # fixtures, used by name

pytestmark = pytest.mark.slow

CORPUS = "httpx"


class TestGate(OfflineGate):
    """The gate on the corpus ``httpx``."""
