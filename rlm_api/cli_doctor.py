"""`rlm doctor`: what is wrong with this deployment, in plain words."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from rlm_workers.engine import Check


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
    from rlm_workers.engine import (
        Check,
        check_broker,
        check_database,
        check_encoder,
        check_llm,
        check_workers,
        running_broker_url,
        running_database_url,
    )

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
            from rlm_workers.engine import get_app

            celery_app = get_app()

            checks += check_broker(s, broker)
            checks += check_workers(celery_app, required=require_workers)
        else:
            checks.append(stopped("broker", "Valkey"))
    except Exception as exc:
        checks.append(Check("broker", False, str(exc)))
    checks += check_encoder(s)
    checks += check_llm(s)
    for c in checks:
        mark = "ok  " if c.ok and not c.warning else "warn" if c.ok else "FAIL"
        typer.echo(f"{mark}  {c.name:<20} {c.detail}")
    typer.echo(summary(checks))
    # a warning is something to know, not a failure: the one-shot setup is healthy with its servers stopped and
    # no worker running (--require-workers makes those failures)
    raise typer.Exit(1 if any(not c.ok for c in checks) else 0)


def summary(checks: list[Check]) -> str:
    """The last line: never "all checks passed" alone when some only passed with a warning."""
    failed = sum(not c.ok for c in checks)
    warned = sum(c.ok and c.warning for c in checks)
    warnings = f"{warned} warning{'s' if warned != 1 else ''}"
    if failed:
        found = f"{failed} problem{'s' if failed != 1 else ''} found"
        return f"{found}, {warnings}" if warned else found
    return f"all checks passed, {warnings}" if warned else "all checks passed"
