"""`rlm doctor`: check every dependency of a deployment and say what is wrong in plain words.

Each check returns a ``Check``; none raises, so one broken piece never hides
the state of the others.  Checks only read: nothing is created or migrated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import Settings
from .constants import ALL_QUEUES

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
    import psycopg

    from .store import migrations

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
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
        info = client.info("server")
    except redis.RedisError as exc:
        return [Check("broker", False, f"cannot reach {_host(url)}: {exc}")]
    name = "Valkey" if "valkey_version" in info else "Redis"
    version = info.get("valkey_version") or info.get("redis_version")
    depth = {q: client.llen(q) for q in ALL_QUEUES}
    backlog = ", ".join(f"{q}={n}" for q, n in depth.items())
    return [Check("broker", True, f"{name} {version} at {_host(url)}; queued: {backlog}")]


def check_workers(app: Celery, timeout: float = 2.0) -> list[Check]:
    try:
        replies = app.control.inspect(timeout=timeout).active_queues() or {}
    except Exception as exc:  # reported, not raised
        return [Check("workers", False, f"cannot ask the workers: {exc}")]
    out = []
    for q in ALL_QUEUES:
        who = sorted(w for w, qs in replies.items() if any(x["name"] == q for x in qs))
        if who:
            out.append(Check(f"queue {q}", True, f"{len(who)} worker(s): {', '.join(who)}"))
        else:
            needed = q != "rlm.ingest"
            hint = "start `rlm worker -Q " + q + "` (or `rlm up`)"
            out.append(Check(f"queue {q}", not needed, f"no worker consumes it: {hint}", warning=not needed))
    return out


def check_llm(settings: Settings, timeout: float = 10.0) -> list[Check]:
    if settings.offline:
        return [
            Check(
                "llm",
                True,
                "no API key: the offline extractive provider answers (set OPENAI_API_KEY "
                "and OPENAI_BASE_URL for a model)",
                warning=True,
            )
        ]
    import httpx

    base = (settings.base_url or "https://api.openai.com/v1").rstrip("/")
    try:
        resp = httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {settings.api_key}"}, timeout=timeout)
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


def _host(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.hostname or parts.query or url.split("@")[-1]
