"""Put variables into this process's environment for a while, then restore exactly what was there."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def patched_env(extra: Mapping[str, str]) -> Iterator[None]:
    """Settings are re-read on entry and on exit, so no test sees another module's configuration."""
    from rlm_workers.config import reset_settings

    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    reset_settings()
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reset_settings()
