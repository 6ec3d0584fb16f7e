"""SQL for code mode's rounds (docs/contract.md#code-mode): one row a round, written when the round ends, so
``rlm job show`` follows a program while it runs and the report lists every round."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..models import CodeRound

if TYPE_CHECKING:
    import psycopg

_COLUMNS = ("round", "code", "output", "output_chars", "error", "calls", "sub_calls", "seconds", "ended")


def save_round(conn: psycopg.Connection, *, job_id: str, entry: CodeRound) -> None:
    """Store a round; a redelivered stage that runs the round again replaces it."""
    values = [getattr(entry, c) for c in _COLUMNS]
    conn.execute(
        f"""INSERT INTO code_rounds (job_id, {", ".join(_COLUMNS)})
            VALUES (%s, {", ".join(["%s"] * len(_COLUMNS))})
            ON CONFLICT (job_id, round) DO UPDATE SET
            {", ".join(f"{c} = excluded.{c}" for c in _COLUMNS[1:])}, created_at = now()""",
        [job_id, *values],
    )


def clear_rounds(conn: psycopg.Connection, *, job_id: str) -> None:
    """A stage that starts its program over (its sandbox died with a worker) drops the rounds it cannot continue."""
    conn.execute("DELETE FROM code_rounds WHERE job_id = %s", (job_id,))


def rounds_of(conn: psycopg.Connection, *, job_id: str) -> list[CodeRound]:
    rows = conn.execute(
        f"SELECT {', '.join(_COLUMNS)} FROM code_rounds WHERE job_id = %s ORDER BY round", (job_id,)
    ).fetchall()
    return [CodeRound(**dict(zip(_COLUMNS, r, strict=True))) for r in rows]
