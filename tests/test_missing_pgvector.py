"""A PostgreSQL without pgvector gets one clear line (docs/contract.md#components), on any machine.

test_services.py and test_doctor.py look for the machine's own PostgreSQL and skip when there is none (CI,
a fresh clone): this module makes such a server from the embedded install (tests/support/plain_postgres.py),
so the ``MissingExtension`` path always runs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import psycopg
import pytest

from rlm_workers.config import Settings
from rlm_workers.errors import MissingExtension
from rlm_workers.runtime import local_servers as services
from rlm_workers.runtime.doctor import check_database
from tests.support.plain_postgres import postgres_without_pgvector
from tests.support.workers import ROOT


@pytest.fixture(scope="module")
def plain_pg():
    with postgres_without_pgvector() as url:
        yield url


def test_the_server_is_a_working_postgres_without_pgvector(plain_pg):
    with psycopg.connect(plain_pg, autocommit=True) as c:
        available = {r[0] for r in c.execute("SELECT name FROM pg_available_extensions")}
    assert "plpgsql" in available and "vector" not in available


def test_ensure_pgvector_raises_one_line_missing_extension(plain_pg):
    with psycopg.connect(plain_pg, autocommit=True) as c, pytest.raises(MissingExtension) as info:
        services.ensure_pgvector(c)
    assert "pgvector" in info.value.message and "\n" not in info.value.message
    assert "RLM_DATABASE_URL" in info.value.message  # says how to get a server that has it


def test_cli_says_pgvector_is_missing_in_one_line(plain_pg, tmp_path):
    env = {**os.environ, "RLM_DATABASE_URL": plain_pg, "RLM_DATA_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", "buffers"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "pgvector" in lines[0], proc.stderr
    with psycopg.connect(plain_pg, autocommit=True) as c:  # nothing was half-created on the way
        assert c.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone()[0] == 0


def test_doctor_names_the_missing_pgvector(plain_pg):
    by_name = {c.name: c for c in check_database(Settings(_env_file=None), plain_pg)}
    assert not by_name["pgvector"].ok and "pgvector/pgvector" in by_name["pgvector"].detail
