"""renewals.Renewals: one thread renews what a process holds; lost items are dropped and reported once."""

from __future__ import annotations

import threading

from rlm_workers.runtime.renewals import Renewals


def test_held_items_are_renewed_until_dropped_and_lost_ones_reported_once():
    rounds: list[list[str]] = []
    lost_seen: list[list[tuple[str, int]]] = []
    renewed = threading.Event()
    reported = threading.Event()

    def renew(due):
        keys = [k for k, _ in due]
        rounds.append(keys)
        if len(rounds) >= 3:
            renewed.set()
        return [k for k in keys if k == "expired"]

    def on_lost(gone):
        lost_seen.append(gone)
        reported.set()

    r: Renewals[str, int] = Renewals("test-renewals", renew, on_lost)
    with r.held("kept", 1, 0.01):
        r.hold("expired", 2, 0.01)
        assert reported.wait(30)
        assert renewed.wait(30)
    assert lost_seen == [[("expired", 2)]]
    # the expired item was renewed no more after it was reported; the kept one round after round
    first_lost = next(i for i, keys in enumerate(rounds) if "expired" in keys)
    assert all("expired" not in keys for keys in rounds[first_lost + 1 :])
    assert sum("kept" in keys for keys in rounds) >= 2


def test_an_item_dropped_while_its_renewal_runs_is_not_reported():
    started, release, second = threading.Event(), threading.Event(), threading.Event()
    lost_seen: list = []
    calls: list[list[str]] = []

    def renew(due):
        calls.append([k for k, _ in due])
        if len(calls) == 1:
            started.set()
            release.wait(30)
            return ["a"]  # the store says it is gone
        second.set()
        return []

    r: Renewals[str, None] = Renewals("test-renewals-drop", renew, lost_seen.append)
    r.hold("a", None, 0.01)
    assert started.wait(30)
    r.drop("a")  # released by its holder while the renewal was under way
    release.set()
    with r.held("probe", None, 0.01):
        assert second.wait(30)  # a later round ran: the first one's answer was handled
    assert lost_seen == []
    assert all("a" not in keys for keys in calls[1:])
