"""Hybrid search's fusion of the bm25 and semantic arms: Reciprocal Rank Fusion, the lexical arm gated by its scores.

Reciprocal Rank Fusion (Cormack et al. 2009, k = 60) scores a chunk by the sum over the arms of
``1 / (RANK_K + its rank there)``, so a chunk both arms find rises above one only one arm finds.  That
is what an answer wants when both lists mean something: on code questions the line that answers is
most often in the chunk both arms rank high.

It is wrong when one list is noise.  A question in other words shares a few common words with many
chunks, and bm25 then scores them nearly alike; fused, those chunks pushed facts only the semantic
arm found out of the top 5.  So **the lexical arm takes part only when its scores pick something
out**: its best score at least ``SHARPNESS`` times its ``SHARP_AT``-th (or its last, when it has
fewer).  Key words or an identifier make the first scores stand far above the rest.  A gated list
still follows the semantic one, in its own order, so a buffer without vectors (or a threshold that
left nothing) still gets bm25's ranking.

Neither rule may lose what an arm alone would have shown: **each arm's first ``k // 2`` chunks are always in
the fused top k** (``fused_top``), in their fused order, in the places the fused list's own last ones would have
held.  At k = 10 that is every chunk either arm ranks in its top 5, whether the gate counted the lexical arm or
not.  The fused order is kept, so what a direct answer reads first changes only where the two arms' first halves,
with nothing in common, fill every place between them.

bench/RESULTS.md#fusion measures this against RRF alone, weighted RRF, score fusions and a best-rank
fusion on three question sets, and says why the best-rank one (higher recall on code) was not kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["RANK_K", "SHARPNESS", "SHARP_AT", "fuse_arms", "fused_top", "lexical_stands_out"]

#: the fusion constant of the original RRF paper
RANK_K = 60
#: how far above its tenth the lexical arm's best score must stand for the arm to count.  Key-word questions'
#: lists stand 3.2× and more above, paraphrases' a median 1.7×; of 1.5-4.0, 2.0 kept every paraphrase fact the
#: others kept and found the most code (bench/RESULTS.md#fusion)
SHARPNESS = 2.0
SHARP_AT = 10


def lexical_stands_out(scores: Sequence[float]) -> bool:
    """Whether a bm25 list (best first) picks some chunks out rather than scoring many alike."""
    if not scores:
        return False
    top, ref = scores[0], scores[min(len(scores), SHARP_AT) - 1]
    if len(scores) == 1 or ref <= 0:
        return top > 0
    return top >= SHARPNESS * ref


def fuse_arms(lexical: Sequence[tuple[int, float]], dense: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """(chunk id, score) best first from the two arms' (chunk id, score) lists, each best first.

    Ties of score go to the chunk that reached the better rank in either arm, then to the lower id; a chunk
    repeated within one list counts at its first place only.
    """
    counted = [dense, lexical] if lexical_stands_out([s for _, s in lexical]) else [dense]
    parts: dict[int, list[float]] = {}
    best: dict[int, int] = {}
    for ranking in counted:
        for rank, cid in enumerate(dict.fromkeys(c for c, _ in ranking), start=1):
            parts.setdefault(cid, []).append(1.0 / (RANK_K + rank))
            best[cid] = min(best.get(cid, rank), rank)
    # fsum is exactly rounded, so a chunk's score does not depend on the order of the arms
    scores = {cid: math.fsum(p) for cid, p in parts.items()}
    out = [(cid, scores[cid]) for cid in sorted(scores, key=lambda c: (-scores[c], best[c], c))]
    if len(counted) == 1:
        # the gated list follows the semantic one in its own order, ranks numbered on from the semantic list's last
        tail = dict.fromkeys(c for c, _ in lexical if c not in scores)
        out += [(cid, 1.0 / (RANK_K + len(scores) + i)) for i, cid in enumerate(tail, start=1)]
    return out


def fused_top(
    lexical: Sequence[tuple[int, float]], dense: Sequence[tuple[int, float]], k: int
) -> list[tuple[int, float]]:
    """The top ``k`` of ``fuse_arms``, holding each arm's first ``k // 2`` chunks: a chunk the fusion ranked lower
    takes the place of the fused list's last one not so held, and keeps its fused order and score."""
    fused = fuse_arms(lexical, dense)
    if len(fused) <= k:
        return fused[: max(0, k)]
    sure = k // 2
    picked = {c for ranking in (dense, lexical) for c in list(dict.fromkeys(c for c, _ in ranking))[:sure]}
    for cid, _ in fused:
        if len(picked) >= k:
            break
        picked.add(cid)
    return [(cid, score) for cid, score in fused if cid in picked]
