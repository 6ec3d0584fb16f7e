"""Logging: plain text or one JSON object a line, with the job id and stage on every line of a task.

``RLM_LOG_FORMAT=json`` is for log shippers; the job id and stage come from a
context variable set when a task starts (each task runs in its own thread or
process, so the context never leaks between jobs).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import time
from collections.abc import Iterator

from celery import signals

from ..config import get_settings

_context: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("rlm_log_context", default=None)


def set_context(**fields: str) -> contextvars.Token:
    return _context.set({k: v for k, v in fields.items() if v})


def reset_context(token: contextvars.Token) -> None:
    _context.reset(token)


@contextlib.contextmanager
def stage_context(stage: str) -> Iterator[None]:
    """Lines logged inside the block name ``stage``, the rest of the context kept.  One task runs several
    stages in a row (``rlm.plan`` goes on to search and the direct answer), so the task's name alone would tag
    an answer's LLM call as ``plan``."""
    token = _context.set({**(_context.get() or {}), "stage": stage})
    try:
        yield
    finally:
        _context.reset(token)


class ContextFilter(logging.Filter):
    """Copies the current job id / stage / task id onto every record (empty outside a task)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _context.get() or {}
        record.job_id = ctx.get("job_id", "")
        record.stage = ctx.get("stage", "")
        record.task_id = ctx.get("task_id", "")
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "job_id": getattr(record, "job_id", "") or None,
            "stage": getattr(record, "stage", "") or None,
            "task_id": getattr(record, "task_id", "") or None,
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(job_id)s %(stage)s] %(message)s"


def configure_logging(*, fmt: str = "text", level: str | int = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level if isinstance(level, int) else level.upper())


def connect_logging_signals() -> None:
    """Own the worker's logging and tag every task's lines with its job and stage."""

    @signals.setup_logging.connect(weak=False)
    def _setup(loglevel=None, **_kw) -> None:
        s = get_settings()
        configure_logging(fmt=s.log_format, level=loglevel or s.log_level)

    tokens: dict[str, contextvars.Token] = {}

    @signals.task_prerun.connect(weak=False)
    def _start(task_id=None, task=None, args=None, **_kw) -> None:
        name = getattr(task, "name", "") or ""
        job = str(args[0]) if args and name.startswith("rlm.") else ""
        tokens[task_id] = set_context(job_id=job, stage=name.removeprefix("rlm."), task_id=task_id or "")

    @signals.task_postrun.connect(weak=False)
    def _end(task_id=None, **_kw) -> None:
        token = tokens.pop(task_id, None)
        if token is not None:
            try:
                reset_context(token)
            except ValueError:
                pass  # set in another context (a pool quirk): the next task overwrites it anyway
