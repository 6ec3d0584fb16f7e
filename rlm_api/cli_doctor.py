"""`rlm doctor`: what is wrong with this deployment, in plain words."""

from __future__ import annotations

import typer


def doctor_command() -> None:
    """Check database (pgvector, schema), broker, workers per queue and the LLM endpoint."""
    from rlm_workers.celery_app import app as celery_app
    from rlm_workers.config import get_settings
    from rlm_workers.doctor import Check, check_broker, check_database, check_llm, check_workers
    from rlm_workers.local_servers import broker_url, database_url

    s = get_settings()
    checks: list[Check] = []
    try:
        checks += check_database(s, database_url(s))
    except Exception as exc:  # e.g. the embedded server cannot start
        checks.append(Check("database", False, str(exc)))
    try:
        checks += check_broker(s, broker_url(s))
        checks += check_workers(celery_app)
    except Exception as exc:
        checks.append(Check("broker", False, str(exc)))
    checks += check_llm(s)
    for c in checks:
        mark = "ok  " if c.ok and not c.warning else "warn" if c.ok else "FAIL"
        typer.echo(f"{mark}  {c.name:<20} {c.detail}")
    failed = [c for c in checks if not c.ok]
    typer.echo(f"{len(failed)} problem(s) found" if failed else "all checks passed")
    raise typer.Exit(1 if failed else 0)
