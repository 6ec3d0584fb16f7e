"""The watcher beside an embedded server: it stops the server once nobody can need it any more.

``python -m rlm_workers.runtime.embedded_watch postgres|valkey|llm DATA_DIR SERVER_PID IDLE_SECONDS`` is started,
detached, by ``local_servers`` beside each embedded PostgreSQL, Valkey and model server it starts (or first finds
unwatched).  An embedded server outlives the command that started it, so that the next command starts in
milliseconds; without a watcher it also outlived everything else: a killed test run left its servers running on
removed temp dirs.

Each round it looks at three things:

- the server process is gone (stopped by `rlm services stop`, `rlm up`, a crash): the watcher exits;
- the data dir is gone or replaced: nothing is left to protect, so the server is stopped, forcibly if needed;
- no client has been connected for ``IDLE_SECONDS`` (0: never): the server is shut down cleanly, under the
  same lock a start takes, so a process starting to use it waits and then starts it again.

A round in which the server does not answer the client count neither resets nor ends the idle time.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from pathlib import Path

from . import local_servers as servers
from .local_llm import LLM_DIRNAME, is_model_server
from .local_llm import clients as llm_clients
from .local_llm import server_status as llm_status

log = logging.getLogger("rlm.services.watch")

#: the longest pause between two looks; shorter when the idle time is short, so it is kept to within a quarter
MAX_POLL_SECONDS = 5.0
#: how long a server gets to shut down cleanly before it is forced (only when its data dir is gone)
SHUTDOWN_GRACE_SECONDS = 30.0


def poll_seconds(idle_seconds: float) -> float:
    return max(0.2, min(MAX_POLL_SECONDS, idle_seconds / 4)) if idle_seconds > 0 else MAX_POLL_SECONDS


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


class Watched:
    """One embedded server: how to tell it runs, count its clients, and stop it."""

    def __init__(self, kind: str, data_dir: Path, pid: int) -> None:
        self.kind, self.data_dir, self.pid = kind, data_dir, pid
        self.dir = (
            data_dir / {"postgres": servers.PG_DIRNAME, "valkey": servers.VALKEY_DIRNAME, "llm": LLM_DIRNAME}[kind]
        )
        self.identity = _identity(self.dir)
        # read now: once the data dir is gone, its pid and password files are gone with it (each kind sets its own)
        self.ports: list[int] | None = None
        self.url: str | None = None
        self.port: int | None = None
        self.password: str | None = None
        if kind == "llm":
            llm = llm_status(data_dir)
            self.ports = list(llm.ports.values()) if llm and llm.pid == pid else None
        elif kind == "postgres":
            status = servers.postgres_status(data_dir)
            self.url = status["url"] if status and status["pid"] == pid else None
        else:
            valkey = servers.valkey_status(data_dir)
            self.port, self.password = (valkey.port, valkey.password) if valkey and valkey.pid == pid else (None, None)

    def alive(self) -> bool:
        return {"postgres": servers.is_postgres, "valkey": servers.is_valkey, "llm": is_model_server}[self.kind](
            self.pid
        )

    def dir_gone(self) -> bool:
        """Removed, or replaced by another dir of the same name (a new test run reusing a temp name)."""
        return self.identity is None or _identity(self.dir) != self.identity

    def clients(self) -> int | None:
        if self.kind == "llm":
            return llm_clients(self.pid, self.ports) if self.ports else None
        if self.kind == "postgres":
            return servers.postgres_clients(self.url) if self.url else None
        return servers.valkey_clients(self.port, self.password) if self.port else None

    def lock(self):
        if self.kind == "postgres":
            return servers.start_lock(self.data_dir / ".pg-start.lock")
        return servers.start_lock(self.dir / ".lock")

    def stop(self, *, force: bool) -> None:
        # SIGINT is PostgreSQL's fast shutdown (what `pg_ctl stop -m fast` sends); SIGTERM is Valkey's SHUTDOWN
        # and ends the model server
        self._signal(signal.SIGINT if self.kind == "postgres" else signal.SIGTERM)
        if self._wait_gone(SHUTDOWN_GRACE_SECONDS) or not force:
            return
        log.warning("%s pid %s did not stop within %.0f s; killing it", self.kind, self.pid, SHUTDOWN_GRACE_SECONDS)
        self._signal(signal.SIGKILL)
        self._wait_gone(SHUTDOWN_GRACE_SECONDS)

    def _signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def _wait_gone(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self.alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True


def watch(server: Watched, idle_seconds: float) -> str:
    """Runs until the server is gone; returns why."""
    poll = poll_seconds(idle_seconds)
    last_client = time.monotonic()
    while True:
        if not server.alive():
            return "the server exited"
        if server.dir_gone():
            server.stop(force=True)
            return f"its data dir {server.dir} is gone: stopped it"
        n = server.clients()
        if n:
            last_client = time.monotonic()
        elif n == 0 and idle_seconds > 0 and time.monotonic() - last_client >= idle_seconds:
            with server.lock():
                # a process may have connected since the count above; the lock keeps new starts out meanwhile
                if server.clients() == 0 and server.alive():
                    server.stop(force=False)
                    return f"no client for {idle_seconds:g} s: stopped it"
            last_client = time.monotonic()
        time.sleep(poll)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rlm_workers.runtime.embedded_watch", description=__doc__.splitlines()[0]
    )
    parser.add_argument("kind", choices=["postgres", "valkey", "llm"])
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("pid", type=int)
    parser.add_argument("idle_seconds", type=float)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s pid %(process)d: %(message)s")
    server = Watched(args.kind, args.data_dir, args.pid)
    log.info("watching %s pid %s in %s (idle %g s)", args.kind, args.pid, server.dir, args.idle_seconds)
    log.info("%s pid %s: %s", args.kind, args.pid, watch(server, args.idle_seconds))


if __name__ == "__main__":
    main()
