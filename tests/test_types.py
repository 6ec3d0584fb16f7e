"""The type checker passes over rlm_workers and rlm_api (issue #42: in `make lint` and in the suite).

mypy runs in the background from the session's start (tests/support/typecheck.py); run alone, this file
starts it itself."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tests.support.jobs import wait_for
from tests.support.typecheck import DIR_ENV, start

#: a cold mypy on a busy two-core machine took 200 s; this leaves room for a slower one
DEADLINE = 1200


def test_mypy_reports_no_error():
    out_dir = os.environ.get(DIR_ENV)
    if out_dir is None:
        out_dir = tempfile.mkdtemp(prefix="rlm-mypy-")
        start(Path(out_dir))
    rc = Path(out_dir) / "rc"
    assert wait_for(rc.exists, timeout=DEADLINE, every=0.5), f"mypy did not end within {DEADLINE} s"
    output = (Path(out_dir) / "out").read_text(errors="replace")
    assert rc.read_text().strip() == "0", output[-4000:]
