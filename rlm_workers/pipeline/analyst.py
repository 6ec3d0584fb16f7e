"""Analyst: one batch of chunks → findings stored under (job, batch).

Its user message, the parsing of its reply and the task's logic live here.  It
never raises into the chord: Celery runs a chord's callback only if every
header task succeeds (celery#1881), so any failure becomes an error record on
the batch and the job goes on with the batches that worked.  A database outage
is the exception: the task retries, and the chord waits for it.

Every chunk of a batch is accounted for: chunks a reply left out (a reply cut
at ``max_tokens``, a proxy dropping the tail) are asked for again, by id, and
those still missing are stored as unanswered, never counted as analysed.
A claim holds the batch's lease, renewed while the analyst waits on a limiter
or the model, so a redelivered message does not pay for the batch again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Collection, Sequence
from typing import Any

from pydantic import ValidationError

from ..config import Settings, get_settings
from ..constants import LIMITER_KEY_PREFIX
from ..errors import BudgetExhausted, JobCancelled, LimiterBusy, ParseError, error_record
from ..limits import MAX_FINDINGS_PER_BATCH, MAX_FOLLOW_UPS
from ..llm.limiter import ConcurrencyLimiter, wait_bound
from ..llm.protocol import CompletionRequest
from ..llm.replies import clip, json_candidates, leading_objects
from ..llm.stage_input import ChunkForPrompt, Question, ReadInput
from ..llm.structured import (
    ANALYST_SCHEMA,
    GRADES,
    NONE_KEY,
    SHARED_SCHEMA,
    BatchAnswer,
    as_chunk_id,
    batch_answer_schema,
    validate_entry,
)
from ..models import RELEVANCE_RANK, Finding, Relevance
from ..records.totals import RECORDS_INSTRUCTION, is_table, merge_records, own_lines, parse_records
from ..runtime.renewals import Renewals
from ..runtime.resources import provider, redis_client
from ..store import jobs as job_store
from ..store.buffers import chunks_for_counting, get_chunks
from ..store.db import DB_OUTAGE, connection, durable_write
from ..store.job_state import JobParams
from .calls import call_llm
from .evidence import CONTEXT_SHARE, evidence_lines, grounded
from .prompts import chunk_source_line, content_block, escape_content, load_prompt, quote_field, system_message
from .route import analyst_reply_tokens
from .sessions import conversation_section, evidence_ids

log = logging.getLogger("rlm.pipeline.analyst")

ANALYST_MAX_TOKENS = 16_384
#: one more call when the reply was not the JSON we asked for or left chunks out (it is told what was wrong)
PARSE_RETRIES = 1
#: how much of an unusable reply is shown back to the model in the retry
PRIOR_REPLY_CHARS = 2000

# --------------------------------------------------------------------------- messages


#: after the block of a chunk an earlier answer of the conversation cited (a chat turn's carried evidence)
CARRIED_MARK = "\n\n(carried evidence: cited by an earlier answer in this conversation)"


def _chunk_blocks(chunks: Sequence[ChunkForPrompt], carried: Collection[int] = ()) -> str:
    return "## Chunks\n\n" + "\n\n".join(
        f"### Chunk {c.chunk_id}\n\n{chunk_source_line(c)}\n\n"
        f"{content_block(c.text)}" + (CARRIED_MARK if c.chunk_id in carried else "")
        for c in chunks
    )


def read_input(
    query: str, chunks: Sequence[ChunkForPrompt], focus_topics: Sequence[str] = (), *, records_wanted: bool = False
) -> ReadInput:
    """One question's read of a batch, as the request carries it (``CompletionRequest.stage_input``).
    ``records_wanted``: the job totals typed records (``--scope all``), so every entry is asked for them."""
    return ReadInput(tuple(chunks), (Question(query, tuple(focus_topics), records_wanted),))


#: what an answering analyst (RLM_ANALYST_FINDINGS=answers) is asked to reply with, after the chunks and the query
ANSWERING_REPLY = (
    "## Reply\n\nAnswer the query from these chunks only. Reply with a JSON object: "
    '{"answer": "<what the chunks say about it, in words; empty when none says anything about it>", '
    '"cited_chunks": [<ids of the chunks the answer comes from>]}.'
)


def render_messages(
    system_prompt: str,
    read: ReadInput,
    *,
    conversation: str = "",
    carried: Collection[int] = (),
    answering: bool = False,
) -> list[dict[str, str]]:
    """One question's read (its only question).  ``conversation``: a chat turn's earlier turns (quoted, before
    the query); ``carried``: chunks an earlier answer of the conversation cited, marked as such after their block
    (docs/contract.md#sessions); ``answering``: the batch is answered from as a whole (RLM_ANALYST_FINDINGS).

    What repeats between calls comes first and what varies last (docs/contract.md#prompt-caching): the system
    prompt, the chunks (read again by a retry, a follow-up or another question), the records instruction, and
    only then the conversation, the query and its focus topics."""
    (question,) = read.questions
    # The query is the user's own words, but it must not open or close a content block either; the
    # planner's topics came from a model that read chunk text, and paths and buffer names from uploads.
    parts = [_chunk_blocks(read.chunks, carried)]
    if question.records_wanted:
        parts.append(f"## Records\n\n{RECORDS_INSTRUCTION}")
    parts.append(f"{conversation}## Query\n\n{escape_content(question.query)}")
    if question.focus_topics:
        parts.append("## Focus topics\n\n" + "\n".join(f"- {quote_field(t)}" for t in question.focus_topics))
    if answering:
        parts.append(ANSWERING_REPLY)
    else:
        parts.append(
            f'## Reply\n\nReply with a JSON object {{"entries": [...]}} holding exactly {len(read.chunks)} entries, '
            "one per chunk id above."
        )
    return [system_message(system_prompt), {"role": "user", "content": "\n\n".join(parts)}]


def build_messages(
    system_prompt: str,
    query: str,
    chunks: Sequence[ChunkForPrompt],
    focus_topics: Sequence[str] = (),
    *,
    records_wanted: bool = False,
    conversation: str = "",
    carried: Collection[int] = (),
) -> list[dict[str, str]]:
    """The analyst's messages, rendered from ``read_input`` of these values (see ``render_messages``)."""
    read = read_input(query, chunks, focus_topics, records_wanted=records_wanted)
    return render_messages(system_prompt, read, conversation=conversation, carried=carried)


def render_shared_messages(system_prompt: str, read: ReadInput) -> list[dict[str, str]]:
    """One read of a chunk batch for several questions: the chunks first (the part every question shares, and
    the prefix a provider's prompt cache keeps), then the questions, numbered, each quoted like a single
    analyst's query."""
    chunks, questions = read.chunks, read.questions
    parts = [_chunk_blocks(chunks)]
    if any(q.records_wanted for q in questions):
        parts.append(f"## Records\n\n{RECORDS_INSTRUCTION}")
    lines = []
    for n, q in enumerate(questions, 1):
        block = f"### Question {n}\n\n{escape_content(q.query)}"
        if q.focus_topics:
            block += "\n\nFocus topics: " + ", ".join(quote_field(t) for t in q.focus_topics)
        if q.records_wanted:
            block += "\n\n(records wanted)"
        lines.append(block)
    parts.append("## Questions\n\n" + "\n\n".join(lines))
    parts.append(
        f'## Reply\n\nReply with a JSON object {{"entries": [...]}} whose entries account for all '
        f"{len(chunks) * len(questions)} (question, chunk id) "
        f"pairs: for each of the {len(questions)} questions, an entry per chunk id above that bears on it and one "
        f'{{"question": n, "{NONE_KEY}": [...]}} object listing the chunk ids it grades none; every object has '
        '"question" set to the question\'s number.'
    )
    return [system_message(system_prompt), {"role": "user", "content": "\n\n".join(parts)}]


def build_shared_messages(
    system_prompt: str, questions: Sequence[Question], chunks: Sequence[ChunkForPrompt]
) -> list[dict[str, str]]:
    """A shared read's messages, rendered from a shared ``ReadInput`` of these values."""
    return render_shared_messages(system_prompt, ReadInput(tuple(chunks), tuple(questions), shared=True))


def retry_messages(
    messages: list[dict[str, str]], reply: str, problem: str, chunk_ids: Sequence[int]
) -> list[dict[str, str]]:
    """The same conversation plus the unusable reply and what was wrong with it (PaperQA2's prior attempt):
    re-sending the identical request at temperature 0 would most likely get the identical reply."""
    shown = reply if len(reply) <= PRIOR_REPLY_CHARS else reply[:PRIOR_REPLY_CHARS] + "…"
    return [
        *messages,
        {"role": "assistant", "content": shown},
        {
            "role": "user",
            "content": (
                f"Your previous reply could not be used: {problem}. Reply again with only a JSON object "
                f'{{"entries": [...]}} holding exactly {len(chunk_ids)} objects, one per chunk id '
                f"({', '.join(map(str, chunk_ids))}), each with chunk_id, "
                "relevance (high, medium, low or none), findings, summary and follow_up (and records, if asked for)."
            ),
        },
    ]


_ANSWER_ASK = ANSWERING_REPLY.removeprefix("## Reply\n\n")


def _answer_retry(messages: list[dict[str, str]], reply: str, problem: str) -> list[dict[str, str]]:
    """An answering analyst's retry: its unusable reply, what was wrong, and the answer object asked for again."""
    shown = reply if len(reply) <= PRIOR_REPLY_CHARS else reply[:PRIOR_REPLY_CHARS] + "…"
    return [
        *messages,
        {"role": "assistant", "content": shown},
        {"role": "user", "content": f"Your previous reply could not be used: {problem}. {_ANSWER_ASK}"},
    ]


# --------------------------------------------------------------------------- parsing


def _entries(value: Any) -> list[dict] | None:
    """The findings array wrapped under one key (``{"entries": [...]}``, the shape asked for), the array itself (old
    servers, scripted tests), or a single finding object."""
    if isinstance(value, list):
        if value and not any(isinstance(v, dict) for v in value):
            return None
        return [v for v in value if isinstance(v, dict)]
    if isinstance(value, dict):
        if "chunk_id" in value or none_ids(value) is not None:
            return [value]
        lists = [v for v in value.values() if isinstance(v, list)]
        if len(lists) == 1:
            return _entries(lists[0])
    return None


def reply_entries(text: str) -> list[dict]:
    """The entries of an analyst's reply; ``ParseError`` when it holds none at all."""
    entries = next((e for v in json_candidates(text or "") if (e := _entries(v)) is not None), None)
    if entries is None:
        # an array cut off mid-way (max_tokens, a proxy): keep the entries it finished; the caller asks
        # again for the chunks they leave out
        entries = leading_objects(text or "") or None
    if entries is None:
        raise ParseError(f"the analyst reply is not a JSON findings object: {(text or '')[:120]!r}")
    # each entry through the model whose schema the analyst was sent; one without a usable chunk id goes
    return [v for e in entries if (v := validate_entry(e)) is not None]


def none_ids(entry: dict) -> list[int] | None:
    """The chunk ids a compact object such as ``{"question": 2, "none": [4, 7]}`` lists as graded none; None for
    an ordinary entry (one with a ``chunk_id`` is always read as an ordinary entry)."""
    if "chunk_id" in entry or NONE_KEY not in entry:
        return None
    raw = entry[NONE_KEY]
    items = raw if isinstance(raw, list) else [raw]
    return [cid for r in items if (cid := as_chunk_id(r)) is not None]


def question_no(entry: dict) -> int | None:
    """The question number a shared read's entry answers (``question``, or ``question_no``)."""
    return as_chunk_id(entry.get("question", entry.get("question_no")))


def parse_findings(text: str, *, batch_chunk_ids: list[int], read: ReadInput | None = None) -> list[Finding]:
    """The analyst's reply → findings for chunks of this batch only, capped (docs/contract.md#limits).
    ``read``: the batch an answering analyst answered from (``answer_entries``)."""
    entries = answer_entries(text, batch_chunk_ids, read) if read is not None else reply_entries(text)
    return findings_from_entries(entries, batch_chunk_ids=batch_chunk_ids)


def answer_entries(text: str, batch_chunk_ids: Sequence[int], read: ReadInput) -> list[dict]:
    """An answering analyst's reply → an entry for every chunk of the batch: the chunks that hold what the answer
    says (``evidence.grounded``: those it cites, or else any of the batch) are graded high, their finding the lines
    that best match the question and the answer, verbatim; a chunk with a line that matches the question nearly as
    well as the batch's best is graded low with that line (one step of a question a small model answered whole may
    sit there); the rest are graded none.  ``ParseError`` when the reply is no answer object."""
    obj = next((v for v in json_candidates(text or "") if isinstance(v, dict) and "answer" in v), None)
    if obj is None:
        raise ParseError(f"the analyst reply is not a JSON answer object: {(text or '')[:120]!r}")
    try:
        reply = BatchAnswer.model_validate(obj)
    except ValidationError as exc:
        raise ParseError(f"the analyst's answer object is unusable ({exc.errors()[0]['msg']})") from None
    answer = reply.answer.strip()
    (question,) = read.questions
    held = grounded(answer, question.query, read.chunks, reply.cited_chunks)
    quoted = evidence_lines(f"{question.query}\n{answer}", read.chunks, held)
    others = [c.chunk_id for c in read.chunks if c.chunk_id not in quoted]
    context = evidence_lines(question.query, read.chunks, others, per_chunk=1, share=CONTEXT_SHARE)
    return [
        {
            "chunk_id": cid,
            "relevance": "high" if cid in quoted else "low" if cid in context else "none",
            "findings": quoted.get(cid) or context.get(cid, []),
            "summary": "",
            "follow_up": [],
        }
        for cid in batch_chunk_ids
    ]


def findings_from_entries(entries: Sequence[dict], *, batch_chunk_ids: Sequence[int]) -> list[Finding]:
    """Entries → findings of this batch's chunks.  A chunk a compact object lists under ``"none"`` is stored as an
    entry graded none with nothing else would be, unless the reply also gave it an entry of its own: that wins."""
    allowed = set(batch_chunk_ids)
    merged: dict[int, Finding] = {}
    listed_none: list[int] = []
    budget = MAX_FINDINGS_PER_BATCH
    for e in entries:
        if (ids := none_ids(e)) is not None:
            listed_none += ids
            continue
        cid = as_chunk_id(e.get("chunk_id"))
        if cid is None or cid not in allowed:
            continue  # an id we never sent: the model invented or misread it
        grade = GRADES.get(str(e.get("relevance", "")).strip().lower(), Relevance.low)
        raw_findings = e.get("findings") or []
        if isinstance(raw_findings, str):
            raw_findings = [raw_findings]
        items = [clip(f) for f in raw_findings if f not in (None, "")][:budget]
        budget -= len(items)
        follow = e.get("follow_up", e.get("follow_ups")) or []
        if isinstance(follow, str):
            follow = [follow]
        # kept whatever the grade: a chunk "none" to the question may still hold items to count
        records, skipped = parse_records(e.get("records"))
        if skipped:
            log.debug("chunk %s: %d unusable or surplus records dropped", cid, skipped)
        finding = Finding(
            chunk_id=cid,
            relevance=grade,
            findings=items,
            summary=clip(e.get("summary") or ""),
            follow_up=[clip(f, 1000) for f in follow][:MAX_FOLLOW_UPS],
            records=records,
        )
        prev = merged.get(cid)
        if prev is not None:  # the same chunk twice: keep the stronger grade and every finding
            best = max((prev.relevance, finding.relevance), key=RELEVANCE_RANK.__getitem__)
            finding = Finding(
                chunk_id=cid,
                relevance=best,
                findings=prev.findings + finding.findings,
                summary=prev.summary or finding.summary,
                follow_up=(prev.follow_up + finding.follow_up)[:MAX_FOLLOW_UPS],
                records=merge_records(prev.records, finding.records),
            )
        merged[cid] = finding
    for cid in listed_none:
        if cid in allowed and cid not in merged:  # an id we never sent is not trusted here either
            merged[cid] = Finding(chunk_id=cid, relevance=Relevance.none, findings=[], summary="", follow_up=[])
    return list(merged.values())


# --------------------------------------------------------------------------- the task's logic


def _job_slot(job_id: str, limit: int | None, batches: int | None, settings: Settings) -> Any:
    """The scaling profile's per-job concurrency, shared by every worker through Redis; waiting for it is
    bounded like every limiter wait (``TimeoutError``)."""
    if not limit or provider().local or (batches and batches <= int(limit)):
        # a cap at or above the job's batch count can never bind: skip two Redis round trips
        return contextlib.nullcontext()
    # Kept even when the global limit is as low: this slot is held from before the call's budget reservation
    # until after its charge (the global one only around the HTTP request), which is what bounds how far the
    # job's calls in flight can overshoot --max-tokens or --max-cost (docs/contract.md#budgets).
    return _job_limiter(job_id, int(limit), redis_client()).slot(wait_bound(settings))


@functools.lru_cache(maxsize=256)
def _job_limiter(job_id: str, limit: int, client: Any) -> ConcurrencyLimiter:
    # one per job (and Redis client: settings reset rebuild it) and process, not per batch: building one
    # registers its five Lua scripts again, a SHA-1 of each
    return ConcurrencyLimiter(client, limit=limit, key=f"{LIMITER_KEY_PREFIX}job:{job_id}")


#: the longest a claimed batch stays taken without a heartbeat: the reconciler takes a lapsed lease for a dead
#: analyst and sends its batch again, so this bounds how long a killed worker's batch waits (one renewal round
#: per process every third of it, in one statement, costs next to nothing)
MAX_BATCH_LEASE_SECONDS = 30.0


def batch_lease_seconds(settings: Settings) -> float:
    """How long a claimed batch stays taken without a heartbeat: well below the visibility timeout, so a
    message redelivered because its worker died finds the lease run out and can claim the batch."""
    return max(3.0, min(MAX_BATCH_LEASE_SECONDS, settings.visibility_timeout / 3))


def _claim(job_id: str, batch_no: int, lease: float) -> list[int] | None:
    """Claim the batch; while another holder's lease is live, wait (about one lease) for it to finish or lapse.

    A live holder keeps its lease and this delivery gives up: one payment per batch.  But a holder that is
    gone (its worker died, or it was this very task before a database outage made it retry) stops renewing,
    and waiting out its lease lets this delivery do the batch instead of leaving it to be marked lost.
    """
    deadline = time.monotonic() + lease * 1.5
    while True:
        with connection() as conn:  # none held while waiting: the pool is shared by every analyst thread
            ids = job_store.claim_batch(conn, job_id=job_id, batch_no=batch_no, lease_seconds=lease)
            if ids is not None:
                return ids
            if time.monotonic() >= deadline or not job_store.batch_held(
                conn, job_id=job_id, batch_no=batch_no, lease_seconds=lease
            ):
                return None
        time.sleep(lease / 3)


def _renew_batches(due: list[tuple[tuple[str, int], float]]) -> set[tuple[str, int]]:
    """Renew the leases of the claimed batches that fell due, in one statement; those no longer pending (ended,
    salvaged, taken over). A failed round (the database blinked) only shortens the leases: logged, tried again."""
    try:
        with connection(timeout=min(every for _, every in due)) as conn:
            pending = job_store.heartbeat_batches(conn, batches=[key for key, _ in due])
    except Exception as exc:  # a database blink: the leases outlive a few missed rounds
        log.warning("heartbeat of %d analyst batches failed: %s", len(due), exc)
        return set()
    return {key for key, _ in due if key not in pending}


#: renews the lease of every batch this process's analysts hold (value: seconds between renewals)
_LEASES: Renewals[tuple[str, int], float] = Renewals("rlm-batch-leases", _renew_batches)


def run(job_id: str, batch_no: int) -> dict:
    """Analyse one batch; returns ``{"batch", "status", …}`` and never raises but for a database outage."""
    try:
        return _analyse(job_id, batch_no)
    except DB_OUTAGE:
        raise  # nothing can be stored while PostgreSQL is away; a retry is not a failure, so the chord waits
    except Exception as exc:  # see the module docstring: the chord must get a result
        if isinstance(exc, BudgetExhausted | JobCancelled):
            log.info("job %s batch %s not sent: %s", job_id, batch_no, exc)
        else:
            log.exception("analyst crashed on job %s batch %s", job_id, batch_no)
        try:
            with connection() as conn:
                job_store.finish_batch(conn, job_id=job_id, batch_no=batch_no, error=error_record(exc))
        except Exception:  # the salvage marks the batch lost instead
            log.exception("could not record the failure of job %s batch %s", job_id, batch_no)
        return {"batch": batch_no, "status": "failed", "error": error_record(exc)}


def _analyse(job_id: str, batch_no: int) -> dict:
    settings = get_settings()
    lease = batch_lease_seconds(settings)
    # the job, the claim and the batch's chunks on one pooled connection: every checkout is a round trip more
    # (the pool checks the connection), paid per batch in a worker whose threads share one GIL
    with connection() as conn:
        job = job_store.get_job(conn, job_id=job_id)
        if job is None or job.terminal:
            return {"batch": batch_no, "status": "skipped"}
        ids = job_store.claim_batch(conn, job_id=job_id, batch_no=batch_no, lease_seconds=lease)
        chunks = None if ids is None else _load_chunks(conn, job, ids)
    if ids is None:
        ids = _claim(job_id, batch_no, lease)
        if ids is None:
            # finished or held by another delivery, or salvaged: this one must not pay for the batch again
            return {"batch": batch_no, "status": "skipped"}
    # the lease renewed every third of it: a redelivery finds the batch taken, and the watchdog sees a batch
    # waiting on a limiter as progress
    with _LEASES.held((job_id, batch_no), lease / 3, lease / 3):
        if chunks is None:
            with connection() as conn:
                chunks = _load_chunks(conn, job, ids)
        return _analyse_claimed(job_id, batch_no, job, ids, chunks, settings)


def _load_chunks(conn: Any, job: job_store.JobRow, ids: list[int]) -> list[ChunkForPrompt]:
    """The claimed batch's chunks as the prompt shows them; those that could not be loaded are counted on the job."""
    chunks = prompt_chunks(conn, tenant=job.tenant, ids=ids, counting=job.route == "exhaustive")
    if missing := len(ids) - len(chunks):
        job_store.add_chunk_load_failures(conn, job_id=job.id, n=missing)
    return chunks


def _analyse_claimed(
    job_id: str, batch_no: int, job: job_store.JobRow, ids: list[int], chunks: list[ChunkForPrompt], settings: Settings
) -> dict:
    present = [c.chunk_id for c in chunks]
    if not chunks:
        err = {"type": "chunk_load", "message": f"none of the batch's {len(ids)} chunks could be loaded"}
        with connection() as conn:
            job_store.finish_batch(conn, job_id=job_id, batch_no=batch_no, error=err)
        return {"batch": batch_no, "status": "failed", "error": err}
    params = job.params or JobParams()
    counting = job.route == "exhaustive"
    read = read_input(job.query, chunks, params.focus_topics, records_wanted=counting)
    # a small model answers from a few chunks well and grades each one badly; counting needs an entry per chunk
    answering = not counting and settings.answering_analysts(settings.subcall_model)
    messages = render_messages(
        load_prompt("answering" if answering else "subcall", prompt_dir=settings.prompt_dir),
        read,
        conversation=conversation_section(job.spec),
        carried=set(evidence_ids(job.spec)),
        answering=answering,
    )
    # No pooled connection is held while the model thinks: the pool (20 per process) would otherwise
    # cap a 64-thread analyst worker at 20 calls in flight. Logging and storing check one out again.
    with contextlib.ExitStack() as stack:
        try:
            lease = stack.enter_context(_job_slot(job_id, params.concurrency, job.batches_total, settings))
        except TimeoutError as exc:
            raise LimiterBusy(
                f"rate limiter busy: the job's concurrency slot stayed taken ({exc}); the batch was not sent"
            ) from exc
        # the claim saw the job open; only a wait for the job's slot leaves time for a cancel to come in between
        waited = lease is not None and lease.waited
        findings, unanswered = _ask(
            job_id, batch_no, messages, read, present, settings, check_open=waited, answering=answering
        )
    if unanswered:
        log.warning(
            "job %s batch %s: no answer for chunks %s even when asked again; reported as unanswered",
            job_id,
            batch_no,
            unanswered,
        )
    stored = durable_write(
        None,
        lambda c: job_store.finish_batch(c, job_id=job_id, batch_no=batch_no, findings=findings, unanswered=unanswered),
        what=f"findings of job {job_id} batch {batch_no}",
    )
    if not stored:
        log.warning(
            "job %s batch %s was salvaged while its call ran; its findings are not in the report",
            job_id,
            batch_no,
        )
        return {"batch": batch_no, "status": "late"}
    return {"batch": batch_no, "status": "ok", "findings": len(findings), "unanswered": len(unanswered)}


def prompt_chunks(conn: Any, *, tenant: str, ids: Sequence[int], counting: bool) -> list[ChunkForPrompt]:
    """The batch's chunks as a prompt shows them, in batch order; a chunk that could not be loaded is left out.
    ``counting``: an exact count reads each line once, so the lines a chunk shares with the one before are left
    out (``_owned``)."""
    if counting:
        counted = chunks_for_counting(conn, tenant=tenant, chunk_ids=ids)
        rows = {cid: cc.row for cid, cc in counted.items()}
    else:
        rows = get_chunks(conn, tenant=tenant, chunk_ids=ids)
    chunks = [ChunkForPrompt.of(c) for cid in ids if (c := rows.get(cid))]
    return [_owned(c, counted[c.chunk_id]) for c in chunks] if counting else chunks


def analyst_request(
    messages: list[dict[str, str]],
    settings: Settings,
    read: ReadInput,
    *,
    tenant: str | None = None,
    answering: bool = False,
) -> CompletionRequest:
    """An analyst call: the subcall model, deterministic, a JSON reply of the analyst's schema (a shared ``read``
    is one for several questions, whose entries carry question numbers and may list none-graded chunks; an
    ``answering`` one answers from the batch as a whole).
    ``messages`` were rendered from ``read``, or are a retry's conversation that opened with them."""
    records = any(q.records_wanted for q in read.questions)
    if answering:
        schema = batch_answer_schema([c.chunk_id for c in read.chunks])
    else:
        schema = SHARED_SCHEMA if read.shared else ANALYST_SCHEMA
    return CompletionRequest(
        role="analyst",
        model=settings.subcall_model,
        messages=messages,
        # what the batch can need: an entry per chunk (per question of a shared read), never thousands of tokens
        max_tokens=min(
            ANALYST_MAX_TOKENS,
            analyst_reply_tokens(len(read.chunks) * len(read.questions), settings, records=records),
        ),
        temperature=0.0,
        json_output=True,
        json_schema=schema,
        tenant=tenant,
        stage_input=read,
    )


def _owned(chunk: ChunkForPrompt, counted: Any) -> ChunkForPrompt:
    first, text = own_lines(chunk.text, chunk.start_line, chunk.end_line, counted.prev_end_line, counted.tail)
    if first > 1 and is_table(chunk.path) and counted.first_line:
        # a table's rows name their columns only through the header: every chunk of it starts with that row
        return chunk.model_copy(
            update={
                "start_line": first - 1,
                "end_line": max(first, chunk.end_line),
                "text": f"{counted.first_line}\n{text}",
            }
        )
    return chunk.model_copy(update={"start_line": first, "end_line": max(first, chunk.end_line), "text": text})


def _ask(
    job_id: str,
    batch_no: int,
    messages: list[dict[str, str]],
    read: ReadInput,
    present: list[int],
    settings: Settings,
    *,
    check_open: bool = True,
    answering: bool = False,
) -> tuple[list[Finding], list[int]]:
    """Call the analyst until every chunk has an entry or the retries are spent: (findings, unanswered ids).

    A reply that is no findings JSON at all, or that leaves chunks out (cut at ``max_tokens``, ``finish_reason``
    ``length``, or simply short), earns another call that repeats the batch, shows the reply and names the
    chunk ids still owed.  Only when no reply was usable at all does the batch fail (``ParseError``).
    """
    answered: dict[int, Finding] = {}
    wanted = list(present)
    for attempt in range(PARSE_RETRIES + 1):
        request = analyst_request(messages, settings, read, answering=answering)
        completion = call_llm(
            None,
            job_id=job_id,
            stage="analyst",
            batch=batch_no,
            request=request,
            check_open=check_open or attempt > 0,
            parse=functools.partial(parse_findings, batch_chunk_ids=wanted, read=read if answering else None),
        )
        cut = completion.finish_reason == "length"
        got, problem = completion.parsed or [], None
        if completion.parse_error is not None:
            if attempt == PARSE_RETRIES and not answered:
                raise completion.parse_error
            problem = str(completion.parse_error)  # a ParseError: its message
        for f in got:
            answered[f.chunk_id] = f
        wanted = [cid for cid in wanted if cid not in answered]
        if not wanted or attempt == PARSE_RETRIES:
            break
        if problem is None:
            problem = f"it had no entry for chunk ids {', '.join(map(str, wanted))}"
        if cut:
            problem += " (it was cut off at the output limit: keep every entry short)"
        log.info("job %s batch %s: unusable or incomplete analyst reply (%s); asking again", job_id, batch_no, problem)
        messages = (
            _answer_retry(messages, completion.text or "", problem)
            if answering
            else retry_messages(messages, completion.text or "", problem, wanted)
        )
    return list(answered.values()), wanted
