"""The Celery app: queues, routes and the reliability settings of docs/contract.md#celery-conventions.

Configuration is applied lazily (``on_configure``) so importing this module
starts no server: the broker URL may name the embedded Valkey, which is only
started when a worker or a submitting client first needs it.  Workers run
``app``; everything that sends a task or asks the workers something goes
through ``get_app()`` (docs/architecture.md#resources).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from celery import Celery, signals
from celery.exceptions import TaskRevokedError
from kombu import Exchange, Queue

from .config import Settings, get_settings, share_cores
from .constants import ALL_QUEUES, QUEUE_ANALYST, QUEUE_CONTROL, QUEUE_INGEST
from .runtime.broker import transport_for
from .runtime.local_servers import broker_url, result_backend_url
from .runtime.logs import connect_logging_signals

#: what a worker imports when it starts: the thin task adapters, by area (the logic they call lives in pipeline/,
#: overnight/ and ingest/), and the reconciler, whose signals run its sweep beside every worker
WORKER_MODULES = [
    "rlm_workers.tasks.pipeline",
    "rlm_workers.tasks.overnight",
    "rlm_workers.tasks.ingest",
    "rlm_workers.pipeline.reconcile",
]


def celery_config(settings: Settings) -> dict:
    broker = broker_url(settings)
    backend = result_backend_url(settings) if settings.result_backend else broker
    transport = {"visibility_timeout": settings.visibility_timeout}
    return {
        "broker_url": broker,
        "result_backend": backend,
        # The same visibility timeout on both sides, above the longest task (celery docs, Redis caveats).
        "broker_transport_options": transport,
        "result_backend_transport_options": transport,
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_deduplicate_successful_tasks": True,
        # Job state lives in PostgreSQL: a STARTED state in the result backend would cost every task a
        # SET and a PUBLISH on the critical path and tell nobody anything (Flower reads task events).
        "task_track_started": False,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "result_expires": 86400,
        "result_extended": False,
        "task_default_queue": QUEUE_CONTROL,
        # Each queue gets its own exchange and key: a bare Queue(name) is bound to the default exchange with
        # the default key, so every queue would receive every task.
        "task_queues": [Queue(q, Exchange(q, type="direct"), routing_key=q) for q in ALL_QUEUES],
        "task_routes": {
            "rlm.analyst": {"queue": QUEUE_ANALYST},
            "rlm.read": {"queue": QUEUE_ANALYST},
            "rlm.subcall": {"queue": QUEUE_ANALYST},
            "rlm.ingest": {"queue": QUEUE_INGEST},
            "rlm.ingest.group": {"queue": QUEUE_INGEST},
            "rlm.embed": {"queue": QUEUE_INGEST},
            "rlm.*": {"queue": QUEUE_CONTROL},
        },
        # a batch job's low priority (set on its first task) carries over to every later stage
        "task_inherit_parent_priority": True,
        "worker_hijack_root_logger": False,
        "worker_soft_shutdown_timeout": 10.0,
        "worker_enable_soft_shutdown_on_idle": True,
    }


class _LazyConfig(Mapping):
    """Celery reads this mapping only when it first needs its configuration: building an app starts nothing,
    and resolving an embedded broker's URL (which starts it) waits until a task is sent or a worker runs."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings
        self._data: dict | None = None

    def _load(self) -> dict:
        if self._data is None:
            if self.settings is None:
                self.settings = get_settings()
            self._data = celery_config(self.settings)
        return self._data

    def __getitem__(self, key: str):
        return self._load()[key]

    def __iter__(self):
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())


def build_app(settings: Settings | None = None) -> Celery:
    """A new app with rlm's tasks, queues and routes, configured from ``settings`` (default: the process's
    settings as they are when Celery first reads its configuration)."""
    return _new_app(_LazyConfig(settings))


def _new_app(config: _LazyConfig) -> Celery:
    new = Celery("rlm_workers", include=WORKER_MODULES, set_as_current=False)
    new.config_from_object(config)
    return new


_APP_CONFIG = _LazyConfig()
#: The workers' app: ``celery -A rlm_workers.celery_app``, ``rlm worker`` and Flower run it.  Code that sends
#: tasks or inspects workers asks ``get_app()``, which is this app unless the settings were switched since.
app = _new_app(_APP_CONFIG)


def _celery_key(settings: Settings) -> tuple:
    """What ``celery_config`` reads from the settings: another value needs another app."""
    return (settings.broker_url, settings.result_backend, settings.visibility_timeout, settings.data_dir)


_switch_lock = threading.Lock()
_switched: tuple[tuple, Celery] | None = None


def get_app() -> Celery:
    """The app this process sends tasks and inspects workers with.

    ``app`` while the settings still name what it was configured from.  A process whose settings were switched
    (``reset_settings()`` after tests or benchmarks point the environment at another broker) gets an app built
    from the new settings: Celery keeps an app's configuration and its worker's queue selection for the app's
    life, so a new app is how to reach another broker without touching Celery's internals.
    """
    global _switched
    settings = get_settings()
    key = _celery_key(settings)
    configured = _APP_CONFIG.settings
    if configured is None or _celery_key(configured) == key:
        return app
    with _switch_lock:
        if _switched is None or _switched[0] != key:
            _switched = (key, build_app(settings))
        return _switched[1]


def _connect_worker_signals() -> None:
    @signals.celeryd_init.connect(weak=False)
    def _reconnecting_transport(conf: Any = None, **_kw: object) -> None:  # celery's untyped Settings
        """A worker consumes through ``broker.Transport``, which survives the broker going away under it.  Only
        workers: clients and Flower keep the URL's own transport, whose name Flower reads to find the broker."""
        if conf is not None and not conf.broker_transport:
            conf.broker_transport = transport_for(conf.broker_url)

    @signals.celeryd_after_setup.connect(weak=False)
    def _share_cores(instance: object = None, **_kw: object) -> None:
        """Prefork children encode side by side: each gets its share of the cores for its encoder threads, so
        ``-c N`` does not start N × cores threads (docs/architecture.md#encoder-runtimes).  Runs before the fork,
        so the children inherit it.  The settings and the app are left as they are: the worker has already
        chosen its queues (-Q) on this app."""
        procs = int(getattr(instance, "concurrency", 1) or 1)
        pool = str(getattr(instance, "pool_cls", ""))
        if "prefork" in pool.lower():
            share_cores(procs)


class _CancelIsNotAnError(logging.Filter):
    """A user's cancel revokes a job's analyst tasks, so its chord ends in ``ChordError(TaskRevokedError)``,
    which Celery logs as an ERROR with a traceback.  A cancel is not an error: one INFO line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or type(exc).__name__ != "ChordError" or not _revoked(exc):
            return True
        group = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.msg, record.args = "chord %s ended early: a task of it was revoked (job cancelled)", (group,)
        record.exc_info, record.exc_text = None, None
        return True


def _revoked(exc: BaseException) -> bool:
    return isinstance(exc.__cause__, TaskRevokedError) or "TaskRevokedError" in str(exc)


for _name in ("celery.backends.redis", "celery.backends.base"):
    logging.getLogger(_name).addFilter(_CancelIsNotAnError())


# Signals only (cheap): JSON or text logs with job id and stage, configured when a worker starts.
connect_logging_signals()
_connect_worker_signals()
