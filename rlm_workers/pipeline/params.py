"""Parameter resolution: CLI flag → plan → operator config → scaling profile → config default → default.

Every knob of a query resolves here, in one pure function, so the order of
precedence is written down once and tested once.  ``sources`` records where
each value came from, which ``--verbose`` prints.  A setting the operator put in
the environment (``RLM_BATCH_SIZE``, ``RLM_SEARCH_TOP_K``) is an override and
beats the tier; left at its default it only fills what the tier leaves open
(docs/contract.md#resolution-order).  Last, the per-job caps
(``RLM_MAX_CHUNKS_PER_JOB``, ``RLM_MAX_BATCHES_PER_JOB``) cut whatever the plan or
the tier asked for, and each cut is listed in ``caps_applied``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..config import Settings
from ..errors import InvalidInput
from ..models import AnalysisPlan, QueryOptions
from .scale import ScalingProfile

#: compiled-in fallbacks, the last link of the chain
DEFAULTS: dict[str, Any] = {
    "search_mode": "hybrid",
    "threshold": 0.3,
    "top_k": 200,
    "max_chunks": 100,
    "batch_size": 10,
}


@dataclass(frozen=True)
class ResolvedParams:
    search_mode: str
    threshold: float
    top_k: int
    max_chunks: int
    batch_size: int
    focus_topics: list[str]
    concurrency: int
    sources: dict[str, str] = field(default_factory=dict)
    #: one line per cap that cut a value ("max_chunks 5000 → 2000 (RLM_MAX_CHUNKS_PER_JOB)")
    caps_applied: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _first(*candidates: tuple[str, Any]) -> tuple[Any, str]:
    for source, value in candidates:
        if value is not None:
            return value, source
    raise AssertionError("the default link of the chain is never None")


def resolve_params(
    opts: QueryOptions, plan: AnalysisPlan | None, profile: ScalingProfile, settings: Settings
) -> ResolvedParams:
    """Resolve every parameter; ``plan`` counts only for the fields the planner actually set."""
    planned = {k: getattr(plan, k) for k in plan.model_fields_set} if plan is not None else {}
    everything = max(1, profile.chunk_count)
    sources: dict[str, str] = {}
    out: dict[str, Any] = {}

    def pick(name: str, *rest: tuple[str, Any]) -> None:
        out[name], sources[name] = _first(
            ("cli", getattr(opts, name)), ("plan", planned.get(name)), *rest, ("default", DEFAULTS[name])
        )

    explicit = settings.model_fields_set

    def config(setting: str) -> tuple[tuple[str, Any], tuple[str, Any]]:
        """(operator override, config default): the value sits before the tier only when it was set."""
        value = getattr(settings, setting)
        return (("config", value) if setting in explicit else ("config", None)), ("config", value)

    pick("search_mode")
    pick("threshold", ("config", settings.threshold))
    top_k_override, top_k_config = config("search_top_k")
    pick(
        "top_k",
        top_k_override,
        ("scale", profile.search_depth if profile.search_depth is not None else everything),
        top_k_config,
    )
    pick("max_chunks", ("scale", profile.max_loaded if profile.max_loaded is not None else everything))
    if opts.num_agents:
        # --num-agents fixes the number of batches; make_batches cuts them evenly.
        out["batch_size"], sources["batch_size"] = 0, "cli:num_agents"
    else:
        batch_override, batch_config = config("batch_size")
        pick("batch_size", batch_override, ("scale", profile.batch_size), batch_config)
    # The per-job ceiling never exceeds the global one, and --num-agents asks for that many in parallel.
    wanted = max(profile.concurrency, opts.num_agents or 0)
    concurrency = min(wanted, settings.max_concurrency)
    focus = [str(t)[:200] for t in planned.get("focus_topics", [])][:10]
    caps = apply_job_caps(out, settings, num_agents=opts.num_agents)
    if opts.num_agents:
        n = min(out["max_chunks"], out["top_k"])
        out["batch_size"] = max(1, math.ceil(n / opts.num_agents))
    return ResolvedParams(
        search_mode=out["search_mode"],
        threshold=float(out["threshold"]),
        top_k=int(out["top_k"]),
        max_chunks=int(out["max_chunks"]),
        batch_size=int(out["batch_size"]),
        focus_topics=focus,
        concurrency=concurrency,
        sources=sources,
        caps_applied=caps,
    )


def apply_job_caps(out: dict[str, Any], settings: Settings, *, num_agents: int | None = None) -> list[str]:
    """Cut ``max_chunks`` to the per-job cap and grow ``batch_size`` until the batches fit their cap.

    A request over a cap was already refused at submission (``QueryOptions``); what is left to cut here
    came from the plan, the tier ("everything" on a tiny buffer is never over) or a cap lowered since.
    """
    caps: list[str] = []
    cap = settings.max_chunks_per_job
    if out["max_chunks"] > cap:
        caps.append(f"max_chunks {out['max_chunks']} → {cap} (RLM_MAX_CHUNKS_PER_JOB)")
        out["max_chunks"] = cap
    if num_agents:
        return caps  # the batch count is the request's own, checked against the cap at submission
    analysed = min(out["max_chunks"], out["top_k"])
    most = settings.max_batches_per_job
    if out["batch_size"] and math.ceil(analysed / out["batch_size"]) > most:
        wider = math.ceil(analysed / most)
        caps.append(f"batch_size {out['batch_size']} → {wider} (RLM_MAX_BATCHES_PER_JOB {most})")
        out["batch_size"] = wider
    return caps


def check_job_caps(opts: QueryOptions, settings: Settings) -> None:
    """At submission: refuse a request that asks one job for more than the per-job caps allow."""
    cap, most = settings.max_chunks_per_job, settings.max_batches_per_job
    if opts.max_chunks is not None and opts.max_chunks > cap:
        raise InvalidInput(f"max-chunks {opts.max_chunks} is over the per-job cap of {cap} (RLM_MAX_CHUNKS_PER_JOB)")
    if opts.num_agents is not None and opts.num_agents > most:
        raise InvalidInput(
            f"num-agents {opts.num_agents} is over the per-job cap of {most} batches (RLM_MAX_BATCHES_PER_JOB)"
        )
    # Only a request that names both knows its batch count; otherwise the tier decides how many chunks are
    # loaded, and resolve_params widens the batches if they would be too many.
    if opts.batch_size is not None and opts.max_chunks is not None:
        analysed = min(opts.max_chunks, cap)
        batches = math.ceil(analysed / opts.batch_size)
        if batches > most:
            raise InvalidInput(
                f"batch-size {opts.batch_size} would cut {analysed} chunks into {batches} batches, over the per-job "
                f"cap of {most} (RLM_MAX_BATCHES_PER_JOB): use a batch size of at least {math.ceil(analysed / most)}"
            )


def make_batches(
    chunk_ids: list[int],
    *,
    batch_size: int | None = None,
    num_agents: int | None = None,
    tokens: Mapping[int, int] | None = None,
    max_tokens: int | None = None,
) -> list[list[int]]:
    """Cut the ranked chunk ids into batches, keeping rank order.

    With ``num_agents`` the chunks are divided evenly (sizes differ by at most
    one); otherwise every batch has ``batch_size`` chunks but the last, and, given each chunk's prompt ``tokens``
    and a ``max_tokens`` a prompt may carry (a small model's context), a batch also ends before it would hold more.
    """
    if not chunk_ids:
        return []
    if num_agents:
        n = min(num_agents, len(chunk_ids))
        base, extra = divmod(len(chunk_ids), n)
        out, start = [], 0
        for k in range(n):
            size = base + (1 if k < extra else 0)
            out.append(chunk_ids[start : start + size])
            start += size
        return out
    if not batch_size or batch_size < 1:
        raise ValueError("make_batches needs a batch_size >= 1 or num_agents")
    if tokens is None or max_tokens is None:
        return [chunk_ids[i : i + batch_size] for i in range(0, len(chunk_ids), batch_size)]
    batches: list[list[int]] = [[]]
    used = 0
    for cid in chunk_ids:
        cost = tokens.get(cid, 0)
        if batches[-1] and (len(batches[-1]) >= batch_size or used + cost > max_tokens):
            batches.append([])
            used = 0
        batches[-1].append(cid)
        used += cost
    return batches
