"""Search: resolve the query's parameters, choose the chunks, route, and cut the analyst batches.

No LLM here.  What the job reads depends on its route (``route.py``): the ranked search hits (fan-out),
the best hits that fit one context (direct), every chunk of the buffers (exhaustive), or the chunks a
parent handed a child.  The batches are stored with the job before any call is made, so a redelivered
search finds them and passes straight on.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import TYPE_CHECKING

from ..errors import NoChunks
from ..models import AnalysisPlan, Mode, QueryOptions, Route, Scope
from ..records.totals import holds_records
from ..runtime.local_servers import database_url
from ..search.service import rank
from ..store import jobs as job_store
from ..store.buffers import chunk_sizes, count_chunks, require_buffers, sample_chunks, sizes_of
from ..store.job_state import JobSpec
from .flow import OK, StageContext
from .params import ResolvedParams, apply_job_caps, make_batches, resolve_params
from .route import analyst_batch_tokens, block_tokens, checked_plan, final_routing, first_routing
from .scale import scaling_profile
from .sessions import evidence_ids

if TYPE_CHECKING:
    from ..config import Settings

log = logging.getLogger("rlm.pipeline.search")

#: chunks read, spread over the buffers, to tell whether they hold records an aggregation can count
RECORD_SAMPLE = 40


def run(ctx: StageContext) -> str:
    job, conn, settings = ctx.job, ctx.conn, ctx.settings
    if job.batches_total and job.params is not None:
        return OK  # cut by an earlier delivery: only the fan-out is left
    rows = require_buffers(conn, tenant=job.tenant, names=job.buffers)
    total = count_chunks(conn, buffer_ids=[r.id for r in rows])
    profile = scaling_profile(total)
    opts = QueryOptions.model_validate(job.options)
    if opts.mode == Mode.code:
        return _code_route(ctx, total, profile.tier)
    # the plan held to the question's kind (a counting question reads every match), except under --scope search
    # (a follow-up child's too), which keeps the search's cut-off; the stored plan stays as the planner wrote it,
    # the correction is said on the route's reason
    stored_plan = job.plan.stored() if job.plan else None
    planned, corrected = (
        (stored_plan or {}, [])
        if opts.scope == Scope.search
        else checked_plan(stored_plan, job.query, settings.threshold)
    )
    plan = AnalysisPlan(**planned) if stored_plan else None
    params = resolve_params(opts, plan, profile, settings)
    routing = first_routing(
        opts,
        job.plan,
        job.query,
        is_child=job.merges_into_parent,
        has_records=lambda: holds_records(sample_chunks(conn, buffer_ids=[r.id for r in rows], limit=RECORD_SAMPLE)),
    )
    spec = job.spec or JobSpec()
    if spec.chunk_ids:
        # a query_subset child reads exactly what its parent chose (those still in the tenant's buffers)
        sizes = sizes_of(conn, tenant=job.tenant, chunk_ids=spec.chunk_ids)
        chosen = [cid for cid in dict.fromkeys(spec.chunk_ids) if cid in sizes]
        if not chosen:
            raise NoChunks("none of the chunk ids given to query_subset is in the job's buffers")
    elif routing.route == Route.exhaustive:
        everything = chunk_sizes(conn, buffer_ids=[r.id for r in rows])
        chosen = [cid for cid, _ in everything]
        sizes = dict(everything)
        if not chosen:
            raise NoChunks(f"the buffers {', '.join(job.buffers)} hold no chunks")
        chosen, params = _exhaustive_params(chosen, params, profile.batch_size, opts, settings)
    else:
        ranked = rank(
            conn,
            settings=settings,
            url=database_url(settings),
            rows=rows,
            query=spec.search or job.query,  # a query_subset child searches what its parent asked for
            mode=params.search_mode,
            top_k=params.top_k,
            threshold=params.threshold,
        )
        chosen = [r.chunk_id for r in ranked]
        if params.max_chunks:
            chosen = chosen[: params.max_chunks]
        # a chat turn's earlier cited chunks join what the analysts read (docs/contract.md#sessions), after the
        # hits; one that is no longer in the tenant's buffers has no size and is left out
        wanted = [c for c in evidence_ids(spec) if c not in chosen]
        sizes = sizes_of(conn, tenant=job.tenant, chunk_ids=chosen + wanted)
        chosen += [c for c in wanted if c in sizes]
        if not chosen:
            raise NoChunks(
                f"no chunks matched the query in {', '.join(job.buffers)} "
                f"(mode {params.search_mode}, threshold {params.threshold})"
            )
    routing = final_routing(routing, [sizes.get(c, 0) for c in chosen], settings)
    if corrected:
        log.info("job %s: plan corrected: %s", job.id, "; ".join(corrected))
        routing = replace(routing, reason=f"{routing.reason}; plan corrected: {'; '.join(corrected)}")
    if routing.route == Route.direct:
        # one "batch": every hit, best first; the answer reads those that fit its context and reports the rest
        # as not read, by id (instant over a small model's context must not drop matched chunks silently)
        batches = [chosen]
    else:
        records = routing.route == Route.exhaustive
        batches = make_batches(
            chosen,
            batch_size=None if opts.num_agents else params.batch_size,
            num_agents=opts.num_agents,
            tokens={c: block_tokens(sizes.get(c, 0)) for c in chosen},
            max_tokens=analyst_batch_tokens(params.batch_size, settings, records=records),
        )
    with conn.transaction():
        job_store.save_route(conn, job_id=job.id, route=routing.route, reason=routing.reason)
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


def _code_route(ctx: StageContext, total: int, tier: str) -> str:
    """Code mode searches nothing here: its programs search and read as they choose (``program.py``)."""
    if not total:
        raise NoChunks(f"the buffers {', '.join(ctx.job.buffers)} hold no chunks")
    with ctx.conn.transaction():
        job_store.save_route(
            ctx.conn, job_id=ctx.job.id, route=Route.code, reason="mode code: the model's programs choose what to read"
        )
        job_store.save_search(
            ctx.conn, job_id=ctx.job.id, params={}, tier=tier, chunks_available=total, chunk_load_failures=0, batches=[]
        )
    return OK


def _exhaustive_params(
    chosen: list[int], params: ResolvedParams, tier_batch: int, opts: QueryOptions, settings: Settings
) -> tuple[list[int], ResolvedParams]:
    """Every chunk, in batches of the tier's size (or the user's); the operator's per-job caps hold as for any
    job (``apply_job_caps``), and a cut is said (coverage then stays below 1 and the answer is incomplete)."""
    out = {"max_chunks": len(chosen), "top_k": len(chosen), "batch_size": opts.batch_size or tier_batch}
    caps = apply_job_caps(out, settings, num_agents=opts.num_agents)
    chosen = chosen[: out["max_chunks"]]
    size = math.ceil(len(chosen) / opts.num_agents) if opts.num_agents else out["batch_size"]
    params = replace(params, top_k=len(chosen), max_chunks=len(chosen), batch_size=size, caps_applied=caps)
    return chosen, params
