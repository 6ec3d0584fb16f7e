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
        #: a shared read's chunks graded none go into one {"question": n, "none": [...]} object per question
        self.compact = False
        #: the none lists also name ids this read never sent (neighbouring chunks, of this buffer or another)
        self.foreign = False
        #: question 1's first chunk of every read is left out of both its entries and its none list, every time
        self.leave_out = False
        #: a shared read's first reply is no JSON at all (its retry is answered as usual)
        self.garble = False
        #: the last user message of each retry (a request whose last message is not the one holding the chunks)
        self.retries: list[str] = []
        #: what it answered to each shared read
        self.replies: list[list[dict]] = []

    def entries(self, text: str, question: str, no: int | None) -> list[dict]:
        topic = question.split("about ", 1)[-1].rstrip("?")
        out = []
        for cid, body in _CHUNK.findall(text):
            e = {
                "chunk_id": int(cid),
                "relevance": "high" if topic in body else "none",
                "findings": [f"answer to [{question}] from chunk {cid}"] if topic in body else [],
                "summary": "notes" if topic in body else "",
                "follow_up": [],
            }
            if no is not None and not self.ignore_numbers:
                e["question"] = no
            out.append(e)
        return out

    def shared(self, text: str) -> list[dict]:
        out = []
        sent = [int(c) for c, _ in _CHUNK.findall(text)]
        for n, q in _QUESTION.findall(text):
            es = self.entries(text, q.split("\n\n")[0].strip(), int(n))
            if self.leave_out and n == "1":
                es = es[1:]
            if self.compact:
                none = [e["chunk_id"] for e in es if e["relevance"] == "none"]
                if self.foreign:
                    none += [i for i in range(min(sent) - 20, max(sent) + 21) if i not in sent]
                es = [e for e in es if e["relevance"] != "none"] + (
                    [{"question": int(n), "none": none}] if none else []
                )
            out += es
        return out

    def __call__(self, req: dict) -> Reply | str:
        model, last = req.get("model"), last_user_message(req)
        # a retry repeats the read and adds the complaint after it: the chunks are in the first user message
        text = next((m["content"] for m in req["messages"] if m["role"] == "user"), last)
        if model == "plan-model":
            return json.dumps({"search_mode": "hybrid", "threshold": -1.0})
        if model == "analyst-model":
            if last != text:
                self.retries.append(last)
            if "\n## Questions\n" in text:
                if self.garble and last == text:
                    return "Sorry, I could not read these chunks."
                out = self.shared(text)
                self.replies.append(out)
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
    for name in (
        "notes",
        "notes-again",
        "notes-solo",
        "notes-plain",
        "notes-full",
        "notes-compact",
        "notes-foreign",
        "notes-budget",
        "notes-garbled",
    ):
        load_paths(conn, buffer=name, paths=[root], embedder=embedder)
        conn.commit()
    for name in ("notes-gap",):
        load_paths(conn, buffer=name, paths=[root], embedder=embedder)
        conn.commit()
    return root


@pytest.fixture(scope="module")
def workers(env, corpus, tmp_path_factory):
    pools = {"ctl": ("rlm.control", 4), "an": ("rlm.analyst", 8)}
    with running_workers(env, tmp_path_factory.mktemp("shared-logs"), pools) as ws:
        yield ws


def _run(conn, workers, buffer, *, llm_batch=False, timeout=120.0, options=None):
    from rlm_workers.overnight.submit import submit_overnight
    from rlm_workers.overnight.views import status_of
    from rlm_workers.store import overnight as store

    batch_id, _ = submit_overnight(
        conn,
        tenant="local",
        queries=QUERIES,
        buffers=[buffer],
        options={"scope": "all", "batch_size": 2, "skip_plan": True, **(options or {})},
        llm_batch=llm_batch,
    )
    deadline = time.monotonic() + timeout
    while True:
        b = store.get_overnight(conn, overnight_batch_id=batch_id)
        conn.commit()
        if b.status == "done":
            break
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {n}\n{w.tail(40)}" for n, w in workers.items())
            raise AssertionError(
                f"batch {batch_id} still {b.status}: {store.progress(conn, overnight_batch_id=batch_id)}\n{tails}"
            )
        time.sleep(0.3)
    items = store.items(conn, overnight_batch_id=batch_id)
    st = status_of(conn, b)
    conn.commit()
    return items, st


def _analyst_requests(llm):
    return [r for r in llm.requests if r.body.get("model") == "analyst-model"]


def _parse_oks(conn, job_ids) -> list[bool | None]:
    """``parse_ok`` of the analyst stage's ok rows of these jobs, first call first."""
    from rlm_workers.store.jobs import llm_calls_of

    out = [
        c.parse_ok for j in job_ids for c in llm_calls_of(conn, job_id=j) if c.stage == "analyst" and c.status == "ok"
    ]
    conn.commit()
    return out


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
        "SELECT DISTINCT shared FROM llm_calls c JOIN overnight_batch_items i ON i.job_id = c.job_id "
        "WHERE c.stage = 'analyst' AND i.query = ANY(%s)",
        (QUERIES,),
    ).fetchall()
    conn.commit()
    assert rows == [(4,)]
    # every reply parsed as it came: each member's row of a shared call says so (docs/contract.md#structured-outputs)
    assert _parse_oks(conn, [i.job_id for i in items]) == [True] * 4 * len(QUERIES)
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


def _stored(conn, items) -> dict[str, tuple[list, dict]]:
    """Per query: every stored finding as (file, grade, findings, summary, follow-ups, records), the chunk's id
    taken out of the text, and the item's counts; comparable across buffers of the same files."""
    from rlm_workers.store import jobs as job_store
    from rlm_workers.store.buffers import get_chunks

    out = {}
    for item in items:
        rows = [f for _, f in job_store.findings_of(conn, job_id=item.job_id)]
        paths = {
            cid: c.path for cid, c in get_chunks(conn, tenant="local", chunk_ids=[f.chunk_id for f in rows]).items()
        }
        conn.commit()
        found = sorted(
            (
                paths[f.chunk_id],
                f.relevance,
                [x.replace(f"chunk {f.chunk_id}", "chunk ?") for x in f.findings],
                f.summary,
                f.follow_up,
                [r.model_dump() for r in f.records],
            )
            for f in rows
        )
        counts = {k: v for k, v in item.result.items() if isinstance(v, int) and "token" not in k and "ms" not in k}
        out[item.query] = (found, counts)
    return out


def test_a_compact_none_list_stores_what_full_none_entries_store(conn, workers, llm, model):
    full_items, _ = _run(conn, workers, "notes-full")
    model.compact = True
    model.replies.clear()
    try:
        compact_items, _ = _run(conn, workers, "notes-compact")
        replies = list(model.replies)
    finally:
        model.compact = False
    assert all(i.status == "done" for i in full_items + compact_items)
    # the compact form was really used (and no full object graded none was written)
    assert all(any("none" in e for e in reply) for reply in replies)
    assert not [e for reply in replies for e in reply if e.get("relevance") == "none"]
    full, compact = _stored(conn, full_items), _stored(conn, compact_items)
    assert compact == full
    for found, _ in compact.values():
        assert len(found) == len(TOPICS) and sum(f[1] == "none" for f in found) == len(TOPICS) - 1


def test_a_none_list_naming_chunks_outside_the_read_is_ignored(conn, workers, llm, model):
    model.compact = model.foreign = True
    try:
        items, _ = _run(conn, workers, "notes-foreign")
    finally:
        model.compact = model.foreign = False
    from rlm_workers.store import jobs as job_store

    for item in items:
        assert item.status == "done"
        rows = job_store.findings_of(conn, job_id=item.job_id)
        batches = job_store.batches(conn, job_id=item.job_id)
        conn.commit()
        # each batch holds its own chunks only, once each: the neighbours the lists named were not stored anywhere
        assert sorted((b, f.chunk_id) for b, f in rows) == sorted((b.batch_no, c) for b in batches for c in b.chunk_ids)
        assert [f.relevance for _, f in rows].count("high") == 1
        assert sum(len(b.unanswered) for b in batches) == 0


def test_a_pair_in_neither_an_entry_nor_the_none_list_is_asked_again_then_unanswered(conn, workers, llm, model):
    model.compact = model.leave_out = True
    model.retries.clear()
    try:
        llm.reset()
        items, _ = _run(conn, workers, "notes-gap")
        reads = len(_analyst_requests(llm)) - len(model.retries)
    finally:
        model.compact = model.leave_out = False
    from rlm_workers.store import jobs as job_store

    # one retry per read, naming the missing pair and still offering the compact form
    assert reads == 4 and len(model.retries) == reads
    assert all("question 1: chunks " in r and '"none"' in r for r in model.retries)
    unanswered, stored = 0, 0
    for item in items:
        assert item.status == "done"
        batches = job_store.batches(conn, job_id=item.job_id)
        rows = job_store.findings_of(conn, job_id=item.job_id)
        conn.commit()
        gaps = {c for b in batches for c in b.unanswered}
        assert not gaps & {f.chunk_id for _, f in rows}  # never counted as read
        unanswered += len(gaps)
        stored += len(rows)
    assert unanswered == reads and stored == len(QUERIES) * len(TOPICS) - reads


def test_a_shared_reads_share_is_charged_to_each_jobs_budget(conn, workers, llm):
    """--max-tokens per job: the shared reads spend it, so each job's synthesis is refused (not called)."""
    llm.reset()
    items, _ = _run(conn, workers, "notes-budget", options={"max_tokens": 50})
    assert [i.status for i in items] == ["done"] * len(QUERIES)
    assert len(_analyst_requests(llm)) == 4  # the reads went out, shared, once each
    assert not [r for r in llm.requests if r.body.get("model") != "analyst-model"]  # no synthesis was paid for
    for item in items:
        budget = item.result["budget"]
        assert budget["exhausted"] == "max_tokens", budget
        assert budget["used_tokens"] > 50 and budget["used_llm_calls"] == 4
        assert item.result["sources"]  # the evidence the reads paid for is still reported


def test_a_shared_reads_unparsable_first_reply_is_logged_parse_ok_false_on_every_member(conn, workers, llm, model):
    """The read's first reply is no JSON: each member job's row of that call says parse_ok false, and of the re-ask
    that fixed it, true; the findings are those of the re-ask."""
    model.garble = True
    model.retries.clear()
    try:
        llm.reset()
        items, _ = _run(conn, workers, "notes-garbled")
        retries = list(model.retries)
    finally:
        model.garble = False
    assert len(_analyst_requests(llm)) == 8 and len(retries) == 4  # four reads, each asked once more
    assert all("not a JSON findings object" in r for r in retries)
    for item in items:
        assert item.status == "done"
        assert len(_findings(conn, item.job_id)) == len(TOPICS)
        oks = _parse_oks(conn, [item.job_id])
        assert sorted(oks) == [False] * 4 + [True] * 4, oks
    rows = conn.execute(
        "SELECT c.parse_ok, count(*), min(c.shared) "
        "FROM llm_calls c JOIN overnight_batch_items i ON i.job_id = c.job_id "
        "WHERE c.stage = 'analyst' AND c.status = 'ok' AND i.job_id = ANY(%s) GROUP BY c.parse_ok ORDER BY 1",
        ([i.job_id for i in items],),
    ).fetchall()
    conn.commit()
    assert rows == [(False, 4 * len(QUERIES), 4), (True, 4 * len(QUERIES), 4)]
