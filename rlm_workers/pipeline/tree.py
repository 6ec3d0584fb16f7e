"""Job trees: thinking mode's rounds, the child jobs they start, and the merge of their findings.

A thinking root, after each fan-out round, runs the completeness check (messages and parsing in
``check.py``).  Each follow-up the check asks for becomes a child job — its own plan, search and chord, one
level deeper — created in one transaction with the parent's stage set to ``children``, then sent.  Nothing
waits in a worker thread: a child that ends sends ``rlm.merge`` to its parent (``notify_parent_if_ended``),
and the reconciler sends it when that message was lost.  Merge unites the findings of the job and of all its
children (one entry per chunk), then checks again; the tree stops at a complete verdict, at ``--depth``, when
nothing new is left to follow, or when the budget is spent, and the root writes one report.
query_subset children (``synthesize.py``) use the same machinery, and so do code mode's ``rlm_query`` children
(``program_api.py``), whose parent's program waits on them instead of a merge.  See docs/architecture.md#job-trees.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..celery_app import get_app
from ..constants import CODE_CHILD_WAITS_KEY
from ..errors import BudgetExhausted, JobCancelled, ParseError, RLMError
from ..llm.protocol import CompletionRequest
from ..llm.structured import response_schema
from ..runtime.resources import redis_client
from ..store import jobs as job_store
from ..store.db import connection, durable_write
from ..store.job_state import PROGRAM_CHILD, CheckRecord
from .budget import ledger_for_job
from .calls import call_llm
from .check import CHECK_MAX_TOKENS, CheckVerdict, check_input, fresh_follow_ups, parse_check, render_messages
from .collect import collect_job, finding_threshold
from .flow import OK, Stage, StageContext
from .prompts import load_prompt

if TYPE_CHECKING:
    import psycopg

    from ..config import Settings
    from ..store.jobs import JobRow

log = logging.getLogger("rlm.pipeline.tree")

#: how often a program waiting on its child jobs looks at them (and at its own job: cancelled, ended)
_CHILD_POLL_SECONDS = 1.0
#: a waiting program's claim lapses this long after its last renewal (its worker died)
_WAIT_CLAIM_SECONDS = 60.0


# --------------------------------------------------------------------------- the check and the children


def max_depth(job: JobRow, settings: Settings) -> int:
    return job.options.depth if job.options.depth is not None else settings.max_depth


def child_rounds(conn: psycopg.Connection, job: JobRow) -> int:
    """How many rounds of children the job has started (its deepest child's depth below it)."""
    kids = job_store.children_of(conn, job_id=job.id)
    return max((k.depth - job.depth for k in kids if k.spec and k.spec.kind == "follow_up"), default=0)


def asked_in_tree(conn: psycopg.Connection, job: JobRow) -> list[str]:
    """Every question the tree has asked: the root's and each child's, so no follow-up is asked twice."""
    return [job.query] + [k.query for k in job_store.tree_of(conn, root_id=job.tree)]


def run_check(ctx: StageContext) -> str:
    job = ctx.job
    if job.options.mode != "thinking" or job.parent_id is not None:
        return OK
    return check_and_branch(ctx.conn, job, ctx.settings)


def check_and_branch(conn: psycopg.Connection, job: JobRow, settings: Settings) -> str:
    """Check the round's findings; start a round of children (and return "waiting …") or return OK (report)."""
    with job_store.launch_lock(conn, job_id=job.id) as mine:
        if not mine:
            return "being checked by another delivery"
        current = job_store.get_job(conn, job_id=job.id)
        if current is None or current.terminal:
            return "skipped"
        job = current
        rnd = child_rounds(conn, job)
        asked = asked_in_tree(conn, job)
        verdict = job.checks[rnd] if len(job.checks) > rnd else None
        if verdict is None:
            verdict = _ask_checker(conn, job, settings, rnd, asked[1:])
            if verdict is None:
                return OK  # the budget is spent: write the report with what there is
            follow, repeated = fresh_follow_ups(verdict.follow_ups, asked)
            if repeated and not follow and not verdict.complete:
                # a small checker asks the same follow-up round after round: the rounds end here, and the
                # report says why it is not more complete (stored with the verdict, so a redelivery agrees)
                shown = "; ".join(repeated[:3])
                verdict.gaps = [
                    *verdict.gaps,
                    f"the completeness check asked only what was asked before ({shown[:300]}): the rounds "
                    "stopped with what they found",
                ]
            durable_write(
                conn,
                lambda c: job_store.add_check(c, job_id=job.id, round_no=rnd, verdict=verdict),
                what=f"check of job {job.id}",
            )
        follow, _ = fresh_follow_ups(verdict.follow_ups, asked)
        if verdict.complete or not follow:
            return OK
        if rnd + 1 > max_depth(job, settings):
            return OK
        if budget_spent(job):
            return OK
        tasks = [(q, {"kind": "follow_up"}) for q in follow]
        kids = start_children(conn, job, tasks, depth=job.depth + rnd + 1, tag=f"r{rnd + 1}")
        return f"waiting on {len(kids)} children"


def _ask_checker(
    conn: psycopg.Connection, job: JobRow, settings: Settings, rnd: int, asked: list[str]
) -> CheckRecord | None:
    """Round ``rnd``'s verdict (``asked``: the follow-ups asked so far); None when the budget is spent."""
    kept = job.collected.kept if job.collected else []
    shown = check_input(job.query, kept, asked)
    messages = render_messages(load_prompt("check", prompt_dir=settings.prompt_dir), shown)
    try:
        completion = call_llm(
            conn,
            job_id=job.id,
            stage="check",
            request=CompletionRequest(
                role="check",
                model=settings.resolved_check_model,
                messages=messages,
                max_tokens=CHECK_MAX_TOKENS,
                json_output=True,
                json_schema=response_schema("check_verdict", CheckVerdict),
                stage_input=shown,
            ),
            parse=parse_check,
        )
        if completion.parse_error is not None:
            raise completion.parse_error
        return CheckRecord.model_validate({"round": rnd, **completion.parsed.model_dump()})
    except BudgetExhausted:
        return None
    except RLMError as exc:  # a failed check ends the rounds, not the job: the report says what is unknown
        log.warning("job %s: completeness check failed: %s", job.id, exc)
        gap = (
            f"the completeness check's reply could not be read: {exc}"
            if isinstance(exc, ParseError)
            else f"completeness check failed: {exc}"
        )
        # a record, not a dict: the caller reads the verdict's follow-ups and gaps by attribute
        return CheckRecord(round=rnd, complete=None, confidence=None, gaps=[gap], follow_ups=[])


def budget_spent(job: JobRow) -> bool:
    ledger = ledger_for_job(job.tree)
    return ledger is not None and ledger.state().get("exhausted") is not None


def child_id(parent_id: str, tag: str, k: int) -> str:
    """A child's id, derived from its parent, its round (or synthesis turn) and its position: a redelivered
    stage computes the same ids and finds the rows instead of doubling them."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"rlm:{parent_id}/{tag}/{k}").hex


def start_children(
    conn: psycopg.Connection,
    parent: JobRow,
    tasks: Iterable[tuple[str, Mapping[str, Any]]],
    *,
    depth: int,
    tag: str,
) -> list[str]:
    """Create the children — ``tasks`` is (question, spec) — and set the parent waiting (stage ``children``),
    all in one transaction, then send them.  All at once: a child that ends fast must find its siblings
    already there, or it would wake the parent too early.  A child whose message is lost sits in ``queued``
    until the reconciler resends it.
    """
    app = get_app()

    ids = []
    options = {"scope": "search"}
    if ft := parent.options.finding_threshold:
        options["finding_threshold"] = ft
    with conn.transaction():
        for k, (question, spec) in enumerate(tasks):
            kid = child_id(parent.id, tag, k)
            job_store.create_child(
                conn, job_id=kid, parent=parent, query=question, options=options, depth=depth, spec=dict(spec)
            )
            ids.append(kid)
        job_store.set_stage(conn, job_id=parent.id, stage=Stage.children)
    for kid in ids:
        app.send_task("rlm.plan", (kid,), argsrepr=f"job={kid} parent={parent.id}")
    log.info("job %s: started %d children at depth %d (%s)", parent.id, len(ids), depth, tag)
    return ids


def start_program_children(conn: psycopg.Connection, parent: JobRow, questions: Sequence[str]) -> list[str]:
    """Code mode's child jobs (``rlm_query``): one per question, one level below ``parent``, sent at once, each
    routed and reported as a plain query of the same buffers would be (``JobRow.merges_into_parent``).  A
    child's id comes from its question, so a question asked again (in a later round, or by a stage sent again
    after its worker died) finds the child it already has instead of starting another.  The parent keeps its
    stage: its program waits on the children (``wait_children``), and nothing wakes it with a merge."""
    ids = [child_id(parent.id, "program/" + hashlib.sha256(q.encode()).hexdigest()[:32], 0) for q in questions]
    created = []
    depth = parent.depth + 1
    with conn.transaction():
        for kid, question in dict(zip(ids, questions, strict=True)).items():
            if job_store.create_child(
                conn,
                job_id=kid,
                parent=parent,
                query=question,
                options={},  # asked as a plain query is: mode auto, its own route
                depth=depth,
                spec={"kind": PROGRAM_CHILD},
            ):
                created.append(kid)
    app = get_app()
    for kid in created:  # one created but never sent (a worker died between) is the reconciler's to send
        app.send_task("rlm.plan", (kid,), argsrepr=f"job={kid} parent={parent.id}")
    log.info("job %s: %d child jobs asked for, %d new, at depth %d", parent.id, len(ids), len(created), depth)
    return ids


@contextlib.contextmanager
def child_wait_claim(job_id: str, limit: int) -> Iterator[Callable[[], None] | None]:
    """A claim to wait on child jobs, one of at most ``limit`` over all workers (``RLM_CODE_CHILD_WAITS``): it
    yields the claim's renewal, or None when ``limit`` programs wait already.  A waiting program holds a control
    slot while its children's stages need control slots too; kept below the pool's slots, the waits can never
    hold them all.  Claims lapse unless renewed, so a dead worker's does not count for long."""
    r = redis_client()

    def renew() -> None:
        r.zadd(CODE_CHILD_WAITS_KEY, {job_id: time.time() + _WAIT_CLAIM_SECONDS})

    pipe = r.pipeline()
    pipe.zremrangebyscore(CODE_CHILD_WAITS_KEY, "-inf", time.time())
    pipe.zadd(CODE_CHILD_WAITS_KEY, {job_id: time.time() + _WAIT_CLAIM_SECONDS})
    pipe.zcard(CODE_CHILD_WAITS_KEY)
    waiting = pipe.execute()[-1]
    try:
        # two programs claiming together may both be refused, never both admitted past the limit
        yield renew if waiting <= limit else None
    finally:
        r.zrem(CODE_CHILD_WAITS_KEY, job_id)


def wait_children(
    conn: psycopg.Connection,
    ids: Sequence[str],
    *,
    should_stop: Callable[[], bool],
    timeout: float,
    on_tick: Callable[[], None],
) -> dict[str, JobRow]:
    """The children, once each has ended or at ``timeout`` (those still open as they are then); ``JobCancelled``
    when the waiting job ends meanwhile (a cancel of the tree has cancelled them too)."""
    deadline = time.monotonic() + timeout
    # each tick reads statuses only; the rows, reports and findings included, are read once at the end
    while job_store.count_open(conn, job_ids=ids) and time.monotonic() <= deadline:
        if should_stop():
            raise JobCancelled("the job has ended; the child jobs its program waited on are cancelled with it")
        on_tick()
        time.sleep(_CHILD_POLL_SECONDS)
    return {j.id: j for j in job_store.jobs_by_id(conn, job_ids=ids)}


# --------------------------------------------------------------------------- children ending, and the merge


def notify_parent_if_ended(job_id: str) -> None:
    """A child that ended wakes its parent once every sibling has ended too (safe to call for any job)."""
    try:
        with connection() as conn:
            job = job_store.get_job(conn, job_id=job_id)
            if job is None or job.parent_id is None or not job.terminal:
                return
            parent = job_store.get_job(conn, job_id=job.parent_id)
            if parent is None or parent.terminal or parent.stage != Stage.children:
                return
            if any(not k.terminal for k in job_store.children_of(conn, job_id=parent.id)):
                return

        app = get_app()

        app.send_task("rlm.merge", (parent.id,), argsrepr=f"job={parent.id}")
    except Exception:  # the reconciler sends the merge when this did not
        log.warning("could not wake the parent of job %s", job_id, exc_info=True)


def run_merge(ctx: StageContext) -> str:
    conn, job = ctx.conn, ctx.job
    kids = job_store.children_of(conn, job_id=job.id)
    if any(not k.terminal for k in kids):
        job_store.set_stage(conn, job_id=job.id, stage=Stage.children)
        return "waiting on children"
    collect_job(conn, job, finding_threshold(ctx.settings))  # its own findings, united with every ended child's
    job = job_store.reread_job(conn, job_id=job.id)
    if job.synth_state:
        return OK  # a synthesis paused on query_subset: it goes on with the children's findings
    if job.options.mode == "thinking" and job.parent_id is None:
        return check_and_branch(conn, job, ctx.settings)
    return OK
