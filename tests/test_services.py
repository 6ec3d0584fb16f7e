"""Embedded servers: start once, reuse from other processes, recover from crashes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psycopg
import pytest

from rlm_workers import local_servers as services
from rlm_workers.errors import MissingExtension


def _in_subprocess(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_valkey_is_reused_by_a_second_process(tmp_path):
    url = services.embedded_valkey_url(tmp_path)
    try:
        state = json.loads((tmp_path / "valkey" / "server.json").read_text())
        other = _in_subprocess(
            f"from pathlib import Path; from rlm_workers import local_servers as services; "
            f"print(services.embedded_valkey_url(Path({str(tmp_path)!r})))"
        )
        assert other == url
        assert json.loads((tmp_path / "valkey" / "server.json").read_text())["pid"] == state["pid"]
    finally:
        services.stop_embedded_valkey(tmp_path)


def test_valkey_recovers_from_a_killed_server(tmp_path):
    import redis

    url = services.embedded_valkey_url(tmp_path)
    pid = json.loads((tmp_path / "valkey" / "server.json").read_text())["pid"]
    redis.Redis.from_url(url).set("k", "v")
    os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 5
    while services._pid_is_valkey(pid) and time.time() < deadline:
        time.sleep(0.05)
    try:
        url2 = services.embedded_valkey_url(tmp_path)  # stale server.json / pid file left behind
        new_pid = json.loads((tmp_path / "valkey" / "server.json").read_text())["pid"]
        assert new_pid != pid
        assert redis.Redis.from_url(url2).ping()
    finally:
        services.stop_embedded_valkey(tmp_path)
    assert not services._pid_is_valkey(new_pid)


def test_postgres_is_reused_and_recovers_after_kill(tmp_path):
    url = services.embedded_postgres_url(tmp_path)
    try:
        with psycopg.connect(url) as c:
            pid = c.execute("SELECT pg_backend_pid()").fetchone()[0]
            postmaster = int((tmp_path / "pg" / "postmaster.pid").read_text().split()[0])
            assert pid != postmaster
        other = _in_subprocess(
            f"from pathlib import Path; from rlm_workers import local_servers as services; "
            f"print(services.embedded_postgres_url(Path({str(tmp_path)!r})))"
        )
        assert other == url
        assert int((tmp_path / "pg" / "postmaster.pid").read_text().split()[0]) == postmaster  # no twin
        os.kill(postmaster, signal.SIGKILL)
        time.sleep(0.5)
        assert (tmp_path / "pg" / "postmaster.pid").exists()  # stale pid file from the crash
        url2 = _in_subprocess(
            f"from pathlib import Path; from rlm_workers import local_servers as services; "
            f"print(services.embedded_postgres_url(Path({str(tmp_path)!r})))"
        )
        with psycopg.connect(url2) as c:
            assert c.execute("SELECT 1").fetchone() == (1,)
    finally:
        services.stop_embedded_postgres(tmp_path)


def _plain_postgres() -> str | None:
    """The machine's own PostgreSQL, which has no pgvector (docs/contract.md#components)."""
    url = os.environ.get("RLM_TEST_PLAIN_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    try:
        with psycopg.connect(url, connect_timeout=2) as c:
            if c.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'").fetchone():
                return None
    except psycopg.OperationalError:
        return None
    return url


def test_postgres_without_pgvector_gives_one_line_error():
    url = _plain_postgres()
    if url is None:
        pytest.skip("no PostgreSQL without pgvector reachable (set RLM_TEST_PLAIN_PG_URL)")
    with psycopg.connect(url, autocommit=True) as c, pytest.raises(MissingExtension) as info:
        services.ensure_pgvector(c)
    assert "pgvector" in info.value.message and "\n" not in info.value.message


def test_cli_reports_missing_pgvector(tmp_path):
    url = _plain_postgres()
    if url is None:
        pytest.skip("no PostgreSQL without pgvector reachable (set RLM_TEST_PLAIN_PG_URL)")
    env = {**os.environ, "RLM_DATABASE_URL": url, "RLM_DATA_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", "buffers"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "pgvector" in lines[0]


def test_bad_setting_is_one_clear_line(tmp_path):
    env = {**os.environ, "RLM_MAX_CONCURRENCY": "lots", "RLM_DATA_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", "buffers"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == "error: invalid setting RLM_MAX_CONCURRENCY: Input should be a valid integer, "
        "unable to parse string as an integer"
    )


def test_a_settings_reset_starts_no_embedded_broker(tmp_path, monkeypatch):
    """Restoring default settings (a test's teardown) once started a Valkey under the user's data dir."""
    from rlm_workers.celery_app import app
    from rlm_workers.config import reset_settings

    monkeypatch.setenv("RLM_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("RLM_BROKER_URL", "redis://127.0.0.1:1/0")  # configuring connects to nothing
    monkeypatch.delenv("RLM_RESULT_BACKEND", raising=False)
    reset_settings()
    try:
        assert app.conf.broker_url == "redis://127.0.0.1:1/0"
        monkeypatch.delenv("RLM_BROKER_URL")
        reset_settings()
        assert not (tmp_path / services.VALKEY_DIRNAME).exists()
    finally:
        monkeypatch.undo()
        reset_settings()
