"""The CLI surfaces of issue 13: --tenant everywhere, `rlm jobs` / `rlm job …` / `rlm chunk show`, --version and
completion, `buffer show`'s files, matched-line previews, "did you mean", and progress lines when stderr is
not a terminal.  Real `rlm` processes, real PostgreSQL and Valkey, real workers answering through the
scripted OpenAI-protocol model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from importlib.metadata import version

import pytest

from tests.support.pipeline_model import NEEDLE, QUESTION, write_essays
from tests.support.workers import ROOT, running_workers, scripted_env
from tests.test_cli import CHUNK_VIEW_KEYS, run_rlm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(rlm_env, llm):
    with scripted_env(rlm_env, llm, RLM_LLM_RETRIES="1", RLM_LLM_TIMEOUT="90") as e:
        yield e


@pytest.fixture(scope="module")
def essays(env, tmp_path_factory):
    root = tmp_path_factory.mktemp("surfaces") / "essays"
    write_essays(root)
    run_rlm(env, "load", str(root), "--buffer", "essays", check=0)
    return root


@pytest.fixture(scope="module")
def acme_notes(env, essays, tmp_path_factory):
    """A buffer of tenant acme, loaded with --tenant."""
    root = tmp_path_factory.mktemp("acme") / "notes"
    root.mkdir()
    (root / "plan.md").write_text("# Plan\n\nThe acme launch happens on the third of March.\n")
    run_rlm(env, "load", str(root), "--buffer", "acme-notes", "--tenant", "acme", check=0)
    return root


@pytest.fixture(scope="module")
def workers(env, essays, tmp_path_factory):
    pools = {"sctl": ("rlm.control", 4), "san": ("rlm.analyst", 4)}
    with running_workers(env, tmp_path_factory.mktemp("surface-workers"), pools, flush_broker=False) as ws:
        yield ws


@pytest.fixture(scope="module")
def done_job(env, workers, essays):
    """One query answered through the workers: its id (the newest root job of tenant local)."""
    proc = run_rlm(env, "query", QUESTION, "--buffer", "essays", "--skip-plan", "--format", "json", check=0)
    return json.loads(proc.stdout)["job_id"]


def _one_line(proc, code: int, needle: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    return lines[0]


# --------------------------------------------------------------------------- tenants


def test_a_buffer_loaded_with_tenant_is_that_tenants_only(env, acme_notes):
    acme = json.loads(run_rlm(env, "buffers", "--tenant", "acme", "--format", "json", check=0).stdout)
    assert [b["name"] for b in acme["buffers"]] == ["acme-notes"]
    local = json.loads(run_rlm(env, "buffers", "--format", "json", check=0).stdout)
    assert "acme-notes" not in [b["name"] for b in local["buffers"]]
    # RLM_TENANT is the default --tenant
    as_env = json.loads(run_rlm({**env, "RLM_TENANT": "acme"}, "buffers", "--format", "json", check=0).stdout)
    assert as_env == acme
    hits = run_rlm(env, "search", "launch March", "--buffer", "acme-notes", "--tenant", "acme", "--format", "json")
    assert hits.returncode == 0 and json.loads(hits.stdout)["results"][0]["path"] == "notes/plan.md"
    _one_line(run_rlm(env, "search", "launch", "--buffer", "acme-notes"), 2, "no buffer named 'acme-notes'")
    _one_line(run_rlm(env, "buffer", "show", "acme-notes"), 2, "no buffer named 'acme-notes'")
    _one_line(run_rlm(env, "buffer", "rm", "acme-notes"), 2, "no buffer named 'acme-notes'")
    assert run_rlm(env, "buffers", "--tenant", "acme", "--format", "json", check=0).stdout.strip() == json.dumps(acme)


@pytest.mark.parametrize(
    "args",
    [
        ["buffers"],
        ["search", "x", "--buffer", "essays"],
        ["buffer", "show", "essays"],
        ["jobs"],
        ["job", "show", "some-id"],
        ["chunk", "show", "1"],
        ["batch", "list"],
        ["query", "x", "--buffer", "essays"],
    ],
)
def test_an_invalid_tenant_is_one_line_and_exit_2(env, essays, args):
    _one_line(run_rlm(env, *args, "--tenant", "no spaces!"), 2, "invalid tenant name 'no spaces!'")


def test_an_invalid_rlm_tenant_is_refused_too(env, essays):
    proc = run_rlm({**env, "RLM_TENANT": "bad/tenant"}, "buffers")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- did you mean


def test_a_misspelt_buffer_gets_a_suggestion_from_the_tenants_own_names(env, essays, acme_notes):
    _one_line(run_rlm(env, "search", "x", "--buffer", "essay"), 2, "did you mean 'essays'?")
    _one_line(run_rlm(env, "buffer", "show", "esays"), 2, "did you mean 'essays'?")
    # acme's buffer is never offered to local, nor anything for a name close to nothing
    line = _one_line(run_rlm(env, "buffer", "show", "acme-note"), 2, "no buffer named 'acme-note'")
    assert "did you mean" not in line
    line = _one_line(run_rlm(env, "buffer", "show", "zzzzzz"), 2, "no buffer named 'zzzzzz'")
    assert "did you mean" not in line
    _one_line(run_rlm(env, "buffer", "show", "acme-note", "--tenant", "acme"), 2, "did you mean 'acme-notes'?")


# --------------------------------------------------------------------------- buffer show, chunk show, previews


def test_buffer_show_lists_files_and_caps_the_listing(env, essays):
    data = json.loads(run_rlm(env, "buffer", "show", "essays", "--format", "json", check=0).stdout)
    names = sorted(p.name for p in essays.iterdir())
    assert data["files"] == len(names) == 28
    assert [f["path"] for f in data["file_list"]] == [f"essays/{n}" for n in names]
    assert all(f["bytes"] > 0 and f["chunks"] >= 1 for f in data["file_list"])
    text = run_rlm(env, "buffer", "show", "essays", "--files", "5", check=0).stdout
    assert f"essays/{names[4]}" in text and f"essays/{names[5]}" not in text
    assert "… and 23 more" in text
    full = run_rlm(env, "buffer", "show", "essays", check=0).stdout
    assert "more" not in full and f"essays/{names[-1]}" in full


def test_buffer_show_aligns_its_columns_and_says_1_chunk(env, acme_notes, tmp_path):
    root = tmp_path / "mixed"
    root.mkdir()
    (root / "a.md").write_text("One short note.\n")
    (root / "a-much-longer-file-name.txt").write_text("".join(f"Sentence {i} adds a little more.\n" for i in range(80)))
    run_rlm(env, "load", str(root), "--buffer", "mixed", "--chunk-size", "200", "--overlap", "20", check=0)
    text = run_rlm(env, "buffer", "show", "mixed", check=0).stdout
    head, _, listing = text.partition("\n\n")
    # every field's colon in one column, the longest names (embedding_windows) included
    assert len({line.index(":") for line in head.splitlines()}) == 1, text
    rows = listing.splitlines()
    short, long = sorted(rows, key=lambda r: "a.md" not in r)
    assert short.endswith(" 1 chunk") and re.search(r" ([2-9]|\d\d+) chunks$", long), rows
    # paths padded to one width; sizes and chunk counts right-aligned, ending in one column each
    assert len({re.search(r"\S+ [KMG]?B(?=  )", r).end() for r in rows}) == 1, rows
    assert len({r.rindex(" chunk") for r in rows}) == 1, rows
    # `rlm buffers` counts alike: acme has one buffer of one file
    [acme] = run_rlm(env, "buffers", "--tenant", "acme", check=0).stdout.splitlines()
    assert re.search(r" 1 file +1 chunk ", acme), acme


def test_chunk_show_prints_what_a_citation_points_at(env, essays, acme_notes):
    hit = json.loads(
        run_rlm(env, "search", "Dolores Park sandwich", "--buffer", "essays", "--format", "json", check=0).stdout
    )["results"][0]
    as_json = json.loads(run_rlm(env, "chunk", "show", str(hit["chunk_id"]), "--format", "json", check=0).stdout)
    assert as_json == {k: hit[k] for k in CHUNK_VIEW_KEYS}
    text = run_rlm(env, "chunk", "show", str(hit["chunk_id"]), check=0).stdout
    header = f"essays {hit['path']}:{hit['start_line']}-{hit['end_line']}"
    assert text.splitlines()[0].startswith(header)
    assert NEEDLE in text
    # acme's chunk is not local's, and a made-up id is no chunk at all
    acme_hit = json.loads(
        run_rlm(env, "search", "launch", "--buffer", "acme-notes", "--tenant", "acme", "--format", "json").stdout
    )["results"][0]
    _one_line(run_rlm(env, "chunk", "show", str(acme_hit["chunk_id"])), 2, f"no chunk {acme_hit['chunk_id']}")
    run_rlm(env, "chunk", "show", str(acme_hit["chunk_id"]), "--tenant", "acme", check=0)
    _one_line(run_rlm(env, "chunk", "show", "999999999"), 2, "no chunk 999999999")


@pytest.mark.parametrize("mode", ["bm25", "hybrid"])
def test_search_preview_shows_the_matched_lines_with_their_numbers(env, essays, mode):
    needle_file = next(p for p in essays.iterdir() if NEEDLE in p.read_text())
    lines = needle_file.read_text().splitlines()
    line_no = next(i for i, ln in enumerate(lines, 1) if "Dolores Park" in ln)
    assert line_no > 3  # the chunk's first lines are the heading and the intro, not the match
    out = run_rlm(env, "search", "Dolores Park sandwich", "--buffer", "essays", "--mode", mode, "--top-k", "1")
    assert out.returncode == 0, out.stderr
    shown = out.stdout.splitlines()
    assert needle_file.name in shown[0]
    assert re.match(rf"^\s+{line_no}: An aside from a trip west", shown[1]), out.stdout
    assert "# Notes on" not in out.stdout


def test_search_preview_cuts_a_long_line_after_a_word_and_marks_the_cut(env, tmp_path):
    root = tmp_path / "long"
    root.mkdir()
    words = " ".join(f"clause{i:02d}" for i in range(60))  # 539 characters on one line
    (root / "policy.md").write_text(f"# Policy\n\nThe retention policy keeps {words}.\n")
    run_rlm(env, "load", str(root), "--buffer", "longline", check=0)
    out = run_rlm(env, "search", "retention policy", "--buffer", "longline", "--mode", "bm25", check=0).stdout
    shown = next(ln for ln in out.splitlines() if "retention policy" in ln).split(": ", 1)[1]
    assert len(shown) <= 110 and shown.endswith(" …"), out
    assert shown.removesuffix(" …").split()[-1] in words.split()  # the last word shown is whole


def test_matched_lines_picks_the_run_with_most_query_terms():
    from rlm_workers.search.preview import matched_lines

    text = "import os\n\n# Billing\nx = 1\ny = 2\nREFUND_WINDOW_DAYS = 30  # refund window\nz = 3\n"
    pv = matched_lines(text, "refund window days", start_line=40)
    assert pv.lines[0] == (45, "REFUND_WINDOW_DAYS = 30  # refund window") and pv.hits > 0 and pv.literal
    none = matched_lines(text, "zyzzyva", start_line=40)
    assert none.hits == 0 and none.lines == [(40, "import os"), (42, "# Billing"), (43, "x = 1")]
    assert not none.literal
    # one stray word of a five-word paraphrase is not the passage that matched: the semantic one is shown
    stray = matched_lines(text, "where did grandpa hide the money billing long ago", start_line=40)
    assert stray.hits == 1 and stray.found == 1 and not stray.literal


# --------------------------------------------------------------------------- version, help, completion


def test_version_prints_the_package_version():
    proc = subprocess.run([sys.executable, "-m", "rlm_api.cli", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"rlm-pipeline {version('rlm-pipeline')}"


@pytest.mark.parametrize("cmd", [["jobs"], ["job"], ["job", "show"], ["job", "result"], ["chunk", "show"]])
def test_dash_h_on_the_new_commands(cmd):
    proc = subprocess.run([sys.executable, "-m", "rlm_api.cli", *cmd, "-h"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"Usage: rlm {' '.join(cmd)}"), proc.stdout
    if cmd != ["job"]:
        assert "--tenant" in proc.stdout


def test_shell_completion_is_available():
    top = subprocess.run([sys.executable, "-m", "rlm_api.cli", "-h"], capture_output=True, text=True).stdout
    assert "--install-completion" in top and "--show-completion" in top
    env = {**os.environ, "_RLM_COMPLETE": "complete_bash", "COMP_WORDS": "rlm jo", "COMP_CWORD": "1"}
    proc = subprocess.run([sys.executable, "-m", "rlm_api.cli"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert set(proc.stdout.split()) == {"jobs", "job"}


# --------------------------------------------------------------------------- jobs


def test_jobs_lists_the_answered_query(env, done_job):
    page = json.loads(run_rlm(env, "jobs", "--format", "json", check=0).stdout)
    assert set(page) == {"jobs", "next_cursor"}
    mine = next(j for j in page["jobs"] if j["job_id"] == done_job)
    assert mine["status"] == "done" and mine["buffers"] == ["essays"] and mine["query"] == QUESTION
    assert mine["usage"]["llm_calls"] > 0 and mine["usage"]["tokens_in"] > 0
    text = run_rlm(env, "jobs", check=0).stdout
    row = next(ln for ln in text.splitlines() if ln.startswith(done_job))
    assert " done " in row and "San Francisco" in row
    assert done_job in run_rlm(env, "jobs", "--status", "done", "--buffer", "essays", check=0).stdout
    assert done_job not in run_rlm(env, "jobs", "--status", "failed", check=0).stdout
    assert done_job not in run_rlm(env, "jobs", "--buffer", "acme-notes", check=0).stdout
    assert done_job not in run_rlm(env, "jobs", "--tenant", "acme", check=0).stdout
    bad = run_rlm(env, "jobs", "--status", "sleeping")
    assert bad.returncode == 2 and "--status" in bad.stderr


def test_jobs_limit_pages(env, done_job, workers):
    run_rlm(env, "query", QUESTION, "--buffer", "essays", "--skip-plan", "--mode", "instant", check=0)
    page = json.loads(run_rlm(env, "jobs", "--limit", "1", "--format", "json", check=0).stdout)
    assert len(page["jobs"]) == 1 and page["next_cursor"] == page["jobs"][0]["job_id"]


def test_job_show_has_stages_batches_calls(env, conn, done_job):
    from rlm_api.views import job_view
    from rlm_workers.store.jobs import get_job

    data = json.loads(run_rlm(env, "job", "show", done_job, "--format", "json", check=0).stdout)
    expected = json.loads(job_view(conn, get_job(conn, job_id=done_job)).model_dump_json())
    conn.commit()
    assert data == expected
    assert data["timings"] and data["batches"] and data["calls"] and data["usage"]["llm_calls"] == len(data["calls"])
    text = run_rlm(env, "job", "show", done_job, check=0).stdout
    assert f"job {done_job}  done" in text
    assert "stages:" in text and "fan_out" in text
    assert f"batches:  {len(data['batches'])} ({len(data['batches'])} done)" in text
    assert f"{data['usage']['llm_calls']} LLM calls" in text


def test_job_result_prints_the_report(env, done_job):
    text = run_rlm(env, "job", "result", done_job, check=0).stdout
    assert NEEDLE in text and "Scale:" in text
    res = json.loads(run_rlm(env, "job", "result", done_job, "--format", "json", check=0).stdout)
    assert res["job_id"] == done_job and NEEDLE in res["response"]


@pytest.mark.parametrize("cmd", [["show"], ["result"], ["cancel"]])
def test_unknown_or_other_tenants_job_is_exit_2(env, done_job, cmd):
    _one_line(run_rlm(env, "job", *cmd, "no-such-job"), 2, "no query job 'no-such-job'")
    _one_line(run_rlm(env, "job", *cmd, done_job, "--tenant", "acme"), 2, f"no query job '{done_job}'")


def test_job_and_batch_ids_are_taken_by_a_unique_prefix(env, conn):
    """As git takes commits: `1e96c35a` names the job whose id starts so; a prefix two ids share is refused
    (exit 2), another tenant's ids are not candidates, and under 4 characters nothing is looked up."""
    from rlm_workers.store.jobs import create_job
    from rlm_workers.store.overnight import create_overnight

    a, b, acme = ("1e96c35a" + "0" * 24), ("1e96c35b" + "0" * 24), ("1e96dddd" + "0" * 24)
    for job_id, tenant in ((a, "local"), (b, "local"), (acme, "acme")):
        create_job(conn, job_id=job_id, tenant=tenant, query="What is the prefix?", buffers=["essays"], options={})
    x, y = ("beefa" + "1" * 27), ("beefb" + "2" * 27)
    later = datetime.now(UTC) + timedelta(days=1)
    for batch_id in (x, y):
        create_overnight(
            conn,
            overnight_batch_id=batch_id,
            tenant="local",
            queries=["q"],
            buffers=["essays"],
            options={},
            run_at=later,  # not due: a scheduler tick in this session's workers must not run it before the cancel
            priority=3,
            token_budget=None,
            tick_token="t",
        )
    conn.commit()

    for cmd in (["show"], ["result"], ["cancel"]):
        _one_line(run_rlm(env, "job", *cmd, "1e96c35"), 2, f"job id prefix '1e96c35' is ambiguous: {a}, {b} start")
        _one_line(run_rlm(env, "job", *cmd, "1e96dd"), 2, "no query job '1e96dd'")  # acme's, not local's
        _one_line(run_rlm(env, "job", *cmd, "1e9"), 2, "no query job '1e9'")
    shown = json.loads(run_rlm(env, "job", "show", "1e96c35a", "--format", "json", check=0).stdout)
    assert shown["job_id"] == a
    _one_line(run_rlm(env, "job", "result", "1E96C35B"), 1, f"job {b} is queued")
    assert run_rlm(env, "job", "cancel", "1e96c35b", check=0).stdout.strip() == f"job {b} cancelled"

    for cmd in (["status"], ["results"], ["cancel"]):
        _one_line(run_rlm(env, "batch", *cmd, "beef"), 2, f"batch id prefix 'beef' is ambiguous: {x}, {y} start")
    assert run_rlm(env, "batch", "status", "beefa", check=0).stdout.startswith(f"{x}  ")
    assert json.loads(run_rlm(env, "batch", "results", "beefa", check=0).stdout)["batch_id"] == x
    assert run_rlm(env, "batch", "cancel", "beefb", check=0).stdout.startswith(f"{y}  cancelled")


def _start_query(env, *args):
    return subprocess.Popen(
        [sys.executable, "-m", "rlm_api.cli", "query", QUESTION, "--buffer", "essays", "--skip-plan", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _until_an_analyst_call(llm) -> None:
    deadline = time.monotonic() + 120
    while not [r for r in llm.requests if r.body.get("model") == "analyst-model"]:
        assert time.monotonic() < deadline, "no analyst call"
        time.sleep(0.2)


def test_a_running_job_has_no_result_yet_and_cancels(env, done_job, model, fresh):
    model.gate.clear()  # analysts hold their replies: the job stays in its fan-out
    proc = _start_query(env)
    try:
        _until_an_analyst_call(fresh)
        running = json.loads(run_rlm(env, "jobs", "--status", "running", "--format", "json", check=0).stdout)
        (job,) = running["jobs"]
        _one_line(run_rlm(env, "job", "result", job["job_id"]), 1, f"job {job['job_id']} is running")
        out = run_rlm(env, "job", "cancel", job["job_id"], check=0).stdout
        assert out.strip() == f"job {job['job_id']} cancelled"
        _one_line(run_rlm(env, "job", "result", job["job_id"]), 1, "is cancelled")
        again = run_rlm(env, "job", "cancel", job["job_id"], check=0).stdout
        assert "already cancelled" in again
        # the waiting `rlm query` sees the cancel and ends with the job's id
        _out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1 and job["job_id"] in err, err
    finally:
        model.gate.set()
        if proc.poll() is None:
            proc.kill()


# --------------------------------------------------------------------------- progress without a terminal


def test_query_progress_lines_when_stderr_is_not_a_tty(env, model, fresh):
    model.gate.clear()
    proc = _start_query(env)
    try:
        _until_an_analyst_call(fresh)
        time.sleep(12)  # held in the fan-out past the quiet start (10 s), so a progress line is due
    finally:
        model.gate.set()
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert re.search(r"^stage: fan_out \d+/\d+ batches \(\d+ s\)$", err, re.M), err
    assert NEEDLE in out


def test_load_progress_lines(capsys):
    from rlm_api import cli_load

    clock = iter(float(t) for t in [1, 3, 3, 4, 5, 6, 9])
    prog = cli_load._LogProgress()
    prog.tick._clock = lambda: next(clock)
    prog.tick.t0 = 0.0
    prog.files_total(10)
    prog.file_done("a")  # t=1: still in the quiet start
    prog.file_done("b")  # t=3: 20% → a line
    prog.windows_embedded(40)  # t=3: too soon after the last line
    prog.file_done("c")  # t=4: 30% → a line
    prog.windows_embedded(5)  # t=5
    prog.windows_embedded(5)  # t=6
    prog.windows_embedded(5)  # t=9: 5 s since the last line
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "loading: 2/10 files, 0 windows embedded, 3 s",
        "loading: 3/10 files, 40 windows embedded, 4 s",
        "loading: 3/10 files, 55 windows embedded, 9 s",
    ]
