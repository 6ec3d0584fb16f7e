"""Real Celery worker processes for pipeline and fault tests (``rlm worker`` in a subprocess)."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: every worker process started by this test process, so none outlives it (a failed test may skip a stop)
_STARTED: list[WorkerProcess] = []


@atexit.register
def _kill_leftovers() -> None:
    for w in _STARTED:
        w.kill()


class WorkerProcess:
    """One ``rlm worker`` process; its log goes to a file the test can show on failure."""

    def __init__(
        self,
        name: str,
        *,
        queues: str,
        env: dict[str, str],
        log_dir: Path,
        concurrency: int = 4,
        pool: str = "threads",
    ) -> None:
        self.name, self.queues, self.env, self.concurrency, self.pool = name, queues, env, concurrency, pool
        self.log_path = log_dir / f"worker-{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90.0) -> WorkerProcess:
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        log = open(self.log_path, "ab")
        mark = self.log_path.stat().st_size
        self.proc = subprocess.Popen(self.argv(), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        if self not in _STARTED:
            _STARTED.append(self)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited {self.proc.returncode}:\n{self.tail()}")
            with open(self.log_path, "rb") as fh:
                fh.seek(mark)
                if b" ready." in fh.read():
                    return self
            time.sleep(0.2)
        raise RuntimeError(f"worker {self.name} not ready after {timeout}s:\n{self.tail()}")

    def argv(self) -> list[str]:
        """The worker's command line (a bench may run a variant of ``rlm worker``)."""
        return [sys.executable, "-m", "rlm_api.cli", "worker", *self.worker_options()]

    def worker_options(self) -> list[str]:
        return [
            "-Q",
            self.queues,
            "-c",
            str(self.concurrency),
            "-P",
            self.pool,
            "-n",
            f"{self.name}@%h",
            "-l",
            "INFO",
        ]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """Warm shutdown (SIGTERM); SIGKILL if it does not leave in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"
