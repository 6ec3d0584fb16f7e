"""Shared reads end to end (docs/contract.md#shared-reads): an overnight batch's questions over one buffer read
each chunk batch once, through real worker processes, PostgreSQL and the scripted OpenAI-protocol server."""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.support.scripted_llm import Reply, last_user_message
from tests.support.workers import running_workers, scripted_env

pytestmark = pytest.mark.slow

TOPICS = ["falconry", "canal locks", "sundials", "windmills", "salt marshes", "clockmaking", "kelp forests", "ice"]
QUERIES = [f"What do the notes say about {t}?" for t in ("falconry", "sundials", "kelp forests", "clockmaking")]
_CHUNK = re.compile(r"### Chunk (\d+)\n\nsource: [^\n]*\n\n<content>\n(.*?)\n</content>", re.S)
_QUESTION = re.compile(r"### Question (\d+)\n\n(.*?)(?=\n\n### Question |\n\n## Reply)", re.S)


class Model:
    """Planner: keep everything.  Analyst: per chunk and question, a finding naming the question it answers (so a
    finding filed under the wrong job shows), graded high when the chunk is about the question's topic."""

    def __init__(self) -> None:
        self.ignore_numbers = False

    def entries(self, text: str, question: str, no: int | None) -> list[dict]:
        topic = question.split("about ", 1)[-1].rstrip("?")
        out = []
        for cid, body in _CHUNK.findall(text):
            e = {
                "chunk_id": int(cid),
                "relevance": "high" if topic in body else "none",
                "findings": [f"answer to [{question}] from chunk {cid}"] if topic in body else [],
                "summary": "notes",
                "follow_up": [],
            }
            if no is not None and not self.ignore_numbers:
                e["question"] = no
            out.append(e)
        return out

    def __call__(self, req: dict) -> Reply | str:
        model, text = req.get("model"), last_user_message(req)
        if model == "plan-model":
            return json.dumps({"search_mode": "hybrid", "threshold": -1.0})
        if model == "analyst-model":
            if "\n## Questions\n" in text:
                out = [
                    e
                    for n, q in _QUESTION.findall(text)
                    for e in self.entries(text, q.split("\n\n")[0].strip(), int(n))
                ]
            else:
                out = self.entries(text, re.search(r"## Query\n\n(.*?)\n\n## ", text, re.S).group(1), None)
            return json.dumps(out)
        query = re.search(r"## Query\n\n(.*?)\n\n", text, re.S)
        return f"## Answer\n\nScripted answer to: {query.group(1) if query else '?'}"


@pytest.fixture(scope="module")
def model():
    return Model()


@pytest.fixture(scope="module")
def env(rlm_env, llm):
    with scripted_env(
        rlm_env,
        llm,
        RLM_BATCH_TICK_SECONDS="0.3",
        RLM_BATCH_PARALLEL="4",
        RLM_SHARED_READ_QUESTIONS="4",
        RLM_MAX_CONCURRENCY="8",
        RLM_LLM_RETRIES="1",
    ) as e:
        yield e


@pytest.fixture(scope="module")
def corpus(env, conn, embedder, tmp_path_factory):
    from rlm_workers.ingest.loader import load_paths

    root = tmp_path_factory.mktemp("shared-corpus")
    for i, topic in enumerate(TOPICS):
        (root / f"{i}-{topic.replace(' ', '-')}.md").write_text(
            f"# Notes on {topic}\n\nPeople who study {topic} keep careful records of {topic}.\n"
        )
    for name in ("notes", "notes-again", "notes-solo", "notes-plain"):
        load_paths(conn, buffer=name, paths=[root], embedder=embedder)
        conn.commit()
    return root


@pytest.fixture(scope="module")
def workers(env, corpus, tmp_path_factory):
    pools = {"ctl": ("rlm.control", 4), "an": ("rlm.analyst", 8)}
    with running_workers(env, tmp_path_factory.mktemp("shared-logs"), pools) as ws:
        yield ws


def _run(conn, workers, buffer, *, llm_batch=False, timeout=120.0):
    from rlm_workers.overnight.submit import status_of, submit_overnight
    from rlm_workers.store import overnight as store

    batch_id, _ = submit_overnight(
        conn,
        tenant="local",
        queries=QUERIES,
        buffers=[buffer],
        options={"scope": "all", "batch_size": 2, "skip_plan": True},
        llm_batch=llm_batch,
    )
    deadline = time.monotonic() + timeout
    while True:
        b = store.get_overnight(conn, batch_id=batch_id)
        conn.commit()
        if b.status == "done":
            break
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {n}\n{w.tail(40)}" for n, w in workers.items())
            raise AssertionError(
                f"batch {batch_id} still {b.status}: {store.progress(conn, batch_id=batch_id)}\n{tails}"
            )
        time.sleep(0.3)
    items = store.items(conn, batch_id=batch_id)
    st = status_of(conn, b)
    conn.commit()
    return items, st


def _analyst_requests(llm):
    return [r for r in llm.requests if r.body.get("model") == "analyst-model"]


def _findings(conn, job_id):
    from rlm_workers.store import jobs as job_store

    rows = job_store.findings_of(conn, job_id=job_id)
    conn.commit()
    return {cid: f for cid, f in ((f.chunk_id, f) for _, f in rows)}


def test_questions_over_one_buffer_read_each_chunk_batch_once(conn, workers, llm):
    llm.reset()
    items, st = _run(conn, workers, "notes")
    assert [i.status for i in items] == ["done"] * len(QUERIES)
    analyst = _analyst_requests(llm)
    # 8 chunks in batches of 2: four reads in all, each answering the four questions (not 16 calls)
    assert len(analyst) == 4
    assert all(last_user_message(r.body).count("### Question ") == 4 for r in analyst)
    for item in items:
        found = _findings(conn, item.job_id)
        assert len(found) == len(TOPICS)  # every chunk answered for this question, none unanswered
        for f in found.values():
            # each job holds only what was said about its own question
            assert all(f"[{item.query}]" in x for x in f.findings)
        assert any(f.relevance == "high" for f in found.values())
        assert item.result["batches_failed"] == 0 and item.result["sources"]
    rows = conn.execute(
        "SELECT DISTINCT shared FROM llm_calls c JOIN batch_items i ON i.job_id = c.job_id "
        "WHERE c.stage = 'analyst' AND i.query = ANY(%s)",
        (QUERIES,),
    ).fetchall()
    conn.commit()
    assert rows == [(4,)]
    # what the analysts read, with sharing, against what four separate reads would have cost
    assert 0 < st["analyst_tokens_in"] < 0.6 * st["analyst_tokens_in_unshared"]


def test_results_have_the_same_shape_and_evidence_as_reads_alone(conn, workers, llm, env):
    """The same batch with sharing off (a control worker started with RLM_SHARED_READ_QUESTIONS=1) cites the
    same chunks with the same grades for every question.  (Another buffer of the same files each time: the result
    cache would answer a repeat.)"""
    from tests.support.workers import WorkerProcess

    shared_items, _ = _run(conn, workers, "notes-again")
    workers["ctl"].stop()
    solo_ctl = WorkerProcess(
        "ctl-solo",
        queues="rlm.control",
        env={**env, "RLM_SHARED_READ_QUESTIONS": "1"},
        log_dir=workers["ctl"].log_path.parent,
        concurrency=4,
    ).start()
    try:
        llm.reset()
        solo_items, _ = _run(conn, {**workers, "ctl": solo_ctl}, "notes-solo")
        analyst = _analyst_requests(llm)
        assert len(analyst) == 4 * len(QUERIES)
        assert all("### Question" not in last_user_message(r.body) for r in analyst)
    finally:
        solo_ctl.stop()
        workers["ctl"].start()
    by_query = {i.query: i for i in solo_items}
    for item in shared_items:
        alone = by_query[item.query]
        assert alone.status == item.status == "done"
        assert set(item.result) == set(alone.result)
        shared_f = {cid: (f.relevance, len(f.findings)) for cid, f in _findings(conn, item.job_id).items()}
        alone_f = {cid: (f.relevance, len(f.findings)) for cid, f in _findings(conn, alone.job_id).items()}
        assert sorted(shared_f.values()) == sorted(alone_f.values())


def test_a_reply_without_question_numbers_is_reported_unanswered_not_misfiled(conn, workers, llm, model):
    model.ignore_numbers = True
    try:
        llm.reset()
        from rlm_workers.store import jobs as job_store

        items, _ = _run(conn, workers, "notes-plain")
    finally:
        model.ignore_numbers = False
    for item in items:
        assert item.status == "done"
        # nothing attributed to a question the reply did not name; every chunk is accounted for as unanswered
        assert _findings(conn, item.job_id) == {}
        batches = job_store.batches(conn, job_id=item.job_id)
        conn.commit()
        assert sum(len(b.unanswered) for b in batches) == len(TOPICS)
