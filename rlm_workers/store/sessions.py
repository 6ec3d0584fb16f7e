"""SQL for chat sessions (docs/contract.md#sessions): a session, its turns, and the session context on a job.

A turn keeps only the question as asked and the id of the job that answered it; status, answer and citations
are read from that job, so there is one truth for both (the job view and the session view can never disagree).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psycopg.types.json import Jsonb

from ..models import QueryResult
from .job_state import JobError, JobSpec, checked
from .rows import one

if TYPE_CHECKING:
    import psycopg


@dataclass
class SessionRow:
    id: str
    tenant: str
    buffers: list[str]
    options: dict[str, Any]
    created_at: Any
    updated_at: Any


@dataclass
class TurnRow:
    turn: int
    content: str
    job_id: str | None
    created_at: Any
    #: of the job, None when the job is gone
    status: str | None
    query: str | None
    result: QueryResult | None
    error: JobError | None
    spec: JobSpec | None


_SESSION_COLS = "id, tenant, buffers, options, created_at, updated_at"


def create_session(
    conn: psycopg.Connection, *, session_id: str, tenant: str, buffers: list[str], options: dict[str, Any]
) -> SessionRow:
    row = one(
        conn.execute(
            f"INSERT INTO sessions (id, tenant, buffers, options) VALUES (%s, %s, %s, %s) RETURNING {_SESSION_COLS}",
            (session_id, tenant, list(buffers), Jsonb(options)),
        )
    )
    return SessionRow(*row)


def get_session(conn: psycopg.Connection, *, session_id: str, tenant: str, lock: bool = False) -> SessionRow | None:
    """The tenant's session (another tenant's is None); ``lock``: held until commit, so two turns posted at once
    are numbered and checked one after the other."""
    sql = f"SELECT {_SESSION_COLS} FROM sessions WHERE id = %s AND tenant = %s" + (" FOR UPDATE" if lock else "")
    row = conn.execute(sql, (session_id, tenant)).fetchone()
    return SessionRow(*row) if row else None


def turns_of(conn: psycopg.Connection, *, session_id: str) -> list[TurnRow]:
    rows = conn.execute(
        """SELECT t.turn, t.content, t.job_id, t.created_at, j.status, j.query, j.result, j.error, j.spec
           FROM session_turns t LEFT JOIN jobs j ON j.id = t.job_id
           WHERE t.session_id = %s ORDER BY t.turn""",
        (session_id,),
    ).fetchall()
    return [
        TurnRow(
            r[0],
            r[1],
            r[2],
            r[3],
            r[4],
            r[5],
            None if r[6] is None else QueryResult.model_validate(r[6]),
            None if r[7] is None else JobError.model_validate(r[7]),
            None if r[8] is None else JobSpec.model_validate(r[8]),
        )
        for r in rows
    ]


def add_turn(conn: psycopg.Connection, *, session_id: str, turn: int, content: str, job_id: str) -> None:
    conn.execute(
        "INSERT INTO session_turns (session_id, turn, content, job_id) VALUES (%s, %s, %s, %s)",
        (session_id, turn, content, job_id),
    )
    conn.execute("UPDATE sessions SET updated_at = now() WHERE id = %s", (session_id,))


def set_job_spec(conn: psycopg.Connection, *, job_id: str, spec: JobSpec | Mapping[str, Any]) -> None:
    """The session context a root job carries (written in the transaction that creates the job)."""
    conn.execute("UPDATE jobs SET spec = %s WHERE id = %s", (Jsonb(checked(JobSpec, spec).stored()), job_id))


def save_question(conn: psycopg.Connection, *, job_id: str, query: str, spec: JobSpec | Mapping[str, Any]) -> None:
    """The standalone question a follow-up was rewritten to becomes the job's query (every stage reads that);
    the words as asked stay in the spec."""
    stored = Jsonb(checked(JobSpec, spec).stored())
    conn.execute("UPDATE jobs SET query = %s, spec = %s WHERE id = %s", (query, stored, job_id))
