"""What the Redis-backed LLM controls share: the server's clock inside a Lua script, and one way to call Redis.

The limiter (``limiter.py``) and the tree budgets (``budget.py``) both keep their state in Redis and decide in
Lua scripts, on the Redis server's clock (``TIME``), the one clock every worker on every host shares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis

from ..errors import ServiceUnavailable

#: the start of a script that needs the time: defines ``now``, the server's clock in epoch ms.  Effects replication
#: must be on before TIME is followed by writes on old Redis (<5); newer servers ignore it, and pcall keeps servers
#: without it happy.
LUA_NOW_MS = """
if redis.replicate_commands then pcall(redis.replicate_commands) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""


def redis_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, a Redis command or script; Redis out of reach is a ``ServiceUnavailable``."""
    try:
        return fn(*args, **kwargs)
    except redis.RedisError as exc:
        raise ServiceUnavailable(f"LLM limiter cannot reach Redis: {exc}") from exc
