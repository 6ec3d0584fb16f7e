"""Code mode end to end (docs/contract.md#code-mode): real worker processes, Redis and PostgreSQL, the scripted
OpenAI-protocol server writing the root model's programs, the sandbox running them, and the programs'
sub-model calls fanned out as a chord of ``rlm.subcall`` tasks on the analyst workers.

The corpus is a log of user actions whose exact counts the test computes itself, and a notes file."""

from __future__ import annotations

import os
import re
import threading
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from tests.support.jobs import wait_for
from tests.support.scripted_llm import Reply, last_user_message
from tests.support.workers import running_workers, scripted_env

pytestmark = pytest.mark.slow

BUFFER = "codelog"
USERS = ("alice", "bob", "carol", "dave")
ACTIONS = ("login", "upload", "error", "logout")
#: (prompt, completion) tokens each model's replies report, so the tree's totals can be recomputed
TOKENS = {"plan-model": (200, 40), "analyst-model": (50, 5)}


def log_lines() -> list[str]:
    """600 lines: user and action cycle with different periods, so every count differs and none is guessable."""
    out = []
    for i in range(600):
        user = USERS[(i * 7 + i // 5) % len(USERS)]
        action = ACTIONS[(i * 3 + i // 11) % len(ACTIONS)]
        detail = "disk full" if action == "error" and i % 3 == 0 else "timeout" if action == "error" else "ok"
        out.append(f"2026-03-{1 + i // 50:02d}T{i % 24:02d}:00 user={user} action={action} detail={detail}")
    return out


LINES = log_lines()
CAROL_ERRORS = [ln for ln in LINES if "user=carol" in ln and "action=error" in ln]
DISK = sum("disk full" in ln for ln in CAROL_ERRORS)

COUNT_PROGRAM = """
files = [f['path'] for b in outline()['buffers'] for f in b['files']]
lines = [ln for p in files for ln in read(p).splitlines() if ln.startswith('2026-')]
errs = [ln for ln in lines if 'user=carol' in ln and 'action=error' in ln]
print(len(lines), len(errs))
"""
CLASSIFY_PROGRAM = """
hits = grep(r'user=carol .*action=error')
labels = llm_query_batched([["Is this error about the disk? Answer disk or other.", h['text']] for h in hits])
disk = sum(1 for x in labels if x.strip() == 'disk')
final(f"carol has {len(errs)} error lines, {disk} of them about the disk", sorted({h['chunk_id'] for h in hits}))
"""


#: what a child job's report says (its writer's words)
CHILD_SAYS = "A child job read the log for this"
CHILDREN_PROGRAMS = [
    """
asked = ["Which users appear in the log?", "What does the notes file say?", "Which users appear in the log?"]
replies = rlm_query_batched(asked)
print(len(replies), replies[0] == replies[2])
""",
    """
import re
again = rlm_query("Which users appear in the log?")
cited = sorted({int(n) for r in replies for n in re.findall(r"\\d+", r.rsplit("sources:", 1)[1])})
print(again == replies[0], cited)
final(replies[0].split("\\n\\n[child job")[0], cited)
""",
]


class Script:
    """The root model writes ``programs`` in turn (the last repeats); the helper model answers ``disk``/``other``."""

    def __init__(self) -> None:
        self.programs: list[str] = [COUNT_PROGRAM, CLASSIFY_PROGRAM]
        self.roots: list[dict] = []
        self.lock = threading.Lock()
        self.on_sub: Callable[[str], None] | None = None
        #: the root model's context, in characters of the whole request (None: no limit)
        self.context_chars: int | None = None
        self.refused = 0
        self.asked: Counter[str] = Counter()
        #: a child job's writer waits on the gate, and says it has been asked
        self.child_gate = threading.Event()
        self.child_gate.set()
        self.child_writing = threading.Event()

    def reply(self, model: str, content: str) -> Reply:
        prompt, completion = TOKENS[model]
        return Reply.text(content, prompt_tokens=prompt, completion_tokens=completion)

    def __call__(self, req: dict) -> Reply:
        system = req["messages"][0].get("content") or ""
        if req.get("model") == "plan-model" and "writing Python programs" in system:
            size = sum(len(m.get("content") or "") for m in req["messages"])
            if self.context_chars is not None and size > self.context_chars:
                self.refused += 1
                error = {
                    "message": f"maximum context length exceeded ({size} characters)",
                    "code": "context_length_exceeded",
                }
                return Reply(content=None, status=400, error={"type": "invalid_request_error", **error})
            with self.lock:
                self.roots.append(req)
                # the n-th program of this job (the question is the first user message)
                n = self.asked[req["messages"][1]["content"]]
                self.asked[req["messages"][1]["content"]] += 1
            program = self.programs[min(n, len(self.programs) - 1)]
            return self.reply("plan-model", f"Here is the program.\n\n```python\n{program.strip()}\n```\n")
        text = last_user_message(req)
        if req.get("model") != "analyst-model" or "### Chunk" in text:
            return self.child(req, text)
        if self.on_sub is not None:
            self.on_sub(text)
        return self.reply("analyst-model", "disk" if "disk full" in text else "other")

    def child(self, req: dict, text: str) -> Reply:
        """A child job's planner, analysts and writer (``rlm_query``): the writer cites the first chunk it is shown."""
        from tests.support.pipeline_model import Model

        if req.get("model") == "synth-model":
            self.child_writing.set()
            self.child_gate.wait(60)
            chunk = re.search(r"### Chunk (\d+)", text)
            return Reply.text(f"## Answer\n\n{CHILD_SAYS} [chunk {chunk.group(1) if chunk else 0}]")
        reply = Model()(req)
        return reply if isinstance(reply, Reply) else Reply.text(reply)


@pytest.fixture(scope="module")
def env(rlm_env, llm):
    with scripted_env(
        rlm_env, llm, RLM_LLM_RETRIES="0", RLM_LLM_TIMEOUT="30", RLM_CODE_MAX_ROUNDS="4", RLM_JOB_TIMEOUT="60"
    ) as e:
        yield e


@pytest.fixture(scope="module")
def corpus(env, conn, embedder, tmp_path_factory):
    from rlm_workers.ingest.loader import load_paths

    root = tmp_path_factory.mktemp("code") / "logs"
    root.mkdir()
    (root / "app.log").write_text("\n".join(LINES) + "\n")
    (root / "notes.md").write_text("# Notes\n\nThe on-call rota changes every Monday.\n")
    load_paths(conn, buffer=BUFFER, paths=[root], embedder=embedder)
    conn.commit()


@pytest.fixture(scope="module")
def workers(env, corpus, tmp_path_factory):
    pools = {"ctl": ("rlm.control", 2), "an": ("rlm.analyst", 4)}
    with running_workers(env, tmp_path_factory.mktemp("worker-logs"), pools) as ws:
        yield ws


@pytest.fixture()
def script(fresh):
    s = Script()
    before = fresh.responder
    fresh.responder = s
    try:
        yield s
    finally:
        fresh.responder = before


def submit(conn, query: str, **options) -> str:
    from rlm_workers.submit import submit_query

    job_id, _ = submit_query(conn, tenant="local", query=query, buffers=[BUFFER], options={"mode": "code", **options})
    conn.commit()
    return job_id


def finished(conn, job_id: str, timeout: float = 120):
    from rlm_workers.submit import wait_for_job

    return wait_for_job(conn, job_id, timeout=timeout)


def result_of(job):
    from rlm_workers.models import QueryResult

    assert job.result is not None, (job.status, job.error)
    return QueryResult.model_validate(job.result)


def calls_logged(conn, job_id: str) -> Counter:
    rows = conn.execute("SELECT stage FROM llm_calls WHERE job_id = %s", (job_id,)).fetchall()
    conn.commit()
    return Counter(r[0] for r in rows)


def sandboxes_running(workers) -> list[int]:
    """Pids of sandbox processes whose parent is one of the module's workers (other modules run sandboxes too)."""
    parents = {w.proc.pid for w in workers.values() if w.proc is not None}
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"sandbox/child.py" not in f.read():
                    continue
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid in parents:
            out.append(int(pid))
    return out


def test_a_program_counts_exactly_and_fans_its_sub_calls_out_as_a_chord(conn, script, workers, llm):
    job = finished(conn, submit(conn, "How many error lines does carol have, and how many are about the disk?"))
    result = result_of(job)
    assert job.status == "done", job.error
    assert f"carol has {len(CAROL_ERRORS)} error lines, {DISK} of them about the disk" in result.response
    assert result.mode == "code" and result.route == "code"
    from rlm_workers.pipeline.report import status_line

    assert "Mode: code (code) | Rounds: 2 |" in status_line(result)
    # every round is on the report: the program as written and what it printed
    assert [r.round for r in result.code_rounds] == [0, 1, 2]
    look = result.code_rounds[0]  # the stage's own look at the data, before any model call
    assert look.output.startswith("2 files\n") and LINES[0] in look.output and look.error is None
    assert result.code_rounds[1].output == f"{len(LINES)} {len(CAROL_ERRORS)}\n"
    assert result.code_rounds[2].sub_calls == len(CAROL_ERRORS) and result.code_rounds[2].error is None
    assert "llm_query_batched" in result.code_rounds[2].code
    # one sub-model call per error line, each its own rlm.subcall task on the analyst worker
    subs = [r.body for r in llm.requests if r.body.get("model") == "analyst-model"]
    assert len(subs) == len(CAROL_ERRORS)
    assert "rlm.subcall" in workers["an"].log_path.read_text()
    assert len(job.task_ids) == len(CAROL_ERRORS) + 1  # the chord and its header: Flower links, cancel revokes
    # accounting is exact: every call logged once, and the report's totals are the server's
    assert calls_logged(conn, job.id) == Counter({"code": 2, "subcall": len(CAROL_ERRORS)})
    assert result.llm_calls == 2 + len(CAROL_ERRORS)
    assert result.tokens_in == 2 * 200 + len(CAROL_ERRORS) * 50
    assert result.tokens_out == 2 * 40 + len(CAROL_ERRORS) * 5
    # the citations are the chunks the program read, resolved to their place in the log
    assert result.sources and all(s.path.endswith("app.log") for s in result.sources)
    assert result.chunks_analyzed >= len(result.sources)


def test_the_second_round_sees_the_first_rounds_output_as_data(conn, script, workers):
    job = finished(conn, submit(conn, "How many error lines does carol have?"))
    assert job.status == "done"
    second = script.roots[1]["messages"]
    shown = second[-1]["content"]
    assert "## Round 1 output" in shown and f"{len(LINES)} {len(CAROL_ERRORS)}" in shown
    assert "<content>" in shown  # the output is fenced as data
    assert second[-2]["role"] == "assistant" and "read(p)" in second[-2]["content"]


def test_a_hostile_program_is_stopped_and_the_next_round_goes_on(conn, script, workers):
    script.programs = [
        "g = [c for c in object.__subclasses__() if c.__name__ == '_wrap_close'][0].__init__.__globals__\n"
        "print(g['open']('/etc/passwd', 0))",
        "import os",
        "final('nothing to see', [])",
    ]
    job = finished(conn, submit(conn, "What does the log say?"))
    result = result_of(job)
    assert job.status == "done" and result.response.startswith("nothing to see")
    first, second = result.code_rounds[1], result.code_rounds[2]
    assert "Operation not permitted" in first.error and "root:" not in first.output
    assert "import of 'os' is not allowed in the sandbox" in second.error
    assert all(w.alive for w in workers.values())


def test_cancel_kills_the_running_program(conn, script, workers):
    from rlm_workers.submit import cancel_query

    script.programs = ["while True:\n    pass"]
    job_id = submit(conn, "Loop forever")
    assert wait_for(lambda: bool(sandboxes_running(workers)), timeout=60), "the program never started"
    cancel_query(conn, job_id=job_id, tenant="local")
    conn.commit()
    assert wait_for(lambda: not sandboxes_running(workers), timeout=30), "the sandbox outlived its cancelled job"
    job = finished(conn, job_id)
    assert job.status == "cancelled"
    # the worker goes on: the next job runs
    script.programs = ["final('still here', [])"]
    assert finished(conn, submit(conn, "Are you there?")).status == "done"


def test_a_cancel_while_sub_calls_run_ends_the_job_and_its_waiting(conn, script, workers):
    from rlm_workers.submit import cancel_query

    started = threading.Event()
    release = threading.Event()

    def hold(_text: str) -> None:
        started.set()
        release.wait(30)

    script.on_sub = hold
    script.programs = ["labels = llm_query_batched(['first', 'second', 'third'])\nfinal(str(labels), [])"]
    job_id = submit(conn, "Ask three things")
    assert started.wait(60), "no sub-call reached the model"
    cancel_query(conn, job_id=job_id, tenant="local")
    conn.commit()
    release.set()
    assert finished(conn, job_id).status == "cancelled"
    assert wait_for(lambda: not sandboxes_running(workers), timeout=30)


def test_a_program_asks_child_jobs_that_run_the_whole_pipeline_one_level_down(conn, script, workers, llm):
    script.programs = list(CHILDREN_PROGRAMS)
    job = finished(conn, submit(conn, "Ask the pipeline two things", depth=1))
    result = result_of(job)
    assert job.status == "done", job.error
    assert [r.error for r in result.code_rounds] == [None, None, None]
    assert result.code_rounds[1].output == "3 True\n" and result.code_rounds[2].output.startswith("True [")
    assert result.response.startswith(f"## Answer\n\n{CHILD_SAYS} [chunk ")
    # the root model was told of them; a question asked twice, or again in a later round, is one child
    assert "## Child jobs" in script.roots[0]["messages"][0]["content"]
    kids = result.children
    assert sorted(k.query for k in kids) == ["What does the notes file say?", "Which users appear in the log?"]
    assert all(k.kind == "program" and k.depth == 1 and k.status == "done" and k.parent_id == job.id for k in kids)
    assert result.depth == 1
    # each child ran its own plan and wrote its own report; the tree's totals are exactly what the server served
    assert all(k.llm_calls >= 2 for k in kids)
    assert result.llm_calls == 2 + sum(k.llm_calls for k in kids) == len(llm.requests)
    assert result.tokens_in + result.tokens_out == llm.usage["total_tokens"]
    # the chunks a child cited are the parent's to cite, resolved to their place
    assert result.sources and all(s.path.endswith(("app.log", "notes.md")) for s in result.sources)


def test_programs_waiting_on_child_jobs_are_bounded_so_children_always_find_a_worker(conn, script, workers):
    import time

    from rlm_workers.constants import CODE_CHILD_WAITS_KEY
    from rlm_workers.runtime.resources import redis_client

    r = redis_client()
    others = {"other-job-1": time.time() + 300, "other-job-2": time.time() + 300}  # RLM_CODE_CHILD_WAITS is 2
    r.zadd(CODE_CHILD_WAITS_KEY, others)
    try:
        script.programs = ["rlm_query('Which users appear in the log?')", "final('not now', [])"]
        job = finished(conn, submit(conn, "Ask a child while two programs wait", depth=1))
    finally:
        r.zrem(CODE_CHILD_WAITS_KEY, *others)
    result = result_of(job)
    assert job.status == "done" and not result.children
    assert "2 programs wait on child jobs already" in result.code_rounds[1].error
    assert "RLM_CODE_CHILD_WAITS" in result.code_rounds[1].error
    assert r.zscore(CODE_CHILD_WAITS_KEY, job.id) is None  # a refused claim is not left behind, nor a used one


def test_without_depth_a_program_has_no_child_jobs(conn, script, workers):
    script.programs = ["rlm_query('Which users appear in the log?')", "final('none', [])"]
    job = finished(conn, submit(conn, "Try a child job"))
    result = result_of(job)
    assert job.status == "done" and not result.children
    assert "NameError" in result.code_rounds[1].error and "rlm_query" in result.code_rounds[1].error
    assert "## Child jobs" not in script.roots[0]["messages"][0]["content"]


def test_a_cancel_while_child_jobs_run_cancels_them_and_ends_the_waiting(conn, script, workers):
    from rlm_workers.store.jobs import children_of
    from rlm_workers.submit import cancel_query

    script.child_gate.clear()
    script.child_writing.clear()
    script.programs = ["r = rlm_query('Which days are in the log?')\nfinal(r, [])"]
    job_id = submit(conn, "Ask a child and wait", depth=2)
    try:
        assert script.child_writing.wait(60), "the child job never reached its writer"
        cancel_query(conn, job_id=job_id, tenant="local")
        conn.commit()
        assert finished(conn, job_id).status == "cancelled"
        assert wait_for(lambda: not sandboxes_running(workers), timeout=30)
    finally:
        script.child_gate.set()
    kids = children_of(conn, job_id=job_id)
    conn.commit()
    assert len(kids) == 1 and kids[0].status == "cancelled"


def test_the_budget_holds_for_sub_calls_and_the_report_says_it_ran_out(conn, script, workers, llm):
    script.programs = [
        "labels = llm_query_batched([f'question {i}' for i in range(6)])\nprint(labels)",
        "final('unreachable', [])",
    ]
    job = finished(conn, submit(conn, "Ask six things", max_llm_calls=4))
    result = result_of(job)
    assert job.status == "done"
    logged = calls_logged(conn, job.id)
    assert sum(logged.values()) == result.llm_calls <= 4
    said = result.code_rounds[1].output
    assert said.count("not run: the budget is spent") == 6 - logged["subcall"]
    assert "budget was exhausted" in result.response and result.budget.exhausted


def test_no_final_within_the_rounds_fails_the_job_with_its_rounds(conn, script, workers):
    script.programs = ["print('thinking')"]
    job = finished(conn, submit(conn, "Never answers"))
    assert job.status == "failed" and "no answer within 4 rounds" in job.error.message
    result = result_of(job)
    assert [r.output for r in result.code_rounds[1:]] == ["thinking\n"] * 4


def test_a_program_that_writes_its_own_api_runs_with_the_real_one_and_is_told(conn, script, workers):
    script.programs = [
        "def read(path):\n    return 'fake'\nprint(len(read('logs/app.log').splitlines()))",
        "if True:\n    def final(a, c):\n        print('mine')\nfinal('done', [])",  # nested: put back next round
        "final('done', [])",
    ]
    result = result_of(finished(conn, submit(conn, "How long is the log?")))
    assert [r.output for r in result.code_rounds[1:]] == [f"{len(LINES)}\n", "mine\n", ""]
    assert result.code_rounds[1].code.startswith("def read(path):")  # the round keeps what the model wrote
    told = script.roots[1]["messages"][-1]["content"]
    assert "Your program wrote its own read()" in told and "call them, never define them" in told
    assert result.response.startswith("done")


def test_grep_hands_each_line_with_its_number(conn, script, workers):
    script.programs = [
        "h = grep(r'user=carol .*action=error')[0]\nfinal(f\"{h['line_number']}: {h['text']}\", h['chunk_id'])"
    ]
    result = result_of(finished(conn, submit(conn, "Where is carol's first error?")))
    assert result.response.startswith(f"{LINES.index(CAROL_ERRORS[0]) + 1}: {CAROL_ERRORS[0]}")
    assert [s.path.rsplit("/", 1)[-1] for s in result.sources] == ["app.log"]


def test_a_program_run_again_is_left_out_of_the_conversation_and_said(conn, script, workers):
    from rlm_workers.pipeline.program import REPEAT_TEMPERATURE

    script.programs = ["print(6 * 7)", "print(6 * 7)", "final('42', [])"]
    result = result_of(finished(conn, submit(conn, "What is six times seven?")))
    assert result.response.startswith("42")
    assert [r.code for r in result.code_rounds[1:]] == script.programs  # every round is on the report
    first, second = (script.roots[n]["messages"] for n in (1, 2))
    assert "The question: What is six times seven?" in first[-1]["content"] and "again" not in first[-1]["content"]
    # the repeat is not in the third request; the second round's output message says it was left out
    assert len(second) == len(first) and second[:-1] == first[:-1]
    assert "Round 2 wrote the program of round 1 again" in second[-1]["content"]
    assert "The question: What is six times seven?" in second[-1]["content"].rsplit("## Round 2", 1)[1]
    # asked with some temperature: at 0 the same conversation gets the same program
    assert [r.get("temperature") for r in script.roots[:3]] == [0.0, 0.0, REPEAT_TEMPERATURE]


def test_the_stage_s_own_look_written_again_is_a_repeat(conn, script, workers):
    from rlm_workers.pipeline.program import LOOK_PROGRAM

    script.programs = [LOOK_PROGRAM, "final('seen', [])"]
    result = result_of(finished(conn, submit(conn, "What do the files hold?")))
    assert result.response.startswith("seen")
    assert "Round 1 wrote the program of round 0 again" in script.roots[1]["messages"][-1]["content"]


def test_a_conversation_over_the_models_context_is_cut_and_asked_again(conn, script, workers):
    script.programs = ["print('x' * 15000)", "final('it fits', [])"]
    script.context_chars = len(load_code_prompt()) + 12_000
    job = finished(conn, submit(conn, "Print a lot"))
    assert job.status == "done", job.error
    result = result_of(job)
    # asked again twice: without the oldest round (the stage's round 0), then with the newest output cut
    assert result.response.startswith("it fits") and script.refused == 2
    shown = script.roots[-1]["messages"][-1]["content"]
    assert "[…cut to fit the model's context]" in shown and "The question: Print a lot" in shown


def load_code_prompt() -> str:
    from rlm_workers.pipeline.prompts import load_prompt

    return load_prompt("code")


def test_a_reply_without_a_program_is_told_so(conn, script, workers):
    script.programs = ["", "final('ok', [])"]
    job = finished(conn, submit(conn, "Say ok"))
    assert job.status == "done"
    assert "held no program" in result_of(job).code_rounds[1].error


def test_citations_the_program_never_read_are_left_out_and_said(conn, script, workers):
    script.programs = ["hits = search('on-call rota', top_k=1)\nfinal('Mondays', [hits[0]['chunk_id'], 999999, 'x'])"]
    result = result_of(finished(conn, submit(conn, "When does the rota change?")))
    assert [s.path.rsplit("/", 1)[-1] for s in result.sources] == ["notes.md"]
    assert re.search(r"left out, not chunks the program was handed: 999999, x", result.response)


@pytest.mark.parametrize(
    "options",
    [{"scope": "all"}, {"batch_size": 5}, {"search_mode": "bm25"}, {"top_k": 5}],
)
def test_search_options_are_refused_in_code_mode(conn, options):
    from rlm_workers.errors import InvalidInput
    from rlm_workers.submit import validate_options

    with pytest.raises(InvalidInput, match="do not apply in mode code"):
        validate_options({"mode": "code", **options})


def test_code_prompt_lists_exactly_what_the_sandbox_allows():
    from rlm_workers.limits import MAX_CODE_OUTPUT_CHARS
    from rlm_workers.pipeline.program_api import ProgramApi
    from rlm_workers.pipeline.prompts import load_prompt
    from rlm_workers.sandbox.child import ALLOWED_MODULES

    prompt = load_prompt("code")
    listed = re.search(r"You may import only: ([a-z, ]+)\.", prompt).group(1).split(", ")
    assert listed == list(ALLOWED_MODULES)
    assert f"{MAX_CODE_OUTPUT_CHARS:,}" in prompt

    def offered(depth: int | None) -> set[str]:
        job = SimpleNamespace(depth=0, options=SimpleNamespace(depth=depth))
        return set(ProgramApi(None, job, None, lambda: False).functions())  # type: ignore[arg-type]

    api = prompt.split("## What a program can call", 1)[1].split("\n## ", 1)[0]
    for name in [*offered(None), "final"]:
        assert re.search(rf"`(\w+ = )?{name}\(", api), name
    # child jobs only where --depth allows them, and their functions only in their own part of the prompt
    assert offered(None) == offered(0) and (children := offered(1) - offered(0))
    assert not any(name in prompt for name in children)
    extra = load_prompt("code_children")
    assert extra.startswith("## Child jobs\n") and all(re.search(rf"`\w+ = {n}\(", extra) for n in children)


def test_the_program_is_read_from_fenced_blocks_or_a_reply_that_is_code():
    from rlm_workers.pipeline.program import extract_program

    assert extract_program("Let me look.\n```python\nprint(1)\n```\nand\n```py\nx = 2\n```") == "print(1)\n\nx = 2"
    assert extract_program("x = read('a')\nprint(len(x))") == "x = read('a')\nprint(len(x))"
    assert extract_program("The answer is 42.") is None
    assert extract_program("answer") is None  # a bare name parses, but does nothing
    assert extract_program("") is None


def test_a_small_context_drops_the_oldest_rounds_and_cuts_the_newest_output():
    from rlm_workers.config import Settings
    from rlm_workers.pipeline.program import output_room, reply_tokens

    small = Settings(model_context=2048, provider="extractive")
    messages = [{"role": "system", "content": "s" * 2000}, {"role": "user", "content": "q" * 400}]
    for n in range(6):
        messages += [{"role": "assistant", "content": f"print({n})" * 40}, {"role": "user", "content": "o" * 6000}]
    messages.append({"role": "assistant", "content": "print('last')"})
    room = output_room(messages, small)
    kept = sum(len(m["content"]) for m in messages) // 4 + room // 4
    assert kept <= 2048 - reply_tokens(small)  # what is shown next still leaves the reply its room
    assert messages[-1]["content"] == "print('last')" and messages[1]["content"] == "q" * 400
    assert len(messages) < 15 and all(len(m["content"]) <= 1600 for m in messages[2:])
    assert (
        output_room([*messages[:2], {"role": "assistant", "content": "x"}], Settings(provider="extractive")) == 20_000
    )
