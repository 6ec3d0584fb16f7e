"""Modes, recursion and exact aggregation with the offline extractive provider, on real workers.

Every mode must run without a model (docs/contract.md#modes): ``instant`` answers from the best passages in
one call, ``auto`` routes by size and question, ``thinking`` follows what the findings name (a two-hop question
no search of the question's words can answer), and ``--scope all`` counts records exactly.  Workers are real
``rlm worker`` processes; the direct crossover is the default 16K tokens here (other suites turn it off).
"""

from __future__ import annotations

import collections
import json
import random

import pytest

from tests.support.pipeline_model import NEEDLE, QUESTION, write_essays
from tests.support.workers import extractive_env, running_workers

pytestmark = pytest.mark.slow

TWO_HOP_QUESTION = "Where does the billing team's service store data?"
KINDS = ["disk_full", "timeout", "oom", "auth_failed", "dns_failure", "conn_reset", "bad_gateway"]


@pytest.fixture(scope="module")
def env(rlm_env):
    with extractive_env(rlm_env, RLM_DIRECT_MAX_TOKENS="16000") as e:
        yield e


def write_logs(root, *, files: int = 25, lines: int = 1000, seed: int = 11) -> collections.Counter:
    """``lines`` log lines over ``files`` files; 7 error kinds with counts known only from the writing.  Five
    files are quiet (no errors): a search for errors has no reason to read them."""
    rng = random.Random(seed)
    truth: collections.Counter = collections.Counter()
    root.mkdir(parents=True, exist_ok=True)
    per_file = lines // files
    for f in range(files):
        out = []
        quiet = f % 5 == 4
        for i in range(per_file):
            ts = f"2026-03-{f % 28 + 1:02d}T10:{i // 60 % 60:02d}:{i % 60:02d}Z"
            r = rng.random()
            if not quiet and r < 0.3:
                kind = rng.choice(KINDS)
                truth[kind] += 1
                out.append(f'{ts} ERROR [api] kind={kind} host=web-{rng.randint(1, 5)} msg="request failed"')
            elif r < 0.4:
                out.append(f"{ts} WARN [api] slow path=/v1/items/{rng.randint(1, 9)}")
            else:
                out.append(f"{ts} INFO [api] served in {rng.randint(1, 99)} ms")
        (root / f"app-{f:02d}.log").write_text("\n".join(out) + "\n")
    return truth


def write_orders(root, *, rows: int = 2000, seed: int = 5) -> collections.Counter:
    """A CSV table: the header names the columns only once, in the file's first line."""
    rng = random.Random(seed)
    truth: collections.Counter = collections.Counter()
    root.mkdir(parents=True, exist_ok=True)
    lines = ["order_id,region,status,amount"]
    for i in range(rows):
        status = rng.choice(["shipped", "pending", "returned", "lost"])
        truth[status] += 1
        lines.append(
            f"{1000 + i},{rng.choice(['north', 'south', 'east'])},{status},{rng.randint(5, 500)}.{i % 100:02d}"
        )
    (root / "orders.csv").write_text("\n".join(lines) + "\n")
    return truth


def write_hops(root) -> None:
    """Fact A names B; the answer is a fact about B in another file that shares no word with the question."""
    write_essays(root, injection_at=None)
    (root / "teams.md").write_text("# Teams\n\nThe billing team maintains the Zephyrine service.\n")
    (root / "storage.md").write_text("# Storage\n\nZephyrine writes every ledger into the Quokka cluster.\n")


def write_big(root, n: int = 40) -> None:
    """Many long chunks: whatever the search selects is far over the 16K-token direct context."""
    rng = random.Random(3)
    words = "river stone lantern harbor meadow orchard signal copper basket window thunder ladder".split()
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        paras = []
        for _ in range(6):
            paras.append(" ".join(rng.choice(words) for _ in range(80)) + " lantern harbor.")
        (root / f"doc-{i:02d}.md").write_text(f"# Document {i}\n\n" + "\n\n".join(paras) + "\n")


def write_code(root) -> None:
    """A Python package: keyword arguments (``name=None,``) and counting words, but no record to count."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "beat.py").write_text(
        '''"""The beat scheduler: it wakes up every max_interval seconds to send due periodic tasks."""

DEFAULT_MAX_INTERVAL = 300


class Scheduler:
    def __init__(self, app, schedule=None, max_interval=None,
                 Producer=None, lazy=False, sync_every=None,
                 name=None, app_name=None, **kwargs):
        self.max_interval = max_interval or DEFAULT_MAX_INTERVAL

    def tick(self, event_t=None, min=min, heappop=None,
             heappush=None, name=None):
        """Run a tick: the beat wakes up, sends what is due and sleeps until the next entry."""
        return min(self.max_interval, 1)
'''
    )
    (root / "__init__.py").write_text('"""Distributed task queue."""\n\nfrom .beat import Scheduler\n')


@pytest.fixture(scope="module")
def corpora(env, conn, embedder, tmp_path_factory):
    from rlm_workers.ingest.loader import load_paths

    base = tmp_path_factory.mktemp("modes")
    write_essays(base / "essays")
    write_hops(base / "hops")
    write_big(base / "big")
    truth = write_logs(base / "logs")
    orders = write_orders(base / "orders")
    write_code(base / "code")
    for name in ("essays", "hops", "big", "logs", "orders", "code"):
        load_paths(conn, buffer=name, paths=[base / name], embedder=embedder)
    # the same logs cut anywhere (the fixed chunker splits lines and trims the blanks at a cut): each line must
    # still be counted once and whole, with overlapping chunks and with none
    for name, size, overlap in (("logs-fixed", 700, 150), ("logs-fixed0", 250, 0)):
        load_paths(
            conn,
            buffer=name,
            paths=[base / "logs"],
            embedder=embedder,
            chunker="fixed",
            chunk_size=size,
            overlap=overlap,
        )
    conn.commit()
    return {"truth": truth, "orders": orders}


@pytest.fixture(scope="module")
def workers(env, corpora, tmp_path_factory):
    pools = {"ctl": ("rlm.control", 4), "an1": ("rlm.analyst", 6), "an2": ("rlm.analyst", 6)}
    with running_workers(env, tmp_path_factory.mktemp("worker-logs"), pools) as ws:
        yield ws


def run_job(conn, query, buffers, timeout=240, **options):
    from rlm_workers.models import QueryResult
    from rlm_workers.submit import submit_query, wait_for_job

    job_id, _ = submit_query(conn, tenant="local", query=query, buffers=list(buffers), options=options)
    conn.commit()
    job = wait_for_job(conn, job_id, timeout=timeout)
    assert job.status == "done", (job.status, job.error)
    return job, QueryResult.model_validate(job.result)


def calls_of_tree(conn, root_id):
    return conn.execute(
        """SELECT j.id, c.stage FROM llm_calls c JOIN jobs j ON j.id = c.job_id WHERE j.root_id = %s ORDER BY c.id""",
        (root_id,),
    ).fetchall()


# --------------------------------------------------------------------------- instant and auto


def test_instant_makes_exactly_one_call_and_answers_from_the_best_passages(conn, workers):
    job, r = run_job(conn, QUESTION, ["essays"], mode="instant")
    assert (r.mode, r.route) == ("instant", "direct")
    assert r.llm_calls == 1 and [s for _, s in calls_of_tree(conn, job.id)] == ["answer"]
    assert job.plan is None  # no planner call
    assert NEEDLE.split(" is ")[1].rstrip(".") in r.response
    assert any(NEEDLE[:40] in s.snippet or s.relevance == "high" for s in r.sources)
    # what was read is said: the chunks given to the one call
    assert r.chunks_analyzed >= 1 and r.batches_processed == 1 and r.children == []
    assert r.confidence is None and r.complete is None  # no check ran: nothing to claim


def test_auto_goes_direct_for_a_small_buffer_and_fans_out_over_a_big_one(conn, workers):
    _, small = run_job(conn, QUESTION, ["essays"])
    assert (small.mode, small.route) == ("auto", "direct")
    assert "fit" in small.route_reason
    _, big = run_job(conn, "Where is the copper lantern kept in the harbor?", ["big"])
    assert big.route == "fanout", big.route_reason
    assert "exceed" in big.route_reason and big.batches_processed > 1
    # a fan-out knob asks for a fan-out even on a small buffer
    _, forced = run_job(conn, QUESTION, ["essays"], batch_size=5)
    assert forced.route == "fanout" and "batch-size" in forced.route_reason and forced.batches_processed >= 1


# --------------------------------------------------------------------------- thinking: two hops


def test_thinking_answers_a_two_hop_question_the_plain_fan_out_misses(conn, workers):
    _, plain = run_job(conn, TWO_HOP_QUESTION, ["hops"], batch_size=5)
    assert plain.route == "fanout" and "Quokka" not in plain.response
    assert plain.children == []

    job, deep = run_job(conn, TWO_HOP_QUESTION, ["hops"], mode="thinking")
    assert "Quokka" in deep.response, deep.response
    assert deep.mode == "thinking" and deep.children and deep.depth >= 1 and deep.rounds >= 2
    assert all(c.status == "done" and c.kind == "follow_up" for c in deep.children)
    assert any("Zephyrine" in c.query for c in deep.children)
    # every child is a job of the tree, with its own plan and chord, one level deeper than its round
    from rlm_workers.store.jobs import tree_of

    kids = tree_of(conn, root_id=job.id)
    assert {k.id for k in kids} == {c.job_id for c in deep.children}
    assert all(k.parent_id == job.id and k.root_id == job.id and k.batches_total >= 1 for k in kids)
    # the tree's totals are every call of every job under the root, checks included
    stages = [s for _, s in calls_of_tree(conn, job.id)]
    assert deep.llm_calls == len(stages) and stages.count("check") == len(job.checks) >= 2
    assert deep.complete is not None and deep.confidence is not None
    # the depth limit holds: no child deeper than --depth
    _, shallow = run_job(conn, TWO_HOP_QUESTION, ["hops"], mode="thinking", depth=0)
    assert shallow.children == [] and shallow.rounds == 1 and "Quokka" not in shallow.response


# --------------------------------------------------------------------------- exhaustive aggregation


# the same logs chunked three ways (see ``corpora``): one test each, so that a miscount names its chunking
@pytest.mark.parametrize("buffer", ["logs", "logs-fixed", "logs-fixed0"])
def test_scope_all_counts_every_record_exactly(conn, workers, corpora, buffer):
    truth = corpora["truth"]
    _, r = run_job(conn, "How many errors of each kind are in the logs?", [buffer], scope="all")
    assert r.route == "exhaustive" and r.coverage == 1.0 and r.complete is True, r.gaps
    assert r.chunks_analyzed == r.chunks_available
    kinds = {row.value: row.count for row in r.records if row.label == "kind"}
    assert kinds == dict(truth)
    levels = {row.value: row.count for row in r.records if row.label == "level"}
    assert levels["ERROR"] == sum(truth.values()) and sum(levels.values()) == 1000
    assert "Exact totals" in r.response and f"| {KINDS[0]} | {truth[KINDS[0]]} |" in r.response


def test_scope_all_counts_the_rows_of_a_csv_table_by_its_header(conn, workers, corpora):
    _, r = run_job(conn, "How many orders are there of each status?", ["orders"], scope="all")
    assert r.coverage == 1.0 and r.chunks_available > 10  # the header is in the first chunk only
    statuses = {row.value: row.count for row in r.records if row.label == "status"}
    assert statuses == dict(corpora["orders"])
    assert not any(row.label == "order_id" for row in r.records)  # unique per row: not counted


def test_an_aggregation_question_routes_exhaustive_and_a_cut_off_search_says_it_is_incomplete(conn, workers, corpora):
    question = "How many errors of each kind are in the logs?"
    _, auto = run_job(conn, question, ["logs"])
    assert auto.route == "exhaustive" and "how many" in auto.route_reason.lower()
    _, cut = run_job(conn, question, ["logs"], scope="search", max_chunks=10, batch_size=5)
    assert cut.route == "fanout" and cut.coverage < 1.0 and cut.records == []
    assert cut.complete is False and any("--scope all" in g for g in cut.gaps)


def test_a_scope_all_answer_with_exact_totals_does_not_open_with_no_findings(conn, workers, corpora):
    # no passage shares a word with the question, so no finding is kept: the answer is the count itself
    _, r = run_job(conn, "Tally the levels", ["logs"], scope="all")
    assert r.findings_count == 0 and r.route == "exhaustive" and r.coverage == 1.0
    assert r.response.startswith("## Answer") and "No relevant findings" not in r.response
    assert "--threshold" not in r.response and "## Exact totals" in r.response
    assert f"| ERROR | {sum(corpora['truth'].values())} |" in r.response


def test_no_findings_with_batches_the_budget_never_ran_points_at_the_budget_not_the_search(conn, workers):
    # no passage shares a word with the question, so the batches that ran kept nothing; the rest never ran
    _, r = run_job(
        conn,
        "Which quasar orbits the zeppelin?",
        ["big"],
        search_mode="semantic",
        threshold=0.0,
        batch_size=5,
        max_llm_calls=3,
    )
    assert r.findings_count == 0 and r.batches_not_run > 0 and r.budget.exhausted == "max_llm_calls"
    assert r.response.startswith("## No relevant findings yet"), r.response
    assert f"before {r.batches_not_run} batch" in r.response and "--max-llm-calls" in r.response
    assert "--threshold" not in r.response


@pytest.mark.parametrize(
    ("question", "buffer", "exhaustive"),
    [
        ("How often does the beat scheduler wake up?", "code", False),  # a behaviour's frequency
        ("How often does the beat scheduler wake up?", "logs", False),
        ("How many schedulers are there?", "code", False),  # counting words, but source code holds no records
        ("How many errors of each kind are in the logs?", "logs", True),
        ("What is the count of each status?", "orders", True),
    ],
)
def test_only_counting_over_records_routes_exhaustive(conn, workers, corpora, question, buffer, exhaustive):
    _, r = run_job(conn, question, [buffer])
    assert (r.route == "exhaustive") is exhaustive, r.route_reason
    if not exhaustive:
        assert r.records == [] and "Exact totals" not in r.response
    if buffer == "code" and "how many" in question.lower():
        assert "no records to count" in r.route_reason


def test_scope_all_over_code_counts_no_keyword_arguments(conn, workers, corpora):
    _, r = run_job(conn, "How often does the beat scheduler wake up?", ["code"], scope="all")
    assert r.route == "exhaustive" and r.coverage == 1.0
    assert r.records == [] and "Exact totals" not in r.response, [(x.label, x.value) for x in r.records]
    assert "wakes up" in r.response


# --------------------------------------------------------------------------- code mode


def test_code_mode_needs_a_model_and_the_job_says_so(conn, workers):
    from rlm_workers.submit import submit_query, wait_for_job

    job_id, _ = submit_query(conn, tenant="local", query=QUESTION, buffers=["essays"], options={"mode": "code"})
    conn.commit()
    job = wait_for_job(conn, job_id, timeout=120)
    assert job.status == "failed" and "mode code needs a model that writes programs" in job.error.message
    assert calls_of_tree(conn, job_id) == []  # nothing was asked of the offline provider


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "args, says",
    [
        (["--mode", "deep"], "--mode"),
        (["--depth", "-1"], "depth"),
        (["--depth", "6"], "depth"),
        (["--max-llm-calls", "-3"], "max-llm-calls"),
        (["--max-tokens", "0"], "max-tokens"),
        (["--max-cost", "nan"], "max-cost"),
        (["--max-cost", "-0.5"], "max-cost"),
        (["--deadline", "inf"], "deadline"),
        (["--mode", "instant", "--scope", "all"], "instant"),
        (["--mode", "code", "--top-k", "5"], "mode code"),
        (["--scope", "everything"], "--scope"),
    ],
)
def test_bad_mode_depth_or_budget_is_one_line_and_exit_2(env, corpora, args, says):
    from tests.test_cli import run_rlm

    proc = run_rlm(env, "query", "anything", "--buffer", "essays", *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    # one message: a line of ours, or click's usage block whose error line names the option
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.lower().startswith("error") and says in ln]
    assert len(errors) == 1 and (len(lines) == 1 or lines[0].startswith("Usage: rlm query")), proc.stderr
    assert "Traceback" not in proc.stderr


def test_options_are_checked_the_same_way_for_the_api(env):
    from pydantic import ValidationError

    from rlm_api.schemas import QueryRequest, describe_errors

    good = QueryRequest.model_validate(
        {"query": "q", "buffers": ["b"], "options": {"mode": "thinking", "depth": 3, "max_cost": 0.5}}
    )
    assert good.options.mode == "thinking" and good.options.depth == 3
    for options in (
        {"mode": "deep"},
        {"depth": 9},
        {"depth": 1.5},
        {"max_llm_calls": -1},
        {"max_cost": float("nan")},
        {"deadline": -2},
        {"scope": "all", "mode": "instant"},
        {"mode": "code", "batch_size": 4},
    ):
        with pytest.raises(ValidationError) as err:
            QueryRequest.model_validate({"query": "q", "buffers": ["b"], "options": options})
        assert describe_errors(err.value.errors()), options
    # NaN as JSON text (Python's json writes it; the API parses it) is refused too
    with pytest.raises(ValidationError):
        QueryRequest.model_validate_json(json.dumps({"query": "q", "buffers": ["b"], "options": {"max_cost": "NaN"}}))
