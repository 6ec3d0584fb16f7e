"""rlm.search: resolve parameters, search, scale, cut batches; then hand over to rlm.fan_out."""

from __future__ import annotations

import dataclasses

from celery import shared_task

from ..config import get_settings
from ..errors import NoChunks, RLMError
from ..models import AnalysisPlan
from ..store import jobs as job_store
from ..store.buffers import require_buffers
from .common import DB_OUTAGE, StageTimer, db, fail_job, log, survives_outages


def options_from(job_options: dict) -> object:
    from ..stages.params import QueryOptions

    known = {f.name for f in dataclasses.fields(QueryOptions)}
    return QueryOptions(**{k: v for k, v in job_options.items() if k in known})


@shared_task(name="rlm.search", bind=True, acks_late=True)
@survives_outages
def search(self, job_id: str) -> str:  # noqa: ANN001
    """The stage as its own task: sent by the reconciler, or by a plan task from before this release."""
    return run_search(job_id)


def run_search(job_id: str) -> str:
    """Search, scale, cut batches, launch the chord; idempotent. ``rlm.plan`` calls it in-process."""
    from ..search.service import rank
    from ..services import database_url
    from ..stages.params import make_batches, resolve_params
    from ..stages.scale import scaling_profile
    from .fanout import launch

    settings = get_settings()
    with db() as conn:
        job = job_store.get_job(conn, job_id=job_id)
        if job is None or job.terminal:
            return "skipped"
        if job.batches_total and job.params is not None:
            # a redelivered search: batches are already cut, only make sure fan-out happens
            launch(job_id)
            return "redelivered"
        job_store.set_stage(conn, job_id=job_id, stage="search")
        try:
            with StageTimer(conn, job_id, "search"):
                rows = require_buffers(conn, tenant=job.tenant, names=job.buffers)
                total = int(conn.execute("SELECT count(*) FROM chunks WHERE buffer_id = ANY(%s)",
                                         ([r.id for r in rows],)).fetchone()[0])
                profile = scaling_profile(total)
                plan = AnalysisPlan(**job.plan) if job.plan else None
                opts = options_from(job.options)
                params = resolve_params(opts, plan, profile, settings)
                ranked = rank(conn, settings=settings, url=database_url(settings), rows=rows, query=job.query,
                              mode=params.search_mode, top_k=params.top_k, threshold=params.threshold)
                if not ranked:
                    raise NoChunks(f"no chunks matched the query in {', '.join(job.buffers)} "
                                   f"(mode {params.search_mode}, threshold {params.threshold})")
                chosen = [r.chunk_id for r in ranked]
                if params.max_chunks:
                    chosen = chosen[: params.max_chunks]
                batches = make_batches(chosen, batch_size=None if opts.num_agents else params.batch_size,
                                       num_agents=opts.num_agents)
                with conn.transaction():
                    job_store.save_search(conn, job_id=job_id, params=params.as_dict(), tier=profile.tier,
                                          chunks_available=total, chunk_load_failures=0, batches=batches)
        except DB_OUTAGE:
            raise  # not the job's fault: the task retries
        except RLMError as exc:
            fail_job(conn, job_id=job_id, exc=exc)
            return "failed"
        except Exception as exc:  # noqa: BLE001 - the job must end, whatever broke
            log.exception("search stage crashed for job %s", job_id)
            fail_job(conn, job_id=job_id, exc=exc, prefix="search failed")
            return "failed"
    launch(job_id)  # in-process: one broker hop less on every query's critical path
    return "ok"
