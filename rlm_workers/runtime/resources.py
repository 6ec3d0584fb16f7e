"""What a process builds once and shares between its tasks: the Redis client and the LLM provider.

Built on first use (importing this starts nothing), one per process.  ``reset()``
drops them so the next use rebuilds from the current settings — ``reset_settings``
calls it, so a test that switches brokers or models never talks to the old ones.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import redis

from ..config import get_settings, on_settings_reset
from ..llm.registry import build_provider
from .local_servers import broker_url

if TYPE_CHECKING:
    from ..llm.protocol import LLMProvider

_lock = threading.RLock()  # re-entrant: building the provider builds the Redis client
_built: dict[str, Any] = {}


def _get(name: str, build: Any) -> Any:
    value = _built.get(name)
    if value is None:
        with _lock:
            value = _built.get(name)
            if value is None:
                value = _built[name] = build()
    return value


def redis_client() -> Any:
    """The process's Redis client (the broker's server): limiter leases, locks, the broker epoch."""

    def build() -> Any:
        return redis.Redis.from_url(broker_url(get_settings()), socket_timeout=10, health_check_interval=30)

    return _get("redis", build)


def provider() -> LLMProvider:
    """The process's LLM provider, chosen by the registry from the settings."""

    def build() -> LLMProvider:
        return build_provider(get_settings(), redis_client)

    return _get("provider", build)


def reset() -> None:
    with _lock:
        _built.clear()


on_settings_reset(reset)
