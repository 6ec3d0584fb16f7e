"""Shared reads: one analyst call reads a chunk batch once and answers every question that needs it.

An overnight batch submits the items of one buffer together, as a *read group* (their jobs carry
``spec.read_group``).  Each job plans and searches on its own, then parks at ``fan_out`` (``fanout.run``).  Once
every job of the group has searched, the overnight tick calls ``launch_group``: the jobs' pending analyst batches
are grouped by their exact chunk ids (always the same under ``--scope all``), and each distinct batch becomes one
*read* whose members are the (job, batch) pairs it answers, at most ``RLM_SHARED_READ_QUESTIONS`` per read.  A
read goes out as an ``rlm.read`` task (``run``) or, for a ``--llm-batch`` batch, in an OpenAI Batch API file
(``overnight/llm_batch.py``: ``request_for`` and ``apply_completion``).  Its reply is split by question, and each
member's findings are stored under its own (job, batch), exactly as its own analyst would have stored them; the
job whose last batch that was moves on to collect and synthesizes alone.  The call is logged on every member job
with its share of the tokens and cost, and what the job alone would have read (``solo_tokens_in``), so a batch
reports its tokens with and without sharing (docs/contract.md#shared-reads).

Like the analyst, a read never raises into its task but for a database outage: a failure is stored on each
member's batch, and the jobs go on with the batches that worked.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..celery_app import get_app
from ..config import Settings, get_settings
from ..errors import LLMError, ParseError, error_record
from ..llm import fair
from ..llm.protocol import Attempt, Completion, CompletionRequest
from ..llm.stage_input import ReadInput
from ..models import Finding
from ..runtime.resources import provider
from ..store import jobs as job_store
from ..store import reads as store
from ..store.db import DB_OUTAGE, connection, durable_write
from . import accounting
from .analyst import (
    NONE_KEY,
    PRIOR_REPLY_CHARS,
    ChunkForPrompt,
    Question,
    analyst_request,
    batch_lease_seconds,
    findings_from_entries,
    prompt_chunks,
    question_no,
    render_messages,
    render_shared_messages,
    reply_entries,
)
from .flow import Heartbeat
from .prompts import load_prompt
from .salvage import watchdog_countdown

if TYPE_CHECKING:
    import psycopg

    from ..store.jobs import JobRow

log = logging.getLogger("rlm.pipeline.reads")

TASK = "rlm.read"
#: said in the system prompt of a read with more than one question (after the analyst's own)
SHARED_PROMPT = "shared"


# --------------------------------------------------------------------------- launching a group (overnight tick)


@dataclass
class Launch:
    """What ``launch_group`` decided, sent by the tick once its transaction committed."""

    #: (read id, Celery task id) to send as ``rlm.read``
    reads: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    #: jobs with nothing left to read: sent straight to collect
    collect: list[str] = dataclasses.field(default_factory=list)
    #: jobs whose fan-out is now watched (``rlm.watchdog``)
    watch: list[str] = dataclasses.field(default_factory=list)
    #: whose reads these are: the fair share counts them as queued (docs/contract.md#fair-share)
    tenant: str | None = None


def launch_group(
    conn: psycopg.Connection,
    *,
    tenant: str,
    overnight_id: str,
    jobs: Sequence[JobRow],
    llm_batch: bool,
    settings: Settings,
) -> Launch:
    """Create the reads of jobs parked at fan_out (in the caller's transaction); sends nothing."""
    out = Launch(tenant=tenant)
    by_job = {j.id: j for j in jobs}
    groups: dict[tuple[bool, tuple[int, ...]], list[tuple[str, int]]] = {}
    for job_id, batch_no, chunk_ids in store.batches_of_jobs(conn, job_ids=list(by_job)):
        # an exact count reads each chunk's own lines only: its text differs, so it reads apart from the others
        counting = by_job[job_id].route == "exhaustive"
        groups.setdefault((counting, tuple(chunk_ids)), []).append((job_id, batch_no))
    tasks: dict[str, list[str]] = {j: [] for j in by_job}
    per_read = max(1, settings.shared_read_questions)
    for (_counting, shared), members in groups.items():
        for part in _parts(members, per_read):
            read_id = store.create_read(
                conn, tenant=tenant, overnight_id=overnight_id, chunk_ids=shared, members=part, llm_batch=llm_batch
            )
            task_id = f"read-{read_id}" if llm_batch else uuid.uuid4().hex
            if not llm_batch:
                out.reads.append((read_id, task_id))
            for job_id, _ in part:
                tasks[job_id].append(task_id)
    for job_id, ids in tasks.items():
        if ids:
            job_store.add_task_ids(conn, job_id=job_id, task_ids=ids)
            if not llm_batch:
                out.watch.append(job_id)
        elif store.flip_to_collect(conn, job_id=job_id):
            out.collect.append(job_id)
    return out


def _parts(members: list[tuple[str, int]], size: int) -> list[list[tuple[str, int]]]:
    """Members split into reads of at most ``size`` questions, never one job twice in a read."""
    parts: list[list[tuple[str, int]]] = []
    for m in members:
        home = next((p for p in parts if len(p) < size and all(j != m[0] for j, _ in p)), None)
        if home is None:
            parts.append(home := [])
        home.append(m)
    return parts


def send_launch(launch: Launch, *, priority: int | None = None) -> None:
    """Send what ``launch_group`` decided (after its transaction committed)."""
    app = get_app()
    settings = get_settings()
    fair.note_queued(launch.tenant, len(launch.reads))
    for read_id, task_id in launch.reads:
        opts: dict[str, Any] = {"task_id": task_id, "argsrepr": f"read={read_id}"}
        if priority is not None:
            opts["priority"] = priority
        app.send_task(TASK, (read_id,), **opts)
    for job_id in launch.collect:
        send_collect(job_id)
    for job_id in launch.watch:
        app.send_task("rlm.watchdog", (job_id,), countdown=watchdog_countdown(settings), argsrepr=f"job={job_id}")


def send_collect(job_id: str) -> None:
    get_app().send_task("rlm.collect", (job_id,), argsrepr=f"job={job_id}")


def tenant_of(read_id: int) -> str | None:
    """The read's tenant (one batch's, so one tenant for all its members); None for an unknown read."""
    with connection() as conn:
        read = store.get_read(conn, read_id=read_id)
    return read.tenant if read is not None else None


def send_read(read_id: int) -> None:
    """An ordinary call for a read (a Batch API line that failed or expired falls back to this)."""
    app = get_app()
    with connection() as conn:
        store.set_status(conn, read_id=read_id, status="pending")
    app.send_task(TASK, (read_id,), argsrepr=f"read={read_id}")


# --------------------------------------------------------------------------- one read


@dataclass
class _Member:
    job: JobRow
    batch_no: int
    question_no: int


@dataclass
class _Prepared:
    read: store.ReadRow
    members: list[_Member]
    chunks: list[ChunkForPrompt]
    request: CompletionRequest
    #: estimated input tokens each member's own call would have sent, as a share of this call's
    solo_share: list[float]


def _prepare(conn: psycopg.Connection, read: store.ReadRow, members: list[_Member], settings: Settings) -> _Prepared:
    counting = any(m.job.route == "exhaustive" for m in members)
    chunks = prompt_chunks(conn, tenant=read.tenant, ids=read.chunk_ids, counting=counting)
    system = load_prompt("subcall", prompt_dir=settings.prompt_dir)
    questions = [
        Question(
            m.job.query,
            tuple(m.job.params.focus_topics if m.job.params else ()),
            records_wanted=m.job.route == "exhaustive",
        )
        for m in members
    ]
    solos = [render_messages(system, ReadInput(tuple(chunks), (q,))) for q in questions]
    if len(members) == 1:
        asked, messages = ReadInput(tuple(chunks), (questions[0],)), solos[0]
    else:
        asked = ReadInput(tuple(chunks), tuple(questions), shared=True)
        messages = render_shared_messages(
            system + "\n\n" + load_prompt(SHARED_PROMPT, prompt_dir=settings.prompt_dir), asked
        )
    size = len(json.dumps(messages, ensure_ascii=False)) or 1
    request = analyst_request(messages, settings, asked, tenant=read.tenant)
    return _Prepared(read, members, chunks, request, [len(json.dumps(s, ensure_ascii=False)) / size for s in solos])


def _open_members(conn: psycopg.Connection, read_id: int) -> tuple[store.ReadRow | None, list[_Member]]:
    """The read and its members whose job is open and whose batch is still pending."""
    read = store.get_read(conn, read_id=read_id)
    if read is None:
        return None, []
    out = []
    for m in store.pending_members(conn, read_id=read_id):
        job = job_store.get_job(conn, job_id=m.job_id)
        if job is not None and not job.terminal:
            out.append(_Member(job, m.batch_no, m.question_no))
    return read, out


def request_for(conn: psycopg.Connection, read_id: int) -> CompletionRequest | None:
    """The read's analyst request (for a Batch API file); None when no member is left to answer."""
    read, members = _open_members(conn, read_id)
    if read is None or not members:
        return None
    return _prepare(conn, read, members, get_settings()).request


def run(read_id: int) -> dict:
    """What ``rlm.read`` does: claim the members' batches, call the model once, store each member's findings."""
    try:
        return _run(read_id)
    except DB_OUTAGE:
        raise
    except Exception as exc:  # never into the task: every member's batch gets the error instead
        log.exception("read %s crashed", read_id)
        _fail(read_id, error_record(exc))
        return {"read": read_id, "status": "failed", "error": error_record(exc)}


def _claim(members: list[_Member], lease: float) -> list[_Member]:
    """Claim the members' batches: one payment per batch.  A batch another delivery holds is waited for (about
    one lease, as the analyst does) so a holder that died — this very task before a database outage made it
    retry — is taken over; one still held after that, or finished, is left out of this call."""
    claimed: list[_Member] = []
    waiting = list(members)
    deadline = time.monotonic() + lease * 1.5
    while True:
        with connection() as conn:  # none held while sleeping: the pool is shared by every analyst thread
            still = []
            for m in waiting:
                if job_store.claim_batch(conn, job_id=m.job.id, batch_no=m.batch_no, lease_seconds=lease) is not None:
                    claimed.append(m)
                elif job_store.batch_held(conn, job_id=m.job.id, batch_no=m.batch_no, lease_seconds=lease):
                    still.append(m)
        waiting = still
        if not waiting or time.monotonic() >= deadline:
            return sorted(claimed, key=lambda m: m.question_no)
        time.sleep(lease / 3)


def _run(read_id: int) -> dict:
    settings = get_settings()
    lease = batch_lease_seconds(settings)
    with connection() as conn:
        read, members = _open_members(conn, read_id)
        if read is None or not members:
            if read is not None:
                store.set_status(conn, read_id=read_id, status="done")
            return {"read": read_id, "status": "skipped"}
    claimed = _claim(members, lease)
    if not claimed:
        return {"read": read_id, "status": "skipped"}
    with connection() as conn:
        prepared = _prepare(conn, read, claimed, settings)
    if not prepared.chunks:
        err = {"type": "chunk_load", "message": f"none of the read's {len(read.chunk_ids)} chunks could be loaded"}
        _store(prepared, {}, error=err)
        return {"read": read_id, "status": "failed", "error": err}

    def beat(conn: psycopg.Connection) -> bool:
        return bool(job_store.heartbeat_batches(conn, batches=[(m.job.id, m.batch_no) for m in claimed]))

    with Heartbeat(beat, lease / 3, f"read {read_id}"):
        try:
            completion, answered, problem = _call(prepared, via="sync")
        except LLMError as exc:
            _store(prepared, {}, error=error_record(exc))
            return {"read": read_id, "status": "failed", "error": error_record(exc)}
        missing = _missing(prepared, answered)
        if missing or problem:
            # one more call naming what was wrong (PaperQA2's prior attempt); still missing after it: unanswered
            retry = dataclasses.replace(
                prepared.request, messages=_retry_messages(prepared, completion.text, problem, missing)
            )
            try:
                _, more, _ = _call(dataclasses.replace(prepared, request=retry), via="sync")
                for q, found in more.items():
                    answered.setdefault(q, {}).update(
                        {cid: f for cid, f in found.items() if cid not in answered.get(q, {})}
                    )
            except LLMError as exc:
                log.warning(
                    "read %s: the second call failed (%s); what is missing is reported unanswered", read_id, exc
                )
        if not answered and problem:
            err = {"type": "parse", "message": problem}
            _store(prepared, {}, error=err)
            return {"read": read_id, "status": "failed", "error": err}
    return _store(prepared, answered)


def apply_completion(read_id: int, completion: Completion, *, via: accounting.Via = "sync") -> str:
    """A reply that came back some other way (a Batch API output line): parse, log, store, move jobs on.
    Chunks it leaves out are stored as unanswered (a Batch API line is not asked again)."""
    try:
        with connection() as conn:
            read, members = _open_members(conn, read_id)
            if read is None or not members:
                if read is not None:
                    store.set_status(conn, read_id=read_id, status="done")
                return "skipped"
            prepared = _prepare(conn, read, members, get_settings())
        answered, problem = _parse_logged(prepared, completion, via)
        if not answered and problem:
            _store(prepared, {}, error={"type": "parse", "message": problem})
            return "failed"
        _store(prepared, answered)
        return "done"
    except DB_OUTAGE:
        raise
    except Exception as exc:
        log.exception("read %s: applying its reply failed", read_id)
        _fail(read_id, error_record(exc))
        return "failed"


# --------------------------------------------------------------------------- call, parse, store


def _call(prepared: _Prepared, *, via: accounting.Via) -> tuple[Completion, dict[int, dict[int, Finding]], str | None]:
    """One provider call for the read, every attempt logged on every member job (its share); the reply parsed
    as ``_parse`` does."""
    try:
        completion = provider().complete(prepared.request)
    except LLMError as exc:
        _log(prepared, accounting.failed(exc), prepared.request.model, via)
        raise
    answered, problem = _parse_logged(prepared, completion, via)
    return completion, answered, problem


def _parse_logged(
    prepared: _Prepared, completion: Completion, via: accounting.Via
) -> tuple[dict[int, dict[int, Finding]], str | None]:
    """Parse the reply, then log the call (the attempts that failed before it too): its ``ok`` rows say whether
    the reply parsed as it came (``parse_ok``, as ``call_llm`` records it for every other JSON stage;
    docs/contract.md#structured-outputs).  A parser that crashes still leaves the paid call logged (parse_ok
    false) before the crash surfaces."""
    crash: Exception | None = None
    answered: dict[int, dict[int, Finding]] = {}
    problem: str | None = None
    try:
        answered, problem = _parse(prepared, completion.text)
    except Exception as exc:
        crash = exc
    attempts = accounting.answered(completion, parse_ok=crash is None and problem is None)
    _log(prepared, attempts, completion.model or prepared.request.model, via)
    if crash is not None:
        raise crash
    return answered, problem


def _log(prepared: _Prepared, attempts: list[Attempt], model: str, via: accounting.Via) -> None:
    """Each attempt as one row per member job, holding that job's share: the batch's sum is the exact bill."""
    calls = accounting.priced(attempts, stage="analyst", provider=provider(), model=model, via=via)
    shares = [
        accounting.Share(m.job.id, m.batch_no, solo)
        for m, solo in zip(prepared.members, prepared.solo_share, strict=True)
    ]
    accounting.record_shared(prepared.read.id, shares, calls, model=model)


def _parse(prepared: _Prepared, text: str) -> tuple[dict[int, dict[int, Finding]], str | None]:
    """The reply's findings by question number and chunk id, and what was wrong with it (None: usable)."""
    try:
        entries = reply_entries(text)
    except ParseError as exc:
        return {}, exc.message
    ids = [c.chunk_id for c in prepared.chunks]
    out: dict[int, dict[int, Finding]] = {}
    if len(prepared.members) == 1:
        q = prepared.members[0].question_no
        out[q] = {f.chunk_id: f for f in findings_from_entries(entries, batch_chunk_ids=ids)}
        return out, None
    wanted = {m.question_no for m in prepared.members}
    by_q: dict[int, list[dict]] = {}
    for e in entries:
        no = question_no(e)
        # an entry with no (or an unknown) question number answers nothing we can attribute
        if no is not None and no in wanted:
            by_q.setdefault(no, []).append(e)
    for q, es in by_q.items():
        out[q] = {f.chunk_id: f for f in findings_from_entries(es, batch_chunk_ids=ids)}
    return out, None


def _missing(prepared: _Prepared, answered: dict[int, dict[int, Finding]]) -> dict[int, list[int]]:
    ids = [c.chunk_id for c in prepared.chunks]
    out = {}
    for m in prepared.members:
        gap = [cid for cid in ids if cid not in answered.get(m.question_no, {})]
        if gap:
            out[m.question_no] = gap
    return out


def _retry_messages(
    prepared: _Prepared, reply: str, problem: str | None, missing: dict[int, list[int]]
) -> list[dict[str, str]]:
    shown = reply if len(reply) <= PRIOR_REPLY_CHARS else reply[:PRIOR_REPLY_CHARS] + "…"
    if len(prepared.members) == 1:
        gap = next(iter(missing.values()), [c.chunk_id for c in prepared.chunks])
        owed = f"one object per chunk id ({', '.join(map(str, gap))})"
    else:
        owed = "an answer for each (question, chunk id) pair: " + "; ".join(
            f"question {q}: chunks {', '.join(map(str, ids))}" for q, ids in sorted(missing.items())
        )
        if not missing:
            owed = "an answer for every chunk id under each question, with its question number"
    why = problem or "it left entries out"
    shape = (
        "each with chunk_id, relevance (high, medium, low or none), findings, summary and follow_up"
        + (", and question" if len(prepared.members) > 1 else "")
        + " (and records, if asked for)"
    )
    if len(prepared.members) > 1:
        # the compact form stays allowed: a retry that had to write every none pair out would cost the most
        shape += (
            f'; the chunks a question grades none may instead be listed in one {{"question": n, "{NONE_KEY}": '
            "[chunk ids]} object for that question"
        )
    return [
        *prepared.request.messages,
        {"role": "assistant", "content": shown},
        {
            "role": "user",
            "content": f"Your previous reply could not be used in full: {why}. Reply again with only a JSON object "
            f'{{"entries": [...]}} holding {owed}, {shape}.',
        },
    ]


def _store(prepared: _Prepared, answered: dict[int, dict[int, Finding]], *, error: dict | None = None) -> dict:
    """Each member's findings (or the error) under its own (job, batch); then the read is done and every member
    job whose batches are all finished moves on to collect."""
    ids = [c.chunk_id for c in prepared.chunks]
    if missing := len(prepared.read.chunk_ids) - len(ids):
        # chunks that could not be loaded count as the analyst counts them, never as read or as unanswered
        with connection() as conn:
            for m in prepared.members:
                job_store.add_chunk_load_failures(conn, job_id=m.job.id, n=missing)
    stored = 0
    for m in prepared.members:
        found = answered.get(m.question_no, {})
        unanswered = [cid for cid in ids if cid not in found] if error is None else []
        if unanswered and error is None:
            log.warning(
                "read %s: job %s batch %s has no answer for chunks %s; reported as unanswered",
                prepared.read.id,
                m.job.id,
                m.batch_no,
                unanswered,
            )
        findings = [found[cid] for cid in ids if cid in found]
        ok = durable_write(
            None,
            functools.partial(
                _finish_batch,
                job_id=m.job.id,
                batch_no=m.batch_no,
                findings=findings,
                unanswered=unanswered,
                error=error,
            ),
            what=f"findings of job {m.job.id} batch {m.batch_no} (read {prepared.read.id})",
        )
        stored += bool(ok)
    _close(prepared.read.id, [m.job.id for m in prepared.members], failed=error is not None, error=error)
    return {"read": prepared.read.id, "status": "failed" if error else "ok", "members": stored}


def _finish_batch(
    conn: psycopg.Connection,
    *,
    job_id: str,
    batch_no: int,
    findings: list[Finding],
    unanswered: list[int],
    error: dict | None,
) -> bool:
    return job_store.finish_batch(
        conn, job_id=job_id, batch_no=batch_no, findings=findings, unanswered=unanswered, error=error
    )


def _close(read_id: int, job_ids: Sequence[str], *, failed: bool, error: dict | None = None) -> None:
    moved = []
    with connection() as conn:
        store.set_status(conn, read_id=read_id, status="failed" if failed else "done", error=error)
        for job_id in dict.fromkeys(job_ids):
            job_store.touch_job(conn, job_id=job_id)
            if store.flip_to_collect(conn, job_id=job_id):
                moved.append(job_id)
    for job_id in moved:
        send_collect(job_id)


def _fail(read_id: int, error: dict) -> None:
    """A read that could not run: its members' pending batches get the error; their jobs go on."""
    try:
        with connection() as conn:
            members = store.members_of(conn, read_id=read_id)
            for m in members:
                job_store.finish_batch(conn, job_id=m.job_id, batch_no=m.batch_no, error=error)
        _close(read_id, [m.job_id for m in members], failed=True, error=error)
    except DB_OUTAGE:
        raise
    except Exception:  # the watchdog or the reconciler salvages the jobs instead
        log.exception("could not record the failure of read %s", read_id)
