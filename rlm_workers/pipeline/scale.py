"""Scale: map a dataset's size to batch size, concurrency, search depth and load cap.

Pure and advisory (docs/contract.md#scale): the profile only fills what the CLI flags and
the plan left open.  ``None`` means "all": search every chunk, load every hit.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScalingProfile:
    tier: str
    chunk_count: int
    batch_size: int
    #: ceiling on this job's in-flight analyst calls (still under RLM_MAX_CONCURRENCY)
    concurrency: int
    #: how many hits the search keeps; None = every chunk
    search_depth: int | None
    #: how many hits are loaded and analysed; None = all of them
    max_loaded: int | None


#: (first chunk count of the tier, tier, batch size, concurrency, search depth, max loaded)
TIERS: tuple[tuple[int, str, int, int, int | None, int | None], ...] = (
    (0, "tiny", 1, 5, None, None),
    (20, "small", 5, 15, 100, None),
    (100, "medium", 10, 30, 200, 100),
    (500, "large", 20, 60, 400, 200),
    (2000, "xlarge", 50, 100, 500, 300),
)


def scaling_profile(chunk_count: int) -> ScalingProfile:
    if chunk_count < 0:
        raise ValueError(f"chunk count cannot be negative: {chunk_count}")
    row = TIERS[0]
    for candidate in TIERS:
        if chunk_count >= candidate[0]:
            row = candidate
    _, tier, batch, conc, depth, loaded = row
    return ScalingProfile(
        tier=tier,
        chunk_count=chunk_count,
        batch_size=batch,
        concurrency=conc,
        search_depth=depth,
        max_loaded=loaded,
    )
