"""A job tree's budget in Redis: reservations across threads and processes, sticky reasons, seeding, TTLs."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from rlm_workers.errors import BudgetExhausted
from rlm_workers.llm.budget import KEY_PREFIX, BudgetLedger, BudgetLimits


@pytest.fixture(scope="module")
def broker_url(test_services) -> str:
    return test_services.broker_url


@pytest.fixture
def r(broker_url):
    client = redis.Redis.from_url(broker_url)
    yield client
    client.close()


def _root() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def _reserve_until_refused(ledger: BudgetLedger, limit: int = 10_000) -> tuple[int, BudgetExhausted]:
    for n in range(limit):
        try:
            ledger.reserve()
        except BudgetExhausted as exc:
            return n, exc
    raise AssertionError(f"no refusal after {limit} reservations")


def test_limits_from_options_and_back():
    lim = BudgetLimits.from_options({"max_llm_calls": 12, "max_cost": 0.5, "deadline": 90, "other": 1}, 1000.0)
    assert (lim.max_llm_calls, lim.max_tokens, lim.max_cost, lim.deadline_at) == (12, None, 0.5, 1090.0)
    assert lim.any
    assert lim.as_dict() == {"max_llm_calls": 12, "max_tokens": None, "max_cost": 0.5, "deadline": 90.0}
    assert not BudgetLimits.from_options({"max_tokens": None}, 1000.0).any
    assert BudgetLimits.from_options({"max_tokens": 5}, 0).any


def test_calls_stop_at_the_limit_with_a_reason_and_detail(r):
    ledger = BudgetLedger(r, _root(), BudgetLimits(max_llm_calls=3))
    made, exc = _reserve_until_refused(ledger)
    assert made == 3
    assert exc.reason == "max_llm_calls" and "3 of 3 LLM calls" in exc.message
    # refused reservations are not counted
    assert ledger.state() == {"calls": 3, "tokens": 0, "cost_usd": 0.0, "exhausted": "max_llm_calls"}


def test_tokens_and_cost_charged_after_calls_stop_new_ones(r):
    tokens = BudgetLedger(r, _root(), BudgetLimits(max_tokens=1000))
    tokens.reserve()
    tokens.charge(999, None)
    tokens.reserve()  # 999 < 1000: a call still starts, and may go past the limit
    tokens.charge(500, None)
    with pytest.raises(BudgetExhausted) as ei:
        tokens.reserve()
    assert ei.value.reason == "max_tokens" and "1499 of 1000 tokens" in ei.value.message

    cost = BudgetLedger(r, _root(), BudgetLimits(max_cost=0.07))
    cost.reserve()
    cost.charge(10, 0.07)  # exactly the budget: not a micro-dollar more from float noise
    assert cost.state()["cost_usd"] == 0.07
    with pytest.raises(BudgetExhausted) as ei:
        cost.reserve()
    assert ei.value.reason == "max_cost" and "$0.0700 of $0.0700" in ei.value.message


def test_cost_is_rounded_up_to_a_micro_dollar(r):
    ledger = BudgetLedger(r, _root(), BudgetLimits(max_cost=1.0))
    for _ in range(3):
        ledger.charge(1, 0.0000001)  # a tenth of a micro-dollar each: counted, not lost
    ledger.charge(1, None)
    ledger.charge(1, float("nan"))
    assert ledger.state() == {"calls": 0, "tokens": 5, "cost_usd": 0.000003, "exhausted": None}


def test_retried_attempts_count_as_calls(r):
    ledger = BudgetLedger(r, _root(), BudgetLimits(max_llm_calls=4))
    ledger.reserve()
    ledger.charge(100, None, extra_calls=2)  # one call that took three HTTP attempts
    ledger.reserve()
    with pytest.raises(BudgetExhausted, match="4 of 4"):
        ledger.reserve()


def test_threads_never_reserve_more_than_the_limit(r):
    root, limit = _root(), 37
    start = threading.Barrier(16)

    def worker() -> int:
        ledger = BudgetLedger(r, root, BudgetLimits(max_llm_calls=limit))  # one per worker, as on real hosts
        start.wait()
        made, exc = _reserve_until_refused(ledger)
        assert exc.reason == "max_llm_calls"
        return made

    with ThreadPoolExecutor(16) as pool:
        made = [f.result() for f in [pool.submit(worker) for _ in range(16)]]
    assert sum(made) == limit
    assert sum(1 for m in made if m) > 1  # the threads really contended
    assert int(r.hget(KEY_PREFIX + root, "calls")) == limit


def _process_worker(url: str, root: str, limit: int, out_key: str) -> None:
    client = redis.Redis.from_url(url)
    ledger = BudgetLedger(client, root, BudgetLimits(max_llm_calls=limit))
    client.incr(out_key + ":ready")
    deadline = time.monotonic() + 30
    while not client.get(out_key + ":go"):
        if time.monotonic() > deadline:
            raise SystemExit(3)
        time.sleep(0.005)
    made, _ = _reserve_until_refused(ledger)
    client.rpush(out_key + ":made", made)


def test_two_processes_share_one_budget(r, broker_url):
    root, limit, out = _root(), 200, f"rlm:test:{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_process_worker, args=(broker_url, root, limit, out)) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 60
        while int(r.get(out + ":ready") or 0) < 2:
            assert time.monotonic() < deadline, "worker processes did not start"
            assert all(p.is_alive() for p in procs), "a worker process died"
            time.sleep(0.02)
        r.set(out + ":go", 1)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
    made = [int(m) for m in r.lrange(out + ":made", 0, -1)]
    assert len(made) == 2 and sum(made) == limit
    assert int(r.hget(KEY_PREFIX + root, "calls")) == limit
    r.delete(out + ":ready", out + ":go", out + ":made")


def test_the_first_reason_sticks(r):
    ledger = BudgetLedger(r, _root(), BudgetLimits(max_llm_calls=3, max_tokens=100))
    ledger.reserve()
    ledger.charge(150, None)
    with pytest.raises(BudgetExhausted) as ei:
        ledger.reserve()
    assert ei.value.reason == "max_tokens"
    ledger.charge(0, None, extra_calls=5)  # calls now past their limit too, and calls are checked first
    with pytest.raises(BudgetExhausted) as ei:
        ledger.reserve()
    assert ei.value.reason == "max_tokens"
    ledger.mark("deadline")
    assert ledger.state()["exhausted"] == "max_tokens"


def test_mark_refuses_later_calls(r):
    ledger = BudgetLedger(r, _root(), BudgetLimits(max_llm_calls=100))
    ledger.reserve()
    ledger.mark("deadline")
    with pytest.raises(BudgetExhausted) as ei:
        ledger.reserve()
    assert ei.value.reason == "deadline" and ledger.state()["calls"] == 1
    with pytest.raises(ValueError, match="unknown budget reason"):
        ledger.mark("tired")


def test_deadline_in_the_past_exhausts_at_once(r):
    lim = BudgetLimits.from_options({"deadline": 5}, time.time() - 60)
    ledger = BudgetLedger(r, _root(), lim)
    with pytest.raises(BudgetExhausted) as ei:
        ledger.reserve()
    assert ei.value.reason == "deadline" and "5s deadline" in ei.value.message
    assert ledger.state() == {"calls": 0, "tokens": 0, "cost_usd": 0.0, "exhausted": "deadline"}


def test_deadline_ahead_allows_calls_and_keeps_the_key_past_it(r):
    day = 86_400
    ledger = BudgetLedger(r, _root(), BudgetLimits.from_options({"deadline": 30 * day}, time.time()))
    ledger.reserve()
    # the hash outlives the deadline by a day, not just the 7-day floor
    assert r.pttl(ledger.key) > 30 * day * 1000
    short = BudgetLedger(r, _root(), BudgetLimits(max_llm_calls=5))
    short.reserve()
    assert 6 * day * 1000 < r.pttl(short.key) <= 7 * day * 1000


def test_seed_resumes_a_lost_budget(r):
    seeds: list[int] = []

    def seed() -> tuple[int, int, float]:
        seeds.append(1)
        return 3, 1234, 0.25  # what the database recorded for the tree

    root = _root()
    ledger = BudgetLedger(r, root, BudgetLimits(max_llm_calls=5), seed=seed)
    ledger.reserve()
    ledger.reserve()
    assert len(seeds) == 1  # the database is asked only while the hash is missing
    assert ledger.state() == {"calls": 5, "tokens": 1234, "cost_usd": 0.25, "exhausted": None}

    r.delete(ledger.key)  # Redis lost it (a restart without persistence)
    other = BudgetLedger(r, root, BudgetLimits(max_llm_calls=5), seed=lambda: (4, 2000, 0.5))
    other.reserve()  # 4 -> 5
    with pytest.raises(BudgetExhausted, match="5 of 5"):
        other.reserve()
    assert other.state()["tokens"] == 2000

    r.delete(ledger.key)
    ledger.charge(10, 0.01)  # a charge that finds the hash missing seeds it first, then adds
    assert len(seeds) == 2
    assert ledger.state() == {"calls": 3, "tokens": 1244, "cost_usd": 0.26, "exhausted": None}


def test_a_second_seeder_does_not_overwrite_the_first(r):
    root = _root()
    first = BudgetLedger(r, root, BudgetLimits(max_llm_calls=10), seed=lambda: (7, 0, 0.0))
    first.reserve()
    called: list[int] = []
    second = BudgetLedger(r, root, BudgetLimits(max_llm_calls=10), seed=lambda: called.append(1) or (0, 0, 0.0))
    second.reserve()
    assert called == [] and second.state()["calls"] == 9


def test_without_limits_redis_is_never_written(r):
    root = _root()
    ledger = BudgetLedger(r, root, BudgetLimits(), seed=lambda: (99, 99, 99.0))
    for _ in range(5):
        ledger.reserve()
    ledger.charge(100, 1.0, extra_calls=3)
    ledger.mark("deadline")
    assert ledger.state() == {"calls": 0, "tokens": 0, "cost_usd": 0.0, "exhausted": None}
    assert r.exists(KEY_PREFIX + root) == 0
    # the same calls with a limit do write it: the check above would catch a ledger that ignores `any`
    BudgetLedger(r, root, BudgetLimits(max_tokens=10**9)).reserve()
    assert r.exists(KEY_PREFIX + root) == 1
