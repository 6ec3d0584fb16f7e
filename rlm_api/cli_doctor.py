"""`rlm doctor`: what is wrong with this deployment, in plain words."""

from __future__ import annotations

from typing import Annotated

import typer


def doctor_command(
    require_workers: Annotated[
        bool,
        typer.Option(
            "--require-workers",
            "--services",
            help="Check a service deployment: a stopped server or a queue without a worker fails. "
            "Without it they are warnings (the one-shot `rlm query` setup starts what it needs).",
        ),
    ] = False,
) -> None:
    """Check database (pgvector, schema), broker, workers per queue and the LLM endpoint; only looks."""
    from rlm_workers.config import get_settings
    from rlm_workers.doctor import Check, check_broker, check_database, check_llm, check_workers
    from rlm_workers.local_servers import running_broker_url, running_database_url

    s = get_settings()
    checks: list[Check] = []

    def stopped(name: str, what: str) -> Check:
        # the doctor never starts an embedded server: that would hide that it was down
        return Check(
            name,
            not require_workers,
            f"the embedded {what} is stopped (the next rlm command, or `rlm up`, starts it)",
            warning=not require_workers,
        )

    try:
        db = running_database_url(s)
        checks += check_database(s, db) if db else [stopped("database", "PostgreSQL")]
    except Exception as exc:  # reported, not raised: the other checks still run
        checks.append(Check("database", False, str(exc)))
    try:
        broker = running_broker_url(s)
        if broker:
            from rlm_workers.celery_app import get_app

            celery_app = get_app()

            checks += check_broker(s, broker)
            checks += check_workers(celery_app, required=require_workers)
        else:
            checks.append(stopped("broker", "Valkey"))
    except Exception as exc:
        checks.append(Check("broker", False, str(exc)))
    checks += check_llm(s)
    for c in checks:
        mark = "ok  " if c.ok and not c.warning else "warn" if c.ok else "FAIL"
        typer.echo(f"{mark}  {c.name:<20} {c.detail}")
    failed = [c for c in checks if not c.ok]
    typer.echo(f"{len(failed)} problem(s) found" if failed else "all checks passed")
    raise typer.Exit(1 if failed else 0)
