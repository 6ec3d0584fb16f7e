"""SQL for query jobs: state, batches, findings and the LLM call log.

Job state lives here, not in Redis, so a lost worker or a restarted broker
loses no job.  Writes are idempotent (upserts keyed by job and batch) because
Celery may deliver a stage twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from ..constants import JOB_ENDED_CHANNEL
from ..models import Finding, JobStatus, LLMCall, QueryResult
from ..runtime import metrics
from .db import held_session_locks, release_session_lock, session_lock_key, transaction_lock, try_session_lock
from .job_state import (
    PROGRAM_CHILD,
    TIMINGS,
    CheckRecord,
    Collected,
    JobError,
    JobOptions,
    JobParams,
    JobPlan,
    JobSpec,
    SynthState,
    checked,
)
from .rows import one

TERMINAL = (JobStatus.done.value, JobStatus.failed.value, JobStatus.cancelled.value)


@dataclass
class JobRow:
    id: str
    tenant: str
    status: str
    stage: str
    query: str
    buffers: list[str]
    options: JobOptions
    plan: JobPlan | None
    params: JobParams | None
    scaling_tier: str | None
    chunks_available: int | None
    chunk_load_failures: int
    batches_total: int
    collected: Collected | None
    result: QueryResult | None
    error: JobError | None
    timings: dict[str, float]
    task_ids: list[str]
    created_at: Any
    started_at: Any
    finished_at: Any
    #: the job tree (docs/architecture.md#job-trees): a child's parent, the tree's root (itself for a root)
    parent_id: str | None = None
    root_id: str | None = None
    depth: int = 0
    route: str | None = None
    route_reason: str | None = None
    #: a child's task: {"kind": "follow_up"|"subset", "chunk_ids": [...] | None}
    spec: JobSpec | None = None
    #: completeness verdicts of thinking mode, one per round
    checks: list[CheckRecord] = field(default_factory=list)
    #: a synthesis paused on query_subset children: its conversation and the calls it waits for
    synth_state: SynthState | None = None

    @classmethod
    def of(cls, row: Sequence[Any]) -> JobRow:
        """A row of ``_JOB_COLS``, its JSON columns validated (a column stored before a key existed reads with
        the key's default)."""
        (jid, tenant, status, stage, query, bufs, options, plan, params, tier, available, load_failures, total,
         collected, result, error, timings, task_ids, created, started, finished, parent, root, depth, route,
         reason, spec, checks, synth_state) = row  # fmt: skip
        return cls(
            jid, tenant, status, stage, query, list(bufs), JobOptions.model_validate(options or {}),
            _opt(JobPlan, plan), _opt(JobParams, params), tier, available, load_failures, total,
            _opt(Collected, collected), _opt(QueryResult, result), _opt(JobError, error),
            TIMINGS.validate_python(timings or {}), list(task_ids or []), created, started, finished, parent, root,
            depth, route, reason, _opt(JobSpec, spec), [CheckRecord.model_validate(c) for c in checks or []],
            _opt(SynthState, synth_state),
        )  # fmt: skip

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def merges_into_parent(self) -> bool:
        """A child whose findings its parent takes in (thinking's follow-ups, query_subset's subsets): it fans out
        and writes no report.  A code-mode program's child is asked as a query and answers as one."""
        return self.parent_id is not None and not (self.spec is not None and self.spec.kind == PROGRAM_CHILD)

    @property
    def tree(self) -> str:
        """The root of the job's tree (jobs from before trees are their own root)."""
        return self.root_id or self.id


def _opt(model: Any, value: Any) -> Any:
    return None if value is None else model.model_validate(value)


def _json(model: Any, value: Any) -> Jsonb | None:
    """``value`` validated as ``model`` (a ``ValidationError`` names the bad key), as the column stores it."""
    if value is None:
        return None
    value = checked(model, value)
    return Jsonb(value.stored() if hasattr(value, "stored") else value.model_dump(mode="json"))


_JOB_COLS = (
    "id, tenant, status, stage, query, buffers, options, plan, params, scaling_tier, chunks_available, "
    "chunk_load_failures, batches_total, collected, result, error, timings, task_ids, created_at, started_at, "
    "finished_at, parent_id, root_id, depth, route, route_reason, spec, checks, synth_state"
)


def create_job(
    conn: psycopg.Connection,
    *,
    job_id: str,
    tenant: str,
    query: str,
    buffers: Sequence[str],
    options: JobOptions | Mapping[str, Any],
    idempotency_key: str | None = None,
    spec: JobSpec | Mapping[str, Any] | None = None,
) -> tuple[str, bool]:
    """Insert a queued job; with an idempotency key already used, return the existing job instead."""
    row = conn.execute(
        """INSERT INTO jobs (id, tenant, query, buffers, options, idempotency_key, root_id, spec)
           VALUES (%s, %s, %s, %s, %s, %s, %s, %s)
           ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
           RETURNING id""",
        (
            job_id,
            tenant,
            query,
            list(buffers),
            Jsonb(checked(JobOptions, options).stored()),
            idempotency_key,
            job_id,
            _json(JobSpec, spec or None),
        ),
    ).fetchone()
    if row:
        return row[0], True
    # the conflict means the key's row exists, and this statement's snapshot sees it
    existing = one(
        conn.execute("SELECT id FROM jobs WHERE tenant = %s AND idempotency_key = %s", (tenant, idempotency_key))
    )
    return existing[0], False


_SUBMIT_SPACE = 0x524C4D53  # "RLMS": one tenant's query submissions


def lock_submissions(conn: psycopg.Connection, *, tenant: str) -> None:
    """Serialise one tenant's submissions until commit, so an in-flight count and a key lookup stay true."""
    transaction_lock(conn, session_lock_key(_SUBMIT_SPACE, tenant))


def job_for_idempotency_key(conn: psycopg.Connection, *, tenant: str, key: str) -> JobRow | None:
    row = conn.execute(
        f"SELECT {_JOB_COLS} FROM jobs WHERE tenant = %s AND idempotency_key = %s", (tenant, key)
    ).fetchone()
    return JobRow.of(row) if row else None


def jobs_in_flight(conn: psycopg.Connection, *, tenant: str) -> int:
    """The tenant's queued or running jobs submitted directly (a batch's items are paced by the batch)."""
    return one(
        conn.execute(
            """SELECT count(*) FROM jobs j WHERE j.status IN ('queued', 'running') AND j.tenant = %s
           AND j.parent_id IS NULL AND NOT EXISTS (SELECT 1 FROM overnight_batch_items i WHERE i.job_id = j.id)""",
            (tenant,),
        )
    )[0]


def get_job(conn: psycopg.Connection, *, job_id: str, tenant: str | None = None) -> JobRow | None:
    sql = f"SELECT {_JOB_COLS} FROM jobs WHERE id = %s"
    args: tuple = (job_id,)
    if tenant is not None:
        sql += " AND tenant = %s"
        args = (job_id, tenant)
    row = conn.execute(sql, args).fetchone()
    return JobRow.of(row) if row else None


def jobs_by_id(conn: psycopg.Connection, *, job_ids: Sequence[str]) -> list[JobRow]:
    """The jobs of these ids that exist, in no set order."""
    rows = conn.execute(f"SELECT {_JOB_COLS} FROM jobs WHERE id = ANY(%s)", (list(job_ids),)).fetchall()
    return [JobRow.of(r) for r in rows]


def count_open(conn: psycopg.Connection, *, job_ids: Sequence[str]) -> int:
    """How many of these jobs are still queued or running: a status read, cheap enough to ask once a second."""
    row = conn.execute(
        "SELECT count(*) FROM jobs WHERE id = ANY(%s) AND status IN ('queued', 'running')", (list(job_ids),)
    ).fetchone()
    return int(row[0]) if row else 0


def reread_job(conn: psycopg.Connection, *, job_id: str) -> JobRow:
    """A job this worker already holds, read again for what changed since: jobs are never deleted, so it is there
    (a missing one fails loudly, as a ``LookupError``)."""
    return JobRow.of(one(conn.execute(f"SELECT {_JOB_COLS} FROM jobs WHERE id = %s", (job_id,))))


def job_ids_starting(conn: psycopg.Connection, *, tenant: str, prefix: str, limit: int = 4) -> list[str]:
    """Ids of the tenant's jobs that start with ``prefix`` (an id given short, as git takes them), at most ``limit``."""
    rows = conn.execute(
        "SELECT id FROM jobs WHERE tenant = %s AND starts_with(id, %s) ORDER BY id LIMIT %s", (tenant, prefix, limit)
    ).fetchall()
    return [r[0] for r in rows]


def is_open(conn: psycopg.Connection, *, job_id: str) -> bool:
    """Queued or running: a call for it may still start (a cancelled or ended job's may not)."""
    row = conn.execute("SELECT status IN ('queued', 'running') FROM jobs WHERE id = %s", (job_id,)).fetchone()
    return bool(row and row[0])


#: stages whose work runs outside the task that entered them (the analysts' chord): their time is the wall time
#: until the next stage starts, recorded by ``set_stage``
TIMED_UNTIL_NEXT = ("fan_out",)


def set_stage(conn: psycopg.Connection, *, job_id: str, stage: str) -> bool:
    """Mark the job running in ``stage``; False when the job already ended (e.g. cancelled).  Leaving a stage of
    ``TIMED_UNTIL_NEXT`` records its wall time, its analysts' included, in the timings and the stage metric."""
    row = conn.execute(
        """WITH left_stage AS (
               SELECT stage, CASE WHEN stage = ANY(%s) AND stage <> %s AND stage_at IS NOT NULL
                                  THEN round(extract(epoch FROM now() - stage_at)::numeric, 4)::float8 END AS seconds
               FROM jobs WHERE id = %s FOR UPDATE)
           UPDATE jobs SET stage = %s, status = 'running', started_at = coalesce(started_at, now()), stage_at = now(),
                  timings = CASE WHEN left_stage.seconds IS NOT NULL
                                 THEN timings || jsonb_build_object(left_stage.stage::text, left_stage.seconds)
                                 ELSE timings END
           FROM left_stage
           WHERE jobs.id = %s AND status NOT IN ('done', 'failed', 'cancelled')
           RETURNING left_stage.stage, left_stage.seconds""",
        (list(TIMED_UNTIL_NEXT), stage, job_id, stage, job_id),
    ).fetchone()
    if row is None:
        return False
    if row[1] is not None:
        metrics.stage_timed(row[0], row[1])
    return True


def add_timing(conn: psycopg.Connection, *, job_id: str, stage: str, seconds: float) -> None:
    conn.execute(
        "UPDATE jobs SET timings = timings || jsonb_build_object(%s::text, %s::float8) WHERE id = %s",
        (stage, round(seconds, 4), job_id),
    )


def add_task_ids(conn: psycopg.Connection, *, job_id: str, task_ids: Sequence[str]) -> None:
    conn.execute("UPDATE jobs SET task_ids = task_ids || %s::text[] WHERE id = %s", (list(task_ids), job_id))


def save_plan(conn: psycopg.Connection, *, job_id: str, plan: JobPlan | Mapping[str, Any] | None) -> None:
    conn.execute("UPDATE jobs SET plan = %s WHERE id = %s", (_json(JobPlan, plan), job_id))


def save_search(
    conn: psycopg.Connection,
    *,
    job_id: str,
    params: JobParams | Mapping[str, Any],
    tier: str,
    chunks_available: int,
    chunk_load_failures: int,
    batches: Sequence[Sequence[int]],
) -> None:
    conn.execute(
        """UPDATE jobs SET params = %s, scaling_tier = %s, chunks_available = %s, chunk_load_failures = %s,
               batches_total = %s WHERE id = %s""",
        (_json(JobParams, params), tier, chunks_available, chunk_load_failures, len(batches), job_id),
    )
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO job_batches (job_id, batch_no, chunk_ids) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
            [(job_id, i, list(ids)) for i, ids in enumerate(batches)],
        )


def save_collected(conn: psycopg.Connection, *, job_id: str, collected: Collected | Mapping[str, Any]) -> None:
    conn.execute("UPDATE jobs SET collected = %s WHERE id = %s", (_json(Collected, collected), job_id))


def add_chunk_load_failures(conn: psycopg.Connection, *, job_id: str, n: int) -> None:
    if n:
        conn.execute("UPDATE jobs SET chunk_load_failures = chunk_load_failures + %s WHERE id = %s", (n, job_id))


#: a job's last sign of life: its stage moved, or one of its batches started, showed life (an analyst waiting on
#: the limiter or the model heartbeats) or finished
_LAST_ACTIVITY = """greatest(j.stage_at, (SELECT greatest(max(b.started_at), max(b.heartbeat_at), max(b.finished_at))
                                         FROM job_batches b WHERE b.job_id = j.id))"""


def claim_batch(
    conn: psycopg.Connection, *, job_id: str, batch_no: int, lease_seconds: float = 60.0
) -> list[int] | None:
    """Start a pending batch of an open job and return its chunk ids; None means: do not call the LLM
    (the job ended, the batch was salvaged, an earlier delivery already finished it, or another delivery holds
    it: its heartbeat is younger than ``lease_seconds``).

    A claim takes the batch's lease in the same statement, so of two deliveries of one batch (Redis
    redelivers a message whose worker looks gone) only one pays for the model; a holder that died stops
    heartbeating and a later delivery may claim the batch once the lease ran out.

    One statement holding a share lock on the job row: analysts of a job never wait for each other,
    but a salvage (which takes that row ``FOR UPDATE``) runs either wholly before a claim (which then
    finds its batch marked lost) or after it (and sees the fresh ``started_at`` as progress), so a
    batch is never billed for a job whose report is already written.
    """
    row = conn.execute(
        """WITH open_job AS (SELECT id FROM jobs WHERE id = %(j)s AND status IN ('queued', 'running') FOR SHARE)
           UPDATE job_batches SET attempts = attempts + 1, started_at = now(), heartbeat_at = now()
           WHERE job_id = (SELECT id FROM open_job) AND batch_no = %(b)s AND status = 'pending'
             AND (heartbeat_at IS NULL OR heartbeat_at < now() - make_interval(secs => %(lease)s))
           RETURNING chunk_ids""",
        {"j": job_id, "b": batch_no, "lease": float(lease_seconds)},
    ).fetchone()
    return list(row[0]) if row else None


def batch_held(conn: psycopg.Connection, *, job_id: str, batch_no: int, lease_seconds: float) -> bool:
    """Is the batch, of an open job, still pending under a live lease (another delivery is working on it)?"""
    return (
        conn.execute(
            """SELECT 1 FROM job_batches b JOIN jobs j ON j.id = b.job_id
               WHERE b.job_id = %s AND b.batch_no = %s AND b.status = 'pending'
                 AND j.status IN ('queued', 'running')
                 AND b.heartbeat_at >= now() - make_interval(secs => %s)""",
            (job_id, batch_no, float(lease_seconds)),
        ).fetchone()
        is not None
    )


def heartbeat_batch(conn: psycopg.Connection, *, job_id: str, batch_no: int) -> bool:
    """Renew a claimed batch's lease (and show the job is moving); False once the batch ended or was salvaged."""
    return (job_id, batch_no) in heartbeat_batches(conn, batches=[(job_id, batch_no)])


def heartbeat_batches(conn: psycopg.Connection, *, batches: Sequence[tuple[str, int]]) -> set[tuple[str, int]]:
    """Renew the leases of many claimed batches in one statement: the (job, batch) pairs still pending, whose
    leases were renewed (the others ended or were salvaged)."""
    if not batches:
        return set()
    rows = conn.execute(
        """UPDATE job_batches b SET heartbeat_at = now()
           FROM unnest(%s::text[], %s::int[]) AS k(job_id, batch_no)
           WHERE b.job_id = k.job_id AND b.batch_no = k.batch_no AND b.status = 'pending'
           RETURNING b.job_id, b.batch_no""",
        ([j for j, _ in batches], [b for _, b in batches]),
    ).fetchall()
    return {(r[0], int(r[1])) for r in rows}


def lock_for_salvage(
    conn: psycopg.Connection,
    *,
    job_id: str,
    min_idle_seconds: float | None = None,
    lease_owner: str | None = None,
    lease_seconds: float = 60.0,
) -> bool:
    """Inside a transaction: lock the open job; False if it ended, (with ``min_idle_seconds``) moved lately,
    or another worker holds its lease (it is synthesizing: a second report would pay for a second synthesis).

    With ``lease_owner`` the lease is taken for the salvage in the same transaction, so two salvages of one
    job never both go on.
    """
    row = conn.execute(
        """SELECT lease_owner IS NOT NULL AND lease_until > clock_timestamp() FROM jobs
           WHERE id = %s AND status IN ('queued', 'running') FOR UPDATE""",
        (job_id,),
    ).fetchone()
    if row is None or row[0]:
        return False
    if min_idle_seconds is not None:
        # a second statement: its snapshot includes claims that committed while we waited for the lock
        # the row is locked above, so it is still there
        idle = one(
            conn.execute(f"SELECT extract(epoch FROM now() - {_LAST_ACTIVITY}) FROM jobs j WHERE j.id = %s", (job_id,))
        )[0]
        if float(idle) < min_idle_seconds:
            return False
    if lease_owner is not None:
        acquire_lease(conn, job_id=job_id, owner=lease_owner, seconds=lease_seconds)
    return True


def acquire_lease(conn: psycopg.Connection, *, job_id: str, owner: str, seconds: float) -> bool:
    """Take the open job's lease for ``owner`` (again, if it is already ``owner``'s); False while another
    holder's lease runs.  Taking it is a sign of life too (``stage_at``)."""
    return (
        conn.execute(
            """UPDATE jobs SET lease_owner = %(o)s, lease_until = clock_timestamp() + make_interval(secs => %(s)s),
                   stage_at = clock_timestamp()
               WHERE id = %(j)s AND status IN ('queued', 'running')
                 AND (lease_owner IS NULL OR lease_owner = %(o)s OR lease_until <= clock_timestamp())
               RETURNING 1""",
            {"j": job_id, "o": owner, "s": seconds},
        ).fetchone()
        is not None
    )


def renew_lease(conn: psycopg.Connection, *, job_id: str, owner: str, seconds: float) -> bool:
    """The holder's heartbeat: push the lease and the stage clock on; False if the lease is no longer ours
    (the job ended, or the lease lapsed and another worker took it)."""
    return (
        conn.execute(
            """UPDATE jobs SET lease_until = clock_timestamp() + make_interval(secs => %(s)s),
                   stage_at = clock_timestamp()
               WHERE id = %(j)s AND lease_owner = %(o)s AND status IN ('queued', 'running') RETURNING 1""",
            {"j": job_id, "o": owner, "s": seconds},
        ).fetchone()
        is not None
    )


def release_lease(conn: psycopg.Connection, *, job_id: str, owner: str) -> None:
    conn.execute(
        "UPDATE jobs SET lease_owner = NULL, lease_until = NULL WHERE id = %s AND lease_owner = %s", (job_id, owner)
    )


def finish_batch(
    conn: psycopg.Connection,
    *,
    job_id: str,
    batch_no: int,
    findings: Sequence[Finding] = (),
    error: JobError | Mapping[str, Any] | None = None,
    unanswered: Sequence[int] = (),
) -> bool:
    """Store a batch's outcome once; False (nothing stored) if a salvage already marked it lost.
    ``unanswered``: chunks of an ``ok`` batch the analyst gave no entry for (reported, never dropped silently)."""
    # one statement, so atomic without a transaction of its own and one round trip: the batch leaves pending and
    # its findings go in together, or nothing changes.  Findings are only ever written by the statement that ends
    # a pending batch, so none should be there already; if some were, the upsert replaces them.
    # The findings travel as one JSON document, not a row each: a batch of 50 chunks paid 50 rows of parameter
    # adaptation (three JSON dumps each) in the analyst's thread, under the worker's one GIL
    rows = {
        f.chunk_id: {
            "chunk_id": f.chunk_id,
            "relevance": str(getattr(f.relevance, "value", f.relevance)),
            "findings": f.findings,
            "summary": f.summary,
            "follow_up": f.follow_up,
            "records": [r.model_dump() for r in f.records],
        }
        for f in findings  # a chunk twice: the later finding wins, as row-by-row upserts had it
    }
    row = conn.execute(
        """WITH done AS (
               UPDATE job_batches SET status = %(status)s, error = %(error)s, unanswered = %(unanswered)s,
                                      finished_at = now()
               WHERE job_id = %(job)s AND batch_no = %(batch)s AND status = 'pending' RETURNING batch_no),
           stored AS (
               INSERT INTO job_findings (job_id, batch_no, chunk_id, relevance, findings, summary, follow_up, records)
               SELECT %(job)s, %(batch)s, f.chunk_id, f.relevance, f.findings, f.summary, f.follow_up, f.records
               FROM jsonb_to_recordset(%(rows)s) AS f(chunk_id bigint, relevance text, findings jsonb, summary text,
                                                       follow_up jsonb, records jsonb)
               WHERE EXISTS (SELECT 1 FROM done)
               ON CONFLICT (job_id, batch_no, chunk_id) DO UPDATE SET relevance = EXCLUDED.relevance,
                   findings = EXCLUDED.findings, summary = EXCLUDED.summary, follow_up = EXCLUDED.follow_up,
                   records = EXCLUDED.records)
           SELECT count(*) FROM done""",
        {
            "status": "failed" if error else "ok",
            "error": _json(JobError, error or None),
            "unanswered": list(unanswered),
            "job": job_id,
            "batch": batch_no,
            "rows": Jsonb(list(rows.values())),
        },
    ).fetchone()
    return bool(row and row[0])


def fail_unfinished_batches(conn: psycopg.Connection, *, job_id: str, reason: JobError | Mapping[str, Any]) -> int:
    return conn.execute(
        """UPDATE job_batches SET status = 'failed', error = %s, finished_at = now()
           WHERE job_id = %s AND status = 'pending'""",
        (_json(JobError, reason), job_id),
    ).rowcount


@dataclass(frozen=True)
class BatchRecord:
    """One analyst batch of a job: its chunks and how it ended (pending, ok, failed)."""

    batch_no: int
    chunk_ids: list[int]
    status: str
    error: JobError | None
    #: chunks of an ok batch the analyst never answered for
    unanswered: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.error, Mapping):  # built from a plain error record: held to its shape too
            object.__setattr__(self, "error", JobError.model_validate(self.error))


def batches(conn: psycopg.Connection, *, job_id: str) -> list[BatchRecord]:
    return [
        BatchRecord(r[0], list(r[1]), r[2], _opt(JobError, r[3]), list(r[4] or []))
        for r in conn.execute(
            """SELECT batch_no, chunk_ids, status, error, unanswered FROM job_batches WHERE job_id = %s
               ORDER BY batch_no""",
            (job_id,),
        )
    ]


def batch_progress(conn: psycopg.Connection, *, job_id: str) -> tuple[int, int]:
    row = one(
        conn.execute(
            """SELECT count(*) FILTER (WHERE status <> 'pending'), count(*) FROM job_batches WHERE job_id = %s""",
            (job_id,),
        )
    )
    return int(row[0]), int(row[1])


def findings_of(conn: psycopg.Connection, *, job_id: str) -> list[tuple[int, Finding]]:
    rows = conn.execute(
        """SELECT batch_no, chunk_id, relevance, findings, summary, follow_up, records FROM job_findings
           WHERE job_id = %s ORDER BY batch_no, chunk_id""",
        (job_id,),
    ).fetchall()
    return [
        (r[0], Finding(chunk_id=r[1], relevance=r[2], findings=r[3], summary=r[4], follow_up=r[5], records=r[6]))
        for r in rows
    ]


_CALL_COLS = (
    "job_id, stage, batch_no, provider, model, tokens_in, tokens_out, latency_ms, status, error, cached_tokens, "
    "cost_usd, shared, solo_tokens_in, via, parse_ok"
)


def record_llm_calls(conn: psycopg.Connection, *, rows: Sequence[tuple[str | None, LLMCall]]) -> None:
    """Log (job id, call) rows in one statement: all or none without a transaction of its own, in one round trip
    (an analyst logs a call per batch from a worker whose threads share one GIL)."""
    if not rows:
        return
    values = []
    for job_id, call in rows:
        values += [
            job_id,
            call.stage,
            call.batch,
            call.provider,
            call.model,
            call.tokens_in,
            call.tokens_out,
            call.latency_ms,
            call.status,
            (call.error or None) and call.error[:1000],
            call.cached_tokens,
            call.cost_usd,
            call.shared,
            call.solo_tokens_in,
            call.via,
            call.parse_ok,
        ]
    marks = "(" + ", ".join(["%s"] * len(_CALL_COLS.split(","))) + ")"  # one placeholder a column
    conn.execute(f"INSERT INTO llm_calls ({_CALL_COLS}) VALUES " + ", ".join([marks] * len(rows)), values)


@dataclass(frozen=True)
class TreeUsage:
    """LLM calls logged for a job or a whole tree, retries included: the exact totals a result reports."""

    calls: int
    tokens_in: int
    tokens_out: int
    cached_tokens: int
    cost_usd: float


def tree_usage(conn: psycopg.Connection, *, root_id: str) -> TreeUsage:
    row = one(
        conn.execute(
            """SELECT count(c.*), coalesce(sum(c.tokens_in), 0), coalesce(sum(c.tokens_out), 0),
                  coalesce(sum(c.cached_tokens), 0), coalesce(sum(c.cost_usd), 0)
           FROM llm_calls c JOIN jobs j ON j.id = c.job_id WHERE coalesce(j.root_id, j.id) = %s""",
            (root_id,),
        )
    )
    return TreeUsage(int(row[0]), int(row[1]), int(row[2]), int(row[3]), float(row[4]))


def tree_models(conn: psycopg.Connection, *, root_id: str) -> list[str]:
    """The models that answered the tree's calls, each once, in the order they first answered."""
    rows = conn.execute(
        """SELECT c.model FROM llm_calls c JOIN jobs j ON j.id = c.job_id
           WHERE coalesce(j.root_id, j.id) = %s AND c.status = 'ok' AND c.model IS NOT NULL
           GROUP BY c.model ORDER BY min(c.id)""",
        (root_id,),
    ).fetchall()
    return [r[0] for r in rows]


def job_usage(conn: psycopg.Connection, *, job_ids: Sequence[str]) -> dict[str, TreeUsage]:
    """Per job: its own calls only."""
    out = {}
    for r in conn.execute(
        """SELECT job_id, count(*), coalesce(sum(tokens_in), 0), coalesce(sum(tokens_out), 0),
                  coalesce(sum(cached_tokens), 0), coalesce(sum(cost_usd), 0)
           FROM llm_calls WHERE job_id = ANY(%s) GROUP BY job_id""",
        (list(job_ids),),
    ):
        out[r[0]] = TreeUsage(int(r[1]), int(r[2]), int(r[3]), int(r[4]), float(r[5]))
    return out


def tree_of(conn: psycopg.Connection, *, root_id: str) -> list[JobRow]:
    """Every job below the root (not the root itself), oldest first."""
    rows = conn.execute(
        f"SELECT {_JOB_COLS} FROM jobs WHERE root_id = %s AND id <> %s ORDER BY depth, created_at, id",
        (root_id, root_id),
    ).fetchall()
    return [JobRow.of(r) for r in rows]


def children_of(conn: psycopg.Connection, *, job_id: str) -> list[JobRow]:
    rows = conn.execute(
        f"SELECT {_JOB_COLS} FROM jobs WHERE parent_id = %s ORDER BY created_at, id", (job_id,)
    ).fetchall()
    return [JobRow.of(r) for r in rows]


def create_child(
    conn: psycopg.Connection,
    *,
    job_id: str,
    parent: JobRow,
    query: str,
    options: JobOptions | Mapping[str, Any],
    depth: int,
    spec: JobSpec | Mapping[str, Any],
) -> bool:
    """Insert a queued child of ``parent`` (same tenant, buffers and tree); False if it exists already (a
    redelivered stage creates the same ids, so it never doubles a child)."""
    row = conn.execute(
        """INSERT INTO jobs (id, tenant, query, buffers, options, parent_id, root_id, depth, spec)
           VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO NOTHING RETURNING id""",
        (
            job_id,
            parent.tenant,
            query,
            list(parent.buffers),
            Jsonb(checked(JobOptions, options).stored()),
            parent.id,
            parent.tree,
            depth,
            _json(JobSpec, spec),
        ),
    ).fetchone()
    return row is not None


def root_options(conn: psycopg.Connection, *, job_id: str) -> tuple[str, dict[str, Any], float] | None:
    """(root id, the root's options, its creation time as epoch seconds) of the job's tree: its budget."""
    row = conn.execute(
        """SELECT r.id, r.options, extract(epoch FROM r.created_at) FROM jobs j
           JOIN jobs r ON r.id = coalesce(j.root_id, j.id) WHERE j.id = %s""",
        (job_id,),
    ).fetchone()
    return (row[0], JobOptions.model_validate(row[1] or {}).stored(), float(row[2])) if row else None


def save_route(conn: psycopg.Connection, *, job_id: str, route: str, reason: str) -> None:
    conn.execute("UPDATE jobs SET route = %s, route_reason = %s WHERE id = %s", (route, reason[:500], job_id))


def add_check(
    conn: psycopg.Connection, *, job_id: str, round_no: int, verdict: CheckRecord | Mapping[str, Any]
) -> None:
    """Store round ``round_no``'s verdict once (a redelivered check finds it and pays for no second call)."""
    conn.execute(
        "UPDATE jobs SET checks = checks || %s WHERE id = %s AND jsonb_array_length(checks) = %s",
        (Jsonb([checked(CheckRecord, verdict).stored()]), job_id, round_no),
    )


def save_synth_state(conn: psycopg.Connection, *, job_id: str, state: SynthState | Mapping[str, Any] | None) -> None:
    conn.execute("UPDATE jobs SET synth_state = %s WHERE id = %s", (_json(SynthState, state or None), job_id))


def finish_job(
    conn: psycopg.Connection,
    *,
    job_id: str,
    status: JobStatus,
    result: QueryResult | Mapping[str, Any] | None = None,
    error: JobError | Mapping[str, Any] | None = None,
) -> bool:
    """End the job once; a second delivery of a final stage changes nothing."""
    cur = conn.execute(
        """UPDATE jobs SET status = %s, stage = %s, result = coalesce(%s, result), error = %s, finished_at = now()
           WHERE id = %s AND status NOT IN ('done', 'failed', 'cancelled')""",
        (
            status.value,
            status.value,
            _json(QueryResult, result),
            _json(JobError, error),
            job_id,
        ),
    )
    if cur.rowcount == 0:
        return False
    # delivered at commit: a waiting `rlm query` wakes at once instead of at its next poll
    conn.execute("SELECT pg_notify(%s, %s)", (JOB_ENDED_CHANNEL, job_id))
    metrics.job_finished(status.value)  # counted at the write: a caller's transaction rolled back after it overcounts
    return True


def cancel_job(
    conn: psycopg.Connection, *, job_id: str, tenant: str, reason: str = "cancelled by the user"
) -> JobRow | None:
    """Cancel the job and every job below it (its children, theirs…): a cancelled tree starts no new call.
    ``reason`` is the root's error message."""
    job = get_job(conn, job_id=job_id, tenant=tenant)
    if job is None:
        return None
    for jid in [job_id, *descendants(conn, job_id=job_id)]:
        finish_job(
            conn,
            job_id=jid,
            status=JobStatus.cancelled,
            error={
                "type": "cancelled",
                "message": reason if jid == job_id else "its parent was cancelled",
            },
        )
    return get_job(conn, job_id=job_id, tenant=tenant)


def descendants(conn: psycopg.Connection, *, job_id: str) -> list[str]:
    return [
        r[0]
        for r in conn.execute(
            """WITH RECURSIVE d(id) AS (SELECT id FROM jobs WHERE parent_id = %s
                 UNION SELECT j.id FROM jobs j JOIN d ON j.parent_id = d.id) SELECT id FROM d""",
            (job_id,),
        )
    ]


def task_ids_of(conn: psycopg.Connection, *, job_ids: Sequence[str]) -> list[str]:
    return [t for r in conn.execute("SELECT task_ids FROM jobs WHERE id = ANY(%s)", (list(job_ids),)) for t in r[0]]


def touch_job(conn: psycopg.Connection, *, job_id: str) -> None:
    """Progress without a stage change (a batch finished): the job is not stuck."""
    conn.execute("UPDATE jobs SET stage_at = now() WHERE id = %s", (job_id,))


def stale_jobs(conn: psycopg.Connection, *, idle_seconds: float, limit: int = 100) -> list[tuple[str, str, float]]:
    """(id, stage, idle seconds) of open jobs with no sign of life (stage, batch start or end) that long."""
    return [
        (r[0], r[1], float(r[2]))
        for r in conn.execute(
            f"""SELECT id, stage, idle FROM (
                SELECT j.id, j.stage, j.stage_at, extract(epoch FROM now() - {_LAST_ACTIVITY}) AS idle FROM jobs j
                WHERE j.status IN ('queued', 'running') AND j.stage_at < now() - make_interval(secs => %(s)s)) c
            WHERE idle >= %(s)s ORDER BY stage_at LIMIT %(n)s""",
            {"s": idle_seconds, "n": limit},
        )
    ]


def llm_calls_of(conn: psycopg.Connection, *, job_id: str) -> list[LLMCall]:
    """Every call logged for the job, retries included, in the order they were logged."""
    return [
        LLMCall(
            stage=r[0],
            batch=r[1],
            provider=r[2],
            model=r[3],
            tokens_in=r[4],
            tokens_out=r[5],
            latency_ms=r[6],
            status=r[7],
            error=r[8],
            cached_tokens=r[9],
            cost_usd=r[10],
            shared=r[11],
            solo_tokens_in=r[12],
            via=r[13],
            parse_ok=r[14],
        )
        for r in conn.execute(
            """SELECT stage, batch_no, provider, model, tokens_in, tokens_out, latency_ms, status, error, cached_tokens,
                      cost_usd, shared, solo_tokens_in, via, parse_ok FROM llm_calls WHERE job_id = %s ORDER BY id""",
            (job_id,),
        )
    ]


def listen_job_ended(conn: psycopg.Connection, *, listen: bool = True) -> None:
    """Start (or stop) hearing ``finish_job``'s notifications on this connection; takes effect at commit."""
    conn.execute(f"{'LISTEN' if listen else 'UNLISTEN'} {JOB_ENDED_CHANNEL}")


_LAUNCH_SPACE = 0x524C4D46  # "RLMF": the fan-out launch of a job, apart from uploads' and migrations' locks


@contextlib.contextmanager
def launch_lock(conn: psycopg.Connection, *, job_id: str) -> Iterator[bool]:
    """Hold the job's launch lock for a block (True), or say another delivery holds it (False).

    Sending a chord and storing its task ids are two steps; a delivery of the same stage running beside a
    first one still in between (a message restored when a worker lost Redis) must not send a second chord.
    """
    key = session_lock_key(_LAUNCH_SPACE, job_id)
    held = try_session_lock(conn, key)
    try:
        yield held
    finally:
        if held:
            release_session_lock(conn, key)


_STAGE_SPACE = 0x524C4D4A  # "RLMJ": a job's stage being run by a live worker


@contextlib.contextmanager
def stage_held(conn: psycopg.Connection, *, job_id: str) -> Iterator[None]:
    """Say, for the block, that a live worker runs a stage of the job: a shared session lock on ``conn``.

    Shared, since two deliveries of one stage may run at once (stages are idempotent).  The lock goes with the
    worker's session when it dies, so ``orphaned_jobs`` tells a dead stage from a slow one at once."""
    key = session_lock_key(_STAGE_SPACE, job_id)
    conn.execute("SELECT pg_advisory_lock_shared(%s)", (key,))
    try:
        yield
    finally:
        try:
            conn.execute("SELECT pg_advisory_unlock_shared(%s)", (key,))
        except psycopg.Error:  # a broken connection took the lock with it
            pass


def orphaned_jobs(
    conn: psycopg.Connection, *, stages: Sequence[str], grace_seconds: float, limit: int = 100
) -> list[tuple[str, str]]:
    """(id, stage) of running jobs in one of ``stages`` that no live worker runs (``stage_held``), whose stage has
    not moved for ``grace_seconds`` and whose lease, if any, lapsed; claimed for re-sending (the stage clock reset),
    atomically.  A job in fan_out counts only before its chord was sent (after it, the analysts carry it) and
    unless it waits for its group's shared reads (``fanout.run``), where it stays with no task running it."""
    held = held_session_locks(conn, _STAGE_SPACE)
    rows = conn.execute(
        """SELECT id, stage FROM jobs
           WHERE status = 'running' AND stage = ANY(%s) AND stage_at < now() - make_interval(secs => %s)
             AND (stage <> 'fan_out' OR (cardinality(task_ids) = 0 AND spec->>'read_group' IS NULL))
             AND (lease_until IS NULL OR lease_until <= clock_timestamp())
           ORDER BY stage_at LIMIT %s""",
        (list(stages), grace_seconds, limit),
    ).fetchall()
    lost = [(r[0], r[1]) for r in rows if session_lock_key(_STAGE_SPACE, r[0]) not in held]
    claimed = []
    for job_id, stage in lost:
        # the same conditions again: a delivery that started the stage since the locks were read moved stage_at
        row = conn.execute(
            """UPDATE jobs SET stage_at = now() WHERE id = %s AND status = 'running' AND stage = %s
                 AND stage_at < now() - make_interval(secs => %s) RETURNING id""",
            (job_id, stage, grace_seconds),
        ).fetchone()
        if row is not None:
            claimed.append((job_id, stage))
    return claimed


def orphaned_batches(
    conn: psycopg.Connection, *, lease_seconds: float, grace_seconds: float, limit: int = 100
) -> list[tuple[str, int]]:
    """(job id, batch number) of started, pending batches whose lease nobody renewed for ``lease_seconds`` (the
    analyst holding it died), in running jobs whose chord was sent and whose clock has not moved for
    ``grace_seconds``; each job claimed for re-sending (its clock reset), atomically."""
    rows = conn.execute(
        """WITH lost AS (
               SELECT b.job_id, b.batch_no FROM job_batches b JOIN jobs j ON j.id = b.job_id
               WHERE j.status = 'running' AND j.stage = 'fan_out' AND cardinality(j.task_ids) > 0
                 AND j.stage_at < now() - make_interval(secs => %(grace)s)
                 AND b.status = 'pending' AND b.started_at IS NOT NULL
                 AND b.heartbeat_at < now() - make_interval(secs => %(lease)s)
               ORDER BY b.job_id, b.batch_no LIMIT %(n)s),
           claimed AS (
               UPDATE jobs SET stage_at = now() WHERE id IN (SELECT job_id FROM lost) AND stage = 'fan_out'
                 AND stage_at < now() - make_interval(secs => %(grace)s) RETURNING id)
           SELECT job_id, batch_no FROM lost WHERE job_id IN (SELECT id FROM claimed) ORDER BY job_id, batch_no""",
        {"lease": float(lease_seconds), "grace": float(grace_seconds), "n": limit},
    ).fetchall()
    return [(r[0], int(r[1])) for r in rows]


def unreported_fan_outs(conn: psycopg.Connection, *, grace_seconds: float, limit: int = 100) -> list[str]:
    """Running jobs still in fan_out ``grace_seconds`` after their last batch ended: the chord's callback waits
    for a message that will not come soon (its analyst died, and a re-sent one is no member of the chord).
    Claimed for sending Collect (the clock reset), atomically."""
    rows = conn.execute(
        """UPDATE jobs j SET stage_at = now()
           WHERE j.id IN (
               SELECT j2.id FROM jobs j2
               WHERE j2.status = 'running' AND j2.stage = 'fan_out' AND cardinality(j2.task_ids) > 0
                 AND j2.stage_at < now() - make_interval(secs => %(grace)s)
                 AND NOT EXISTS (SELECT 1 FROM job_batches b WHERE b.job_id = j2.id AND b.status = 'pending')
                 AND (SELECT max(b.finished_at) FROM job_batches b WHERE b.job_id = j2.id)
                     < now() - make_interval(secs => %(grace)s)
               ORDER BY j2.stage_at LIMIT %(n)s)
             AND j.stage = 'fan_out' AND j.stage_at < now() - make_interval(secs => %(grace)s)
           RETURNING j.id""",
        {"grace": float(grace_seconds), "n": limit},
    ).fetchall()
    return [r[0] for r in rows]


# --------------------------------------------------------------------------- what the job list, web view and MCP read


@dataclass(frozen=True)
class BatchState:
    """One analyst batch as a person watching the job sees it (docs/contract.md#job-view)."""

    batch_no: int
    chunks: int
    #: queued (not claimed yet), running (claimed), done, failed
    state: str
    attempts: int
    error: JobError | None


def batch_states(conn: psycopg.Connection, *, job_id: str) -> list[BatchState]:
    return [
        BatchState(r[0], r[1], r[2], r[3], _opt(JobError, r[4]))
        for r in conn.execute(
            """SELECT batch_no, cardinality(chunk_ids),
                      CASE WHEN status = 'ok' THEN 'done' WHEN status = 'failed' THEN 'failed'
                           WHEN started_at IS NULL THEN 'queued' ELSE 'running' END,
                      attempts, error
               FROM job_batches WHERE job_id = %s ORDER BY batch_no""",
            (job_id,),
        )
    ]


#: most jobs one page of ``list_jobs`` returns
MAX_PAGE = 200


def list_jobs(
    conn: psycopg.Connection,
    *,
    tenant: str,
    status: str | None = None,
    buffer: str | None = None,
    text: str | None = None,
    roots_only: bool = True,
    limit: int = 50,
    before: str | None = None,
) -> list[JobRow]:
    """A tenant's jobs, newest first (keyset paging: ``before`` is the last id of the previous page).

    Walks the (tenant, created_at) index; a filter narrows the walk, never a sort over the whole table.
    """
    where = ["tenant = %(t)s"]
    args: dict[str, Any] = {"t": tenant, "n": max(1, min(limit, MAX_PAGE))}
    if status:
        where.append("status = %(s)s")
        args["s"] = status
    if buffer:
        where.append("%(b)s = ANY(buffers)")
        args["b"] = buffer
    if text:
        # a literal substring: LIKE's own wildcards in the user's text are escaped
        where.append("query ILIKE %(q)s ESCAPE '\\'")
        args["q"] = "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    if roots_only:
        where.append("parent_id IS NULL")
    if before:
        where.append("(created_at, id) < (SELECT created_at, id FROM jobs WHERE id = %(c)s AND tenant = %(t)s)")
        args["c"] = before
    rows = conn.execute(
        f"SELECT {_JOB_COLS} FROM jobs WHERE {' AND '.join(where)} ORDER BY created_at DESC, id DESC LIMIT %(n)s",
        args,
    ).fetchall()
    return [JobRow.of(r) for r in rows]
