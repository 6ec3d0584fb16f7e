"""Overnight reads through the OpenAI Batch API (docs/contract.md#llm-batch-api).

An overnight batch submitted with ``--llm-batch`` creates its reads ``queued`` instead of sending them.
``advance``, run by the batch's tick once its transaction committed, then:

1. polls the batch's open provider batches, at most every ``RLM_LLM_BATCH_POLL_SECONDS``; once one is
   terminal, routes each line back to its read: an answer (status 200) is applied like an ordinary reply but
   priced at the Batch API discount; an error line, or no line at all (the batch expired, failed or was
   cancelled), sends the read as an ordinary call;
2. submits the queued reads, at most ``RLM_LLM_BATCH_MAX_REQUESTS`` per file, custom_id ``read-<id>``;
3. marks the jobs of reads still queued or submitted alive, so neither the reconciler nor the tick's stall
   check takes them for lost while the provider works (their items stay running, so the overnight batch
   cannot finish meanwhile).

Cancelling the overnight batch cancels its provider batches still running and closes their reads
(``cancel_open``, run by the first tick after the cancel).

One advance at a time per overnight batch (a session advisory lock: a second one returns at once). A provider
batch is recorded in the same transaction that marks its reads submitted, after the provider accepted it; a
crash in between leaves a batch we never recorded, tagged with metadata ``rlm_overnight``: the next advance
finds it among the account's newest batches and adopts it (its reads, still queued, go into it) instead of
sending them again.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import TYPE_CHECKING

from ..config import Settings, get_settings
from ..errors import LLMError
from ..pipeline import reads as read_stage
from ..store import provider_batches as store
from ..store import reads as read_store
from ..store.db import connection, release_session_lock, session_lock_key, try_session_lock

if TYPE_CHECKING:
    import psycopg

    from ..llm.batch_api import BatchClient, BatchState

log = logging.getLogger("rlm.overnight")

_LOCK_SPACE = 0x524C4D42  # "RLMB": one overnight batch's Batch API work
METADATA_KEY = "rlm_overnight"
CUSTOM_PREFIX = "read-"
#: input files submitted per advance: the rest waits for the next tick
MAX_FILES_PER_ADVANCE = 4
#: how many of the account's newest batches are searched for one we created but never recorded
ADOPT_WINDOW = 100


# seams: tests stand fakes in for the reads (pipeline/reads.py applies every answered line, and so accounts it)
def _reads() -> ModuleType:
    return read_stage


def _read_store() -> ModuleType:
    return read_store


def advance(overnight_batch_id: str, settings: Settings | None = None) -> list[str]:
    """Poll, route and submit the Batch API work of one overnight batch; one line per action, each logged.

    A provider error is logged and left for the next tick (a retryable one) or sends the reads concerned as
    ordinary calls (one that waiting will not fix); a database outage is raised.
    """
    settings = settings or get_settings()
    actions: list[str] = []
    with connection(settings) as conn:
        key = session_lock_key(_LOCK_SPACE, overnight_batch_id)
        if not try_session_lock(conn, key):
            return actions  # another advance of this batch is at it
        try:
            head = store.overnight_of(conn, overnight_id=overnight_batch_id)
            if head is None:
                return actions
            tenant = head[0]
            # alive first: building the client (its first import) and the provider's replies take seconds on a
            # busy machine, and a worker that just came back must not let the reconciler take the jobs for lost
            store.touch_waiting_jobs(conn, overnight_id=overnight_batch_id)
            client = _client(settings)
            _poll(conn, client, overnight_batch_id, settings, actions)
            _submit(conn, client, overnight_batch_id, tenant, settings, actions)
            store.touch_waiting_jobs(conn, overnight_id=overnight_batch_id)  # and the jobs of reads just submitted
        finally:
            release_session_lock(conn, key)
    for line in actions:
        log.info("llm batch: %s", line)
    return actions


def _client(settings: Settings) -> BatchClient:
    # the Batch API client is built on the openai package, a heavy edge: the scheduler, and through it
    # `rlm batch submit` and `cancel`, load it only when a batch goes to a provider
    from ..llm.batch_api import BatchClient

    return BatchClient(settings)


def cancel_open(overnight_batch_id: str, settings: Settings | None = None) -> list[str] | None:
    """The overnight batch was cancelled: cancel its provider batches still running (lines not run yet are not
    billed) and close their reads.  Best effort per provider batch: one the provider will not cancel now is
    closed here all the same (nothing would read its answers), and said so.  One line per action, logged;
    None when an advance holds the batch (the caller comes back later)."""
    settings = settings or get_settings()
    actions: list[str] = []
    why = {"type": "cancelled", "message": f"batch {overnight_batch_id} was cancelled"}
    with connection(settings) as conn:
        key = session_lock_key(_LOCK_SPACE, overnight_batch_id)
        if not try_session_lock(conn, key):
            return None
        try:
            open_ids = store.open_ids(conn, overnight_id=overnight_batch_id)
            if open_ids:  # a client needs an API key: none is made for a batch with nothing at the provider
                client = _client(settings)
                for pb in open_ids:
                    try:
                        state = client.cancel(pb)
                        status, note = state.status, ""
                    except LLMError as exc:
                        status, note = "cancel_failed", f" (the provider said: {exc.message})"
                    closed = store.close_cancelled(conn, provider_batch_id=pb, status=status, error=why)
                    actions.append(
                        f"batch {overnight_batch_id}: provider batch {pb} {status}{note}; {closed} reads closed"
                    )
            queued = store.close_queued_reads(conn, overnight_id=overnight_batch_id, error=why)
            if queued:
                actions.append(f"batch {overnight_batch_id}: {queued} reads not yet sent to the provider closed")
        finally:
            release_session_lock(conn, key)
    for line in actions:
        log.info("llm batch: %s", line)
    return actions


# --------------------------------------------------------------------------- polling and routing


def _poll(
    conn: psycopg.Connection, client: BatchClient, overnight_batch_id: str, settings: Settings, actions: list[str]
) -> None:
    for pb in store.claim_due(conn, overnight_id=overnight_batch_id, poll_seconds=settings.llm_batch_poll_seconds):
        try:
            state = client.retrieve(pb.id)
        except LLMError as exc:
            if exc.retryable:
                actions.append(
                    f"batch {overnight_batch_id}: provider batch {pb.id} not readable now ({exc.message}); next poll"
                )
                continue
            # the provider no longer knows it: nothing will come back, every read falls back
            actions.append(f"batch {overnight_batch_id}: provider batch {pb.id} is gone ({exc.message})")
            _route(
                conn, client, overnight_batch_id, pb.id, None, actions, error={"type": "gone", "message": exc.message}
            )
            continue
        if not state.terminal:
            if state.status != pb.status:
                store.mark_checked(
                    conn, provider_batch_id=pb.id, status=state.status, output_file_id=None, error_file_id=None
                )
                actions.append(f"batch {overnight_batch_id}: provider batch {pb.id} {state.status} {_counts(state)}")
            continue
        store.mark_checked(
            conn,
            provider_batch_id=pb.id,
            status=state.status,
            output_file_id=state.output_file_id,
            error_file_id=state.error_file_id,
        )
        error = None
        if state.status != "completed":
            error = {"type": state.status, "message": state.error or f"the provider batch ended {state.status}"}
        _route(conn, client, overnight_batch_id, pb.id, state, actions, error=error, settings=settings)


def _route(
    conn: psycopg.Connection,
    client: BatchClient,
    overnight_batch_id: str,
    provider_batch_id: str,
    state: BatchState | None,
    actions: list[str],
    *,
    error: dict[str, str] | None,
    settings: Settings | None = None,
) -> None:
    lines = {}
    if state is not None:
        try:
            lines = client.results(state, (settings or client.settings).subcall_model)
        except LLMError as exc:
            if exc.retryable:  # the answers exist: fetch them at the next poll rather than pay again
                actions.append(
                    f"batch {overnight_batch_id}: results of {provider_batch_id} not readable now ({exc.message})"
                )
                return
            actions.append(f"batch {overnight_batch_id}: results of {provider_batch_id} unreadable ({exc.message})")
    reads = _reads()
    applied = fallen_back = 0
    # Only reads still submitted to this batch: a route cut short by a crash resumes without doing a read twice.
    for read_id, status in _read_store().reads_of_provider_batch(conn, provider_batch_id=provider_batch_id):
        if status != "submitted":
            continue
        line = lines.get(f"{CUSTOM_PREFIX}{read_id}")
        if line is not None and line.completion is not None:
            reads.apply_completion(read_id, line.completion, via="batch_api")
            applied += 1
        else:
            why = line.error if line is not None else "no answer in the provider batch"
            log.warning("batch %s: read %d falls back to an ordinary call: %s", overnight_batch_id, read_id, why)
            reads.send_read(read_id)
            fallen_back += 1
    store.mark_routed(conn, provider_batch_id=provider_batch_id, error=error)
    ended = state.status if state is not None else "gone"
    actions.append(
        f"batch {overnight_batch_id}: provider batch {provider_batch_id} {ended}: {applied} reads answered, "
        f"{fallen_back} sent as ordinary calls"
    )


def _counts(state: BatchState) -> str:
    c = state.counts
    return f"({c.get('completed', 0)}+{c.get('failed', 0)} failed of {c.get('total', 0)})"


# --------------------------------------------------------------------------- submitting


def _submit(
    conn: psycopg.Connection,
    client: BatchClient,
    overnight_batch_id: str,
    tenant: str,
    settings: Settings,
    actions: list[str],
) -> None:
    rs = _read_store()
    adopted = False
    for _ in range(MAX_FILES_PER_ADVANCE):
        read_ids = rs.queued_reads(conn, overnight_id=overnight_batch_id, limit=settings.llm_batch_max_requests)
        if not read_ids:
            return
        if not adopted:
            adopted = True
            if _adopt(conn, client, overnight_batch_id, tenant, actions):
                continue  # some queued reads were in it: look again
        lines, done = [], []
        for read_id in read_ids:
            request = _reads().request_for(conn, read_id)
            if request is None:
                done.append(read_id)
            else:
                lines.append(client.line(f"{CUSTOM_PREFIX}{read_id}", request))
        if done:
            store.close_reads(conn, read_ids=done)
            actions.append(f"batch {overnight_batch_id}: {len(done)} queued reads had nothing left to ask")
        if not lines:
            continue
        ids = [int(line["custom_id"][len(CUSTOM_PREFIX) :]) for line in lines]
        try:
            state = client.submit(lines, metadata={METADATA_KEY: overnight_batch_id})
        except LLMError as exc:
            if exc.retryable:
                actions.append(f"batch {overnight_batch_id}: {len(ids)} reads not submitted ({exc.message}); next tick")
                return
            # the endpoint cannot take batches (no Batch API behind OPENAI_BASE_URL): ordinary calls instead
            for read_id in ids:
                _reads().send_read(read_id)
            actions.append(
                f"batch {overnight_batch_id}: Batch API refused ({exc.message}); "
                f"{len(ids)} reads sent as ordinary calls"
            )
            continue
        _record(conn, state.id, tenant, overnight_batch_id, state.input_file_id, state.status, ids)
        actions.append(f"batch {overnight_batch_id}: {len(ids)} reads submitted in provider batch {state.id}")


def _record(
    conn: psycopg.Connection,
    provider_batch_id: str,
    tenant: str,
    overnight_batch_id: str,
    input_file_id: str,
    status: str,
    read_ids: list[int],
) -> None:
    with conn.transaction():
        store.insert(
            conn,
            provider_batch_id=provider_batch_id,
            tenant=tenant,
            overnight_id=overnight_batch_id,
            input_file_id=input_file_id,
            status=status,
            requests=len(read_ids),
        )
        _read_store().mark_submitted(conn, read_ids=read_ids, provider_batch_id=provider_batch_id)


def _adopt(
    conn: psycopg.Connection, client: BatchClient, overnight_batch_id: str, tenant: str, actions: list[str]
) -> bool:
    """Record the provider batches of this overnight batch that a crash kept us from recording; True if one
    took some queued reads."""
    try:
        mine = [s for s in client.recent(ADOPT_WINDOW) if s.metadata.get(METADATA_KEY) == overnight_batch_id]
        orphans = [s for s in mine if s.id not in store.known(conn, ids=[s.id for s in mine])]
        took = False
        for s in orphans:
            custom = [c for c in client.custom_ids(s.input_file_id) if c.startswith(CUSTOM_PREFIX)]
            ids = store.still_queued(conn, read_ids=[int(c[len(CUSTOM_PREFIX) :]) for c in custom])
            # reads it holds that are no longer queued were sent again meanwhile: their lines are never routed
            _record(conn, s.id, tenant, overnight_batch_id, s.input_file_id, s.status, ids)
            actions.append(
                f"batch {overnight_batch_id}: adopted provider batch {s.id} left unrecorded ({len(ids)} reads)"
            )
            took = took or bool(ids)
        return took
    except LLMError as exc:  # listing is a safeguard: without it we may pay a rare duplicate, never lose work
        actions.append(f"batch {overnight_batch_id}: could not list provider batches to adopt ({exc.message})")
        return False
