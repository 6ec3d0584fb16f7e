"""Vectors this process already computed, by encoder and text, the least recently used dropped first.

The offline provider ranks a buffer's passages by meaning for every question asked over it: a chat's next turn, a
thinking round, each ``--scope all`` read of the same logs bring the same passages back, and encoding them is most
of its CPU on a small machine.  The loader keeps one per encoder for the windows it stores, so a long-lived process
that loads a text again encodes only what it has not seen (ingest/loader.py).  A vector is 1.5 KB, so tens of
thousands cost tens of megabytes; keys are digests, so a memo's size does not grow with the length of what it keeps.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["VectorMemo"]


class VectorMemo:
    """At most ``capacity`` vectors; thread-safe (a threads-pool worker runs several stages at once)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._vectors: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._vectors)

    def encode(self, encoder: str, texts: Sequence[str], compute: Callable[[list[str]], np.ndarray]) -> np.ndarray:
        """The vectors of ``texts`` (one row each, in order); ``compute`` encodes only the ones not kept.
        ``encoder`` names what computed them (model and runtime): another encoder's vectors are never returned."""
        if not texts:
            return np.asarray(compute([]), dtype=np.float32)
        keys = [_key(encoder, t) for t in texts]
        with self._lock:
            found = {k: v for k in keys if (v := self._vectors.get(k)) is not None}
            for k in found:
                self._vectors.move_to_end(k)
        wanted = {k: t for k, t in zip(keys, texts, strict=True) if k not in found}
        if wanted:
            fresh = np.asarray(compute(list(wanted.values())), dtype=np.float32)
            # each row a copy: a kept view would hold its whole batch's array in memory
            new = {k: row.copy() for k, row in zip(wanted, fresh, strict=True)}
            found.update(new)
            with self._lock:
                self._vectors.update(new)
                while len(self._vectors) > self.capacity:
                    self._vectors.popitem(last=False)
        return np.stack([found[k] for k in keys])


def _key(encoder: str, text: str) -> bytes:
    return hashlib.blake2b(f"{encoder}\x00{text}".encode(errors="surrogatepass"), digest_size=16).digest()
