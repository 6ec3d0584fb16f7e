"""The loader's database writes, in order, on one thread that owns the connection — so the main thread chunks
and encodes while COPY and the server's HNSW inserts run — and sequence ids reserved in blocks for it.  Shared by
a whole load (``loader``) and a file group of a split upload (``groups``)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..store import buffers as store

if TYPE_CHECKING:
    import psycopg


class Writer:
    """Runs database writes in order on one thread that owns the connection."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn
        self.q: queue.Queue[Callable[[], object] | None] = queue.Queue(maxsize=8)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="rlm-load-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.q.get()
            if job is None:
                return
            if self.error is None:
                try:
                    job()
                except BaseException as exc:  # re-raised on the main thread
                    self.error = exc

    def submit(self, job: Callable[[], object]) -> None:
        self.raise_error()
        self.q.put(job)

    def close(self) -> None:
        self.q.put(None)
        self.thread.join()
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


class IdBlocks:
    """Sequence values reserved in blocks, so the main thread never waits on the writer for an id."""

    def __init__(self, writer: Writer, sequence: str, block: int) -> None:
        self.writer, self.sequence, self.block = writer, sequence, block
        self.free: list[int] = []

    def take(self, n: int) -> list[int]:
        if len(self.free) < n:
            self.free.extend(self._reserve(max(self.block, n - len(self.free))))
        out, self.free = self.free[:n], self.free[n:]
        return out

    def _reserve(self, want: int) -> list[int]:
        got: list[int] = []
        done = threading.Event()

        def job() -> None:
            got.extend(store.reserve_ids(self.writer.conn, sequence=self.sequence, n=want))
            done.set()

        self.writer.submit(job)
        while not done.wait(0.05):
            self.writer.raise_error()
        return got
