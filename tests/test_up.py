"""`rlm up`: the whole stack in one foreground command, and a clean stop on Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.api import free_port
from tests.support.workers import ROOT

pytestmark = pytest.mark.slow


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
        deadline = time.monotonic() + 120
        ready = False
        while time.monotonic() < deadline and not ready:
            try:
                ready = httpx.get(f"{base}/readyz", timeout=2).status_code == 200 and _listening(flower_port)
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        out.flush()
        printed = (tmp_path / "up.log").read_text()
        assert ready, printed[-3000:]
        assert f"api       http://127.0.0.1:{api_port}" in printed and f":{flower_port}" in printed
        key = re.search(r"api key\s+(rlm_\S+)", printed).group(1)
        assert httpx.get(f"{base}/v1/buffers", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        # the web view is served, and links task ids to the Flower started here
        assert f'data-flower="http://127.0.0.1:{flower_port}"' in httpx.get(f"{base}/ui/").text
        # the workers it started answer on every queue
        from rlm_workers.celery_app import get_app
        from rlm_workers.ephemeral import served_queues

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
        deadline = time.monotonic() + 120
        ready = False
        while time.monotonic() < deadline and not ready:
            try:
                ready = httpx.get(f"http://127.0.0.1:{api_port}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        out.flush()
        printed = (tmp_path / "up.log").read_text()
        assert ready, printed[-3000:]
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
