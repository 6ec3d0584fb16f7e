"""Reciprocal Rank Fusion (Cormack et al. 2009) of several rankings of chunk ids."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["rrf_fuse"]


#: the fusion constant of the original RRF paper, which the contract fixes (docs/contract.md#pipeline-semantics)
RRF_K = 60


def rrf_fuse(
    rankings: Sequence[Sequence[int]], *, k: int = RRF_K, weights: Sequence[float] | None = None
) -> list[tuple[int, float]]:
    """Fuse rankings: score(d) = Σ_i w_i / (k + rank_i(d)), ranks starting at 1.

    A doc missing from a ranking gets nothing from it; a doc repeated within a
    ranking counts only at its first position.  Sorted by score descending,
    then by the best rank the doc reached in any list, then by chunk id.
    """
    if k < 0:
        raise ValueError(f"rrf k must be >= 0, got {k}")
    if weights is None:
        weights = [1.0] * len(rankings)
    elif len(weights) != len(rankings):
        raise ValueError(f"{len(weights)} weights for {len(rankings)} rankings")

    terms: dict[int, list[float]] = {}
    best: dict[int, int] = {}
    for ranking, w in zip(rankings, weights, strict=True):
        seen: set[int] = set()
        for rank, doc in enumerate(ranking, start=1):
            if doc in seen:
                continue
            seen.add(doc)
            terms.setdefault(doc, []).append(w / (k + rank))
            if rank < best.get(doc, rank + 1):
                best[doc] = rank
    # fsum is exactly rounded, so a doc's score does not depend on list order:
    # symmetric placements tie exactly and fall through to the tie-breaks
    scored = [(doc, math.fsum(parts)) for doc, parts in terms.items()]
    scored.sort(key=lambda item: (-item[1], best[item[0]], item[0]))
    return scored
