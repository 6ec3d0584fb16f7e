"""Plan: the planner model turns the query and the buffers' size into an ``AnalysisPlan``.

Its messages, the parsing of its reply and the stage itself live here.  A planner
failure ends the job with a clear error (docs/contract.md#pipeline-semantics);
``--skip-plan`` or a plan already stored (a redelivery) skips the call.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import BudgetExhausted, BufferNotFound, ParseError
from ..llm.protocol import CompletionRequest
from ..llm.replies import json_candidates
from ..llm.stage_input import PlanInput
from ..llm.structured import PLAN_SCHEMA, PlanReply
from ..models import AnalysisPlan
from ..search.service import query_vector
from ..store import jobs as job_store
from ..store.buffers import list_buffers
from ..store.db import durable_write
from .calls import call_llm
from .flow import OK, StageContext
from .prompts import load_prompt, system_message
from .sessions import conversation_section, resolve_question

if TYPE_CHECKING:
    import psycopg

    from ..config import Settings

log = logging.getLogger("rlm.pipeline.plan")

PLAN_MAX_TOKENS = 1024


def render_messages(system_prompt: str, asked: PlanInput, *, conversation: str = "") -> list[dict[str, str]]:
    """``conversation``: a chat turn's earlier turns (``sessions.conversation_section``), quoted, before the query."""
    user = (
        f"{conversation}## Query\n\n{asked.query}\n\n## Dataset\n\n"
        f"- buffers: {', '.join(asked.buffers)}\n- chunks: {asked.chunk_count}\n- bytes: {asked.byte_size}\n\n"
        "Reply with the JSON plan only."
    )
    return [system_message(system_prompt), {"role": "user", "content": user}]


def build_messages(
    system_prompt: str,
    query: str,
    chunk_count: int,
    byte_size: int,
    buffers: Sequence[str],
    *,
    conversation: str = "",
) -> list[dict[str, str]]:
    """The planner's messages, rendered from a ``PlanInput`` of these values."""
    return render_messages(
        system_prompt, PlanInput(query, chunk_count, byte_size, tuple(buffers)), conversation=conversation
    )


def parse_plan(text: str) -> AnalysisPlan:
    """The planner's reply → a plan holding only the fields it set sensibly (the rest stays unset): found leniently,
    then read through ``PlanReply``, the model whose schema the planner was sent."""
    reply = plan_reply(text)
    return AnalysisPlan(**reply.model_dump(exclude_unset=True, exclude={"route", "route_reason"}))


def parse_route(text: str) -> dict[str, str]:
    """The planner's route (direct, fanout, exhaustive) and its reason, when it gave a valid one."""
    try:
        reply = plan_reply(text)
    except ParseError:
        return {}
    return {"route": reply.route, "route_reason": reply.route_reason or ""} if reply.route else {}


def plan_reply(text: str) -> PlanReply:
    obj = next((v for v in json_candidates(text or "") if isinstance(v, dict)), None)
    if obj is None:
        raise ParseError(f"the planner reply is not a JSON object: {(text or '')[:120]!r}")
    if len(obj) == 1 and isinstance(next(iter(obj.values())), dict):
        obj = next(iter(obj.values()))  # {"plan": {...}}
    return PlanReply.model_validate(obj)


def planned_fields(text: str) -> dict[str, Any]:
    """What the planner's reply sets, the route included, as the job stores it."""
    return parse_plan(text).model_dump(exclude_unset=True) | parse_route(text)


def buffer_stats(conn: psycopg.Connection, *, tenant: str, names: list[str]) -> tuple[int, int, str | None]:
    """(chunk count, byte size, the encoder runtime of the first buffer with vectors) over the job's buffers."""
    infos = {b.name: b for b in list_buffers(conn, tenant=tenant)}
    missing = [n for n in names if n not in infos]
    if missing:
        raise BufferNotFound(missing[0])
    runtime = next((infos[n].embedding_runtime for n in names if infos[n].embedding_runtime), None)
    return sum(infos[n].chunks for n in names), sum(infos[n].bytes for n in names), runtime


@contextlib.contextmanager
def _query_vector_ahead(query: str, settings: Settings, runtime: str | None) -> Iterator[None]:
    """Embed the query in a thread while the block (the planner's call) runs, so the search that follows finds the
    vector cached.  The block's end waits for the thread: the search needs the vector next anyway, and a thread
    left inside the native encoder when its process exits aborts the process (a chat's in-process worker, stopped
    when a turn ran out of time, ended ``rlm chat`` with SIGABRT)."""
    if runtime is None:  # no vectors to search
        yield
        return

    def run() -> None:
        try:
            query_vector(settings.embedding_model, query, runtime)
        except Exception:  # only a head start; the search embeds it again and reports errors
            log.debug("query vector prefetch failed", exc_info=True)

    thread = threading.Thread(target=run, name="rlm-query-vector", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()


def run(ctx: StageContext) -> str:
    conn, settings = ctx.conn, ctx.settings
    # a chat turn first becomes a standalone question (docs/contract.md#sessions), whatever the mode
    job = ctx.job = resolve_question(conn, ctx.job, settings)
    if job.plan is not None or job.options.skip_plan or job.options.mode in ("instant", "code"):
        return OK  # instant never plans: its one call is the answer; code mode's programs choose what to read
    if not settings.plans_with_model(settings.primary_model):
        return OK  # RLM_PLANNER: the defaults, not a small model's guesses (docs/contract.md#providers)
    chunks, size, runtime = buffer_stats(conn, tenant=job.tenant, names=job.buffers)
    with _query_vector_ahead(job.query, settings, runtime):
        return _ask_planner(ctx, PlanInput(job.query, chunks, size, tuple(job.buffers)))


def _ask_planner(ctx: StageContext, asked: PlanInput) -> str:
    conn, settings, job = ctx.conn, ctx.settings, ctx.job
    messages = render_messages(
        load_prompt("primary", prompt_dir=settings.prompt_dir), asked, conversation=conversation_section(job.spec)
    )
    try:
        completion = call_llm(
            conn,
            job_id=job.id,
            stage="plan",
            request=CompletionRequest(
                role="plan",
                model=settings.primary_model,
                messages=messages,
                max_tokens=PLAN_MAX_TOKENS,
                json_output=True,
                json_schema=PLAN_SCHEMA,
                stage_input=asked,
            ),
            parse=planned_fields,
        )
    except BudgetExhausted:
        # the plan only tunes the search: the job goes on with the defaults and ends with what it can afford
        log.info("job %s: budget exhausted before planning; searching with the defaults", job.id)
        job_store.save_plan(conn, job_id=job.id, plan={})
        return OK
    if completion.parse_error is not None:
        raise completion.parse_error
    planned = completion.parsed
    # paid for: a database blink is waited out rather than answered by a second planner call
    durable_write(conn, lambda c: job_store.save_plan(c, job_id=job.id, plan=planned), what=f"plan of job {job.id}")
    return OK
