"""Parameter resolution: CLI flag → plan → scaling profile → config → default.

Every knob of a query resolves here, in one pure function, so the order of
precedence is written down once and tested once.  ``sources`` records where
each value came from, which ``--verbose`` prints.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..config import Settings
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

    pick("search_mode")
    pick("threshold", ("config", settings.threshold))
    pick(
        "top_k",
        ("scale", profile.search_depth if profile.search_depth is not None else everything),
        ("config", settings.search_top_k),
    )
    pick("max_chunks", ("scale", profile.max_loaded if profile.max_loaded is not None else everything))
    if opts.num_agents:
        # --num-agents fixes the number of batches; make_batches cuts them evenly.
        out["batch_size"], sources["batch_size"] = 0, "cli:num_agents"
    else:
        pick("batch_size", ("scale", profile.batch_size), ("config", settings.batch_size))
    # The per-job ceiling never exceeds the global one, and --num-agents asks for that many in parallel.
    wanted = max(profile.concurrency, opts.num_agents or 0)
    concurrency = min(wanted, settings.max_concurrency)
    focus = [str(t)[:200] for t in planned.get("focus_topics", [])][:10]
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
    )


def make_batches(
    chunk_ids: list[int], *, batch_size: int | None = None, num_agents: int | None = None
) -> list[list[int]]:
    """Cut the ranked chunk ids into batches, keeping rank order.

    With ``num_agents`` the chunks are divided evenly (sizes differ by at most
    one); otherwise every batch has ``batch_size`` chunks but the last.
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
    return [chunk_ids[i : i + batch_size] for i in range(0, len(chunk_ids), batch_size)]
