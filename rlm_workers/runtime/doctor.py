"""`rlm doctor`: check every dependency of a deployment and say what is wrong in plain words.

Each check returns a ``Check``; none raises, so one broken piece never hides
the state of the others.  Checks only read: nothing is created or migrated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx
import psycopg
import redis
from kombu.transport.redis import PRIORITY_STEPS, Channel

from ..config import Settings
from ..constants import ALL_QUEUES
from ..errors import ConfigError
from ..ingest.embed import CUDA_RUNTIME, gpu_driver_present, resolve_runtime
from ..limits import DOCTOR_QUEUE_SCAN
from ..store import migrations
from .local_llm import server_status, status_line

if TYPE_CHECKING:
    from celery import Celery


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    #: a warning does not fail the doctor (e.g. no worker on the ingest queue)
    warning: bool = False


def check_database(settings: Settings, url: str) -> list[Check]:
    try:
        conn = psycopg.connect(url, connect_timeout=5, autocommit=True)
    except psycopg.OperationalError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return [Check("database", False, f"cannot connect: {first}")]
    with conn:
        out = [Check("database", True, f"PostgreSQL {migrations.server_version(conn)} at {_host(url)}")]
        installed = migrations.vector_installed(conn)
        if installed:
            out.append(Check("pgvector", True, f"vector {installed} installed"))
        elif migrations.vector_available(conn):
            out.append(Check("pgvector", True, "available; created on first use", warning=True))
        else:
            out.append(
                Check(
                    "pgvector",
                    False,
                    "the server has no pgvector: use the pgvector/pgvector image, "
                    "install postgresql-NN-pgvector, or unset RLM_DATABASE_URL",
                )
            )
        applied = migrations.applied_if_any(conn)
        latest = migrations.MIGRATIONS[-1][0]
        if not applied:
            out.append(Check("schema", True, "empty database; the first rlm command creates the schema", warning=True))
        elif latest in applied:
            out.append(Check("schema", True, f"up to date ({latest})"))
        elif any(a not in {n for n, _ in migrations.MIGRATIONS} for a in applied):
            out.append(
                Check(
                    "schema",
                    False,
                    f"the database is newer ({applied[-1]}) than this rlm ({latest}): "
                    "upgrade rlm-pipeline on this host",
                )
            )
        else:
            out.append(Check("schema", True, f"at {applied[-1]}; {latest} is applied at the next start", warning=True))
    return out


def check_broker(settings: Settings, url: str) -> list[Check]:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
        info = client.info("server")
    except redis.RedisError as exc:
        return [Check("broker", False, f"cannot reach {_host(url)}: {exc}")]
    name = "Valkey" if "valkey_version" in info else "Redis"
    version = info.get("valkey_version") or info.get("redis_version")
    try:
        depth = queue_depths(client)
    except redis.RedisError as exc:
        return [Check("broker", False, f"{name} {version} at {_host(url)} does not list its queues: {exc}")]
    backlog = ", ".join(
        f"{q}={ready}" + (f" (+{delayed} delayed)" if delayed else "") for q, (ready, delayed) in depth.items()
    )
    held = ""
    if any(delayed for _, delayed in depth.values()):
        try:
            held = f"; {describe_delayed(client)}"
        except redis.RedisError:
            pass  # the counts above stand on their own
    return [Check("broker", True, f"{name} {version} at {_host(url)}; queued: {backlog}{held}")]


#: what a delayed task of ours is, for doctor's line: "4 delayed" alone read as four stuck tasks
DELAYED_MEANING = {
    "rlm.watchdog": "job watchdogs, which do nothing once their job has ended",
    "rlm.batch.tick": "batches' next scheduling ticks",
}


def describe_delayed(client) -> str:
    """The delayed messages by task, when they fall due, and why they are no backlog.

    They are tasks sent with a countdown (a job's watchdog, a batch's tick).  A worker holds such a task
    unacknowledged until its time comes and, when it stops (even cleanly), hands it back to the queue: kombu's
    "Restoring N unacknowledged messages".  That is what keeps a watchdog alive across a restart, and why
    delayed messages show up here after `rlm up` or a worker was stopped.
    """
    tasks: dict[str, list[datetime]] = {}
    for q in ALL_QUEUES:
        for key in [q] + [f"{q}{Channel.sep}{p}" for p in PRIORITY_STEPS if p]:
            for raw in client.lrange(key, 0, DOCTOR_QUEUE_SCAN - 1):
                try:
                    headers = json.loads(raw).get("headers", {})
                    eta = datetime.fromisoformat(headers["eta"]) if headers.get("eta") else None
                except (ValueError, AttributeError, TypeError):
                    continue
                if eta is not None:
                    tasks.setdefault(str(headers.get("task")), []).append(eta)
    parts = []
    for task, etas in sorted(tasks.items()):
        first, last = (t.astimezone(UTC).strftime("%Y-%m-%d %H:%M") for t in (min(etas), max(etas)))
        due = f"due {first} UTC" if first == last else f"due {first} to {last} UTC"
        meaning = f"{DELAYED_MEANING[task]}; " if task in DELAYED_MEANING else ""
        parts.append(f"{len(etas)} {task} ({meaning}{due})")
    return (
        "delayed tasks wait for their time, not for a worker, and a stopping worker hands back those it held: "
        + ", ".join(parts)
    )


def queue_depths(client) -> dict[str, tuple[int, int]]:
    """Per queue: messages ready to run, and messages held for a later time (ETA/countdown).

    A watchdog is sent with a countdown and, with no worker to hold it, waits in the queue's list like any
    task (kombu keeps the ETA in the message headers); those are not work waiting for a worker.  kombu
    stores each non-zero priority step in its own list beside the queue's.
    """
    out = {}
    for q in ALL_QUEUES:
        ready = delayed = 0
        for key in [q] + [f"{q}{Channel.sep}{p}" for p in PRIORITY_STEPS if p]:
            n = client.llen(key)
            if not n:
                continue
            seen = client.lrange(key, 0, DOCTOR_QUEUE_SCAN - 1)
            held = 0
            for raw in seen:
                try:
                    held += bool(json.loads(raw).get("headers", {}).get("eta"))
                except (ValueError, AttributeError):
                    pass
            # beyond the scanned head, assume the same share of held messages
            held = held if n <= len(seen) else round(held * n / max(1, len(seen)))
            ready += n - held
            delayed += held
        out[q] = (ready, delayed)
    return out


def check_workers(app: Celery, timeout: float = 2.0, *, required: bool = False) -> list[Check]:
    """Workers per queue.  Missing ones fail only when the deployment is meant to run them (``required``):
    in the one-shot setup (`make demo`, `rlm query` with its ephemeral worker) none run between commands."""
    try:
        replies = app.control.inspect(timeout=timeout).active_queues() or {}
    except Exception as exc:  # reported, not raised
        return [Check("workers", not required, f"cannot ask the workers: {exc}", warning=not required)]
    out = []
    for q in ALL_QUEUES:
        who = sorted(w for w, qs in replies.items() if any(x["name"] == q for x in qs))
        if who:
            out.append(Check(f"queue {q}", True, f"{len(who)} worker(s): {', '.join(who)}"))
        else:
            fails = required and q != "rlm.ingest"
            hint = "start `rlm worker -Q " + q + "` (or `rlm up`)"
            if not required:
                hint += "; fine for one-shot `rlm query`, which runs its own"
            out.append(Check(f"queue {q}", not fails, f"no worker consumes it: {hint}", warning=not fails))
    return out


def check_llm(settings: Settings, timeout: float = 10.0) -> list[Check]:
    if settings.offline:
        why = f" ({settings.local_problem})" if settings.local_problem else ""
        return [
            Check(
                "llm",
                True,
                f"no model: the offline extractive provider answers{why}; set OPENAI_API_KEY (and OPENAI_BASE_URL) "
                "for a hosted model",
                warning=True,
            )
        ]

    key = settings.api_key
    if settings.resolved_provider == "local":
        # only looks: a stopped local model server is reported, not started
        state = server_status(settings.data_dir)
        if state is None or not set(settings.local_models) <= set(state.ports):
            return [Check("llm", True, status_line(settings).removeprefix("llm:").strip(), warning=True)]
        out = []
        for model in settings.local_models:
            try:
                ok = (
                    httpx.get(
                        f"{state.url(model)}/models",
                        headers={"Authorization": f"Bearer {state.api_key}"},
                        timeout=timeout,
                    ).status_code
                    == 200
                )
            except httpx.HTTPError:
                ok = False
            out.append(
                Check(
                    f"llm {model}",
                    ok,
                    f"local model server, {state.url(model)}"
                    + ("" if ok else ": does not answer; `rlm services stop` and try again"),
                )
            )
        return out
    else:
        base = (settings.base_url or "https://api.openai.com/v1").rstrip("/")
    try:
        resp = httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {key}"}, timeout=timeout)
    except httpx.HTTPError as exc:
        return [Check("llm", False, f"cannot reach {base}: {exc}")]
    if resp.status_code in (401, 403):
        return [Check("llm", False, f"{base} refused the API key (HTTP {resp.status_code})")]
    if resp.status_code >= 400:
        return [
            Check(
                "llm",
                True,
                f"{base} answers, but /models gave HTTP {resp.status_code}: model names not verified",
                warning=True,
            )
        ]
    try:
        known = {m.get("id") for m in resp.json().get("data", [])}
    except ValueError:
        known = set()
    out = [Check("llm", True, f"{base} reachable")]
    for role, model in (
        ("planner", settings.primary_model),
        ("analyst", settings.subcall_model),
        ("synthesizer", settings.synthesizer_model),
    ):
        if not known:
            out.append(Check(f"model {role}", True, f"{model} (server lists no models)", warning=True))
        elif model in known:
            out.append(Check(f"model {role}", True, model))
        else:
            out.append(
                Check(
                    f"model {role}",
                    False,
                    f"{model} is not offered by {base}: set "
                    "RLM_" + {"planner": "PRIMARY", "analyst": "SUBCALL"}.get(role, "SYNTHESIZER") + "_MODEL",
                )
            )
    return out


def check_encoder(settings: Settings) -> list[Check]:
    """What an ingest worker on this host encodes with (RLM_EMBEDDING_RUNTIME and RLM_EMBEDDING_DEVICE).

    Torch is imported only where a GPU driver is present (or RLM_EMBEDDING_DEVICE=cuda asks for one)."""
    try:
        runtime = resolve_runtime(settings.embedding_model)
    except ConfigError as exc:
        return [Check("encoder", False, exc.message)]
    if runtime == CUDA_RUNTIME:
        import torch

        return [Check("encoder", True, f"{runtime} on {torch.cuda.get_device_name(0)}")]
    if settings.embedding_device == "cpu":
        where = "the CPU (RLM_EMBEDDING_DEVICE=cpu)"
    elif gpu_driver_present():
        where = "the CPU (a GPU driver is present, but this torch sees no CUDA device: a CPU build of torch?)"
    else:
        where = "the CPU (no GPU on this host)"
    return [Check("encoder", True, f"{runtime} on {where}")]


def _host(url: str) -> str:
    parts = urlsplit(url)
    return parts.hostname or parts.query or url.split("@")[-1]
