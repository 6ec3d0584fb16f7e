"""mypy over the two packages, started once when the session begins so that it runs beside the other tests.

A cold mypy takes minutes on two cores; waiting for it inside one test would make that test the suite's
slowest.  The process that starts the session (pytest itself, or xdist's controller, which runs no test)
starts it in the background and hands its folder to every test process through the environment;
``tests/test_types.py`` then only reads the result."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.workers import ROOT

#: the folder holding mypy's output (``out``) and, once it ended, its exit status (``rc``)
DIR_ENV = "RLM_TEST_MYPY_DIR"


def start(out_dir: Path) -> subprocess.Popen:
    """mypy as configured in pyproject.toml, its cache inside ``out_dir`` (a fresh clone's cold run, as CI's)."""
    script = (
        f'"{sys.executable}" -m mypy --cache-dir "{out_dir / "cache"}" > "{out_dir / "out"}" 2>&1; '
        f'echo $? > "{out_dir / "rc.tmp"}" && mv "{out_dir / "rc.tmp"}" "{out_dir / "rc"}"'
    )
    return subprocess.Popen(["sh", "-c", script], cwd=ROOT, start_new_session=True)


def _selected(config: pytest.Config) -> bool:
    """Whether this run may include tests/test_types.py: the whole suite, or a path that holds it."""
    marks = config.getoption("markexpr")
    if marks and "not" not in marks:  # e.g. -m real_model: only marked tests run, and this one is not marked
        return False
    args = [a for a in config.args if not a.startswith("-")]
    return not args or any(
        (ROOT / "tests" / "test_types.py").resolve().is_relative_to(Path(a.split("::")[0]).resolve()) for a in args
    )


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if "PYTEST_XDIST_WORKER" in os.environ or DIR_ENV in os.environ or not _selected(config):
        return
    out_dir = Path(tempfile.mkdtemp(prefix="rlm-mypy-"))
    os.environ[DIR_ENV] = str(out_dir)  # xdist's workers start later and inherit it
    config.stash[_PROC] = start(out_dir)


def pytest_unconfigure(config: pytest.Config) -> None:
    proc = config.stash.get(_PROC, None)
    if proc is not None and proc.poll() is None:
        proc.kill()


_PROC = pytest.StashKey[subprocess.Popen]()
