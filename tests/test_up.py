"""`rlm up`: the whole stack in one foreground command, and a clean stop on Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.api import free_port
from tests.support.workers import ROOT

pytestmark = pytest.mark.slow


def _until_printed(log, line: str, proc, timeout: float = 180) -> None:
    """Wait until `rlm up` has printed ``line`` (its output goes to ``log``); fail if it exits first."""
    deadline = time.monotonic() + timeout
    while line not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_up_runs_everything_and_stops_cleanly_on_ctrl_c(rlm_env, tmp_path):
    api_port, flower_port = free_port(), free_port()
    out = open(tmp_path / "up.log", "w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlm_api.cli",
            "up",
            "--api-port",
            str(api_port),
            "--flower-port",
            str(flower_port),
            "--analysts",
            "4",
        ],
        cwd=ROOT,
        env={**os.environ, **rlm_env, "HF_HUB_OFFLINE": "1"},
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{api_port}"
        # `rlm up` prints where to go once every child answers: workers to a ping, the API, Flower
        _until_printed(tmp_path / "up.log", "Ctrl-C stops everything.", proc)
        assert httpx.get(f"{base}/readyz", timeout=5).status_code == 200 and _listening(flower_port)
        printed = (tmp_path / "up.log").read_text()
        assert f"api       http://127.0.0.1:{api_port}" in printed and f":{flower_port}" in printed
        key = re.search(r"api key\s+(rlm_\S+)", printed).group(1)
        # the addresses and the key are the last thing on the screen: the children's banners and logs are in
        # files of their own, not scrolled over them
        assert printed.rstrip().endswith("Ctrl-C stops everything."), printed[-3000:]
        assert " -------------- control@" not in printed and "Registered tasks" not in printed, printed[-3000:]
        logs = Path(rlm_env["RLM_DATA_DIR"]) / "logs"
        assert f"(logs: {logs})" in printed
        assert " -------------- control@" in (logs / "control-worker.log").read_text()
        assert "Uvicorn running" in (logs / "api.log").read_text()
        assert httpx.get(f"{base}/v1/buffers", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        # the web view is served, and links task ids to the Flower started here
        assert f'data-flower="http://127.0.0.1:{flower_port}"' in httpx.get(f"{base}/ui/").text
        # the workers it started answer on every queue
        from rlm_workers.celery_app import get_app
        from rlm_workers.runtime.ephemeral import served_queues

        deadline = time.monotonic() + 60
        while served_queues(get_app(), timeout=1.0) < {"rlm.control", "rlm.analyst", "rlm.ingest"}:
            assert time.monotonic() < deadline, "not every queue got a worker"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
        assert "stopped" in (tmp_path / "up.log").read_text()
        assert not _listening(api_port) and not _listening(flower_port)
        assert served_queues(get_app(), timeout=1.0) == set()
    finally:
        if proc.poll() is None:
            proc.kill()
        out.close()


def test_up_started_with_sigint_ignored_still_stops_on_sigint(rlm_env, tmp_path, conn):
    """A non-interactive shell starts background children with SIGINT ignored; `rlm up` must still stop."""
    from rlm_api.cli_up import local_api_key
    from rlm_workers.config import get_settings

    # a second start: the key exists already, so only its prefix may be printed (service logs keep it)
    key, _ = local_api_key(conn, get_settings().data_dir / "local-api-key")
    conn.commit()
    api_port = free_port()
    out = open(tmp_path / "up.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlm_api.cli", "up", "--api-port", str(api_port), "--no-flower", "--analysts", "2"],
        cwd=ROOT,
        env={**os.environ, **rlm_env, "HF_HUB_OFFLINE": "1"},
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        _until_printed(tmp_path / "up.log", "Ctrl-C stops everything.", proc)
        assert httpx.get(f"http://127.0.0.1:{api_port}/readyz", timeout=5).status_code == 200
        printed = (tmp_path / "up.log").read_text()
        assert key not in printed and f"api key   {key[:10]}…" in printed
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0, (tmp_path / "up.log").read_text()[-3000:]
        assert "stopped" in (tmp_path / "up.log").read_text()
        assert not _listening(api_port)
    finally:
        if proc.poll() is None:
            proc.terminate()  # SIGTERM is handled: the children (own sessions) are stopped, not orphaned
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        out.close()


# --------------------------------------------------------------------------- embedded servers on exit


def _embedded_env(data_dir) -> dict[str, str]:
    """Nothing configured: `rlm up` uses (or starts) the embedded servers under data_dir."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLM_") or k == "RLM_ENCODER_DIR"}
    return {**env, "RLM_DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1"}


def _run_up_until_ready_then_ctrl_c(env: dict[str, str], log_path, before_ctrl_c=lambda: None) -> str:
    api_port = free_port()
    out = open(log_path, "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlm_api.cli", "up", "--api-port", str(api_port), "--no-flower", "--analysts", "1"],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        ready = False
        while time.monotonic() < deadline and not ready and proc.poll() is None:
            try:
                ready = httpx.get(f"http://127.0.0.1:{api_port}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert ready, log_path.read_text()[-3000:]
        before_ctrl_c()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, log_path.read_text()[-3000:]
        return log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        out.close()


def test_up_leaves_embedded_servers_that_were_running_before_it(tmp_path):
    """Ctrl-C on `rlm up` stopped the embedded servers a separately started worker and API were using."""
    from rlm_workers.runtime import local_servers

    data_dir = tmp_path / "data"
    local_servers.embedded_postgres_url(data_dir, idle_seconds=0)
    local_servers.embedded_valkey_url(data_dir, idle_seconds=0)
    pg_pid, valkey_pid = local_servers.postgres_status(data_dir)["pid"], local_servers.valkey_status(data_dir).pid
    try:
        printed = _run_up_until_ready_then_ctrl_c(_embedded_env(data_dir), tmp_path / "up.log")
        assert "database  embedded, left running (it was running before `rlm up` started)" in printed
        assert "broker    embedded, left running (it was running before `rlm up` started)" in printed
        assert local_servers.postgres_status(data_dir)["pid"] == pg_pid
        assert local_servers.valkey_status(data_dir).pid == valkey_pid
    finally:
        local_servers.stop_embedded_postgres(data_dir)
        local_servers.stop_embedded_valkey(data_dir)


def test_up_stops_the_embedded_servers_it_started_unless_others_are_connected(tmp_path):
    """What `rlm up` started it stops, except a server another process is still connected to."""
    import redis

    from rlm_workers.runtime import local_servers

    data_dir = tmp_path / "data"
    clients = []

    def another_process_uses_the_broker() -> None:
        client = redis.Redis.from_url(local_servers.valkey_status(data_dir).url)
        client.ping()  # holds its connection open, as a worker started beside `rlm up` does
        clients.append(client)

    try:
        printed = _run_up_until_ready_then_ctrl_c(
            _embedded_env(data_dir), tmp_path / "up.log", another_process_uses_the_broker
        )
        assert "database  embedded, stopped" in printed
        assert re.search(
            r"broker    embedded, left running: 1 other client\(s\) connected; it stops after 1800 s", printed
        )
        assert local_servers.postgres_status(data_dir) is None
        assert local_servers.valkey_status(data_dir) is not None and clients[0].ping()
    finally:
        for client in clients:
            client.close()
        local_servers.stop_embedded_postgres(data_dir)
        local_servers.stop_embedded_valkey(data_dir)
