"""Search: resolve the query's parameters, rank chunks, scale, and cut the analyst batches.

No LLM here.  The batches are stored with the job before the chord is sent, so
a redelivered search finds them and passes straight on to the fan-out.
"""

from __future__ import annotations

from ..errors import NoChunks
from ..local_servers import database_url
from ..models import AnalysisPlan, QueryOptions
from ..search.service import rank
from ..store import jobs as job_store
from ..store.buffers import count_chunks, require_buffers
from .flow import OK, StageContext
from .params import make_batches, resolve_params
from .scale import scaling_profile


def run(ctx: StageContext) -> str:
    job, conn, settings = ctx.job, ctx.conn, ctx.settings
    if job.batches_total and job.params is not None:
        return OK  # cut by an earlier delivery: only the fan-out is left
    rows = require_buffers(conn, tenant=job.tenant, names=job.buffers)
    total = count_chunks(conn, buffer_ids=[r.id for r in rows])
    profile = scaling_profile(total)
    plan = AnalysisPlan(**job.plan) if job.plan else None
    opts = QueryOptions.model_validate(job.options)
    params = resolve_params(opts, plan, profile, settings)
    ranked = rank(
        conn,
        settings=settings,
        url=database_url(settings),
        rows=rows,
        query=job.query,
        mode=params.search_mode,
        top_k=params.top_k,
        threshold=params.threshold,
    )
    if not ranked:
        raise NoChunks(
            f"no chunks matched the query in {', '.join(job.buffers)} "
            f"(mode {params.search_mode}, threshold {params.threshold})"
        )
    chosen = [r.chunk_id for r in ranked]
    if params.max_chunks:
        chosen = chosen[: params.max_chunks]
    batches = make_batches(
        chosen, batch_size=None if opts.num_agents else params.batch_size, num_agents=opts.num_agents
    )
    with conn.transaction():
        job_store.save_search(
            conn,
            job_id=job.id,
            params=params.as_dict(),
            tier=profile.tier,
            chunks_available=total,
            chunk_load_failures=0,
            batches=batches,
        )
    return OK
