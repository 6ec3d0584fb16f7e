"""`rlm doctor` tells what is wrong, in plain words, and fails (exit 1) only on real problems."""

from __future__ import annotations

import os
import subprocess
import sys

import psycopg
import pytest

from rlm_workers.config import Settings
from rlm_workers.runtime.doctor import check_database, check_llm
from tests.support.scripted_llm import ScriptedLLM
from tests.support.workers import ROOT


def _rlm(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Runs `rlm` with exactly this environment (rlm_env is also patched into os.environ)."""
    return subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**env, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )


def _embedded_env(data_dir) -> dict[str, str]:
    """A one-shot setup as `make demo` leaves it: embedded servers under the data dir, nothing configured."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLM_")}
    return {**env, "RLM_DATA_DIR": str(data_dir)}


def test_doctor_against_the_test_services_reports_missing_workers(rlm_env, conn):
    proc = _rlm("doctor", env={**os.environ, **rlm_env})
    out = proc.stdout
    assert "ok    pgvector" in out and "ok    schema               up to date" in out
    assert "ok    broker" in out
    # the one-shot setup runs no workers between commands: a warning, not a failure
    assert "warn  queue rlm.analyst    no worker consumes it" in out
    assert "offline extractive provider" in out
    assert proc.returncode == 0, out
    proc = _rlm("doctor", "--require-workers", env={**os.environ, **rlm_env})
    assert "FAIL  queue rlm.analyst    no worker consumes it" in proc.stdout
    assert proc.returncode == 1


def test_doctor_and_status_start_no_embedded_server(tmp_path):
    env = _embedded_env(tmp_path)
    status = _rlm("services", "status", env=env)
    assert status.returncode == 0, status.stderr
    assert "database: embedded stopped" in status.stdout and "broker:   embedded stopped" in status.stdout
    doctor = _rlm("doctor", env=env)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    # stopped servers and the offline provider are warnings: the summary must not read as a clean bill
    assert "warn  broker               the embedded Valkey is stopped" in doctor.stdout
    assert doctor.stdout.splitlines()[-1] == "all checks passed, 3 warnings"
    strict = _rlm("doctor", "--require-workers", env=env)
    assert strict.returncode == 1 and strict.stdout.splitlines()[-1] == "2 problems found, 1 warning"
    assert "warn  database             the embedded PostgreSQL is stopped" in doctor.stdout
    assert "warn  broker               the embedded Valkey is stopped" in doctor.stdout
    assert _rlm("doctor", "--services", env=env).returncode == 1
    # looking started nothing
    assert not (tmp_path / "pg" / "postmaster.pid").exists() and not (tmp_path / "valkey" / "server.json").exists()


def test_doctor_right_after_make_demo(tmp_path):
    """Embedded servers up, no worker, leftover watchdogs (sent with a countdown) in the control queue."""
    from celery import Celery

    from rlm_workers.celery_app import celery_config
    from rlm_workers.runtime import local_servers

    settings = Settings(_env_file=None, data_dir=tmp_path, database_url=None, broker_url=None, result_backend=None)
    local_servers.embedded_postgres_url(tmp_path)
    broker = local_servers.embedded_valkey_url(tmp_path)
    try:
        sender = Celery("doctor-test", set_as_current=False)
        sender.conf.update(celery_config(settings))
        for job in ("j1", "j2"):
            sender.send_task("rlm.watchdog", (job,), countdown=3600)
        sender.send_task("rlm.analyst", ("j3", 1))
        sender.close()
        env = _embedded_env(tmp_path)
        proc = _rlm("doctor", env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "rlm.control=0 (+2 delayed)" in proc.stdout and "rlm.analyst=1," in proc.stdout
        # what the delayed ones are: "2 delayed" alone read as two stuck tasks
        assert "delayed tasks wait for their time, not for a worker" in proc.stdout
        assert "2 rlm.watchdog (job watchdogs, which do nothing once their job has ended; due " in proc.stdout
        assert "warn  queue rlm.control    no worker consumes it" in proc.stdout
        status = _rlm("services", "status", env=env)
        pg_pid = int((tmp_path / "pg" / "postmaster.pid").read_text().split()[0])
        valkey = local_servers.valkey_status(tmp_path)
        assert f"database: embedded running, pid {pg_pid}, port " in status.stdout
        assert f"broker:   embedded running, pid {valkey.pid}, port {valkey.port} " in status.stdout
        assert valkey.password and valkey.password not in status.stdout and broker not in status.stdout
    finally:
        local_servers.stop_embedded(settings)


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
