"""``rlm api`` in a subprocess on a free port, as clients reach it: real uvicorn, real HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from tests.support.workers import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Api:
    def __init__(
        self, env: dict[str, str], log_path: Path, args: Sequence[str] = (), launcher: Sequence[str] = ()
    ) -> None:
        """``args`` go after ``rlm api --port N``; ``launcher`` runs before it (``sh -c '…; exec "$@"' sh``)."""
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [*launcher, sys.executable, "-m", "rlm_api.cli", "api", "--port", str(self.port), *args],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                if self.proc.poll() is not None:  # it exited (a bad option, a port taken): no use waiting
                    break
                time.sleep(0.2)
        raise RuntimeError(f"API did not start: {Path(log_path).read_text()[-2000:]}")

    def client(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.base, headers=headers, timeout=60)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)
        self.log.close()
