"""The budget of one job tree (a root job and all its children), shared by every worker through Redis.

``--max-llm-calls``, ``--max-tokens``, ``--max-cost`` and ``--deadline`` bound a whole tree
(docs/contract.md#budgets), whose calls run on many workers at once.  So, like the limiter (``limiter.py``),
the count lives in Redis and is checked in one Lua script: ``reserve()`` before every call either counts the
call or raises ``BudgetExhausted``; ``charge()`` after it adds the tokens and cost it used.  The deadline is
read on the Redis server's clock (``TIME``), the one clock every worker shares.

A reservation checks what was spent *before* the call: calls already in flight may carry a tree past
``max_tokens`` or ``max_cost`` by what they use, but no call starts once a limit is reached.  The first limit
hit is kept (``exhausted``) and refuses every later call, so the result names one reason.

If Redis loses the hash (a restart without persistence), the next access re-seeds it from ``seed()``: what
the database recorded so far, so a restart does not hand a tree a fresh budget.  A call whose usage the
database already holds may then be charged twice: a budget errs on the side of stopping.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import constants
from ..errors import BudgetExhausted
from .redis_scripts import LUA_NOW_MS, redis_call

#: one hash per tree: KEY_PREFIX + root_id
KEY_PREFIX = constants.LIMITER_KEY_PREFIX + "budget:"

REASONS = ("deadline", "max_llm_calls", "max_tokens", "max_cost")

_DAY_MS = 86_400_000
#: a tree's hash outlives its jobs by this much at least, so a late retry still sees the spent budget
_MIN_TTL_MS = 7 * _DAY_MS

# Every script starts here.  KEYS[1] the tree's hash; ARGV[1] seed mode: "none" (no seed function), "need"
# (a seed function exists but was not called: answer {2} if the hash is missing, so the database is asked only
# then), "seed" (ARGV[2..4] = calls, tokens, cost_micro to seed a missing hash with; HSETNX, so two workers
# seeding at once agree); ARGV[5] deadline in epoch ms or -1.  Defines key, now, ttl.
_PREAMBLE = (
    LUA_NOW_MS
    + """
local key = KEYS[1]
if redis.call('EXISTS', key) == 0 then
  if ARGV[1] == 'need' then return {2} end
  if ARGV[1] == 'seed' then
    redis.call('HSETNX', key, 'calls', ARGV[2])
    redis.call('HSETNX', key, 'tokens', ARGV[3])
    redis.call('HSETNX', key, 'cost_micro', ARGV[4])
  end
end
local deadline = tonumber(ARGV[5])
local ttl = """
    + str(_MIN_TTL_MS)
    + """
if deadline >= 0 then ttl = math.max(ttl, deadline - now + """
    + str(_DAY_MS)
    + """) end
"""
)

# ARGV[6..8]: max calls, max tokens, max cost_micro (-1: none).
# {0} reserved; {1, reason, calls, tokens, cost_micro} refused; {2} seed needed.
_RESERVE_LUA = (
    _PREAMBLE
    + """
local max_calls, max_tokens, max_cost = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local calls = tonumber(redis.call('HGET', key, 'calls') or '0')
local tokens = tonumber(redis.call('HGET', key, 'tokens') or '0')
local cost = tonumber(redis.call('HGET', key, 'cost_micro') or '0')
local reason = redis.call('HGET', key, 'exhausted')
if not reason then
  if deadline >= 0 and now >= deadline then reason = 'deadline'
  elseif max_calls >= 0 and calls >= max_calls then reason = 'max_llm_calls'
  elseif max_tokens >= 0 and tokens >= max_tokens then reason = 'max_tokens'
  elseif max_cost >= 0 and cost >= max_cost then reason = 'max_cost'
  end
  if reason then redis.call('HSET', key, 'exhausted', reason) end
end
if reason then
  redis.call('PEXPIRE', key, ttl)
  return {1, reason, calls, tokens, cost}
end
redis.call('HINCRBY', key, 'calls', 1)
redis.call('PEXPIRE', key, ttl)
return {0}
"""
)

# ARGV[6..8]: tokens, cost_micro, extra calls.  {0} charged; {2} seed needed.
_CHARGE_LUA = (
    _PREAMBLE
    + """
redis.call('HINCRBY', key, 'tokens', ARGV[6])
redis.call('HINCRBY', key, 'cost_micro', ARGV[7])
redis.call('HINCRBY', key, 'calls', ARGV[8])
redis.call('PEXPIRE', key, ttl)
return {0}
"""
)

# ARGV[6]: reason.  {0} marked (or already exhausted); {2} seed needed.
_MARK_LUA = (
    _PREAMBLE
    + """
redis.call('HSETNX', key, 'exhausted', ARGV[6])
redis.call('PEXPIRE', key, ttl)
return {0}
"""
)


def _micro(usd: float | None) -> int:
    """USD as whole micro-dollars, rounded up (a budget never undercounts); None, NaN or negative count 0."""
    if usd is None or not math.isfinite(usd) or usd <= 0:
        return 0
    # round first: 0.07 * 1e6 is 70000.00000000001, which must not become 70001
    return math.ceil(round(usd * 1e6, 3))


def _usd(micro: float) -> str:
    usd = micro / 1e6
    return f"${usd:.4f}" if usd >= 0.01 else f"${usd:.6f}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class BudgetLimits:
    """A tree's limits; None means no limit of that kind."""

    max_llm_calls: int | None = None
    max_tokens: int | None = None
    #: USD, priced from RLM_PRICES
    max_cost: float | None = None
    #: unix epoch seconds: the root's submission time plus ``deadline``
    deadline_at: float | None = None
    #: the deadline in seconds as the user gave it (reported back by ``as_dict``)
    deadline: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.max_llm_calls, self.max_tokens, self.max_cost, self.deadline_at))

    @classmethod
    def from_options(cls, options: Mapping[str, Any], created_at_epoch: float) -> BudgetLimits:
        """From a query's options (keys max_llm_calls, max_tokens, max_cost, deadline; absent or None: no
        limit); the deadline counts from ``created_at_epoch``, when the root job was submitted."""

        def get(name: str, kind: type) -> Any:
            value = options.get(name)
            return None if value is None else kind(value)

        deadline = get("deadline", float)
        return cls(
            max_llm_calls=get("max_llm_calls", int),
            max_tokens=get("max_tokens", int),
            max_cost=get("max_cost", float),
            deadline_at=None if deadline is None else float(created_at_epoch) + deadline,
            deadline=deadline,
        )

    def as_dict(self) -> dict[str, Any]:
        """The limits as given, for the result's ``budget``."""
        return {
            "max_llm_calls": self.max_llm_calls,
            "max_tokens": self.max_tokens,
            "max_cost": self.max_cost,
            "deadline": self.deadline,
        }


class BudgetLedger:
    """What one tree has spent, in the Redis hash ``KEY_PREFIX + root_id`` (fields calls, tokens, cost_micro,
    exhausted).  Without limits (``not limits.any``) nothing touches Redis.

    ``seed()`` returns (calls, tokens, cost_usd) the database recorded for the tree so far; it is called only
    when the hash is missing."""

    def __init__(
        self,
        redis_client: Any,
        root_id: str,
        limits: BudgetLimits,
        *,
        seed: Callable[[], tuple[int, int, float]] | None = None,
    ) -> None:
        self.redis = redis_client
        self.root_id = str(root_id)
        self.key = KEY_PREFIX + self.root_id
        self.limits = limits
        self._seed = seed
        self._reserve = redis_client.register_script(_RESERVE_LUA)
        self._charge = redis_client.register_script(_CHARGE_LUA)
        self._mark = redis_client.register_script(_MARK_LUA)

    @property
    def _deadline_ms(self) -> int:
        at = self.limits.deadline_at
        return -1 if at is None else int(at * 1000)

    def _run(self, script: Any, args: list[Any]) -> list[Any]:
        mode = "none" if self._seed is None else "need"
        got = redis_call(script, keys=[self.key], args=[mode, 0, 0, 0, self._deadline_ms, *args])
        if int(got[0]) == 2:
            calls, tokens, cost = self._seed()  # type: ignore[misc]  # "need" is only sent with a seed
            seeded = [max(0, int(calls)), max(0, int(tokens)), _micro(cost)]
            got = redis_call(script, keys=[self.key], args=["seed", *seeded, self._deadline_ms, *args])
        return got

    def reserve(self) -> None:
        """Count one LLM call about to start, or raise ``BudgetExhausted`` (and start nothing) when a limit
        is reached: checked atomically across every worker."""
        lim = self.limits
        if not lim.any:
            return
        max_cost = -1 if lim.max_cost is None else round(lim.max_cost * 1e6)
        got = self._run(
            self._reserve,
            [
                -1 if lim.max_llm_calls is None else lim.max_llm_calls,
                -1 if lim.max_tokens is None else lim.max_tokens,
                max_cost,
            ],
        )
        if int(got[0]) == 0:
            return
        reason = _text(got[1])
        calls, tokens, cost = int(got[2]), int(got[3]), int(got[4])
        raise BudgetExhausted(reason, self._detail(reason, calls, tokens, cost))

    def _detail(self, reason: str, calls: int, tokens: int, cost_micro: int) -> str:
        lim = self.limits
        if reason == "deadline":
            return f"the {lim.deadline:g}s deadline passed" if lim.deadline is not None else "the deadline passed"
        if reason == "max_llm_calls":
            return f"{calls} of {lim.max_llm_calls} LLM calls made"
        if reason == "max_tokens":
            return f"{tokens} of {lim.max_tokens} tokens used"
        if reason == "max_cost" and lim.max_cost is not None:
            return f"{_usd(cost_micro)} of {_usd(lim.max_cost * 1e6)} spent"
        return ""

    def charge(self, tokens: int, cost_usd: float | None, extra_calls: int = 0) -> None:
        """Add what a finished call used: its tokens, its cost (rounded up to a micro-dollar; None when the
        model has no price) and ``extra_calls`` HTTP attempts beyond the reserved one (retries are calls)."""
        if not self.limits.any:
            return
        self._run(self._charge, [max(0, int(tokens)), _micro(cost_usd), max(0, int(extra_calls))])

    def mark(self, reason: str) -> None:
        """Record that the tree stopped for ``reason`` without a refused call (say, a stage saw the deadline
        pass); kept only if no reason was recorded before."""
        if reason not in REASONS:
            raise ValueError(f"unknown budget reason {reason!r}; expected one of {', '.join(REASONS)}")
        if not self.limits.any:
            return
        self._run(self._mark, [reason])

    def state(self) -> dict[str, Any]:
        """{"calls", "tokens", "cost_usd", "exhausted"}: spent so far and the first limit hit (None if none)."""
        raw = redis_call(self.redis.hgetall, self.key) if self.limits.any else {}
        fields = {_text(k): _text(v) for k, v in raw.items()}
        return {
            "calls": int(fields.get("calls", 0)),
            "tokens": int(fields.get("tokens", 0)),
            "cost_usd": int(fields.get("cost_micro", 0)) / 1e6,
            "exhausted": fields.get("exhausted"),
        }
