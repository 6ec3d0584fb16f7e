"""`rlm keys …` (API keys, printed once) and `rlm api` (the HTTP API under uvicorn)."""

from __future__ import annotations

import resource
import sys
from typing import TYPE_CHECKING, Annotated

import typer

from rlm_workers.engine import InvalidInput

from .auth import KEY_PREFIX, create_key, list_keys, revoke_key
from .cli_types import new_typer

if TYPE_CHECKING:
    import psycopg

keys_app = new_typer(help="API keys: create (printed once), list, revoke.")


def _conn() -> psycopg.Connection:
    # psycopg loads with a command that connects, not for `rlm --help` (cli_types)
    from rlm_workers.engine import connect

    return connect()


@keys_app.command("create")
def create(
    tenant: Annotated[str, typer.Option("--tenant", help="Tenant the key acts for.")],
    name: Annotated[str, typer.Option("--name", help="A label to tell keys apart.")] = "",
) -> None:
    """Create a key; it is printed once on stdout and only its hash is stored."""
    conn = _conn()
    try:
        key, info = create_key(conn, tenant=tenant, name=name)
        conn.commit()
    finally:
        conn.close()
    typer.echo(key)
    typer.echo(f"key {info.prefix}… for tenant {tenant} created; store it now, it cannot be shown again", err=True)


@keys_app.command("list")
def list_(tenant: Annotated[str | None, typer.Option("--tenant")] = None) -> None:
    """Keys by prefix (never the keys themselves)."""
    conn = _conn()
    try:
        for k in list_keys(conn, tenant=tenant):
            typer.echo(
                f"{k.prefix}…  {k.tenant:<20} {'revoked' if k.revoked else 'active ':<8} {k.created_at}  {k.name}"
            )
    finally:
        conn.close()


@keys_app.command("revoke")
def revoke(
    key: Annotated[
        str,
        typer.Argument(
            metavar="PREFIX|-",
            help="The prefix `rlm keys list` shows, or - to read the whole key from stdin (never put it in argv).",
        ),
    ],
) -> None:
    """Revoke a key at once; requests with it answer 401 from then on."""
    if key == "-":
        key = sys.stdin.readline().strip()
        if not key:
            raise InvalidInput("no key on stdin: pipe the key in, e.g. `rlm keys revoke - < keyfile`")
    elif key.startswith(KEY_PREFIX) and len(key) > 20:
        # Still revoked (it is exposed now anyway), but say how not to expose the next one.
        typer.echo(
            "warning: a whole key on the command line lands in shell history and `ps`; use - next time", err=True
        )
    conn = _conn()
    try:
        n = revoke_key(conn, key_or_prefix=key.rstrip("…"))
        conn.commit()
    finally:
        conn.close()
    if not n:
        raise InvalidInput("no active key matches")
    typer.echo(f"revoked {n} key(s)")


def api_command(
    host: Annotated[str | None, typer.Option("--host", help="Bind address (default RLM_API_HOST, 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Port (default RLM_API_PORT, 8000).")] = None,
    workers: Annotated[int, typer.Option("--workers", help="uvicorn worker processes.")] = 1,
    backlog: Annotated[
        int,
        typer.Option(
            "--backlog", min=1, max=65535, help="Connections the kernel may hold unaccepted (capped by somaxconn)."
        ),
    ] = 2048,
) -> None:
    """Serve the HTTP API (OpenAPI at /docs)."""
    # uvicorn and the settings load with the command, not for `rlm --help` (cli_types)
    import uvicorn

    from rlm_workers.config import get_settings
    from rlm_workers.engine import broker_url, database_url

    s = get_settings()
    # Resolve (and start, when embedded) the servers once here, not in every request.
    database_url(s)
    broker_url(s)
    raise_open_files_limit()
    uvicorn.run(
        "rlm_api.app:create_app",
        factory=True,
        host=host or s.api_host,
        port=port if port is not None else s.api_port,
        workers=workers,
        backlog=backlog,
        log_level="info",
        proxy_headers=False,
    )


#: a ceiling for a hard limit of "unlimited", which the soft limit cannot always be set to
_OPEN_FILES_CEILING = 1 << 20


def raise_open_files_limit() -> int:
    """Lift this process's soft limit on open files to its hard limit and return the new soft limit.

    Every client connection is a file: at a common soft limit of 1024 the API stops accepting (EMFILE)
    near a thousand clients while the hard limit, which an unprivileged process may go up to, is far higher.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _OPEN_FILES_CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # a platform that refuses it: keep serving with what there is
            return soft
        return target
    return soft
