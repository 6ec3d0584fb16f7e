"""Search: resolve the query's parameters, choose the chunks, route, and cut the analyst batches.

No LLM here.  What the job reads depends on its route (``route.py``): the ranked search hits (fan-out),
the best hits that fit one context (direct), every chunk of the buffers (exhaustive), or the chunks a
parent handed a child.  The batches are stored with the job before any call is made, so a redelivered
search finds them and passes straight on.
"""

from __future__ import annotations

import math

from ..errors import NoChunks
from ..local_servers import database_url
from ..models import AnalysisPlan, QueryOptions, Route
from ..search.service import rank
from ..store import jobs as job_store
from ..store.buffers import chunk_sizes, count_chunks, require_buffers, sizes_of
from .flow import OK, StageContext
from .params import ResolvedParams, make_batches, resolve_params
from .route import direct_budget, final_routing, first_routing, fit
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
    routing = first_routing(opts, job.plan, job.query, is_child=job.parent_id is not None)
    spec = job.spec or {}
    caps: list[str] = []
    if spec.get("chunk_ids"):
        # a query_subset child reads exactly what its parent chose (those still in the tenant's buffers)
        sizes = sizes_of(conn, tenant=job.tenant, chunk_ids=spec["chunk_ids"])
        chosen = [cid for cid in dict.fromkeys(spec["chunk_ids"]) if cid in sizes]
        if not chosen:
            raise NoChunks("none of the chunk ids given to query_subset is in the job's buffers")
    elif routing.route == Route.exhaustive:
        everything = chunk_sizes(conn, buffer_ids=[r.id for r in rows])
        chosen = [cid for cid, _ in everything]
        sizes = dict(everything)
        if not chosen:
            raise NoChunks(f"the buffers {', '.join(job.buffers)} hold no chunks")
        chosen, params, caps = _exhaustive_params(chosen, params, profile.batch_size, opts, settings)
    else:
        ranked = rank(
            conn,
            settings=settings,
            url=database_url(settings),
            rows=rows,
            query=spec.get("search") or job.query,  # a query_subset child searches what its parent asked for
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
        sizes = sizes_of(conn, tenant=job.tenant, chunk_ids=chosen)
        if routing.route == Route.direct:
            chosen = fit(chosen, sizes, direct_budget(settings))
    routing = final_routing(routing, [sizes.get(c, 0) for c in chosen], settings)
    if routing.route == Route.direct:
        batches = [chosen]  # one "batch": what the single call reads
    else:
        batches = make_batches(
            chosen, batch_size=None if opts.num_agents else params.batch_size, num_agents=opts.num_agents
        )
    stored = params.as_dict()
    stored["caps_applied"] = list(params.caps_applied) + caps
    with conn.transaction():
        job_store.save_route(conn, job_id=job.id, route=routing.route, reason=routing.reason)
        job_store.save_search(
            conn,
            job_id=job.id,
            params=stored,
            tier=profile.tier,
            chunks_available=total,
            chunk_load_failures=0,
            batches=batches,
        )
    return OK


def _exhaustive_params(
    chosen: list[int], params: ResolvedParams, tier_batch: int, opts: QueryOptions, settings
) -> tuple[list[int], ResolvedParams, list[str]]:
    """Every chunk, in batches of the tier's size (or the user's); the operator's per-job caps still hold, and
    a cut is said (coverage then stays below 1 and the answer is reported incomplete)."""
    from dataclasses import replace

    caps = []
    cap = settings.max_chunks_per_job
    if len(chosen) > cap:
        caps.append(f"scope all: {len(chosen)} chunks → {cap} (RLM_MAX_CHUNKS_PER_JOB)")
        chosen = chosen[:cap]
    size = opts.batch_size or tier_batch
    if opts.num_agents:
        size = math.ceil(len(chosen) / opts.num_agents)
    most = settings.max_batches_per_job
    if math.ceil(len(chosen) / size) > most:
        wider = math.ceil(len(chosen) / most)
        caps.append(f"batch_size {size} → {wider} (RLM_MAX_BATCHES_PER_JOB {most})")
        size = wider
    params = replace(params, top_k=len(chosen), max_chunks=len(chosen), batch_size=size, caps_applied=[])
    return chosen, params, caps
