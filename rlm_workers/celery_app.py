"""The Celery app: queues, routes and the reliability settings of DESIGN §9.

Configuration is applied lazily (``on_configure``) so importing this module
starts no server: the broker URL may name the embedded Valkey, which is only
started when a worker or a submitting client first needs it.
"""

from __future__ import annotations

from collections.abc import Mapping

from celery import Celery
from kombu import Queue

from .constants import QUEUE_ANALYST, QUEUE_CONTROL, QUEUE_INGEST

TASK_MODULES = [
    "rlm_workers.tasks.plan",
    "rlm_workers.tasks.search",
    "rlm_workers.tasks.fanout",
    "rlm_workers.tasks.analyst",
    "rlm_workers.tasks.collect",
    "rlm_workers.tasks.synthesize",
    "rlm_workers.tasks.salvage",
]

app = Celery("rlm_workers", include=TASK_MODULES, set_as_current=False)


def celery_config(settings) -> dict:  # noqa: ANN001 - Settings
    from .services import broker_url, result_backend_url

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
        "task_track_started": True,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "result_expires": 86400,
        "result_extended": False,
        "task_default_queue": QUEUE_CONTROL,
        "task_queues": [Queue(QUEUE_CONTROL), Queue(QUEUE_ANALYST), Queue(QUEUE_INGEST)],
        "task_routes": {
            "rlm.analyst": {"queue": QUEUE_ANALYST},
            "rlm.ingest": {"queue": QUEUE_INGEST},
            "rlm.embed": {"queue": QUEUE_INGEST},
            "rlm.*": {"queue": QUEUE_CONTROL},
        },
        "worker_hijack_root_logger": False,
        "worker_soft_shutdown_timeout": 10.0,
        "worker_enable_soft_shutdown_on_idle": True,
    }


class _LazyConfig(Mapping):
    """Celery reads this mapping only when it first needs its configuration."""

    def __init__(self) -> None:
        self._data: dict | None = None

    def _load(self) -> dict:
        if self._data is None:
            from .config import get_settings

            self._data = celery_config(get_settings())
        return self._data

    def __getitem__(self, key: str):  # noqa: ANN204
        return self._load()[key]

    def __iter__(self):  # noqa: ANN204
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())


app.config_from_object(_LazyConfig())
