"""Hybrid fusion (search/fusion.py): Reciprocal Rank Fusion, the lexical arm counted only when its scores stand out,
and a top k that holds each arm's first k // 2."""

from __future__ import annotations

import random

import pytest

from rlm_workers.search.fusion import RANK_K, SHARP_AT, SHARPNESS, fuse_arms, fused_top, lexical_stands_out


def _sharp(ids: list[int]) -> list[tuple[int, float]]:
    """A bm25 list whose first score stands far above the rest (key words, an identifier)."""
    return [(c, 20.0 if i == 0 else 2.0 - i * 0.01) for i, c in enumerate(ids)]


def _flat(ids: list[int]) -> list[tuple[int, float]]:
    """A bm25 list of nearly equal scores (common words shared with many chunks)."""
    return [(c, 5.0 - i * 0.05) for i, c in enumerate(ids)]


def _dense(ids: list[int]) -> list[tuple[int, float]]:
    return [(c, 0.6 - i * 0.01) for i, c in enumerate(ids)]


def _ids(fused: list[tuple[int, float]]) -> list[int]:
    return [c for c, _ in fused]


def test_a_flat_lexical_list_does_not_bury_what_the_semantic_arm_found():
    # RRF of both lists put 10..15 (ranked 2-7 by both arms) above 99, the semantic arm's first: the
    # paraphrase failure this gate removes
    half_liked = [10, 11, 12, 13, 14, 15]
    dense = _dense([99, *half_liked])
    lexical = _flat([50, *half_liked, 51, 52, 53])
    assert not lexical_stands_out([s for _, s in lexical])
    fused = fuse_arms(lexical, dense)
    assert _ids(fused) == [99, *half_liked, 50, 51, 52, 53]  # the semantic list, then bm25's others in its order
    scores = [s for _, s in fused]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == len(scores)
    assert scores[0] == 1 / (RANK_K + 1) and scores[7] == 1 / (RANK_K + 8)


def test_a_sharp_lexical_list_is_fused_and_agreement_rises():
    dense = _dense([1, 2, 3, 4, 5])
    lexical = _sharp([9, 8, 7, 6, 3])
    assert lexical_stands_out([s for _, s in lexical])
    fused = fuse_arms(lexical, dense)
    assert _ids(fused)[:5] == [3, 1, 9, 2, 8]  # 3 is in both lists; ties of score go to the better rank, then id
    assert dict(fused)[3] == 1 / (RANK_K + 3) + 1 / (RANK_K + 5)


def test_one_arm_empty_keeps_the_other_arms_order():
    for lexical in (_flat([4, 5, 6]), _sharp([4, 5, 6])):
        assert _ids(fuse_arms(lexical, [])) == [4, 5, 6]
    assert _ids(fuse_arms([], _dense([3, 1, 2]))) == [3, 1, 2]
    assert fuse_arms([], []) == []


def test_each_chunk_comes_once():
    dense = _dense([1, 2, 3, 1])
    lexical = _sharp([3, 2, 1, 3])
    fused = fuse_arms(lexical, dense)
    assert _ids(fused) == [1, 3, 2]  # 1 and 3 tie exactly (1/61 + 1/63 each): the lower id
    assert dict(fused)[2] == 2 / (RANK_K + 2)


def test_when_the_lexical_arm_stands_out():
    assert not lexical_stands_out([])
    assert lexical_stands_out([0.5])  # one match: it picks exactly that out
    assert not lexical_stands_out([0.0])
    tenth = [10.0] + [4.0] * (SHARP_AT - 2) + [10.0 / SHARPNESS]
    assert lexical_stands_out(tenth)  # exactly SHARPNESS times its tenth
    assert not lexical_stands_out([10.0] + [4.0] * (SHARP_AT - 2) + [10.0 / SHARPNESS + 0.01])
    # what lies past the tenth does not matter; fewer than ten compare with the last
    assert lexical_stands_out(tenth + [0.1] * 5)
    assert lexical_stands_out([6.0, 5.0, 2.9]) and not lexical_stands_out([6.0, 5.0, 3.1])
    assert lexical_stands_out([3.0, 1.0, -0.5])  # a last score at or below zero: any positive best stands out


def test_the_top_k_holds_a_gated_lexical_arms_first_half():
    # the flat list is left out of the fusion, yet its first five are what bm25 alone would have shown at 5
    dense = _dense([99, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20])
    lexical = _flat([50, 51, 10, 52, 53, 54, 55])
    assert not lexical_stands_out([s for _, s in lexical])
    top = fused_top(lexical, dense, 10)
    # the fused order first; 50, 51, 52 and 53 take the places of the semantic list's last four, in bm25's order
    assert _ids(top) == [99, 10, 11, 12, 13, 14, 50, 51, 52, 53]
    assert top == [(c, s) for c, s in fuse_arms(lexical, dense) if c in set(_ids(top))]


def test_the_top_k_is_the_fused_top_k_when_the_arms_agree():
    dense = _dense(list(range(1, 21)))
    lexical = _sharp(list(range(1, 21)))
    assert fused_top(lexical, dense, 10) == fuse_arms(lexical, dense)[:10]
    assert fused_top(lexical, dense, 0) == []
    assert _ids(fused_top(lexical[:2], dense[:1], 10)) == [1, 2]  # fewer than k chunks in all: every one


@pytest.mark.parametrize("seed", range(200))
def test_no_chunk_either_arm_ranks_in_its_first_half_is_lost(seed):
    rnd = random.Random(seed)
    pool = list(range(rnd.randint(1, 60)))
    k = rnd.randint(1, 20)
    dense = _dense(rnd.sample(pool, min(len(pool), 2 * k)))
    ids = rnd.sample(pool, min(len(pool), 2 * k))
    lexical = _sharp(ids) if rnd.random() < 0.5 else _flat(ids)
    top = _ids(fused_top(lexical, dense, k))
    assert len(top) == len(set(top)) == min(k, len(set(ids) | {c for c, _ in dense}))
    assert {c for c, _ in dense[: k // 2]} | set(ids[: k // 2]) <= set(top)
    order = _ids(fuse_arms(lexical, dense))
    assert top == sorted(top, key=order.index)  # in the fused order
