"""Reciprocal Rank Fusion: hand-checked scores, weights, duplicates, tie-breaks."""

from __future__ import annotations

import pytest

from rlm_workers.search.rrf import rrf_fuse


def test_two_lists_hand_checked() -> None:
    # k=60, lists [1, 2, 3] and [3, 1, 4]:
    #   1/61 = 0.0163934426, 1/62 = 0.0161290323, 1/63 = 0.0158730159
    #   1: 1/61 + 1/62 = 0.0325224749   (ranks 1 and 2)
    #   3: 1/63 + 1/61 = 0.0322664585   (ranks 3 and 1)
    #   2: 1/62        = 0.0161290323
    #   4: 1/63        = 0.0158730159
    got = rrf_fuse([[1, 2, 3], [3, 1, 4]])
    assert [d for d, _ in got] == [1, 3, 2, 4]
    assert [s for _, s in got] == [1 / 61 + 1 / 62, 1 / 63 + 1 / 61, 1 / 62, 1 / 63]
    assert [s for _, s in got] == pytest.approx([0.0325224749, 0.0322664585, 0.0161290323, 0.0158730159], abs=1e-10)


def test_custom_k() -> None:
    # k=0: 1 -> 1/1 + 1/2 = 1.5, 2 -> 1/2 + 1/1 = 1.5 (tie, best rank 1 both -> id), 3 -> 1/3
    assert rrf_fuse([[1, 2, 3], [2, 1]], k=0) == [(1, 1.5), (2, 1.5), (3, 1 / 3)]


def test_weights_scale_each_list() -> None:
    # weights 2 and 0.5: 1 -> 2/61 + 0.5/62, 3 -> 2/63 + 0.5/61, 2 -> 2/62, 4 -> 0.5/63
    got = dict(rrf_fuse([[1, 2, 3], [3, 1, 4]], weights=[2.0, 0.5]))
    assert got == pytest.approx({1: 2 / 61 + 0.5 / 62, 3: 2 / 63 + 0.5 / 61, 2: 2 / 62, 4: 0.5 / 63}, rel=1e-15)
    # 1 = 0.0408, 3 = 0.0399, 2 = 0.0323, 4 = 0.0079
    assert [d for d, _ in rrf_fuse([[1, 2, 3], [3, 1, 4]], weights=[2.0, 0.5])] == [1, 3, 2, 4]
    # weight 10 on the second list: 3 = 1/63 + 10/61 = 0.180, 1 = 1/61 + 10/62 = 0.178,
    # 4 = 10/63 = 0.159, 2 = 1/62 = 0.016
    assert [d for d, _ in rrf_fuse([[1, 2, 3], [3, 1, 4]], weights=[1.0, 10.0])] == [3, 1, 4, 2]


def test_duplicates_count_only_at_first_position() -> None:
    # 7 at ranks 1 and 3 of the same list: only rank 1 counts; 8 keeps its position (rank 2)
    assert rrf_fuse([[7, 8, 7]]) == [(7, 1 / 61), (8, 1 / 62)]


def test_ties_break_by_best_rank_then_chunk_id() -> None:
    # k=1: 9 -> 1/2 (best rank 1); 8 -> 1/2 (best rank 1); 2 -> 1/4 + 1/4 = 1/2 (best rank 3);
    #      5 -> 1/3 and 6 -> 1/3 (best rank 2 both)
    got = rrf_fuse([[9, 5, 2], [8, 6, 2]], k=1)
    assert got == [(8, 0.5), (9, 0.5), (2, 0.5), (5, 1 / 3), (6, 1 / 3)]


def test_score_does_not_depend_on_list_order() -> None:
    lists = [[1, 2, 3], [2, 3, 1], [3, 1, 2]]
    a = dict(rrf_fuse(lists))
    b = dict(rrf_fuse(lists[::-1]))
    assert a == b
    assert a[1] == a[2] == a[3]  # each doc sits at ranks 1, 2, 3 once: exact tie


def test_empty_inputs() -> None:
    assert rrf_fuse([]) == []
    assert rrf_fuse([[], []]) == []
    assert rrf_fuse([[], [4]]) == [(4, 1 / 61)]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        rrf_fuse([[1], [2]], weights=[1.0])
    with pytest.raises(ValueError):
        rrf_fuse([[1]], k=-1)
