"""rlm-pipeline workers: Celery app, pipeline stages, storage, search, LLM providers.

The Celery app is imported lazily so that ``import rlm_workers`` (and so the
``rlm`` CLI) stays fast; ``celery -A rlm_workers worker`` still finds ``app``.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("app", "celery"):
        from .celery_app import app

        return app
    raise AttributeError(name)
