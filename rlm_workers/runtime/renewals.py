"""One thread per process renewing everything the process holds, each item on its own period.

A thread per held lease cost every holder a thread start and a join, waited for under the GIL that the other
threads of a 100-thread analyst worker want too (bench/RESULTS.md, ``--scope all``).  ``Renewals`` keeps the
held items in one table and renews those that fall due from one daemon thread, started with the first item
(again after a fork, which copies no thread) and asleep while nothing is due.  The limiter's slot leases and
the analyst's batch leases each have one.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Renewals(Generic[K, V]):
    """``renew(due)`` gets the held ``(key, value)`` pairs that fell due and returns the keys that are no longer
    alive (ended, expired, taken over): they are renewed no more, and ``on_lost`` hears of those still held
    when the answer came (not those dropped meanwhile).  ``renew`` runs outside the lock, so a slow store
    never holds up ``hold`` and ``drop``; it handles its own errors (a failed round only shortens leases)."""

    def __init__(
        self,
        name: str,
        renew: Callable[[list[tuple[K, V]]], Iterable[K]],
        on_lost: Callable[[list[tuple[K, V]]], None] | None = None,
    ) -> None:
        self._name, self._renew, self._on_lost = name, renew, on_lost
        self._lock = threading.Condition()
        #: key -> (value, seconds between renewals, when the next one is due on the monotonic clock)
        self._held: dict[K, tuple[V, float, float]] = {}
        #: until when the thread sleeps (inf: until woken); None while it is awake and will look again anyway
        self._asleep_until: float | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0

    def hold(self, key: K, value: V, every: float) -> None:
        with self._lock:
            due = time.monotonic() + every
            self._held[key] = (value, every, due)
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()
                self._asleep_until = None
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            elif self._asleep_until is not None and due < self._asleep_until:
                self._lock.notify()  # only when it would sleep past this item's renewal

    def drop(self, key: K) -> None:
        """Renew ``key`` no more: a renewal already under way may still push it once."""
        with self._lock:
            self._held.pop(key, None)

    @contextlib.contextmanager
    def held(self, key: K, value: V, every: float) -> Iterator[None]:
        self.hold(key, value, every)
        try:
            yield
        finally:
            self.drop(key)

    def _run(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                due = [(key, value) for key, (value, _, at) in self._held.items() if at <= now]
                if not due:
                    nxt = min((at for _, _, at in self._held.values()), default=None)
                    self._asleep_until = math.inf if nxt is None else nxt
                    self._lock.wait(None if nxt is None else nxt - now)
                    self._asleep_until = None
                    continue
                for key, value in due:
                    every = self._held[key][1]
                    self._held[key] = (value, every, now + every)
            lost = set(self._renew(due))
            if not lost:
                continue
            with self._lock:
                gone = [(key, value) for key, value in due if key in lost and self._held.pop(key, None) is not None]
            if gone and self._on_lost is not None:
                self._on_lost(gone)
