"""rlm.plan: the planner LLM turns the query and buffer sizes into an AnalysisPlan."""

from __future__ import annotations

from celery import shared_task

from ..config import get_settings
from ..errors import RLMError
from ..llm.protocol import CompletionRequest
from ..store import jobs as job_store
from ..store.buffers import list_buffers
from .common import DB_OUTAGE, StageTimer, call_llm, db, durable_write, fail_job, log, survives_outages

PLAN_MAX_TOKENS = 1024


def buffer_stats(conn, *, tenant: str, names: list[str]) -> tuple[int, int]:  # noqa: ANN001
    """(chunk count, byte size) over the job's buffers."""
    from ..errors import BufferNotFound

    infos = {b.name: b for b in list_buffers(conn, tenant=tenant)}
    missing = [n for n in names if n not in infos]
    if missing:
        raise BufferNotFound(missing[0])
    return sum(infos[n].chunks for n in names), sum(infos[n].bytes for n in names)


def _prefetch_query_vector(query: str, settings) -> None:  # noqa: ANN001 - Settings
    """Embed the query while the planner thinks, so the search that follows finds the vector cached."""
    import threading

    from ..search.service import query_vector

    def run() -> None:
        try:
            query_vector(settings.embedding_model, query)
        except Exception:  # noqa: BLE001 - only a head start; the search embeds it again and reports errors
            log.debug("query vector prefetch failed", exc_info=True)

    threading.Thread(target=run, name="rlm-query-vector", daemon=True).start()


@shared_task(name="rlm.plan", bind=True, acks_late=True)
@survives_outages
def plan(self, job_id: str) -> str:  # noqa: ANN001
    from ..stages.parsing import parse_plan
    from ..stages.prompting import build_plan_messages, load_prompt
    from .search import run_search

    settings = get_settings()
    with db() as conn:
        job = job_store.get_job(conn, job_id=job_id)
        if job is None or job.terminal:
            return "skipped"
        job_store.set_stage(conn, job_id=job_id, stage="plan")
        if job.plan is None and not job.options.get("skip_plan"):
            _prefetch_query_vector(job.query, settings)
            try:
                with StageTimer(conn, job_id, "plan"):
                    chunks, size = buffer_stats(conn, tenant=job.tenant, names=job.buffers)
                    messages = build_plan_messages(load_prompt("primary", prompt_dir=settings.prompt_dir),
                                                   job.query, chunks, size, job.buffers)
                    completion = call_llm(conn, job_id=job_id, stage="plan", request=CompletionRequest(
                        role="plan", model=settings.primary_model, messages=messages,
                        max_tokens=PLAN_MAX_TOKENS, json_output=True))
                    planned = parse_plan(completion.text).model_dump(exclude_unset=True)
                    durable_write(conn, lambda c: job_store.save_plan(c, job_id=job_id, plan=planned),
                                  what=f"plan of job {job_id}")
            except DB_OUTAGE:
                raise  # not the job's fault: the task retries
            except RLMError as exc:
                # DESIGN §6: a planner failure aborts the job with a clear error.
                fail_job(conn, job_id=job_id, exc=exc, prefix="planning failed")
                return "failed"
            except Exception as exc:  # noqa: BLE001 - the job must end, whatever broke
                log.exception("plan stage crashed for job %s", job_id)
                fail_job(conn, job_id=job_id, exc=exc)
                return "failed"
    # In-process, not a new message: one broker hop less on every query's critical path. A crash
    # here redelivers this task, which finds the plan stored and goes straight to the search again.
    return run_search(job_id)
