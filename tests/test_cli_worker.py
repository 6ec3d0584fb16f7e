"""`rlm worker` pool choice: prefork for the CPU-bound ingest queue, threads for the I/O-bound rest."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlm_api.cli_worker import resolve_pool, worker_argv
from rlm_workers.errors import InvalidInput


def _pool(argv: list[str]) -> str:
    return argv[argv.index("-P") + 1]


@pytest.mark.parametrize(
    "queues, pool, expected",
    [
        ("rlm.ingest", None, "prefork"),
        ("rlm.control,rlm.analyst", None, "threads"),
        ("rlm.analyst", None, "threads"),
        ("rlm.ingest", "threads", "threads"),  # an explicit -P is the user's choice
        ("rlm.control,rlm.analyst,rlm.ingest", "prefork", "prefork"),
    ],
)
def test_pool_resolution(queues, pool, expected):
    assert _pool(worker_argv(queues, pool, concurrency=None, loglevel="INFO", hostname=None)) == expected


def test_ingest_never_lands_on_threads_without_an_explicit_pool():
    with pytest.raises(InvalidInput, match="prefork"):
        resolve_pool(["rlm.control", "rlm.analyst", "rlm.ingest"], None)
    with pytest.raises(InvalidInput, match="unknown pool"):
        resolve_pool(["rlm.ingest"], "gevent")


def test_default_worker_command_resolves_to_threads_without_ingest():
    from rlm_api.cli_worker import worker

    default_queues = worker.__defaults__[0]
    argv = worker_argv(default_queues, None, concurrency=None, loglevel="INFO", hostname=None)
    assert "rlm.ingest" not in argv[argv.index("-Q") + 1] and _pool(argv) == "threads"


def test_mixing_ingest_on_the_command_line_is_one_line_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", "worker", "-Q", "rlm.analyst,rlm.ingest"],
        env={
            **os.environ,
            "RLM_BROKER_URL": "redis://127.0.0.1:1/0",
            "RLM_DATABASE_URL": "postgresql://x@127.0.0.1:1/x",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "rlm worker -Q rlm.ingest" in lines[0], proc.stderr
