"""/metrics from prometheus_client, counted as jobs run (docs/contract.md#metrics): real worker processes, the
scripted OpenAI-protocol server, a real API subprocess scraped over HTTP and parsed with prometheus_client's parser.

The Redis holding the counters is the test session's shared broker, so every assertion is a delta between two
scrapes around the work, compared with what the job itself logged in PostgreSQL (``llm_calls``, ``timings``).
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.api import Api
from tests.support.jobs import wait_for
from tests.support.pipeline_model import CHUNK_COUNT, QUESTION, write_essays
from tests.support.scripted_llm import fail_first
from tests.support.workers import running_workers, scripted_env

pytestmark = pytest.mark.slow

#: USD per 1M tokens: input, cached input, output (RLM_PRICES for the workers)
PRICES = {"plan-model": [2.0, 1.0, 8.0], "analyst-model": [1.0, 0.5, 4.0], "synth-model": [5.0, 2.5, 20.0]}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def env(rlm_env, llm):
    with scripted_env(
        rlm_env,
        llm,
        RLM_LLM_RETRIES="1",
        RLM_LLM_TIMEOUT="30",
        RLM_MAX_CONCURRENCY="3",
        RLM_VISIBILITY_TIMEOUT="30",
        RLM_JOB_TIMEOUT="25",
        RLM_PRICES=json.dumps(PRICES),
    ) as e:
        yield e


@pytest.fixture(scope="module")
def corpus(env, conn, embedder, tmp_path_factory):
    from rlm_workers.ingest.loader import load_paths

    root = tmp_path_factory.mktemp("metrics") / "essays"
    write_essays(root)
    report = load_paths(conn, buffer="essays", paths=[root], embedder=embedder)
    conn.commit()
    assert report.chunks_written == CHUNK_COUNT


@pytest.fixture(scope="module")
def workers(env, corpus, tmp_path_factory):
    pools = {"ctl": ("rlm.control", 4), "an1": ("rlm.analyst", 6)}
    with running_workers(env, tmp_path_factory.mktemp("worker-logs"), pools) as ws:
        yield ws


@pytest.fixture(scope="module")
def api(env, workers, tmp_path_factory):
    a = Api(env, tmp_path_factory.mktemp("metrics-api") / "api.log")
    yield a
    a.stop()


def scrape(api: Api) -> tuple[Samples, dict[str, str]]:
    """Every sample by (name, sorted labels), and every family's type, as a Prometheus server would read them."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{api.base}/metrics", timeout=60)
    assert r.status_code == 200, r.text
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(r.text):
        types[family.name] = family.type
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in samples, f"series {key} rendered twice"
            samples[key] = s.value
    return samples, types


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def submit(conn, query: str) -> str:
    from rlm_workers.submit import submit_query

    job_id, _ = submit_query(conn, tenant="local", query=query, buffers=["essays"], options={})
    conn.commit()
    return job_id


def test_a_job_moves_every_counter_by_what_it_logged(conn, fresh, model, api):
    from rlm_workers.store.jobs import llm_calls_of
    from rlm_workers.submit import wait_for_job

    # one 429 on the planner: a "retried" attempt, which the errors family counts too
    model.plan_reply = fail_first(
        1, lambda req: json.dumps({"search_mode": "hybrid", "threshold": -1.0}), status=429, retry_after=0.2
    )
    before, _ = scrape(api)
    job = wait_for_job(conn, submit(conn, QUESTION), timeout=120)
    assert job.status == "done", job.error
    after, types = scrape(api)

    assert types["rlm_stage_seconds"] == "histogram" and types["rlm_llm_latency_seconds"] == "histogram"
    assert types["rlm_jobs"] == "gauge" and types["rlm_queue_depth"] == "gauge"
    assert delta(after, before, "rlm_jobs_finished_total", status="done") == 1
    assert delta(after, before, "rlm_jobs_finished_total", status="failed") == 0

    calls = llm_calls_of(conn, job_id=job.id)
    assert {c.status for c in calls} == {"ok", "retried"}
    for m in {c.model for c in calls}:
        mine = [c for c in calls if c.model == m]
        for status in ("ok", "retried", "error"):
            n = sum(c.status == status for c in mine)
            assert delta(after, before, "rlm_llm_calls_total", model=m, status=status) == n, (m, status)
        assert delta(after, before, "rlm_llm_errors_total", model=m) == sum(c.status != "ok" for c in mine)
        for direction, attr in (("in", "tokens_in"), ("out", "tokens_out"), ("cached", "cached_tokens")):
            n = sum(getattr(c, attr) for c in mine)
            assert delta(after, before, "rlm_llm_tokens_total", model=m, direction=direction) == n, (m, direction)
        cost = sum(c.cost_usd or 0.0 for c in mine)
        assert cost > 0 and delta(after, before, "rlm_llm_cost_usd_total", model=m) == pytest.approx(cost, abs=1e-9)
        assert delta(after, before, "rlm_llm_latency_seconds_count", model=m) == len(mine)
        assert delta(after, before, "rlm_llm_latency_seconds_bucket", model=m, le="+Inf") == len(mine)
        latency = sum(c.latency_ms for c in mine) / 1000
        assert delta(after, before, "rlm_llm_latency_seconds_sum", model=m) == pytest.approx(latency, abs=1e-6)
    # every HTTP attempt went through the limiter once (the planner's retry too)
    assert delta(after, before, "rlm_limiter_wait_seconds_count") == len(calls)

    assert job.timings.keys() >= {"plan", "search", "collect", "synthesize"}
    for stage, seconds in job.timings.items():
        assert delta(after, before, "rlm_stage_seconds_count", stage=stage) == 1, stage
        assert delta(after, before, "rlm_stage_seconds_sum", stage=stage) == pytest.approx(seconds, abs=1e-3)
        # buckets are cumulative: each is at most the next, +Inf is the count
        les = sorted(
            (float(dict(k[1])["le"]), v)
            for k, v in after.items()
            if k[0] == "rlm_stage_seconds_bucket" and dict(k[1]).get("stage") == stage
        )
        assert [v for _, v in les] == sorted(v for _, v in les)
        assert les[-1] == (float("inf"), after[("rlm_stage_seconds_count", (("stage", stage),))])


def test_jobs_in_flight_and_cancelled(conn, fresh, model, api):
    from rlm_workers.submit import cancel_query

    model.gate.clear()  # analysts wait at the server: the job stays running
    try:
        before, _ = scrape(api)
        job_id = submit(conn, QUESTION)
        assert wait_for(lambda: _running(conn)), "the job never started running"
        during, _ = scrape(api)
        running = conn.execute("SELECT count(*) FROM jobs WHERE status = 'running'").fetchone()[0]
        conn.commit()
        assert running >= 1 and during[("rlm_jobs", (("status", "running"),))] == running
        cancel_query(conn, job_id=job_id, tenant="local")
        conn.commit()
        after, _ = scrape(api)
        assert delta(after, before, "rlm_jobs_finished_total", status="cancelled") == 1
        assert delta(after, before, "rlm_jobs_finished_total", status="done") == 0
        assert after[("rlm_jobs", (("status", "running"),))] == running - 1
    finally:
        model.gate.set()


def _running(conn) -> bool:
    n = conn.execute("SELECT count(*) FROM jobs WHERE status = 'running'").fetchone()[0]
    conn.commit()
    return n > 0


def test_a_scrape_reads_no_llm_calls(conn, api):
    """The aggregates over whole tables are gone (stage times summed over every job's timings, calls over every
    logged call): a scrape still answers, with the LLM counters, while another transaction holds ``llm_calls``
    exclusively — a query over it would wait for that lock and the scrape would time out."""
    from rlm_workers.store import metrics as store_metrics

    assert not {"stage_totals", "call_totals", "jobs_by_status"} & set(vars(store_metrics))
    with conn.transaction():
        conn.execute("LOCK TABLE llm_calls IN ACCESS EXCLUSIVE MODE")
        samples, _ = scrape(api)
    assert any(name == "rlm_llm_calls_total" for name, _ in samples)
    conn.commit()


def test_metric_writes_never_raise_without_a_broker(env, tmp_path):
    """A dead broker drops the increments (debug log) instead of failing the stage that counts them."""
    from rlm_workers.config import reset_settings
    from rlm_workers.runtime import metrics
    from rlm_workers.runtime.metrics_render import render
    from tests.support.envpatch import patched_env

    with patched_env({"RLM_BROKER_URL": "redis://127.0.0.1:1/0"}):
        reset_settings()
        try:
            metrics.job_finished("done")
            metrics.stage_timed("plan", 0.3)
            metrics.limiter_waited(0.0)
            text = render({"queued": 2}, ("rlm.analyst",)).decode()
        finally:
            metrics._down_until = 0.0  # the back-off would also skip this process's later writes
            reset_settings()
    assert 'rlm_jobs{status="queued"} 2.0' in text and "rlm_queue_depth{" not in text


def test_bucket_labels_are_the_prometheus_clients_own():
    """Workers label buckets without loading the Prometheus client; a label written another way would be a second
    series for the same bucket after an upgrade."""
    from prometheus_client.utils import floatToGoString

    from rlm_workers.runtime.metrics import HISTOGRAM_FAMILIES, bucket_label

    bounds = [b for _, buckets, _ in HISTOGRAM_FAMILIES.values() for b in buckets] + [float("inf")]
    assert [bucket_label(b) for b in bounds] == [floatToGoString(b) for b in bounds]
