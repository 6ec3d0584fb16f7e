"""`rlm mcp`: the MCP server for coding agents, over stdio (default) or streamable HTTP (docs/contract.md#mcp).

Registered in cli.py as the ``mcp`` command; ``python -m rlm_api.cli_mcp ARGS`` runs the same command.
"""

from __future__ import annotations

import runpy
import sys
from enum import Enum
from typing import Annotated

import typer

from rlm_workers.engine import InvalidInput

from .auth import validate_tenant

#: the HTTP transport's port when --port is not given (the API's is RLM_API_PORT, 8000)
DEFAULT_HTTP_PORT = 8001


class Transport(str, Enum):
    stdio = "stdio"
    http = "http"


def mcp_command(
    transport: Annotated[
        Transport, typer.Option("--transport", help="stdio: one local client; http: streamable HTTP with API keys.")
    ] = Transport.stdio,
    host: Annotated[
        str | None, typer.Option("--host", help="HTTP bind address (default RLM_API_HOST, 127.0.0.1).")
    ] = None,
    port: Annotated[int | None, typer.Option("--port", help=f"HTTP port (default {DEFAULT_HTTP_PORT}).")] = None,
    tenant: Annotated[
        str | None, typer.Option("--tenant", help="stdio: the tenant to act for (default RLM_TENANT).")
    ] = None,
) -> None:
    """Serve the MCP tools list_buffers, search, query, get_job and get_chunks to a coding agent."""
    # the settings and the servers load with the command, not for `rlm --help` (cli_types)
    from rlm_workers.config import get_settings
    from rlm_workers.engine import broker_url, database_url

    settings = get_settings()
    if transport == Transport.stdio:
        if host is not None or port is not None:
            raise InvalidInput("--host and --port are for --transport http; stdio talks on stdin/stdout")
        chosen = validate_tenant(tenant or settings.tenant)
    else:
        if tenant is not None:
            raise InvalidInput("over --transport http each request's API key names the tenant: drop --tenant")
        if port is not None and not 0 < port < 65536:
            raise InvalidInput(f"--port must be between 1 and 65535, got {port}")
    # the MCP SDK is a heavy edge: loaded once the options are known good, and only by `rlm mcp`
    from . import mcp_server

    # stdio: stdout is the protocol's before anything (an embedded server starting, say) could write to it
    protocol = mcp_server.take_stdout() if transport == Transport.stdio else None
    # Resolve (and start, when embedded) the database and broker once here, not in the first tool call.
    database_url(settings)
    broker_url(settings)
    if protocol is not None:
        mcp_server.serve_stdio(chosen, protocol)
    else:
        mcp_server.serve_http(host=host or settings.api_host, port=DEFAULT_HTTP_PORT if port is None else port)


if __name__ == "__main__":
    # `rlm mcp ARGS`, run as `python -m rlm_api.cli` runs: its errors and exit codes, without this module
    # importing the CLI that imports it
    sys.argv[1:1] = ["mcp"]
    runpy.run_module("rlm_api.cli", run_name="__main__", alter_sys=True)
