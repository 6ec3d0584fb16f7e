"""Modes, recursion and budgets end to end (docs/contract.md#modes, #recursion, #budgets, #costs): real worker
processes, real Redis and PostgreSQL, and the scripted OpenAI-protocol server answering by model name.

The corpus is the essays plus a two-hop pair: a.md says which service the billing team runs (Zephyrine), b.md
where Zephyrine writes (Quokka), and b.md shares no search term with the question.  Every scripted reply states
its own usage, so each token, cached token and cent a tree reports can be recomputed from what the server served.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from collections.abc import Callable

import pytest

from tests.support.jobs import wait_for
from tests.support.pipeline_model import write_essays
from tests.support.scripted_llm import Reply, last_user_message
from tests.support.workers import WorkerProcess, running_workers, scripted_env

pytestmark = pytest.mark.slow

QUESTION = "Where does the billing team's service store data?"
FOLLOW_UP = "Where does Zephyrine write its ledgers?"
A_TEXT = "The billing team maintains the Zephyrine service."
B_TEXT = "Zephyrine writes every ledger into the Quokka cluster."
#: matches every essay by bm25 (and neither a.md nor b.md): a big fan-out for the budget tests
BIG_QUESTION = "Summarise the history notes of practitioners"
BUFFER = "modes"
#: (prompt, completion) tokens every reply of a model reports
TOKENS = {
    "plan-model": (100, 10),
    "analyst-model": (300, 20),
    "check-model": (150, 12),
    "synth-model": (400, 50),
}
#: USD per 1M tokens: input, cached input, output (RLM_PRICES for the workers)
PRICES = {
    "plan-model": [2.0, 1.0, 8.0],
    "analyst-model": [1.0, 0.5, 4.0],
    "check-model": [3.0, 1.5, 12.0],
    "synth-model": [5.0, 2.5, 20.0],
}
#: RLM_MAX_CONCURRENCY below: the per-job analyst ceiling of the small tier (15) is cut to it
CONCURRENCY = 4

_CHUNK = re.compile(r"### Chunk (\d+)\n\nsource: [^\n]*\n\n<content>\n(.*?)\n</content>", re.S)
_QUERY = re.compile(r"## Query\n\n(.*?)\n\n## ", re.S)


# --------------------------------------------------------------------------- the scripted model


class Script:
    """Planner, analyst, check and synthesizer of the two-hop story, by model name; a test tunes what it needs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: cached prompt tokens each model reports (None: no prompt_tokens_details at all)
        self.cached: dict[str, int] = {}
        self.follow_up = FOLLOW_UP
        #: the follow-up of each check in turn (the last one repeats), instead of ``follow_up``
        self.follow_up_rounds: list[str] | None = None
        self.checks = 0
        self.analyst_delay = 0.0
        #: analyst calls whose query this accepts wait for ``gate`` at the server
        self.hold: Callable[[str], bool] | None = None
        self.gate = threading.Event()
        self.gate.set()
        self.held = 0
        #: the synthesizer's first turn (tool calls), if it makes one
        self.synth_tools: Callable[[dict], Reply] | None = None

    def reply(self, model: str, content: str | None = None, *, tools=None, delay: float = 0.0) -> Reply:
        prompt, completion = TOKENS[model]
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": self.cached.get(model)}
        if tools is not None:
            return Reply.tools(*tools, content=content, delay=delay, **usage)
        return Reply.text(content, delay=delay, **usage)

    def __call__(self, req: dict) -> Reply:
        model = req.get("model")
        text = last_user_message(req)
        if model == "plan-model":
            return self.reply(model, json.dumps({"search_mode": "bm25"}))
        if model == "check-model":
            found = text.split("## Findings", 1)[-1]
            if "Quokka" in found:
                verdict = {"complete": True, "confidence": 0.9, "gaps": [], "follow_ups": []}
            else:
                with self.lock:
                    n, self.checks = self.checks, self.checks + 1
                ask = self.follow_up_rounds[min(n, len(self.follow_up_rounds) - 1)] if self.follow_up_rounds else None
                verdict = {
                    "complete": False,
                    "confidence": 0.3,
                    "gaps": ["where"],
                    "follow_ups": [ask or self.follow_up],
                }
            return self.reply(model, json.dumps(verdict))
        if model == "analyst-model":
            return self.analyst(text)
        return self.synthesizer(req, text)

    def analyst(self, text: str) -> Reply:
        m = _QUERY.search(text)
        query = m.group(1) if m else ""
        if self.hold is not None and self.hold(query):
            with self.lock:
                self.held += 1
            self.gate.wait(120)
        out = []
        for cid, body in _CHUNK.findall(text):
            entry = {"chunk_id": int(cid), "relevance": "none", "findings": [], "summary": "", "follow_up": []}
            if "billing" in query and "Zephyrine" in body:
                entry.update(relevance="high", findings=[A_TEXT], summary="Names the billing team's service.")
            elif "Zephyrine" in query and "Quokka" in body:
                entry.update(relevance="high", findings=[B_TEXT], summary="Says where Zephyrine writes.")
            elif "practitioners" in query:
                heading = body.strip().splitlines()[0]
                entry.update(relevance="medium", findings=[f"Heading: {heading}"], summary="Background notes.")
            out.append(entry)
        return self.reply("analyst-model", json.dumps({"findings": out}), delay=self.analyst_delay)

    def synthesizer(self, req: dict, text: str) -> Reply:
        tool_msgs = [m for m in req["messages"] if m.get("role") == "tool"]
        if self.synth_tools is not None and not tool_msgs:
            return self.synth_tools(req)
        # quote what the findings say, so a fact is in the report iff some finding holds it
        said = re.findall(r"^- (.+)$", text.split("## Findings", 1)[-1], re.M)
        for m in tool_msgs:
            answer = json.loads(m["content"])
            if "error" in answer and "findings" not in answer:
                said.append(f"tool error: {answer['error']}")
            for row in answer.get("findings") or []:
                said += [f"(from job {answer['job_id']}) {f}" for f in row["findings"]]
        return self.reply("synth-model", "## Answer\n\n" + "\n".join(f"> {s}" for s in said))


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def env(rlm_env, llm):
    with scripted_env(
        rlm_env,
        llm,
        RLM_LLM_RETRIES="1",
        RLM_LLM_TIMEOUT="30",
        RLM_MAX_CONCURRENCY=str(CONCURRENCY),
        # short enough that a killed worker's batch is redelivered or salvaged within the test's patience
        RLM_VISIBILITY_TIMEOUT="30",
        RLM_JOB_TIMEOUT="25",
        # a dead worker's work looked for every 2 s and re-sent once it is 2 s gone (production: 60 s and 20 s)
        RLM_RECONCILE_SECONDS="2",
        RLM_WORKER_LOST_SECONDS="2",
        RLM_PRICES=json.dumps(PRICES),
    ) as e:
        yield e


@pytest.fixture(scope="module")
def corpus(env, conn, embedder, tmp_path_factory):
    """{"a": chunk id of a.md, "b": chunk id of b.md}: one chunk per file, 28 essays beside them."""
    from rlm_workers.ingest.loader import load_paths

    root = tmp_path_factory.mktemp("modes") / "docs"
    write_essays(root, injection_at=None)
    (root / "a.md").write_text(f"# Teams\n\n{A_TEXT}\n")
    (root / "b.md").write_text(f"# Storage\n\n{B_TEXT}\n")
    load_paths(conn, buffer=BUFFER, paths=[root], embedder=embedder)
    conn.commit()
    ids = {}
    for name in ("a", "b"):
        [(cid,)] = conn.execute("SELECT id FROM chunks WHERE path LIKE %s", (f"%/{name}.md",)).fetchall()
        ids[name] = cid
    assert conn.execute("SELECT count(*) FROM chunks").fetchone()[0] == 30
    conn.commit()
    return ids


@pytest.fixture(scope="module")
def workers(env, corpus, tmp_path_factory):
    pools = {"ctl": ("rlm.control", 4), "an1": ("rlm.analyst", 6), "an2": ("rlm.analyst", 6)}
    with running_workers(env, tmp_path_factory.mktemp("worker-logs"), pools) as ws:
        yield ws


@pytest.fixture()
def script(fresh):
    """A new Script answering for the test; the module's own responder is put back after it."""
    s = Script()
    before = fresh.responder
    fresh.responder = s
    try:
        yield s
    finally:
        s.gate.set()
        fresh.responder = before


# --------------------------------------------------------------------------- helpers


def submit(conn, query: str, **options) -> str:
    from rlm_workers.submit import submit_query

    job_id, _ = submit_query(conn, tenant="local", query=query, buffers=[BUFFER], options=options)
    conn.commit()
    return job_id


def wait(conn, job_id: str, timeout: float = 150):
    from rlm_workers.submit import wait_for_job

    return wait_for_job(conn, job_id, timeout=timeout)


def run_job(conn, query: str, **options):
    return wait(conn, submit(conn, query, **options))


def result_of(job):
    from rlm_workers.models import QueryResult

    assert job.result is not None, (job.status, job.error)
    return QueryResult.model_validate(job.result)


def tree_ids(conn, root_id: str) -> list[str]:
    from rlm_workers.store import jobs as job_store

    ids = [root_id] + [k.id for k in job_store.tree_of(conn, root_id=root_id)]
    conn.commit()
    return ids


def logged(conn, job_ids: list[str]) -> tuple[int, int, int, int, float]:
    """(calls, tokens_in, tokens_out, cached, cost) over the llm_calls rows of these jobs."""
    row = conn.execute(
        """SELECT count(*), coalesce(sum(tokens_in), 0), coalesce(sum(tokens_out), 0),
                  coalesce(sum(cached_tokens), 0), coalesce(sum(cost_usd), 0)
           FROM llm_calls WHERE job_id = ANY(%s)""",
        (job_ids,),
    ).fetchone()
    conn.commit()
    return int(row[0]), int(row[1]), int(row[2]), int(row[3]), float(row[4])


def served(llm, model: str | None = None) -> list[dict]:
    return [r.body for r in llm.requests if model is None or r.body.get("model") == model]


def analyst_query(body: dict) -> str:
    m = _QUERY.search(last_user_message(body))
    return m.group(1) if m else ""


def batch_rows(conn, job_id: str):
    rows = conn.execute(
        "SELECT batch_no, status, error, started_at FROM job_batches WHERE job_id = %s ORDER BY batch_no", (job_id,)
    ).fetchall()
    conn.commit()
    return rows


def job_row(conn, job_id: str):
    from rlm_workers.store import jobs as job_store

    job = job_store.get_job(conn, job_id=job_id)
    conn.commit()
    return job


def children(conn, job_id: str):
    from rlm_workers.store import jobs as job_store

    kids = job_store.children_of(conn, job_id=job_id)
    conn.commit()
    return kids


# --------------------------------------------------------------------------- 1. two hops


def test_plain_fan_out_misses_the_second_hop(conn, script):
    job = run_job(conn, QUESTION, mode="auto")
    r = result_of(job)
    assert job.status == "done", job.error
    assert r.mode == "auto" and r.route == "fanout" and not r.children and r.rounds == 1 and r.depth == 0
    assert "Zephyrine" in r.response  # the first hop is found…
    assert "Quokka" not in r.response  # …but b.md shares no word with the question
    assert r.confidence is None  # no check runs outside thinking mode


def test_thinking_follows_up_and_the_tree_bill_is_exact(conn, script, llm):
    job = run_job(conn, QUESTION, mode="thinking")
    r = result_of(job)
    assert job.status == "done", job.error
    assert "Quokka" in r.response and "Zephyrine" in r.response
    assert r.mode == "thinking" and r.route == "fanout"
    assert r.children and all(c.status == "done" for c in r.children)
    assert [(c.kind, c.depth, c.query, c.parent_id) for c in r.children] == [("follow_up", 1, FOLLOW_UP, job.id)]
    assert r.depth >= 1 and r.rounds == 2
    assert r.complete is True and r.confidence == pytest.approx(0.9)
    kids = children(conn, job.id)
    assert [(k.root_id, k.depth, k.spec.kind) for k in kids] == [(job.id, 1, "follow_up")]
    # the bill: the sums over every job's llm_calls rows, what the server served, and what the replies said
    calls, tin, tout, cached, _ = logged(conn, tree_ids(conn, job.id))
    assert (r.llm_calls, r.tokens_in, r.tokens_out) == (calls, tin, tout)
    assert r.total_tokens == tin + tout
    usage = llm.usage
    assert (r.llm_calls, r.tokens_in, r.tokens_out) == (llm.calls, usage["prompt_tokens"], usage["completion_tokens"])
    bodies = served(llm)
    assert r.tokens_in == sum(TOKENS[b["model"]][0] for b in bodies)
    assert r.tokens_out == sum(TOKENS[b["model"]][1] for b in bodies)
    # root: plan, 1 analyst batch, 2 checks, 1 synthesis; the child: plan, 1 analyst batch
    assert sorted(b["model"] for b in bodies) == sorted(
        ["plan-model"] * 2 + ["analyst-model"] * 2 + ["check-model"] * 2 + ["synth-model"]
    )
    assert r.cached_tokens == cached == 0  # no reply reported cached tokens
    child = r.children[0]
    child_calls = logged(conn, [child.job_id])
    assert (child.llm_calls, child.total_tokens) == (child_calls[0], child_calls[1] + child_calls[2]) == (2, 430)
    assert r.budget.used_llm_calls == r.llm_calls and r.budget.used_tokens == r.total_tokens
    assert r.budget.exhausted is None


def test_thinking_ends_the_rounds_when_the_check_only_asks_again_what_it_asked(conn, script, llm):
    """A small checker asked the same follow-up every round, reworded a little, and never said complete: a
    near-duplicate is not asked again, and the rounds end with a gap that says why."""
    script.follow_up_rounds = ["Which team runs the billing service?", "which team runs the billing services"]
    job = run_job(conn, QUESTION, mode="thinking")
    r = result_of(job)
    assert job.status == "done", job.error
    assert [c.query for c in r.children] == ["Which team runs the billing service?"]  # no second round of children
    assert r.rounds == 2 and script.checks == 2
    assert any("asked only what was asked before" in g for g in r.gaps), r.gaps
    assert r.complete is False  # the checker never said it was; the report says what is missing


# --------------------------------------------------------------------------- 6. cached tokens and cost


def test_cached_tokens_and_cost_are_exact_over_the_tree(conn, script, llm):
    script.cached = {"plan-model": 40, "analyst-model": 100, "check-model": 0, "synth-model": 300}
    job = run_job(conn, QUESTION, mode="thinking")
    r = result_of(job)
    assert job.status == "done", job.error
    assert r.children
    bodies = served(llm)
    expected_cached = sum(script.cached[b["model"]] for b in bodies)

    def cost(model: str) -> float:
        (prompt, completion), c = TOKENS[model], script.cached[model]
        pin, pcached, pout = PRICES[model]
        return ((prompt - c) * pin + c * pcached + completion * pout) / 1e6

    expected_cost = sum(cost(b["model"]) for b in bodies)
    assert r.cached_tokens == expected_cached == llm.usage["cached_tokens"] > 0
    assert r.cost_usd == pytest.approx(expected_cost, abs=1e-9) and r.cost_usd > 0
    assert r.budget.used_cost_usd == pytest.approx(expected_cost, abs=1e-9)
    # the children's share is their own calls, and the root's is the rest
    _, _, _, _, child_cost = logged(conn, [c.job_id for c in r.children])
    assert sum(c.cost_usd for c in r.children) == pytest.approx(child_cost, abs=1e-9)
    assert child_cost == pytest.approx(cost("plan-model") + cost("analyst-model"), abs=1e-9)


# --------------------------------------------------------------------------- 2. budgets


def _budget_checks(conn, llm, job, r, reason: str) -> tuple[list, list]:
    """What every budget stop shares; returns (budget-failed batches, batches that ran)."""
    from rlm_workers.pipeline.report import status_line

    assert job.status == "done", job.error
    assert r.response.strip() and "budget was exhausted" in r.response
    assert r.budget.exhausted == reason
    assert r.complete is False and any("budget ran out" in g for g in r.gaps)
    rows = batch_rows(conn, job.id)
    spent = [b for b in rows if b[1] == "failed" and (b[2] or {}).get("type") == "budget"]
    ran = [b for b in rows if b[1] == "ok"]
    assert spent and ran, [(b[0], b[1]) for b in rows]  # stopped mid-way: some batches ran, some never started
    assert {e.batch for e in r.batch_errors if e.type == "budget"} == {b[0] for b in spent}
    # batches the budget never ran are "not run", not failures, in the result and in the status line
    assert (r.batches_not_run, r.batches_failed, r.batches_processed) == (len(spent), 0, len(ran))
    assert f"Batches: {len(ran)} ok, 0 failed, {len(spent)} not run (budget) |" in status_line(r)
    # a batch the budget stopped made no call: no llm_calls row and no request for its chunk
    billed = {
        n
        for (n,) in conn.execute(
            "SELECT DISTINCT batch_no FROM llm_calls WHERE job_id = %s AND stage = 'analyst'", (job.id,)
        ).fetchall()
    }
    conn.commit()
    assert billed == {b[0] for b in ran}
    assert len(served(llm, "analyst-model")) == len(ran)
    # nothing after the fan-out called a model: no check (no children), and the report is the offline writer's
    assert not r.children and not served(llm, "check-model") and not served(llm, "synth-model")
    # the ledger's totals are the exact ones, retries included (there were none)
    calls, tin, tout, _, cost = logged(conn, tree_ids(conn, job.id))
    assert (r.budget.used_llm_calls, r.budget.used_tokens) == (calls, tin + tout) == (llm.calls, tin + tout)
    assert r.budget.used_cost_usd == pytest.approx(cost, abs=1e-6)
    statuses = {s for (s,) in conn.execute("SELECT status FROM llm_calls WHERE job_id = %s", (job.id,)).fetchall()}
    conn.commit()
    assert statuses == {"ok"}
    return spent, ran


def _big(conn, **budget):
    """A thinking root over all 28 essays, one chunk a batch: 28 analyst calls if nothing stopped it."""
    return run_job(conn, BIG_QUESTION, mode="thinking", batch_size=1, **budget)


def test_max_llm_calls_stops_a_big_fan_out(conn, script, llm, workers):
    job = _big(conn, max_llm_calls=8)
    r = result_of(job)
    _budget_checks(conn, llm, job, r, "max_llm_calls")
    # a reservation counts the call before it starts, atomically over every worker: never one call more
    # (only retried HTTP attempts could add to it, and there were none); all 28 batches asked, so all 8 ran
    assert r.budget.used_llm_calls == 8 == r.llm_calls
    assert r.budget.max_llm_calls == 8
    # the batches went to both analyst processes (each logs its calls and its refusals with the job id)
    for name in ("an1", "an2"):
        text = workers[name].log_path.read_text()
        assert f"llm analyst job={job.id}" in text or f"job {job.id} batch" in text, name


def test_max_tokens_stops_a_big_fan_out(conn, script, llm):
    limit = 2000
    job = _big(conn, max_tokens=limit)
    r = result_of(job)
    _, ran = _budget_checks(conn, llm, job, r, "max_tokens")
    per_call = sum(TOKENS["analyst-model"])
    # The last call to start saw at most limit - 1 tokens charged; the calls not yet charged then were those
    # holding one of the job's CONCURRENCY analyst slots (a slot is held from before the reservation until
    # after the charge; the planner's call had ended).  So the tree used at most limit - 1 tokens plus what
    # CONCURRENCY analyst calls use.
    assert limit <= r.budget.used_tokens <= limit - 1 + CONCURRENCY * per_call
    assert r.budget.used_tokens == sum(TOKENS["plan-model"]) + len(ran) * per_call


def test_max_cost_stops_a_big_fan_out(conn, script, llm):
    script.cached = {"plan-model": 40, "analyst-model": 100}
    limit = 0.002
    job = _big(conn, max_cost=limit)
    r = result_of(job)
    _, ran = _budget_checks(conn, llm, job, r, "max_cost")
    per_call = (200 * 1.0 + 100 * 0.5 + 20 * 4.0) / 1e6
    plan = (60 * 2.0 + 40 * 1.0 + 10 * 8.0) / 1e6
    # the bound of max_tokens, in USD; these prices make every charge a whole number of micro-dollars, so the
    # ledger (which rounds each charge up to one) holds exactly what was spent
    assert limit <= r.budget.used_cost_usd + 1e-9
    assert r.budget.used_cost_usd <= limit + CONCURRENCY * per_call + 1e-9
    assert r.cost_usd == pytest.approx(plan + len(ran) * per_call, abs=1e-9)


def test_deadline_passes_during_the_fan_out(conn, script, llm):
    script.analyst_delay = 2.0  # 28 calls, 4 at a time: 14 s of fan-out against an 8 s deadline
    deadline = 8.0
    job = _big(conn, deadline=deadline)
    r = result_of(job)
    _budget_checks(conn, llm, job, r, "deadline")
    assert r.budget.deadline == deadline
    # No call is reserved after the deadline (on the Redis clock, the same host's clock as the job's created_at):
    # a request that reached the server later was reserved before it, by a batch holding one of the job's
    # CONCURRENCY slots, so at most that many arrived after the deadline.
    due = job.created_at.timestamp() + deadline
    late = [q for q in llm.requests if q.body.get("model") == "analyst-model" and q.arrived > due]
    assert len(late) <= CONCURRENCY


def test_max_llm_calls_ends_the_rounds_when_a_child_cannot_start(conn, script, llm):
    # root plan, root batch, check, the child's plan: the child's batch cannot start, nor can the second check
    job = run_job(conn, QUESTION, mode="thinking", max_llm_calls=4)
    r = result_of(job)
    assert job.status == "done", job.error
    assert r.budget.exhausted == "max_llm_calls" and r.budget.used_llm_calls == 4 == llm.calls
    [child] = r.children
    assert child.status == "done" and child.llm_calls == 1
    [err] = r.batch_errors
    assert err.type == "budget" and err.job_id == child.job_id
    assert "budget was exhausted" in r.response and "Zephyrine" in r.response and "Quokka" not in r.response
    assert len(served(llm, "check-model")) == 1 and not served(llm, "synth-model")


def faulty(script: Script) -> Callable[[dict], Reply]:
    """The script behind a provider failing three requests in ten, by arrival: a 429 with Retry-After, a 503
    and a 500, each retried by the provider (RLM_LLM_RETRIES=1).  Deterministic in number: the first request
    fails, so does every tenth after it."""
    counter = itertools.count()
    lock = threading.Lock()
    faults = {
        0: Reply.http_error(429, "Rate limit reached", type="requests", headers={"Retry-After": "0.1"}),
        3: Reply.http_error(503, "scripted overload"),
        6: Reply.http_error(500, "scripted error"),
    }

    def respond(req: dict) -> Reply:
        with lock:
            i = next(counter) % 10
        return faults[i] if i in faults else script(req)

    return respond


@pytest.mark.parametrize(("mode", "limit"), [("auto", 5), ("thinking", 5), ("auto", 25), ("thinking", 25)])
def test_max_llm_calls_holds_under_provider_faults(conn, script, fresh, mode, limit):
    """Each HTTP attempt is reserved, retries included: the server never sees more requests than the limit."""
    fresh.responder = faulty(script)  # the script fixture puts the module's responder back
    job = run_job(conn, BIG_QUESTION, mode=mode, batch_size=1, max_llm_calls=limit)
    r = result_of(job)
    assert job.status == "done", job.error
    assert r.response.strip() and "budget was exhausted" in r.response
    assert r.budget.exhausted == "max_llm_calls"
    # every request the server saw, failed ones included, was reserved first
    assert fresh.calls <= limit
    calls, *_ = logged(conn, tree_ids(conn, job.id))
    assert r.budget.used_llm_calls == calls == fresh.calls
    statuses = [
        s for (s,) in conn.execute("SELECT status FROM llm_calls WHERE job_id = ANY(%s)", (tree_ids(conn, job.id),))
    ]
    conn.commit()
    assert "ok" in statuses and len(statuses) - statuses.count("ok") >= limit // 5  # the faults were retried


# --------------------------------------------------------------------------- 3. cancel


def _hold_child_then_cancel(conn, script, llm, *, batches: int):
    """A thinking root whose one child has ``batches`` batches, all claimed, min(batches, CONCURRENCY) of them
    held at the server; the root is then cancelled, the held calls released, and the child's batches left to
    end.  Returns (root, child, child analyst calls at the cancel, child analyst calls once it settled)."""
    from rlm_workers.submit import cancel_query

    script.hold = lambda q: "Zephyrine" in q  # the child's analyst calls wait at the server
    script.gate.clear()
    root = submit(conn, QUESTION, mode="thinking")
    at_server = min(batches, CONCURRENCY)

    def child_busy():
        kids = children(conn, root)
        if len(kids) != 1 or kids[0].status != "running":
            return False
        rows = batch_rows(conn, kids[0].id)
        # every batch claimed: some at the server, the rest (if any) waiting for one of the job's slots
        return len(rows) == batches and all(b[3] is not None for b in rows) and script.held == at_server

    assert wait_for(child_busy, timeout=90), (job_row(conn, root).stage, [k.status for k in children(conn, root)])
    [child] = children(conn, root)
    held = [b for b in served(llm, "analyst-model") if analyst_query(b) == script.follow_up]
    assert len(held) == at_server
    cancel_query(conn, job_id=root, tenant="local")
    conn.commit()
    assert job_row(conn, root).status == "cancelled"
    assert [k.status for k in children(conn, root)] == ["cancelled"]
    assert job_row(conn, child.id).error.message == "its parent was cancelled"
    script.gate.set()
    # the held calls answer, then every batch ends one way or another (should one never end, we stop waiting)
    wait_for(lambda: llm.stats()["in_flight"] == 0 and all(b[1] != "pending" for b in batch_rows(conn, child.id)), 30)
    after = [b for b in served(llm, "analyst-model") if analyst_query(b) == script.follow_up]
    return root, child, held, after


def test_cancelling_the_parent_cancels_its_children(conn, script, llm):
    root, child, held, after = _hold_child_then_cancel(conn, script, llm, batches=1)
    assert len(after) == len(held) == 1  # the held call was the child's only one
    # the child's end woke nobody: no second check, no synthesis, and both stay cancelled
    assert len(served(llm, "check-model")) == 1 and not served(llm, "synth-model")
    assert job_row(conn, root).status == "cancelled" and job_row(conn, child.id).status == "cancelled"
    assert job_row(conn, root).result is None


def test_a_cancelled_childs_batches_waiting_for_a_slot_call_no_model(conn, script, llm):
    # the follow-up also names the essays' words: the child reads all 30 chunks in 6 batches, CONCURRENCY at a time
    script.follow_up = FOLLOW_UP.rstrip("?") + ", per the history notes of practitioners?"
    root, child, held, after = _hold_child_then_cancel(conn, script, llm, batches=6)
    assert len(after) == len(held), "a batch of a cancelled child still called the model"
    assert job_row(conn, root).status == "cancelled" and job_row(conn, child.id).status == "cancelled"


# --------------------------------------------------------------------------- 5. query_subset


def test_query_subset_runs_a_child_and_resumes_the_synthesis(conn, script, llm, corpus):
    script.synth_tools = lambda req: script.reply(
        "synth-model", tools=[("query_subset", {"question": FOLLOW_UP, "chunk_ids": [corpus["b"]]})]
    )
    job = run_job(conn, QUESTION, mode="auto")
    r = result_of(job)
    assert job.status == "done", job.error
    [child] = r.children
    assert (child.kind, child.depth, child.status, child.query) == ("subset", 1, "done", FOLLOW_UP)
    kid = job_row(conn, child.job_id)
    assert kid.spec.stored() == {"kind": "subset", "chunk_ids": [corpus["b"]]} and kid.parent_id == job.id
    # the child read exactly b.md, and its finding came back as the tool's result into the report
    assert child.chunks_analyzed == 1 and child.findings_count == 1
    assert f"(from job {child.job_id}) {B_TEXT}" in r.response
    assert [(t.name, t.status) for t in r.tool_calls] == [("query_subset", "ok")]
    synth = served(llm, "synth-model")
    assert len(synth) == 2  # the turn that asked, and the resumed one
    [tool_msg] = [m for m in synth[1]["messages"] if m.get("role") == "tool"]
    assert json.loads(tool_msg["content"])["status"] == "done" and B_TEXT in tool_msg["content"]
    assert r.llm_calls == llm.calls == logged(conn, tree_ids(conn, job.id))[0]


def test_query_subset_bad_arguments_are_tool_errors(conn, script, llm, corpus):
    script.synth_tools = lambda req: script.reply(
        "synth-model",
        tools=[
            ("query_subset", {"question": FOLLOW_UP, "chunk_ids": [corpus["b"]], "search": "Quokka"}),
            ("query_subset", {"question": "   ", "chunk_ids": [corpus["b"]]}),
        ],
    )
    job = run_job(conn, QUESTION, mode="auto")
    r = result_of(job)
    assert job.status == "done", job.error
    assert not r.children and not children(conn, job.id)
    assert [(t.name, t.status) for t in r.tool_calls] == [("query_subset", "error")] * 2
    assert "exactly one of chunk_ids or search" in r.tool_calls[0].error
    assert "question must be a non-empty string" in r.tool_calls[1].error
    # the model was told, in the tool messages, and could answer with what it had
    assert "tool error: give exactly one of chunk_ids or search" in r.response
    assert "tool error: question must be a non-empty string" in r.response
    assert "Zephyrine" in r.response


def test_a_synthesizer_without_native_tool_calling_calls_a_tool_by_json_action(conn, script, llm, workers, env, corpus):
    """A server that answers 400 to any request carrying ``tools`` (docs/contract.md#structured-outputs): the
    synthesizer is offered them in words, its JSON action runs the tool, and the next turn's ``{"answer": ...}``
    is the report.  The refusal is learned per (base URL, model) for the life of a worker process, so the job runs
    on a control worker of its own whose synthesizer model no other test uses."""
    synth = "synth-no-tools"
    answer = f"Zephyrine is the billing team's service. {B_TEXT} [chunk {corpus['b']}]"
    seen: list[dict] = []

    def no_tools(req: dict) -> Reply:
        if req.get("model") != synth:
            return script(req)
        seen.append(req)
        if "tools" in req:
            return Reply.http_error(400, "tools param requires --jinja flag", type="invalid_request_error")
        results = [
            m["content"]
            for m in req["messages"]
            if m.get("role") == "user" and str(m.get("content")).startswith("Result of get_chunks")
        ]
        if not results:
            action = {"action": "get_chunks", "arguments": {"chunk_ids": [corpus["b"]]}}
            return script.reply("synth-model", json.dumps(action))
        # the answer holds b.md's text only if the tool really read it
        return script.reply("synth-model", json.dumps({"answer": answer if B_TEXT in results[0] else "no result"}))

    llm.responder = no_tools  # the script fixture puts the module's responder back
    workers["ctl"].stop()
    own_ctl = WorkerProcess(
        "ctl-no-tools",
        queues="rlm.control",
        env={**env, "RLM_SYNTHESIZER_MODEL": synth},
        log_dir=workers["ctl"].log_path.parent,
        concurrency=4,
    ).start()
    try:
        job = run_job(conn, QUESTION, mode="auto")
    finally:
        own_ctl.stop()
        workers["ctl"].start()
    r = result_of(job)
    assert job.status == "done", job.error
    assert [(t.name, t.status) for t in r.tool_calls] == [("get_chunks", "ok")]
    assert r.response.strip() == answer
    # refused once with tools, then the action turn and the answer turn without them, the tools told in words
    assert ["tools" in b for b in seen] == [True, False, False]
    assert all("## Tools" in b["messages"][0]["content"] for b in seen[1:])
    assert seen[1]["response_format"]["json_schema"]["name"] == "tool_action"


# --------------------------------------------------------------------------- a tool call written as the report


def synth_calls(conn, job_id: str) -> list[bool | None]:
    """``parse_ok`` of the synthesizer's logged calls of the job, first call first."""
    from rlm_workers.store.jobs import llm_calls_of

    out = [c.parse_ok for c in llm_calls_of(conn, job_id=job_id) if c.stage == "synthesize"]
    conn.commit()
    return out


_LISTING = '{"name": "list_buffers", "arguments": {}}'


@pytest.mark.parametrize(
    "tool",
    [
        "query_subset",
        "list_buffers",  # one call repeated until the output limit cut it off: no single JSON value
    ],
)
def test_a_last_turn_that_writes_a_tool_call_is_asked_again_for_the_report(conn, script, llm, corpus, tool):
    """qwen2.5-coder-0.5b under llama-server, past its tool turns, wrote a query_subset call as fenced JSON (or one
    list_buffers call over and over) instead of the report: that reply is no report and is logged as one that did
    not parse; the model is told why and asked again on the same turn (with the start of what it wrote), and its
    answer object then is the report (unwrapped with no tools offered)."""
    from rlm_workers.pipeline.synthesize import MAX_ECHO_BYTES, MAX_TURNS

    call = {"name": "query_subset", "arguments": {"question": FOLLOW_UP, "chunk_ids": [str(corpus["b"])]}}
    stray = f"```json\n{json.dumps(call, indent=2)}\n```" if tool == "query_subset" else (_LISTING + "\n") * 60 + "{"
    report = f"## Answer\n\nThe billing team runs Zephyrine. [chunk {corpus['a']}]"
    last_turns: list[dict] = []

    def respond(req: dict) -> Reply:
        if req.get("model") != "synth-model":
            return script(req)
        if "tools" in req:  # every turn that may call a tool reads a chunk, so the last turn comes
            return script.reply("synth-model", tools=[("get_chunks", {"chunk_ids": [corpus["a"]]})])
        last_turns.append(req)
        return script.reply("synth-model", stray if len(last_turns) == 1 else json.dumps({"answer": report}))

    llm.responder = respond  # the script fixture puts the module's responder back
    job = run_job(conn, QUESTION, mode="auto")
    r = result_of(job)
    assert job.status == "done", job.error
    assert r.response == report
    assert [(t.name, t.status) for t in r.tool_calls] == [("get_chunks", "ok")] * (MAX_TURNS - 1)
    # the re-ask went out on the last turn: the stray reply, then our words naming the tool it may not call now
    assert len(last_turns) == 2 and "tools" not in last_turns[1]
    *_, said, asked = last_turns[1]["messages"]
    assert said["role"] == "assistant" and said["content"].removesuffix("…") == stray[:MAX_ECHO_BYTES]
    assert asked["role"] == "user" and f"`{tool}` cannot be called on this turn" in asked["content"]
    assert "report" in asked["content"]
    assert synth_calls(conn, job.id) == [True] * (MAX_TURNS - 1) + [False, True]


def test_a_synthesizer_that_keeps_writing_tool_calls_gets_the_findings_written_up_without_it(conn, script, llm):
    """Every reply calls a tool that does not exist: after MAX_REASKS re-asks the findings are written up by the
    offline writer, which says no model wrote the report; no JSON reaches the user, and the made-up name is not
    echoed back to the model."""
    from rlm_workers.pipeline.synthesize import MAX_REASKS

    stray = json.dumps({"name": "summarize_findings", "parameters": {"style": "brief"}})
    script.synth_tools = lambda req: script.reply("synth-model", f"<tool_call>\n{stray}\n</tool_call>")
    job = run_job(conn, QUESTION, mode="auto")
    r = result_of(job)
    assert job.status == "done", job.error
    assert r.response.startswith("_The synthesizer model kept replying with a tool call it could not make")
    assert A_TEXT in r.response  # the evidence is all there, written up without the model
    assert not any(s in r.response for s in ("summarize_findings", "parameters", "tool_call", "```"))
    assert not r.tool_calls and not r.children
    asked = [last_user_message(b) for b in served(llm, "synth-model")[1:]]
    assert len(asked) == MAX_REASKS
    assert all("the tool it names does not exist" in a and "summarize_findings" not in a for a in asked)
    assert synth_calls(conn, job.id) == [False] * (MAX_REASKS + 1)


def test_a_synthesis_that_outgrows_the_context_ends_with_the_findings_written_up(conn, script, llm):
    """qwen2.5-coder-0.5b under llama-server (8K context) wrote 2,048 tokens of one repeated call, was asked again
    with that reply in the conversation, and the next request was refused as longer than the context: the job
    failed with an empty report.  Now a re-ask sends back only the start of such a reply, and a conversation that
    still outgrows the context ends with the findings written up offline, the job done."""
    from rlm_workers.pipeline.synthesize import MAX_ECHO_BYTES

    repeated = (_LISTING.replace("list_buffers", "summarize_findings") + "\n") * 200
    asked: list[dict] = []

    def respond(req: dict) -> Reply:
        if req.get("model") != "synth-model":
            return script(req)
        asked.append(req)
        if len(asked) == 1:
            return script.reply("synth-model", repeated)
        return Reply(
            status=400,
            error={
                "message": "request (8288 tokens) exceeds the available context size (8192 tokens), try increasing it",
                "type": "exceed_context_size_error",
                "code": 400,
            },
        )

    llm.responder = respond
    job = run_job(conn, QUESTION, mode="auto")
    r = result_of(job)
    assert job.status == "done", job.error
    assert r.response.startswith("_The conversation with the synthesizer outgrew the model's context")
    assert A_TEXT in r.response and "summarize_findings" not in r.response
    echoed = asked[1]["messages"][-2]
    assert echoed["role"] == "assistant" and len(echoed["content"].encode()) <= MAX_ECHO_BYTES + len("…".encode())
    assert len(asked) == 2  # refused for its length: not sent again


def test_a_report_that_quotes_a_tool_call_deep_inside_is_the_report(conn, script, llm):
    """A markdown report with a function call's JSON in a code block is a report, returned as the model wrote it."""
    snippet = json.dumps({"name": "query_subset", "arguments": {"question": "Who runs Zephyrine?"}}, indent=2)
    report = (
        "## Answer\n\nThe billing team runs Zephyrine.\n\n## How it was checked\n\nA follow-up would look like:"
        f"\n\n```json\n{snippet}\n```\n\n## Sources\n\n- a.md"
    )
    script.synth_tools = lambda req: script.reply("synth-model", report)
    job = run_job(conn, QUESTION, mode="auto")
    r = result_of(job)
    assert job.status == "done", job.error
    assert r.response == report and not r.tool_calls and not r.children
    assert synth_calls(conn, job.id) == [True]
    assert len(served(llm, "synth-model")) == 1


# --------------------------------------------------------------------------- 4. a child's worker killed


def test_a_child_whose_worker_is_killed_still_lets_the_parent_finish(conn, script, llm, workers):
    script.hold = lambda q: "Zephyrine" in q
    script.gate.clear()
    root = submit(conn, QUESTION, mode="thinking")

    def child_claimed():
        kids = children(conn, root)
        if len(kids) != 1:
            return None
        rows = batch_rows(conn, kids[0].id)
        return rows and all(b[3] is not None for b in rows) and script.held >= 1

    assert wait_for(child_claimed, timeout=90), job_row(conn, root).stage
    workers["an1"].kill()
    workers["an2"].kill()
    workers["an1"].start()
    script.gate.set()
    job = wait(conn, root, timeout=150)
    r = result_of(job)
    assert job.status == "done", job.error
    assert r.response.strip()
    [child] = r.children
    # redelivered (then it found Quokka) or salvaged by the watchdog (then its batch is lost): either way it ended
    assert child.status == "done", child
    if "Quokka" not in r.response:
        assert [(e.type, e.job_id) for e in r.batch_errors] == [("lost", child.job_id)]


# --------------------------------------------------------------------------- a small model's context


def test_instant_over_a_small_model_context_reads_what_fits_and_names_the_rest(conn, script, llm, corpus):
    """RLM_MODEL_CONTEXT=2048 (llama-server -c 2048): the direct prompt keeps to it, the answer allowance is a
    quarter of it, and the matched chunks left out are named in the gaps (a 1.5B model was sent 17 chunks)."""
    import uuid

    from rlm_workers.pipeline.flow import Stage
    from rlm_workers.pipeline.stages import run_stage
    from rlm_workers.store import jobs as job_store
    from tests.support.envpatch import patched_env

    job_id = "small" + uuid.uuid4().hex
    # stored, not sent: this process runs it, with its own settings, and no worker sees it
    job_store.create_job(
        conn,
        job_id=job_id,
        tenant="local",
        query=BIG_QUESTION,
        buffers=[BUFFER],
        options={"mode": "instant", "search_mode": "bm25"},
    )
    conn.commit()
    before = len(served(llm, "synth-model"))
    with patched_env({"RLM_MODEL_CONTEXT": "2048"}):
        run_stage(job_id, Stage.plan)
    r = result_of(job_row(conn, job_id))
    [body] = served(llm, "synth-model")[before:]
    assert (r.route, r.llm_calls) == ("direct", 1)
    assert body["max_completion_tokens"] == 512
    # the chunks' share: 2048 less 512 for the answer and 1024 for the frame, at ~4 characters a token
    chunks_part = last_user_message(body).split("## Chunks", 1)[1]
    assert len(chunks_part) <= 512 * 4 + 200
    assert r.chunks_analyzed >= 1 and r.chunks_unanswered >= 1
    left_out = [g for g in r.gaps if "did not fit the direct answer's context" in g]
    assert left_out and str(r.unanswered_chunk_ids[0]) in left_out[0]
    assert r.batches_failed == 0 and not any("analyst" in g for g in r.gaps)


def test_a_counting_question_is_not_read_at_the_planners_cap_and_the_job_says_why(conn, corpus):
    """The planner's one plan for every question (direct, threshold 0.4, max_chunks 5) meets "how many": the
    search drops the caps and the job's route_reason says so (the essays hold no records: it is searched)."""
    import uuid

    from rlm_workers.config import get_settings
    from rlm_workers.pipeline import search
    from rlm_workers.pipeline.flow import StageContext
    from rlm_workers.store import jobs as job_store

    job_id = "cap" + uuid.uuid4().hex
    query = "How many practitioners are named in the history notes?"
    job_store.create_job(conn, job_id=job_id, tenant="local", query=query, buffers=[BUFFER], options={})
    same = {"route": "direct", "route_reason": "small", "threshold": 0.4, "max_chunks": 5, "search_mode": "bm25"}
    job_store.save_plan(conn, job_id=job_id, plan=same)
    conn.commit()
    try:
        search.run(StageContext(conn=conn, job=job_row(conn, job_id), settings=get_settings()))
        conn.commit()
        job = job_row(conn, job_id)
        assert "plan corrected" in job.route_reason and "max_chunks=5" in job.route_reason, job.route_reason
        assert job.params.stored()["max_chunks"] != 5 and job.params.stored()["threshold"] != 0.4
        assert sum(len(b.chunk_ids) for b in job_store.batches(conn, job_id=job_id)) > 5
        assert job.plan.stored() == same  # what the planner said stays on record
    finally:
        job_store.cancel_job(conn, job_id=job_id, tenant="local")  # no worker may push it on
        conn.commit()


def test_the_plan_stage_leaves_no_encoder_thread_behind_when_its_job_was_cancelled(conn, corpus):
    """The plan embeds the query in a thread while the planner is asked; the stage waits for that thread even when
    the call is refused because the job was cancelled.  A thread still inside the native encoder when its process
    exits aborts the process: `rlm chat`, whose in-process worker stops as soon as a turn runs out of time."""
    import threading
    import uuid

    from rlm_workers.config import get_settings
    from rlm_workers.errors import JobCancelled
    from rlm_workers.pipeline import plan
    from rlm_workers.pipeline.flow import StageContext
    from rlm_workers.store import jobs as job_store

    job_id = "plancancel" + uuid.uuid4().hex
    query = f"Which practitioner is named in note {uuid.uuid4().hex}?"  # a query no cache has embedded yet
    job_store.create_job(conn, job_id=job_id, tenant="local", query=query, buffers=[BUFFER], options={})
    job = job_row(conn, job_id)
    job_store.cancel_job(conn, job_id=job_id, tenant="local")
    conn.commit()
    with pytest.raises(JobCancelled):
        plan.run(StageContext(conn=conn, job=job, settings=get_settings()))
    conn.commit()
    assert not [t for t in threading.enumerate() if t.name == "rlm-query-vector" and t.is_alive()]
