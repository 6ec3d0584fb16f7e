"""Hybrid search's fusion of the bm25 and semantic arms: best rank, with the lexical arm gated by its own scores.

Two rules, each answering a way the Reciprocal Rank Fusion we used before lost facts
(bench/RESULTS.md#fusion measures both on three question sets):

- **A chunk scores by its best rank in either arm**, not by the sum over arms.  Under a sum, chunks
  that both arms half-like (rank 6 here, rank 8 there) outrank a chunk one arm puts first: a fact
  the semantic arm alone found at rank 1 fell out of the hybrid top 5.  By best rank, the top k
  holds each arm's own top ~k/2 whatever the other arm says; agreement only breaks ties.
- **The lexical arm takes part only when its scores pick something out**: its best score at least
  ``SHARPNESS`` times its ``SHARP_AT``-th (or its last, when it has fewer).  A question in other
  words shares a few common words with many chunks, and bm25 then ranks them on nearly equal
  scores: that list is noise and, fused, it pushes real semantic hits out.  Key words or an
  identifier make the first scores stand far above the rest.  A gated list still fills in after
  the semantic one, so a buffer without vectors (or a threshold that left nothing) still gets
  bm25's ranking.

Ties of best rank go to the semantic arm, then to the chunk in both lists, then to the lower id.
A hit's score is ``1 / (RANK_K + best rank)``: comparable within one result, not across queries.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["RANK_K", "SHARPNESS", "SHARP_AT", "fuse_arms", "lexical_stands_out"]

#: the constant of reciprocal-rank scores (Cormack et al.'s 60); it orders nothing, it only scales the score
RANK_K = 60
#: how far above its tenth the lexical arm's best score must stand for the arm to count.  Key-word questions'
#: lists stand 3.2× and more above, paraphrases' a median 1.7×; of 1.0-4.0, 2.0 kept every paraphrase fact the
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
    """(chunk id, score) best first from the two arms' (chunk id, score) lists, each best first."""
    lexical_counts = lexical_stands_out([s for _, s in lexical])
    # per chunk: (best rank, arm of that rank: 0 semantic / 1 lexical, -ranks held) — smaller sorts first
    best: dict[int, list[int]] = {}
    for arm, ranking in ((0, dense), (1, lexical if lexical_counts else ())):
        for rank, (cid, _) in enumerate(ranking, start=1):
            have = best.get(cid)
            if have is None:
                best[cid] = [rank, arm, -1]
            else:
                have[2] -= 1
                if rank < have[0]:
                    have[0], have[1] = rank, arm
    fused = sorted(best.items(), key=lambda item: (*item[1], item[0]))
    out = [(cid, 1.0 / (RANK_K + key[0])) for cid, key in fused]
    if not lexical_counts:
        # the gated list follows the semantic one in its own order, ranks numbered on from the last
        tail = [cid for cid, _ in lexical if cid not in best]
        out += [(cid, 1.0 / (RANK_K + len(dense) + i)) for i, cid in enumerate(dict.fromkeys(tail), start=1)]
    return out
