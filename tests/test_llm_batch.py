"""The OpenAI Batch API mode of overnight batches (docs/contract.md#llm-batch-api).

First the scripted server's /v1/files and /v1/batches through the real ``openai`` client and our
``BatchClient``; then a 3 × 2 overnight batch run with ``--llm-batch`` on real workers.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest

from rlm_workers.llm.batch_api import BatchClient, parse_line
from rlm_workers.llm.protocol import CompletionRequest
from tests.support.scripted_llm import Reply, ScriptedLLM, last_user_message


def _settings(srv: ScriptedLLM):
    from rlm_workers.config import Settings

    return Settings(api_key="sk-test", base_url=srv.base_url)


def _request(text: str) -> CompletionRequest:
    return CompletionRequest(
        role="analyst", model="analyst-model", messages=[{"role": "user", "content": text}], max_tokens=50
    )


def _responder(req: dict) -> Reply | str:
    text = last_user_message(req)
    if "fail" in text:
        return Reply.http_error(500, "scripted line failure")
    return Reply.text(f"echo {text}", prompt_tokens=100, completion_tokens=7, cached_tokens=40)


def _wait(client: BatchClient, batch_id: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = client.retrieve(batch_id)
        if state.terminal:
            return state
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} not done after {timeout}s: {state}")


def test_files_and_batches_through_the_openai_client():
    import openai

    with ScriptedLLM(_responder) as srv:
        client = openai.OpenAI(api_key="sk-test", base_url=srv.base_url, max_retries=0)
        lines = [
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            for i, body in enumerate(
                [
                    {"model": "m", "messages": [{"role": "user", "content": "one"}]},
                    {"model": "m", "messages": [{"role": "user", "content": "please fail"}]},
                ]
            )
        ]
        data = "".join(json.dumps(x) + "\n" for x in lines).encode()
        f = client.files.create(file=("in.jsonl", data), purpose="batch")
        assert f.purpose == "batch" and f.bytes == len(data)
        assert client.files.content(f.id).content == data
        b = client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"k": "v"}
        )
        deadline = time.monotonic() + 20
        while b.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
            time.sleep(0.05)
            b = client.batches.retrieve(b.id)
        assert b.status == "completed"
        assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (2, 1, 1)
        assert b.metadata == {"k": "v"}
        assert [x.id for x in client.batches.list(limit=10).data] == [b.id]
        out = [json.loads(s) for s in client.files.content(b.output_file_id).text.splitlines()]
        err = [json.loads(s) for s in client.files.content(b.error_file_id).text.splitlines()]
        assert [o["custom_id"] for o in out] == ["r0"] and [e["custom_id"] for e in err] == ["r1"]
        assert out[0]["response"]["status_code"] == 200
        assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == "echo one"
        assert err[0]["response"]["status_code"] == 500 and err[0]["response"]["body"]["error"]["message"]
        # batch lines are counted apart from synchronous calls, their usage with everything else
        assert srv.calls == 0 and srv.stats()["batch_calls"] == 2 and srv.usage["prompt_tokens"] == 100


def test_batch_client_round_trip_with_usage_and_failed_line():
    with ScriptedLLM(_responder) as srv:
        client = BatchClient(_settings(srv))
        reqs = {"read-1": _request("alpha"), "read-2": _request("fail here"), "read-3": _request("gamma")}
        state = client.submit([client.line(k, r) for k, r in reqs.items()], metadata={"rlm_overnight": "b1"})
        assert client.custom_ids(state.input_file_id) == list(reqs)
        # the body is what an ordinary call sends (OpenAIProvider._params)
        body = json.loads(client._client.files.content(state.input_file_id).text.splitlines()[0])["body"]
        assert body["max_completion_tokens"] == 50 and body["model"] == "analyst-model"
        state = _wait(client, state.id)
        assert state.status == "completed" and state.counts == {"total": 3, "completed": 2, "failed": 1}
        lines = client.results(state, "analyst-model")
        assert set(lines) == set(reqs)
        ok = lines["read-1"].completion
        assert ok is not None and ok.text == "echo alpha"
        assert (ok.tokens_in, ok.tokens_out, ok.cached_tokens) == (100, 7, 40)
        assert lines["read-2"].completion is None and "500" in lines["read-2"].error
        assert [s.id for s in client.recent()] == [state.id] and client.recent()[0].metadata == {"rlm_overnight": "b1"}


def test_held_batch_stays_in_progress_and_expired_batch_leaves_lines_unanswered():
    with ScriptedLLM(_responder) as srv:
        client = BatchClient(_settings(srv))
        srv.hold_batches()
        state = client.submit([client.line("a", _request("x"))], metadata={})
        time.sleep(0.3)
        assert client.retrieve(state.id).status == "in_progress" and srv.stats()["batch_calls"] == 0
        srv.release_batches()
        assert _wait(client, state.id).status == "completed"
        srv.expire_after = 1
        state = client.submit([client.line(c, _request(c)) for c in ("a", "b", "c")], metadata={})
        state = _wait(client, state.id)
        assert state.status == "expired" and set(client.results(state, "m")) == {"a"}


def test_errors_are_one_line_llm_errors():
    from rlm_workers.errors import LLMError

    with ScriptedLLM(_responder) as srv:
        client = BatchClient(_settings(srv))
        with pytest.raises(LLMError) as exc:
            client.retrieve("batch_nope")
        assert not exc.value.retryable and "\n" not in exc.value.message
    from rlm_workers.config import Settings

    gone = BatchClient(Settings(api_key="sk-test", base_url="http://127.0.0.1:9/v1"))
    with pytest.raises(LLMError) as exc:
        gone.retrieve("batch_x")
    assert exc.value.retryable


def test_parse_line_edge_cases():
    assert parse_line("not json", "m").completion is None
    line = parse_line(json.dumps({"custom_id": "x", "response": None, "error": {"code": "e", "message": "boom"}}), "m")
    assert line.custom_id == "x" and line.completion is None and "boom" in line.error
    bad = {"custom_id": "y", "response": {"status_code": 200, "body": {"choices": []}}, "error": None}
    assert parse_line(json.dumps(bad), "m").completion is None


# --------------------------------------------------------------------------- advance, against fakes of the reads API
# Stand-ins for pipeline/reads.py and store/reads.py on the real tables: they keep these tests about submitting,
# polling and routing apart from the analyst's parsing (the end-to-end test below runs the real ones).


class FakeReads:
    """pipeline.reads: the request of a read, applying an answer, falling back to an ordinary call."""

    def __init__(self) -> None:
        self.applied: list[tuple[int, str, str]] = []
        self.sent: list[int] = []

    def request_for(self, conn, read_id: int) -> CompletionRequest | None:
        chunks = conn.execute("SELECT chunk_ids FROM reads WHERE id = %s", (read_id,)).fetchone()[0]
        if not chunks:
            return None
        return _request(f"read {read_id} chunks {chunks}")

    def apply_completion(self, read_id: int, completion, *, via: str = "sync") -> str:
        from rlm_workers.store.db import connection

        self.applied.append((read_id, completion.text, via))
        with connection() as c:
            c.execute("UPDATE reads SET status = 'done', finished_at = now() WHERE id = %s", (read_id,))
        return "done"

    def send_read(self, read_id: int) -> None:
        from rlm_workers.store.db import connection

        self.sent.append(read_id)
        with connection() as c:
            c.execute("UPDATE reads SET status = 'pending' WHERE id = %s", (read_id,))


class FakeReadStore:
    @staticmethod
    def queued_reads(conn, *, overnight_id: str, limit: int) -> list[int]:
        rows = conn.execute(
            "SELECT id FROM reads WHERE overnight_id = %s AND status = 'queued' ORDER BY id LIMIT %s",
            (overnight_id, limit),
        )
        return [r[0] for r in rows]

    @staticmethod
    def mark_submitted(conn, *, read_ids, provider_batch_id: str) -> None:
        conn.execute(
            "UPDATE reads SET status = 'submitted', provider_batch_id = %s WHERE id = ANY(%s) AND status = 'queued'",
            (provider_batch_id, list(read_ids)),
        )

    @staticmethod
    def reads_of_provider_batch(conn, *, provider_batch_id: str) -> list[tuple[int, str]]:
        rows = conn.execute(
            "SELECT id, status FROM reads WHERE provider_batch_id = %s ORDER BY id", (provider_batch_id,)
        )
        return [(r[0], r[1]) for r in rows]


@pytest.fixture()
def fakes(monkeypatch):
    from rlm_workers.overnight import llm_batch

    reads = FakeReads()
    monkeypatch.setattr(llm_batch, "_reads", lambda: reads)
    monkeypatch.setattr(llm_batch, "_read_store", lambda: FakeReadStore)
    return reads


def _overnight(n_reads: int, *, texts: dict[int, str] | None = None) -> tuple[str, list[int], list[str]]:
    """An overnight batch with one job per read, each read queued over chunks [1, 2]."""
    import uuid

    from rlm_workers.store import jobs as job_store
    from rlm_workers.store import overnight as ostore
    from rlm_workers.store.db import connection

    batch_id = uuid.uuid4().hex
    with connection() as c:
        ostore.create_overnight(
            c,
            overnight_batch_id=batch_id,
            tenant="t1",
            queries=["q"],
            buffers=["b"],
            options={},
            run_at=None,
            priority=3,
            token_budget=None,
            tick_token="x",
            llm_batch=True,
        )
        jobs, reads = [], []
        for _ in range(n_reads):
            job_id = uuid.uuid4().hex
            job_store.create_job(c, job_id=job_id, tenant="t1", query="q", buffers=["b"], options={})
            rid = c.execute(
                "INSERT INTO reads (tenant, overnight_id, chunk_ids, status, llm_batch) "
                "VALUES ('t1', %s, '{1,2}', 'queued', true) RETURNING id",
                (batch_id,),
            ).fetchone()[0]
            c.execute("INSERT INTO read_members VALUES (%s, %s, 0, 1)", (rid, job_id))
            jobs.append(job_id)
            reads.append(rid)
    return batch_id, reads, jobs


def _db(sql: str, params: tuple = ()) -> list[tuple]:
    from rlm_workers.store.db import connection

    with connection() as c:
        return c.execute(sql, params).fetchall()


def _until_routed(batch_id: str, settings, timeout: float = 30.0) -> list[str]:
    from rlm_workers.overnight import llm_batch

    actions: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        actions += llm_batch.advance(batch_id, settings)
        if not _db("SELECT 1 FROM provider_batches WHERE overnight_id = %s AND finished_at IS NULL", (batch_id,)):
            return actions
        time.sleep(0.05)
    raise AssertionError(f"provider batches of {batch_id} not routed: {actions}")


def _fail_read(srv: ScriptedLLM, read_id: int) -> None:
    srv.responder = lambda req: (
        Reply.http_error(500, "scripted line failure")
        if f"read {read_id} " in last_user_message(req)
        else _responder(req)
    )


def test_advance_submits_once_keeps_jobs_alive_and_routes_lines(rlm_env, fakes):
    from concurrent.futures import ThreadPoolExecutor

    from rlm_workers.config import Settings
    from rlm_workers.overnight import llm_batch

    batch_id, reads, jobs = _overnight(3)
    with ScriptedLLM(_responder) as srv:
        settings = Settings(api_key="sk-test", base_url=srv.base_url, llm_batch_poll_seconds=0.01)
        _fail_read(srv, reads[1])
        srv.hold_batches()
        _db("UPDATE jobs SET stage_at = now() - interval '1 hour' WHERE id = ANY(%s) RETURNING id", (jobs,))
        # two advances at once (a redelivered tick): the reads go out in one provider batch, once
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda _: llm_batch.advance(batch_id, settings), range(2)))
        assert len(srv.batches) == 1, results
        pb = srv.batches[0]
        assert pb["metadata"] == {"rlm_overnight": batch_id}
        assert (
            _db("SELECT status, provider_batch_id FROM reads WHERE id = ANY(%s)", (reads,))
            == [("submitted", pb["id"])] * 3
        )
        assert _db("SELECT requests, status FROM provider_batches WHERE id = %s", (pb["id"],))[0][0] == 3
        # held in_progress: polled, nothing routed, the waiting jobs marked alive
        time.sleep(0.1)
        llm_batch.advance(batch_id, settings)
        idle = _db("SELECT max(extract(epoch FROM now() - stage_at)) FROM jobs WHERE id = ANY(%s)", (jobs,))[0][0]
        assert idle < 60 and fakes.applied == [] and fakes.sent == []
        srv.release_batches()
        _until_routed(batch_id, settings)
    assert sorted(r for r, _, _ in fakes.applied) == [reads[0], reads[2]]
    assert {via for _, _, via in fakes.applied} == {"batch_api"} and fakes.sent == [reads[1]]
    assert _db("SELECT status FROM provider_batches WHERE id = %s", (pb["id"],)) == [("routed",)]


def test_cancelling_the_overnight_batch_cancels_its_provider_batches(rlm_env, fakes):
    from rlm_workers.config import Settings
    from rlm_workers.overnight import llm_batch
    from rlm_workers.overnight.scheduler import run_tick
    from rlm_workers.overnight.submit import cancel_overnight
    from rlm_workers.store.db import connection, release_session_lock, session_lock_key, try_session_lock

    batch_id, reads, _ = _overnight(3)
    with ScriptedLLM(_responder) as srv:
        settings = Settings(api_key="sk-test", base_url=srv.base_url, llm_batch_poll_seconds=0.01)
        srv.hold_batches()
        llm_batch.advance(batch_id, settings)
        assert len(srv.batches) == 1
        pb = srv.batches[0]["id"]
        # a read queued after the submission: it must never reach the provider
        late = _db(
            "INSERT INTO reads (tenant, overnight_id, chunk_ids, status, llm_batch) "
            "VALUES ('t1', %s, '{3}', 'queued', true) RETURNING id",
            (batch_id,),
        )[0][0]
        with connection() as c:
            assert cancel_overnight(c, tenant="t1", overnight_batch_id=batch_id).status == "cancelled"
        # an advance begun before the cancel still holds the batch: the tick leaves it be (and comes back later)
        with connection() as holder:
            key = session_lock_key(llm_batch._LOCK_SPACE, batch_id)
            assert try_session_lock(holder, key)
            with connection() as c:
                held = run_tick(c, batch_id, None, settings=settings).actions
            assert held == [f"batch {batch_id}: held by an advance; cancelling its provider batches in 2.0 s"]
            assert srv.batches[0]["status"] == "in_progress"
            release_session_lock(holder, key)
        with connection() as c:
            res = run_tick(c, batch_id, None, settings=settings)  # the tick that comes back
        assert res.status == "cancelled", res
        assert any(pb in line and "3 reads closed" in line for line in res.actions), res.actions
        assert srv.batches[0]["status"] in ("cancelling", "cancelled")
        assert _db("SELECT status, finished_at IS NOT NULL FROM provider_batches WHERE id = %s", (pb,))[0][1]
        got = dict(_db("SELECT id, status FROM reads WHERE overnight_id = %s", (batch_id,)))
        assert got == {r: "failed" for r in [*reads, late]}
        # nothing routed or re-sent as an ordinary call, and no second provider batch
        assert fakes.applied == [] and fakes.sent == [] and len(srv.batches) == 1
        with connection() as c:
            assert run_tick(c, batch_id, None, settings=settings).actions == []  # a later tick: nothing open


def test_expired_batch_falls_back_and_nothing_left_to_ask_is_closed(rlm_env, fakes):
    from rlm_workers.config import Settings

    batch_id, reads, _ = _overnight(4)
    _db("UPDATE reads SET chunk_ids = '{}' WHERE id = %s RETURNING id", (reads[3],))  # request_for → None
    with ScriptedLLM(_responder) as srv:
        srv.expire_after = 1
        settings = Settings(api_key="sk-test", base_url=srv.base_url, llm_batch_poll_seconds=0.01)
        _until_routed(batch_id, settings)
        assert srv.stats()["batch_calls"] == 1 and len(srv.batches) == 1
    assert [r for r, _, _ in fakes.applied] == [reads[0]] and fakes.sent == reads[1:3]
    assert _db("SELECT status FROM reads WHERE id = %s", (reads[3],)) == [("done",)]
    err = _db("SELECT error FROM provider_batches WHERE overnight_id = %s", (batch_id,))[0][0]
    assert err["type"] == "expired"


def test_batch_created_but_never_recorded_is_adopted(rlm_env, fakes):
    from rlm_workers.config import Settings
    from rlm_workers.llm.batch_api import BatchClient

    batch_id, reads, _ = _overnight(2)
    with ScriptedLLM(_responder) as srv:
        settings = Settings(api_key="sk-test", base_url=srv.base_url, llm_batch_poll_seconds=0.01)
        client = BatchClient(settings)
        # what a worker killed between the provider's accept and our commit leaves behind
        orphan = client.submit([client.line(f"read-{reads[0]}", _request("x"))], metadata={"rlm_overnight": batch_id})
        _until_routed(batch_id, settings)
        ids = [b["id"] for b in srv.batches]
    assert ids[0] == orphan.id and len(ids) == 2  # the orphan took read 0; only read 1 went out again
    assert sorted(r for r, _, _ in fakes.applied) == reads and fakes.sent == []


def test_endpoint_without_batch_api_sends_reads_as_ordinary_calls(rlm_env, fakes):
    from rlm_workers.config import Settings
    from rlm_workers.overnight import llm_batch

    batch_id, reads, _ = _overnight(2)
    with ScriptedLLM(_responder) as srv:
        settings = Settings(api_key="sk-test", base_url=srv.base_url + "/nothing-here")
        actions = llm_batch.advance(batch_id, settings)
    assert fakes.sent == reads and any("ordinary calls" in a for a in actions)


# --------------------------------------------------------------------------- end to end: a 3 × 2 overnight batch

E2E_QUERIES = [
    "What do practitioners of falconry disagree about?",
    "How old is the history of canal locks?",
    "Which instruments are used for sundials today?",
]
_CHUNK = re.compile(r"### Chunk (\d+)\n\nsource: [^\n]*\n\n<content>\n(.*?)\n</content>", re.S)
_QUESTION = re.compile(r"^### Question (\d+)$", re.M)
#: what the scripted analyst bills per call, so the test can price it
ANALYST_USAGE = {"prompt_tokens": 1200, "completion_tokens": 300, "cached_tokens": 200}
PRICES = {"analyst-model": {"input": 1.0, "cached_input": 0.5, "output": 4.0}}


class E2EModel:
    """Planner: hybrid search keeping everything.  Analyst: a finding per (question, chunk); its first call fails
    (a Batch API line, since batches are the first analyst calls) and later ones answer.  Synthesizer: echoes."""

    def __init__(self) -> None:
        self.analyst_calls = 0
        self.lock = threading.Lock()

    def __call__(self, req: dict) -> Reply | str:
        model, text = req.get("model"), last_user_message(req)
        if model == "plan-model":
            return json.dumps({"search_mode": "hybrid", "threshold": -1.0})
        if model == "analyst-model":
            with self.lock:
                self.analyst_calls += 1
                first = self.analyst_calls == 1
            if first:
                return Reply.http_error(500, "scripted: this line fails")
            questions = [int(q) for q in _QUESTION.findall(text)] or [None]
            out = [
                {
                    "chunk_id": int(cid),
                    "relevance": "medium",
                    "findings": [body.strip().splitlines()[0]],
                    "summary": "notes",
                    "follow_up": [],
                    **({"question": q} if q is not None else {}),
                }
                for q in questions
                for cid, body in _CHUNK.findall(text)
            ]
            return Reply.text(json.dumps(out), **ANALYST_USAGE)
        query = re.search(r"## Query\n\n(.*?)\n\n", text, re.S)
        return f"## Answer\n\nScripted answer to: {query.group(1) if query else '?'}"


def _essay(topic: str) -> str:
    return (
        f"# Notes on {topic}\n\nPeople who study {topic} keep careful records. The history of {topic} goes "
        f"back several centuries. Practitioners of {topic} often disagree about methods.\n"
    )


@pytest.fixture(scope="module")
def e2e_llm():
    with ScriptedLLM(E2EModel()) as srv:
        yield srv


@pytest.fixture(scope="module")
def e2e_env(rlm_env, e2e_llm):
    from tests.support.workers import scripted_env

    with scripted_env(
        rlm_env,
        e2e_llm,
        RLM_LLM_RETRIES="1",
        RLM_BATCH_PARALLEL="6",
        RLM_BATCH_TICK_SECONDS="0.5",
        RLM_LLM_BATCH_POLL_SECONDS="0.5",
        RLM_RECONCILE_SECONDS="1",
        # short, so the provider batch is held longer than a job may sit idle: only the touch keeps them alive
        RLM_JOB_TIMEOUT="7",
        RLM_VISIBILITY_TIMEOUT="8",
        RLM_PRICES=json.dumps(PRICES),
    ) as env:
        yield env


@pytest.fixture(scope="module")
def e2e_workers(e2e_env, conn, embedder, tmp_path_factory):
    from rlm_workers.ingest.loader import load_paths
    from tests.support.workers import running_workers

    root = tmp_path_factory.mktemp("llmbatch-corpus")
    for name, topics in (("alpha", ["falconry", "canal locks"]), ("beta", ["sundials", "windmills"])):
        d = root / name
        d.mkdir()
        for i, topic in enumerate(topics):
            (d / f"{i}-{topic.replace(' ', '-')}.md").write_text(_essay(topic))
        load_paths(conn, buffer=name, paths=[d], embedder=embedder)
        conn.commit()
    logs = tmp_path_factory.mktemp("llmbatch-logs")
    with running_workers(e2e_env, logs, {"lbctl": ("rlm.control", 4), "lban": ("rlm.analyst", 4)}) as ws:
        yield ws


def _rows(conn, sql: str, params: tuple = ()) -> list[tuple]:
    rows = conn.execute(sql, params).fetchall()
    conn.commit()
    return rows


def _wait_for(what: str, check, workers, timeout: float = 120.0, state=None):
    """Wait for ``check()``; on a timeout, say what ``state()`` shows and the workers' last log lines."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    tails = "\n".join(f"--- {n}\n{w.tail(40)}" for n, w in workers.items())
    raise AssertionError(f"timed out waiting for {what}\n{state() if state else ''}\n{tails}")


def test_overnight_batch_through_the_batch_api_with_a_failed_line_and_a_control_restart(
    e2e_env, e2e_llm, e2e_workers, conn, tmp_path
):
    import subprocess
    import sys

    from rlm_workers.llm.prices import cost_usd, parse_prices
    from rlm_workers.store import overnight as ostore
    from tests.support.workers import ROOT

    srv, ctl = e2e_llm, e2e_workers["lbctl"]
    srv.hold_batches()
    qfile = tmp_path / "q.txt"
    qfile.write_text("\n".join(E2E_QUERIES) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", "batch", "submit", "--queries", str(qfile)]
        + ["--buffer", "alpha", "--buffer", "beta", "--llm-batch"],
        cwd=ROOT,
        env={**os.environ, **e2e_env},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    batch_id = proc.stdout.strip()

    def all_submitted() -> bool:
        jobs = _rows(
            conn,
            "SELECT count(DISTINCT m.job_id) FROM reads r JOIN read_members m ON m.read_id = r.id "
            "WHERE r.overnight_id = %s",
            (batch_id,),
        )[0][0]
        queued = _rows(conn, "SELECT count(*) FROM reads WHERE overnight_id = %s AND status = 'queued'", (batch_id,))
        return jobs == 6 and queued[0][0] == 0

    def jobs_and_reads() -> str:
        jobs = _rows(
            conn,
            "SELECT j.id, j.status, j.stage, j.error FROM jobs j JOIN overnight_batch_items i ON i.job_id = j.id "
            "WHERE i.overnight_batch_id = %s",
            (batch_id,),
        )
        reads = _rows(conn, "SELECT id, status FROM reads WHERE overnight_id = %s", (batch_id,))
        return f"jobs: {jobs}\nreads: {reads}"

    _wait_for("every read in a provider batch", all_submitted, e2e_workers, state=jobs_and_reads)
    held_since = time.monotonic()
    n_reads = _rows(conn, "SELECT count(*) FROM reads WHERE overnight_id = %s", (batch_id,))[0][0]
    assert srv.batches and all(b["metadata"] == {"rlm_overnight": batch_id} for b in srv.batches)

    # the control worker dies while the provider batch is in flight, and comes back
    ctl.kill()
    ctl.start()
    # held longer than RLM_JOB_TIMEOUT (and the batch's stall check): the waiting jobs are kept alive
    time.sleep(max(0.0, 12 - (time.monotonic() - held_since)))
    assert [b["status"] for b in srv.batches] == ["in_progress"] * len(srv.batches)
    items = _rows(conn, "SELECT status, attempts FROM overnight_batch_items WHERE overnight_batch_id = %s", (batch_id,))
    assert items == [("running", 0)] * 6, items
    assert srv.stats()["batch_calls"] == 0 and not any(r.body.get("model") == "analyst-model" for r in srv.requests)

    srv.release_batches()

    def finished():
        b = ostore.get_overnight(conn, overnight_batch_id=batch_id)
        conn.commit()
        return b if b.status in ("done", "cancelled") else None

    b = _wait_for("the overnight batch to finish", finished, e2e_workers, timeout=120)
    assert b.status == "done"
    items = _rows(
        conn, "SELECT status, attempts, result FROM overnight_batch_items WHERE overnight_batch_id = %s", (batch_id,)
    )
    assert [(s, a) for s, a, _ in items] == [("done", 0)] * 6
    assert all("Scripted answer to" in json.dumps(r) for _, _, r in items)
    # each read went out once through the Batch API; the one failed line fell back to one ordinary call
    assert srv.stats()["batch_calls"] == n_reads
    assert sum(1 for r in srv.requests if r.body.get("model") == "analyst-model") == 1
    assert _rows(conn, "SELECT DISTINCT status FROM provider_batches WHERE overnight_id = %s", (batch_id,)) == [
        ("routed",)
    ]
    assert _rows(conn, "SELECT DISTINCT status FROM reads WHERE overnight_id = %s", (batch_id,)) == [("done",)]
    # exact usage from the output lines, priced at half; the fallback at the full price
    calls = _rows(
        conn,
        "SELECT c.via, c.status, sum(c.tokens_in), sum(c.cached_tokens), sum(c.tokens_out), sum(c.cost_usd), "
        "count(*) FROM llm_calls c JOIN overnight_batch_items i ON i.job_id = c.job_id "
        "WHERE i.overnight_batch_id = %s AND c.stage = 'analyst' GROUP BY c.via, c.status ORDER BY c.via",
        (batch_id,),
    )
    by_via = {via: row for via, status, *row in calls if status == "ok"}
    assert set(by_via) == {"batch_api", "sync"}, calls
    table = parse_prices(json.dumps(PRICES))
    for via, (tin, cached, tout, cost, _n) in by_via.items():
        assert tin % ANALYST_USAGE["prompt_tokens"] == 0 and cached > 0
        full = cost_usd("analyst-model", tin, cached, tout, table)
        assert cost == pytest.approx(full * (0.5 if via == "batch_api" else 1.0), rel=1e-6)
    assert by_via["batch_api"][0] == (n_reads - 1) * ANALYST_USAGE["prompt_tokens"]
    # a Batch API line's reply is parsed before its rows are written, as a sync read's is
    oks = _rows(
        conn,
        "SELECT DISTINCT c.via, c.parse_ok FROM llm_calls c JOIN overnight_batch_items i ON i.job_id = c.job_id "
        "WHERE i.overnight_batch_id = %s AND c.stage = 'analyst' AND c.status = 'ok' ORDER BY c.via",
        (batch_id,),
    )
    assert oks == [("batch_api", True), ("sync", True)], oks


def test_llm_batch_is_refused_without_an_api_key(rlm_env, tmp_path):
    import subprocess
    import sys

    from tests.support.workers import ROOT

    qfile = tmp_path / "q.txt"
    qfile.write_text("a question\n")
    env = {k: v for k, v in {**os.environ, **rlm_env}.items() if k not in ("OPENAI_API_KEY", "RLM_API_KEY")}
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", "batch", "submit", "--queries", str(qfile), "--buffer", "x"]
        + ["--llm-batch", "--no-check-workers"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--llm-batch needs an OpenAI API key" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
