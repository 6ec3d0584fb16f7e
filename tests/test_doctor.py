"""`rlm doctor` tells what is wrong, in plain words, and fails (exit 1) only on real problems."""

from __future__ import annotations

import os
import subprocess
import sys

import psycopg
import pytest

from rlm_workers.config import Settings
from rlm_workers.doctor import check_database, check_llm
from tests.support.scripted_llm import ScriptedLLM
from tests.support.workers import ROOT


def test_doctor_against_the_test_services_reports_missing_workers(rlm_env, conn):
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", "doctor"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **rlm_env, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    out = proc.stdout
    assert "ok    pgvector" in out and "ok    schema               up to date" in out
    assert "ok    broker" in out
    assert "FAIL  queue rlm.analyst    no worker consumes it" in out
    assert "offline extractive provider" in out
    assert proc.returncode == 1


def test_doctor_names_a_postgres_without_pgvector():
    url = os.environ.get("RLM_TEST_PLAIN_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    try:
        psycopg.connect(url, connect_timeout=3).close()
    except psycopg.OperationalError:
        pytest.skip("no plain PostgreSQL on this machine")
    by_name = {c.name: c for c in check_database(Settings(_env_file=None), url)}
    if by_name["pgvector"].ok:
        pytest.skip("this PostgreSQL has pgvector")
    assert "pgvector/pgvector" in by_name["pgvector"].detail


def test_doctor_llm_checks():
    [offline] = check_llm(Settings(_env_file=None, api_key=None))
    assert offline.ok and offline.warning
    with ScriptedLLM() as srv:
        checks = check_llm(
            Settings(_env_file=None, api_key="sk-test", base_url=srv.base_url, subcall_model="scripted-model")
        )
        assert checks[0].ok and srv.base_url in checks[0].detail
        by_name = {c.name: c for c in checks}
        assert by_name["model analyst"].ok
        assert not by_name["model planner"].ok and "RLM_PRIMARY_MODEL" in by_name["model planner"].detail
    [down] = check_llm(Settings(_env_file=None, api_key="sk-test", base_url=srv.base_url), timeout=2)
    assert not down.ok and "cannot reach" in down.detail
