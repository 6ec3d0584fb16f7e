"""Real Celery worker processes for pipeline and fault tests (``rlm worker`` in a subprocess)."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
        self._mark = 0  # the log's size when the process was started: "ready." is looked for after it

    def start(self, timeout: float = 90.0) -> WorkerProcess:
        return self.spawn().wait_ready(timeout)

    def spawn(self) -> WorkerProcess:
        """Start the process and return at once (``wait_ready`` waits for it): a module's workers boot together."""
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as log:
            self._mark = self.log_path.stat().st_size
            self.proc = subprocess.Popen(self.argv(), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        if self not in _STARTED:
            _STARTED.append(self)
        return self

    def wait_ready(self, timeout: float = 90.0) -> WorkerProcess:
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited {self.proc.returncode}:\n{self.tail()}")
            with open(self.log_path, "rb") as fh:
                fh.seek(self._mark)
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
        self.ask_to_stop()
        self.wait_stopped()

    def ask_to_stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.wait(timeout=timeout)
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


@contextlib.contextmanager
def running_workers(
    env: dict[str, str], log_dir: Path, pools: dict[str, tuple[str, int]], *, flush_broker: bool = True
) -> Iterator[dict[str, WorkerProcess]]:
    """Worker processes by key (``{"ctl": ("rlm.control", 4)}`` → a worker named ``ctl`` with 4 threads), all
    started before the block and stopped after it; the broker is emptied first, so no task an earlier module
    left behind reaches them."""
    if flush_broker:
        import redis

        redis.Redis.from_url(env["RLM_BROKER_URL"]).flushdb()
    ws = {
        key: WorkerProcess(key, queues=queues, env=env, log_dir=log_dir, concurrency=threads)
        for key, (queues, threads) in pools.items()
    }
    try:
        for w in ws.values():
            w.spawn()
        for w in ws.values():
            w.wait_ready()
        yield ws
    finally:  # all asked at once: each warm shutdown waits on its own pool
        for w in ws.values():
            w.ask_to_stop()
        for w in ws.values():
            w.wait_stopped()


@contextlib.contextmanager
def scripted_env(rlm_env: dict[str, str], llm: Any, **settings: str) -> Iterator[dict[str, str]]:
    """A module's environment when its workers answer through the scripted OpenAI-protocol server: the test
    process gets it too (patched), and the dict is what subprocesses are given."""
    from tests.support.envpatch import patched_env
    from tests.support.pipeline_model import MODEL_ENV

    extra = {
        "OPENAI_API_KEY": "sk-test-not-a-real-key",
        "OPENAI_BASE_URL": llm.base_url,
        **MODEL_ENV,
        "HF_HUB_OFFLINE": "1",
        **settings,
    }
    with patched_env(extra):
        yield {**rlm_env, **extra}


@contextlib.contextmanager
def extractive_env(rlm_env: dict[str, str], **settings: str) -> Iterator[dict[str, str]]:
    """A module's environment when, with no API key, the offline extractive provider answers: patched into the
    test process as well, and the dict is what subprocesses are given."""
    from tests.support.envpatch import patched_env

    extra = {"HF_HUB_OFFLINE": "1", **settings}
    with patched_env(extra):
        yield {**rlm_env, **extra}
