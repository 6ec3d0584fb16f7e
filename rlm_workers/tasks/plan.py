"""rlm.plan: the planner LLM turns the query and buffer sizes into an AnalysisPlan."""

from __future__ import annotations

from celery import shared_task

from ..config import get_settings
from ..errors import RLMError
from ..llm.protocol import CompletionRequest
from ..store import jobs as job_store
from ..store.buffers import list_buffers
from .common import StageTimer, call_llm, db, fail_job, log

PLAN_MAX_TOKENS = 1024


def buffer_stats(conn, *, tenant: str, names: list[str]) -> tuple[int, int]:  # noqa: ANN001
    """(chunk count, byte size) over the job's buffers."""
    from ..errors import BufferNotFound

    infos = {b.name: b for b in list_buffers(conn, tenant=tenant)}
    missing = [n for n in names if n not in infos]
    if missing:
        raise BufferNotFound(missing[0])
    return sum(infos[n].chunks for n in names), sum(infos[n].bytes for n in names)


@shared_task(name="rlm.plan", bind=True, acks_late=True)
def plan(self, job_id: str) -> str:  # noqa: ANN001
    from ..stages.parsing import parse_plan
    from ..stages.prompting import build_plan_messages, load_prompt
    from .search import search

    settings = get_settings()
    with db() as conn:
        job = job_store.get_job(conn, job_id=job_id)
        if job is None or job.terminal:
            return "skipped"
        job_store.set_stage(conn, job_id=job_id, stage="plan")
        if job.plan is None and not job.options.get("skip_plan"):
            try:
                with StageTimer(conn, job_id, "plan"):
                    chunks, size = buffer_stats(conn, tenant=job.tenant, names=job.buffers)
                    messages = build_plan_messages(load_prompt("primary", prompt_dir=settings.prompt_dir),
                                                   job.query, chunks, size, job.buffers)
                    completion = call_llm(conn, job_id=job_id, stage="plan", request=CompletionRequest(
                        role="plan", model=settings.primary_model, messages=messages,
                        max_tokens=PLAN_MAX_TOKENS, json_output=True))
                    job_store.save_plan(conn, job_id=job_id, plan=parse_plan(completion.text).model_dump())
            except RLMError as exc:
                # DESIGN §6: a planner failure aborts the job with a clear error.
                fail_job(conn, job_id=job_id, exc=exc, prefix="planning failed")
                return "failed"
            except Exception as exc:  # noqa: BLE001 - the job must end, whatever broke
                log.exception("plan stage crashed for job %s", job_id)
                fail_job(conn, job_id=job_id, exc=exc)
                return "failed"
    search.apply_async((job_id,), argsrepr=f"job={job_id}")
    return "ok"
