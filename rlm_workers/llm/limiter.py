"""Global LLM limits shared by every worker process on every host, kept in Redis.

Celery's ``rate_limit`` is per worker (docs/contract.md#limiter), so the ceiling on in-flight
calls (``RLM_MAX_CONCURRENCY``) and the provider's RPM/TPM budget live here:

* ``ConcurrencyLimiter``: a lease-based semaphore.  Each holder owns a member
  of a sorted set scored by its expiry; a worker that dies simply stops
  renewing and its slot comes back after ``lease_seconds``.  The slots are
  shared fairly between the tenants using them (docs/contract.md#fair-share).
* ``RateBudget``: sliding-window request and token budgets.  Tokens are
  charged with an estimate before the call and corrected with real usage.
* ``Limits``: both behind one ``with limits.call(estimate) as record:``.

All clocks are the Redis server's (``TIME`` inside Lua), so hosts with skewed
clocks still agree on when a lease or a window entry expires.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .. import constants
from ..errors import ConfigError, ServiceUnavailable
from ..runtime import metrics
from ..runtime.renewals import Renewals
from .redis_scripts import LUA_NOW_MS, redis_call

if TYPE_CHECKING:
    from ..config import Settings

log = logging.getLogger("rlm.limiter")

# Polling rather than pub/sub wake-ups: a released slot needs no notification
# path that could be lost, and 10-50 ms of jitter spreads contending workers.
_POLL_MIN, _POLL_MAX = 0.010, 0.050
# Within a process a release also wakes one thread waiting on the same key at once, so the waiters of a process
# poll Redis (for slots other processes free) at about this many threads' pace together, not each at the full
# pace: a worker running more threads than slots would otherwise spend its CPU asking Redis.
_POLLERS = 4


class _Waiters:
    """The threads of this process waiting for a slot of one limiter key."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.count = 0


_WAITERS: dict[str, _Waiters] = {}
_WAITERS_LOCK = threading.Lock()


def _waiters(key: str) -> _Waiters:
    with _WAITERS_LOCK:
        return _WAITERS.setdefault(key, _Waiters())


# Fair share (docs/contract.md#fair-share).  Beside the lease zset K, keys in K's cluster slot ("{K}:…"):
#   {K}:t:<tenant>  that tenant's leases (the same members and expiries as in K)
#   {K}:active      tenant -> until when it counts as active (holding, waiting, or with tasks queued)
#   {K}:wait        tenant -> until when it counts as waiting (a refused attempt, a task about to ask)
#   {K}:pend:<t>    the tenant's queued tasks not started yet (a fan-out adds, a starting task takes one off)
# A tenant's share is limit * w / (sum of the active tenants' w), at least 1.  It "crowds" the others when it
# holds its share or more while another active tenant waits below its own share: then it gets no new slot
# (and its queued tasks step aside, llm/fair.py).  Otherwise any free slot is its own: alone, a tenant uses
# the whole limit.  ARGV of every script below starts: limit, lease_ms, tenant, weights JSON.
_FAIR_LUA = """
local key, limit, lease_ms, tenant = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local pre = '{' .. key .. '}:'
local ok_w, weights = pcall(cjson.decode, ARGV[4])
if not ok_w or type(weights) ~= 'table' then weights = {} end
local function weight(t)
  local w = tonumber(weights[t])
  if w and w > 0 then return w end
  return 1
end
local function mark(zkey, t, until_ms, ttl_ms)
  local old = tonumber(redis.call('ZSCORE', zkey, t) or '0')
  if old < until_ms then redis.call('ZADD', zkey, until_ms, t) end
  if redis.call('PTTL', zkey) < ttl_ms then redis.call('PEXPIRE', zkey, ttl_ms) end
end
local function held(t)
  local tk = pre .. 't:' .. t
  redis.call('ZREMRANGEBYSCORE', tk, '-inf', now)
  return redis.call('ZCARD', tk)
end
local function waiting(t)
  if tonumber(redis.call('ZSCORE', pre .. 'wait', t) or '0') > now then return true end
  return tonumber(redis.call('GET', pre .. 'pend:' .. t) or '0') > 0
end
-- whether `tenant` holds its share or more while another active tenant waits below its own
local function crowding()
  redis.call('ZREMRANGEBYSCORE', pre .. 'active', '-inf', now)
  local total_w, others = weight(tenant), {}
  for _, t in ipairs(redis.call('ZRANGE', pre .. 'active', 0, -1)) do
    if t ~= tenant then
      total_w = total_w + weight(t)
      others[#others + 1] = t
    end
  end
  if #others == 0 then return false end
  if held(tenant) < math.max(1, limit * weight(tenant) / total_w) then return false end
  for _, t in ipairs(others) do
    if waiting(t) and held(t) < math.max(1, limit * weight(t) / total_w) then return true end
  end
  return false
end
"""

# KEYS[1] lease zset; ARGV: limit, lease_ms, tenant, weights, lease id, wait_ms.  1 = acquired.
_ACQUIRE_LUA = (
    LUA_NOW_MS
    + _FAIR_LUA
    + """
local wait_ms = tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
if redis.call('ZCARD', key) >= limit or crowding() then
  mark(pre .. 'active', tenant, now + wait_ms, lease_ms * 2)
  mark(pre .. 'wait', tenant, now + wait_ms, lease_ms * 2)
  return 0
end
local tk = pre .. 't:' .. tenant
redis.call('ZADD', key, now + lease_ms, ARGV[5])
redis.call('ZADD', tk, now + lease_ms, ARGV[5])
mark(pre .. 'active', tenant, now + lease_ms, lease_ms * 2)
-- the keys vanish if every holder dies, without shortening live leases
for _, k in ipairs({key, tk}) do
  if redis.call('PTTL', k) < lease_ms * 2 then redis.call('PEXPIRE', k, lease_ms * 2) end
end
return 1
"""
)

# A lease that already expired is not revived: another holder may have its slot.
# KEYS[1] lease zset; ARGV: limit, lease_ms, tenant, weights, lease id.
_RENEW_LUA = (
    LUA_NOW_MS
    + _FAIR_LUA
    + """
local tk = pre .. 't:' .. tenant
local score = redis.call('ZSCORE', key, ARGV[5])
if not score or tonumber(score) <= now then
  redis.call('ZREM', key, ARGV[5])
  redis.call('ZREM', tk, ARGV[5])
  return 0
end
redis.call('ZADD', key, 'XX', now + lease_ms, ARGV[5])
redis.call('ZADD', tk, now + lease_ms, ARGV[5])
mark(pre .. 'active', tenant, now + lease_ms, lease_ms * 2)
for _, k in ipairs({key, tk}) do
  if redis.call('PTTL', k) < lease_ms * 2 then redis.call('PEXPIRE', k, lease_ms * 2) end
end
return 1
"""
)

# KEYS[1] lease zset; ARGV: limit, lease_ms, tenant, weights, lease id.
_RELEASE_LUA = """
redis.call('ZREM', KEYS[1], ARGV[5])
redis.call('ZREM', '{' .. KEYS[1] .. '}:t:' .. ARGV[3], ARGV[5])
return 1
"""

# KEYS[1] lease zset; ARGV: limit, lease_ms, tenant, weights.  1 = the tenant crowds another one out.
_CROWDING_LUA = LUA_NOW_MS + _FAIR_LUA + "return crowding() and 1 or 0\n"

# KEYS[1] lease zset; ARGV: limit, lease_ms, tenant, weights, tasks (+n queued, -1 started), pending_ms, wait_ms,
# and 1 to check crowding first (a task about to start: -1 and nothing counted when its tenant crowds another out).
# A task that starts is about to ask for a slot: it counts as waiting until it does.
_PENDING_LUA = (
    LUA_NOW_MS
    + _FAIR_LUA
    + """
if ARGV[8] == '1' and crowding() then return -1 end
local n, pending_ms, wait_ms = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local pk = pre .. 'pend:' .. tenant
local left = redis.call('INCRBY', pk, n)
if left <= 0 then
  redis.call('DEL', pk)
else
  redis.call('PEXPIRE', pk, pending_ms)
  mark(pre .. 'active', tenant, now + pending_ms, pending_ms)
end
if n < 0 then
  mark(pre .. 'active', tenant, now + wait_ms, lease_ms * 2)
  mark(pre .. 'wait', tenant, now + wait_ms, lease_ms * 2)
end
return math.max(left, 0)
"""
)


#: Short, because the keeper renews live leases every third of it: a dead worker's slots come back
#: within this many seconds instead of blocking every other worker for the length of a call.
LEASE_SECONDS = 20.0
#: How long a refused attempt (or a task about to ask) marks its tenant as waiting: several polls long, so a
#: waiter that keeps polling never drops out, and one that gave up stops holding the others to their share soon.
WAIT_SECONDS = 1.0
#: How long a fan-out's count of queued tasks marks its tenant as waiting with no task of it starting: long
#: enough for tasks queued behind another tenant's to reach a thread, short enough that a lost task does not
#: hold the others to their share for long.
PENDING_SECONDS = 120.0
#: whose call a lease serves when the caller names no tenant (docs/contract.md#fair-share)
DEFAULT_TENANT = "local"


def _owner_tag() -> str:
    # Lease ids say who holds them, so `ZRANGE rlm:limiter:inflight 0 -1` is readable in an incident.
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class Lease:
    id: str
    key: str
    tenant: str = DEFAULT_TENANT
    #: the slot was not free at once: the holder waited for it (and what it checked before may have changed)
    waited: bool = False


def parse_weights(raw: str | None) -> dict[str, float]:
    """``RLM_TENANT_WEIGHTS`` (JSON ``{"tenant": weight}``) as a dict; a tenant not named weighs 1."""
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"invalid setting RLM_TENANT_WEIGHTS: not JSON ({exc.msg})") from None
    bad = not isinstance(value, dict) or any(
        isinstance(w, bool) or not isinstance(w, int | float) or not w > 0 for w in value.values()
    )
    if bad:
        raise ConfigError('invalid setting RLM_TENANT_WEIGHTS: expected {"tenant": weight > 0, ...}')
    return {str(t): float(w) for t, w in value.items()}


class ConcurrencyLimiter:
    """At most ``limit`` leases on ``key`` at once, across every process sharing the Redis, shared between the
    tenants asking for them by ``weights`` (docs/contract.md#fair-share)."""

    def __init__(
        self,
        redis_client: Any,
        *,
        limit: int,
        key: str = constants.LIMITER_KEY_PREFIX + "inflight",
        lease_seconds: float = LEASE_SECONDS,
        weights: dict[str, float] | None = None,
    ) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be > 0")
        if "{" in key or "}" in key:
            raise ValueError("the key must hold no braces: its fair-share keys are tagged with it")
        self.redis = redis_client
        self.limit = limit
        self.key = key
        self.lease_seconds = lease_seconds
        self.weights = dict(weights or {})
        self._weights_json = json.dumps(self.weights)
        self._acquire = redis_client.register_script(_ACQUIRE_LUA)
        self._renew = redis_client.register_script(_RENEW_LUA)
        self._release = redis_client.register_script(_RELEASE_LUA)
        self._crowding = redis_client.register_script(_CROWDING_LUA)
        self._pending = redis_client.register_script(_PENDING_LUA)

    @property
    def _lease_ms(self) -> int:
        return max(1, int(self.lease_seconds * 1000))

    def _args(self, tenant: str, *more: Any) -> list[Any]:
        return [self.limit, self._lease_ms, tenant, self._weights_json, *more]

    def try_acquire(self, tenant: str | None = None) -> Lease | None:
        """One atomic attempt: a lease, or None when all ``limit`` slots are held or ``tenant`` holds its share
        while another tenant waits below its own."""
        tenant = tenant or DEFAULT_TENANT
        lease_id = _owner_tag()
        args = self._args(tenant, lease_id, int(WAIT_SECONDS * 1000))
        got = redis_call(self._acquire, keys=[self.key], args=args)
        return Lease(lease_id, self.key, tenant) if int(got) == 1 else None

    def acquire(self, timeout: float | None = None, tenant: str | None = None) -> Lease:
        """Block until a slot is free; ``TimeoutError`` after ``timeout`` seconds (None: wait forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        lease = self.try_acquire(tenant)
        if lease is not None:
            return lease
        waiters = _waiters(self.key)
        with waiters.cond:
            waiters.count += 1
        try:
            while True:
                with waiters.cond:
                    pause = random.uniform(_POLL_MIN, _POLL_MAX) * max(1.0, waiters.count / _POLLERS)
                    if deadline is not None:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise TimeoutError(f"no free slot on {self.key} (limit {self.limit}) within {timeout:g}s")
                        pause = min(pause, left)
                    waiters.cond.wait(pause)  # a release in this process ends it early
                lease = self.try_acquire(tenant)
                if lease is not None:
                    return replace(lease, waited=True)
        finally:
            with waiters.cond:
                waiters.count -= 1

    def release(self, lease: Lease) -> None:
        redis_call(self._release, keys=[lease.key], args=self._args(lease.tenant, lease.id))
        waiters = _WAITERS.get(lease.key)
        if waiters is not None:
            with waiters.cond:
                waiters.cond.notify()

    def renew(self, lease: Lease) -> bool:
        """Push the lease's expiry ``lease_seconds`` ahead; False if it had already expired."""
        return int(redis_call(self._renew, keys=[lease.key], args=self._args(lease.tenant, lease.id))) == 1

    def crowding(self, tenant: str | None) -> bool:
        """Whether ``tenant`` holds its share or more while another active tenant waits below its own: a task
        of it should step aside rather than take a worker thread to wait in (llm/fair.py)."""
        return int(redis_call(self._crowding, keys=[self.key], args=self._args(tenant or DEFAULT_TENANT))) == 1

    def queued(self, tenant: str | None, n: int) -> int:
        """Count ``n`` tasks of ``tenant`` queued (a fan-out), or ``-1`` for one that starts; the tenant counts as
        waiting while any are queued.  Returns how many are still queued."""
        return int(redis_call(self._pending, keys=[self.key], args=self._pending_args(tenant, int(n), check=False)))

    def start_unless_crowding(self, tenant: str | None) -> bool:
        """``crowding`` and, when it is not, ``queued(tenant, -1)``, in one round trip: False (nothing counted) when
        the task should step aside, True when it starts."""
        args = self._pending_args(tenant, -1, check=True)
        return int(redis_call(self._pending, keys=[self.key], args=args)) >= 0

    def _pending_args(self, tenant: str | None, n: int, *, check: bool) -> list[Any]:
        ms = (int(PENDING_SECONDS * 1000), int(WAIT_SECONDS * 1000))
        return self._args(tenant or DEFAULT_TENANT, n, *ms, 1 if check else 0)

    def held_by(self, tenant: str | None) -> int:
        """Live leases of ``tenant`` right now."""
        now_s, now_us = redis_call(self.redis.time)
        now_ms = int(now_s) * 1000 + int(now_us) // 1000
        tk = f"{{{self.key}}}:t:{tenant or DEFAULT_TENANT}"
        return int(redis_call(self.redis.zcount, tk, f"({now_ms}", "+inf"))

    def held(self) -> int:
        """Live leases right now (expired ones not yet swept are excluded)."""
        now_s, now_us = redis_call(self.redis.time)
        now_ms = int(now_s) * 1000 + int(now_us) // 1000
        return int(redis_call(self.redis.zcount, self.key, f"({now_ms}", "+inf"))

    @contextmanager
    def slot(self, timeout: float | None = None, tenant: str | None = None) -> Iterator[Lease]:
        """Hold one slot for the block, renewing it in the background so slow calls keep it."""
        lease = self.acquire(timeout, tenant)
        _KEEPER.hold(lease.id, (self, lease), self.lease_seconds / 3)
        try:
            yield lease
        finally:
            _KEEPER.drop(lease.id)
            try:
                self.release(lease)
            except ServiceUnavailable:
                # The lease expires on its own; a Redis blip must not mask the call's outcome.
                log.warning(
                    "could not release lease %s on %s; it expires in %.0fs",
                    lease.id,
                    lease.key,
                    self.lease_seconds,
                )


def _renew_leases(due: list[tuple[str, tuple[ConcurrencyLimiter, Lease]]]) -> list[str]:
    """Renew the slot leases that fell due, one by one; the ids of those that had already expired."""
    lost = []
    for lease_id, (limiter, lease) in due:
        try:
            if not limiter.renew(lease):
                lost.append(lease_id)
        except ServiceUnavailable as exc:
            log.warning("lease renewal failed, will retry: %s", exc)
    return lost


def _expired(gone: list[tuple[str, tuple[ConcurrencyLimiter, Lease]]]) -> None:
    for _, (_, lease) in gone:
        log.warning("lease %s on %s expired before renewal; the limit may be briefly exceeded", lease.id, lease.key)


#: renews every slot lease this process holds, each every third of its lifetime
_KEEPER: Renewals[str, tuple[ConcurrencyLimiter, Lease]] = Renewals("lease-keeper", _renew_leases, _expired)


def limiter_from_settings(settings: Settings, redis_client: Any) -> ConcurrencyLimiter:
    """The process-wide ceiling ``RLM_MAX_CONCURRENCY`` on in-flight LLM calls, shared by ``RLM_TENANT_WEIGHTS``."""
    return ConcurrencyLimiter(
        redis_client, limit=settings.max_concurrency, weights=parse_weights(settings.tenant_weights)
    )


# KEYS: log zset (entry id -> time), tokens hash (entry id -> tokens), running token total.
# ARGV: rpm (0 = none), tpm (0 = none), estimated tokens, entry id, window ms.
# Returns {0, entry id} when charged, else {wait_ms} until the oldest entry leaves the window.
_CHARGE_LUA = (
    LUA_NOW_MS
    + """
local zlog, toks, total = KEYS[1], KEYS[2], KEYS[3]
local rpm, tpm, est, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[5])
local cutoff = now - window
while true do
  -- in pages: unpack() of a huge list would overflow the Lua stack
  local old = redis.call('ZRANGEBYSCORE', zlog, '-inf', cutoff, 'LIMIT', 0, 500)
  if #old == 0 then break end
  local gone = 0
  for _, v in ipairs(redis.call('HMGET', toks, unpack(old))) do gone = gone + (tonumber(v) or 0) end
  redis.call('DECRBY', total, gone)
  redis.call('HDEL', toks, unpack(old))
  redis.call('ZREM', zlog, unpack(old))
end
local count = redis.call('ZCARD', zlog)
local used = tonumber(redis.call('GET', total) or '0')
-- a single call larger than the whole token budget still runs once the window is empty
local over_tokens = tpm > 0 and count > 0 and used + est > tpm
if (rpm > 0 and count >= rpm) or over_tokens then
  local first = redis.call('ZRANGE', zlog, 0, 0, 'WITHSCORES')
  return {math.max(1, tonumber(first[2]) + window - now)}
end
redis.call('ZADD', zlog, now, ARGV[4])
redis.call('HSET', toks, ARGV[4], est)
redis.call('INCRBY', total, est)
for _, k in ipairs(KEYS) do redis.call('PEXPIRE', k, window * 2) end
return {0, ARGV[4]}
"""
)

# KEYS as above; ARGV: entry id, actual tokens.  An entry that already left the
# window is not re-added: the provider counted it when it was sent.
_CORRECT_LUA = """
local old = redis.call('HGET', KEYS[2], ARGV[1])
if not old then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('INCRBY', KEYS[3], tonumber(ARGV[2]) - tonumber(old))
return 1
"""


@dataclass(frozen=True)
class Charge:
    """One request counted against the budget; ``id`` is None when no budget is configured."""

    id: str | None
    estimated_tokens: int


class RateBudget:
    """Requests-per-minute and tokens-per-minute budgets over a sliding window."""

    def __init__(
        self,
        redis_client: Any,
        *,
        rpm: int | None,
        tpm: int | None,
        key: str = constants.RATE_KEY_PREFIX + "default",
        window_seconds: float = 60.0,
    ) -> None:
        self.redis = redis_client
        self.rpm = rpm or 0
        self.tpm = tpm or 0
        self.window_seconds = window_seconds
        # One hash tag: the three keys land in one cluster slot, as a Lua script requires.
        self._keys = [f"{{{key}}}:log", f"{{{key}}}:tokens", f"{{{key}}}:total"]
        self._charge = redis_client.register_script(_CHARGE_LUA)
        self._correct = redis_client.register_script(_CORRECT_LUA)

    @property
    def enabled(self) -> bool:
        return bool(self.rpm or self.tpm)

    def try_charge(self, estimated_tokens: int) -> tuple[Charge | None, float]:
        """Charge one request now, or return (None, seconds to wait before trying again)."""
        est = max(0, int(estimated_tokens))
        if not self.enabled:
            return Charge(None, est), 0.0
        entry = _owner_tag()
        got = redis_call(
            self._charge,
            keys=self._keys,
            args=[self.rpm, self.tpm, est, entry, int(self.window_seconds * 1000)],
        )
        if int(got[0]) == 0:
            return Charge(entry, est), 0.0
        return None, int(got[0]) / 1000

    def wait_for_capacity(self, estimated_tokens: int, timeout: float | None = None) -> Charge:
        """Block until one more request of ``estimated_tokens`` fits; ``TimeoutError`` after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            charge, wait = self.try_charge(estimated_tokens)
            if charge is not None:
                return charge
            # Jitter so workers woken by the same expiring entry do not all retry at once.
            pause = min(wait, 1.0) + random.uniform(0, _POLL_MAX)
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rate budget (rpm={self.rpm}, tpm={self.tpm}) still full after {timeout:g}s")
                pause = min(pause, left)
            time.sleep(pause)

    def record(self, charge: Charge, actual_tokens: int) -> None:
        """Replace the estimate with the tokens the provider reported."""
        if charge.id is None:
            return
        redis_call(self._correct, keys=self._keys, args=[charge.id, max(0, int(actual_tokens))])

    def used(self) -> tuple[int, int]:
        """(requests, tokens) in the current window, as of the last charge."""
        return (
            int(redis_call(self.redis.zcard, self._keys[0])),
            int(redis_call(self.redis.get, self._keys[2]) or 0),
        )


def wait_bound(settings: Settings) -> float:
    """The longest one wait for a slot or a rate budget may take: a third of the visibility timeout, at most
    ten minutes.  An unbounded wait let a task outlive ``visibility_timeout``, so Redis redelivered it and the
    batch was paid twice; a wait that times out ends in ``LimiterBusy`` (docs/contract.md#limiter).

    Never shorter than a dead worker's leases take to lapse (``LEASE_SECONDS``) unless the visibility timeout
    itself is that short: a killed worker must not fail the batches that wait for its slots."""
    vis = float(settings.visibility_timeout)
    return max(1.0, min(600.0, max(vis / 3, min(LEASE_SECONDS + 5, vis * 0.8))))


class Limits:
    """What the provider goes through for every HTTP attempt: a global slot, then the rate budget."""

    def __init__(
        self,
        concurrency: ConcurrencyLimiter | None = None,
        budget: RateBudget | None = None,
        *,
        acquire_timeout: float | None = None,
    ) -> None:
        self.concurrency = concurrency
        self.budget = budget if budget is not None and budget.enabled else None
        self.acquire_timeout = acquire_timeout

    @classmethod
    def from_settings(cls, settings: Settings, redis_client: Any) -> Limits:
        budget = RateBudget(redis_client, rpm=settings.rpm, tpm=settings.tpm) if settings.rpm or settings.tpm else None
        return cls(limiter_from_settings(settings, redis_client), budget, acquire_timeout=wait_bound(settings))

    @contextmanager
    def call(self, estimated_tokens: int, tenant: str | None = None) -> Iterator[Callable[[int], None]]:
        """Hold a slot (``tenant``'s, docs/contract.md#fair-share) and a budget charge for one request; call the
        yielded ``record(actual_tokens)``.

        The slot is taken first and the budget charged right before the request
        goes out, so the window sees the request when the provider does; a call
        that never records keeps its (conservative) estimate.  Both waits share one ``acquire_timeout``
        (``TimeoutError`` when it runs out), so one call never waits longer than that in all.
        """
        start = time.monotonic()
        deadline = None if self.acquire_timeout is None else start + self.acquire_timeout
        slot: AbstractContextManager[Any] = (
            self.concurrency.slot(self.acquire_timeout, tenant) if self.concurrency else nullcontext()
        )
        with slot:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            charge = self.budget.wait_for_capacity(estimated_tokens, left) if self.budget else None

            def record(actual_tokens: int) -> None:
                if self.budget is not None and charge is not None:
                    self.budget.record(charge, actual_tokens)

            metrics.limiter_waited(time.monotonic() - start)
            yield record
