"""The ``rlm`` CLI as users run it: real processes, real exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.corpus import write_mixed_tree

#: what ``rlm chunk show --format json`` and ``GET /v1/chunks/{id}`` show of a chunk (docs/contract.md#http-chunks)
CHUNK_VIEW_KEYS = (
    *("chunk_id", "buffer", "path", "start_line", "end_line", "text"),
    *("page_start", "page_end", "section", "heading_path"),
)

#: a real document the loader skips as `encrypted` (tests/data/documents/README.md)
ENCRYPTED_PDF = Path(__file__).parent / "data" / "documents" / "pypdf-r4-aes-user-password.pdf"


def run_rlm(env, *args, check=None):
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check is not None:
        assert proc.returncode == check, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def stored(conn) -> list:
    """The local tenant's buffers with their versions and counts, read from the store: a refused command leaves
    them as they were (read in-process: two `rlm buffers` per case were 46 process starts, about 23 CPU-s)."""
    from rlm_workers.engine import list_buffers

    try:
        return list_buffers(conn, tenant="local")
    finally:
        conn.commit()


@pytest.fixture(scope="module")
def cli_env(rlm_env):
    return dict(rlm_env)


@pytest.fixture(scope="module")
def loaded(cli_env, tmp_path_factory):
    tree = write_mixed_tree(tmp_path_factory.mktemp("cli") / "proj")
    proc = run_rlm(cli_env, "load", str(tree), "--buffer", "proj", "--chunk-size", "400", "--overlap", "50", check=0)
    assert "2 files loaded" in proc.stdout
    assert "1 binary" in proc.stdout and "1 not-utf8" in proc.stdout and "1 empty" in proc.stdout
    return tree


def test_search_json_shape(cli_env, loaded):
    proc = run_rlm(cli_env, "search", "refund window days", "--buffer", "proj", "--format", "json", check=0)
    data = json.loads(proc.stdout)
    assert set(data) == {"results"}
    first = data["results"][0]
    assert set(first) == {
        *("chunk_id", "buffer", "path", "start_line", "end_line", "score", "text", "passage"),
        # where a document's chunk sits (docs/contract.md#documents); null / [] for code like this hit
        *("page_start", "page_end", "section", "heading_path"),
    }
    assert (first["page_start"], first["page_end"], first["section"], first["heading_path"]) == (None, None, None, [])
    assert first["passage"] is None or first["passage"] in first["text"]
    assert first["path"] == "proj/pkg/billing.py"
    assert first["buffer"] == "proj"


def test_search_text_output(cli_env, loaded):
    proc = run_rlm(cli_env, "search", "nightly backups", "--buffer", "proj", "--top-k", "2", check=0)
    assert "proj:proj/docs/guide.md:" in proc.stdout


def test_buffers_and_show(cli_env, loaded):
    out = json.loads(run_rlm(cli_env, "buffers", "--format", "json", check=0).stdout)
    names = [b["name"] for b in out["buffers"]]
    assert "proj" in names
    show = json.loads(run_rlm(cli_env, "buffer", "show", "proj", "--format", "json", check=0).stdout)
    assert show["files"] == 2 and show["chunks"] >= 2


@pytest.mark.parametrize(
    "args, needle",
    [
        (["load", "/definitely/missing/path", "--buffer", "proj"], "path not found"),
        (["search", "anything", "--buffer", "no-such-buffer"], "no buffer named 'no-such-buffer'"),
        (["search", "   ", "--buffer", "proj"], "query is empty"),
        (["search", "x", "--buffer", "proj", "--top-k", "0"], "--top-k"),
        (["load", ".", "--buffer", "proj", "--overlap", "5000"], "overlap"),
        (["buffer", "show", "ghost"], "no buffer named 'ghost'"),
        # a bound broken names the bound
        (["query", "x", "--buffer", "proj", "--depth", "9"], "depth: 9 (must be an integer from 0 to 5)"),
        (["query", "x", "--buffer", "proj", "--threshold", "2"], "threshold: 2.0 (must be a number from -1 to 1)"),
        (["query", "x", "--buffer", "proj", "--max-cost", "0"], "max-cost: 0.0 (must be a number above 0 and at"),
        (["query", "x", "--buffer", "proj", "--top-k", "0"], "top-k: 0 (must be an integer from 1 to 10000)"),
        (["query", "x", "--buffer", "proj", "--timeout", "-1"], "timeout: -1 (must be a number above 0)"),
        # a load that ran (and showed progress) before it found nothing to load: no blank line left above the
        # error, and the reason in words that do not read as "PDFs are not supported"
        (
            ["load", str(ENCRYPTED_PDF), "--buffer", "locked"],
            "(1 encrypted: pypdf-r4-aes-user-password.pdf); encrypted: documents that need a password are not opened",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(cli_env, conn, loaded, args, needle):
    before = stored(conn)
    proc = run_rlm(cli_env, *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()  # blank ones too: an empty line above the error is not "one line"
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert stored(conn) == before  # nothing lost or added


def _options(*command: str) -> set[str]:
    """Every option string `rlm COMMAND…` accepts."""
    import typer.main

    from rlm_api.cli import app

    cmd = typer.main.get_command(app)
    for name in command:
        cmd = cmd.commands[name]
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", text))


def test_no_results_exits_3_with_hints(cli_env, loaded):
    proc = run_rlm(cli_env, "search", "zyzzyva", "--buffer", "proj", "--mode", "bm25")
    assert proc.returncode == 3
    assert "--threshold" in proc.stderr and "switch --mode" in proc.stderr


def test_every_flag_a_hint_names_is_an_option_of_its_command(cli_env, loaded):
    """What `rlm search` prints when nothing matches, and what `rlm query` prints (its exit-3 error, and the
    report of a job whose analysts found nothing): each --flag named there is one the command takes."""
    from rlm_workers.errors import NoChunks
    from rlm_workers.pipeline.synthesize import canned_no_findings_report

    search = run_rlm(cli_env, "search", "zzzqqq", "-b", "proj", "--mode", "bm25")
    assert search.returncode == 3
    hints = {
        ("search",): search.stderr,
        # `rlm query` re-raises a job's no_chunks error as NoChunks(detail), and prints a job's canned report
        ("query",): NoChunks("no chunks matched the query").message
        + canned_no_findings_report("q")
        + canned_no_findings_report("q", not_run=2),
    }
    for command, text in hints.items():
        assert _flags(text), text
        assert _flags(text) <= _options(*command), (command, _flags(text) - _options(*command))


def test_buffer_rm(cli_env, loaded, tmp_path):
    (tmp_path / "a.md").write_text("# A\n\nSomething to remove later.\n")
    run_rlm(cli_env, "load", str(tmp_path / "a.md"), "--buffer", "tmp-buf", check=0)
    run_rlm(cli_env, "buffer", "rm", "tmp-buf", check=0)
    assert run_rlm(cli_env, "buffer", "rm", "tmp-buf").returncode == 2


# --------------------------------------------------------------------------- usage errors (issue 10)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["query", "x", "--buffer", "proj", "--bogus"], "No such option: --bogus"),
        (["search", "x", "--buffer", "proj", "--bogus"], "No such option: --bogus"),
        (["search", "x", "--buffer", "proj", "--format", "yaml"], "'--format'"),
        (["search", "x", "--buffer", "proj", "--top-k", "abc"], "'--top-k'"),
        (["query", "--buffer", "proj"], "Missing argument 'QUERY'"),
        (["lod"], "No such command 'lod'"),
        ([], "Usage: rlm"),
        (["buffer"], "Usage: rlm buffer"),
        (["batch", "submit", "--search-mode", "fuzzy", "-q", "-"], "'--search-mode'"),
        (["jobs", "--status", "bogus"], "'bogus' is not one of 'queued'"),
        (["query", "x", "--buffer", "proj", "--mode", "deep"], "'deep' is not one of 'instant'"),
    ],
)
def test_usage_error_is_one_message_and_exit_2(cli_env, conn, loaded, args, needle):
    before = stored(conn)
    proc = run_rlm(cli_env, *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    out = proc.stdout + proc.stderr
    assert needle in out, out
    assert "Traceback" not in out and "Exception" not in out and "Value error" not in out, out
    assert stored(conn) == before


@pytest.mark.parametrize("group", [[], ["query"], ["buffer"], ["buffer", "show"], ["batch", "submit"], ["keys"]])
def test_dash_h_is_help_everywhere(group):
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", *group, "-h"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Usage: rlm"), proc.stdout


def test_help_at_80_columns_keeps_every_option_name_and_lists_search_modes():
    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb"}
    for cmd in (["query"], ["batch", "submit"]):
        out = subprocess.run(
            [sys.executable, "-m", "rlm_api.cli", *cmd, "--help"], env=env, capture_output=True, text=True, timeout=120
        ).stdout
        assert not re.search(r"--[\w-]*…", out), out  # an option name cut to fit
        assert max(len(line) for line in out.splitlines()) <= 80, out
        # one option type for both: the choices are listed, not a bare <str>
        assert "--search-mode <hybrid|semantic|bm25>" in out, out
    out = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", "batch", "submit", "--help"], env=env, capture_output=True, text=True
    ).stdout
    assert "--idempotency-key" in out and "--no-check-workers" in out


def test_every_query_option_has_help_and_each_numeric_one_its_range():
    import typer

    from rlm_api.cli import app

    query = typer.main.get_command(app).commands["query"]  # type: ignore[attr-defined]
    # typer may bring its own click: options are told by kind, not by class
    options = [p for p in query.params if p.param_type_name == "option" and p.name != "help"]
    assert len(options) >= 19
    for opt in options:
        assert opt.help and opt.help.strip(), f"{opt.opts[0]} has no help"
    for name in ("--threshold", "--top-k", "--max-chunks", "--batch-size", "--num-agents", "--depth", "--timeout"):
        [opt] = [o for o in options if name in o.opts]
        assert " from " in opt.help or " above " in opt.help, (name, opt.help)
    for name in ("--max-llm-calls", "--max-tokens", "--max-cost", "--deadline"):
        [opt] = [o for o in options if name in o.opts]
        assert " from " in opt.help or " above " in opt.help, (name, opt.help)


def test_non_utf8_argument_is_one_line_exit_2(cli_env, loaded):
    proc = subprocess.run(
        [sys.executable.encode(), b"-m", b"rlm_api.cli", b"buffer", b"show", b"\xff"],
        env={**os.environ, **cli_env},
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and b"not valid UTF-8" in lines[0], proc.stderr


def test_click_exceptions_from_either_click_are_recognised():
    """typer >= 0.25 raises its vendored click's classes; an older typer raises the click package's."""
    import click

    from rlm_api.cli_types import click_error_kind

    assert click_error_kind(click.UsageError("x")) == ("usage", 2)
    assert click_error_kind(click.exceptions.NoSuchOption("--x")) == ("usage", 2)
    assert click_error_kind(click.exceptions.Exit(3)) == ("exit", 3)
    try:
        from typer._click import exceptions as vendored
    except ImportError:
        pytest.skip("this typer does not vendor click")
    assert click_error_kind(vendored.NoSuchOption("--x")) == ("usage", 2)
    assert click_error_kind(vendored.ClickException("x")) == ("click", 1)
    assert click_error_kind(ValueError("x")) is None


def test_a_stopped_broker_is_one_line_not_a_traceback(cli_env, loaded):
    import socket

    with socket.socket() as s:  # a port nothing listens on once the socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**cli_env, "RLM_BROKER_URL": f"redis://127.0.0.1:{port}/0"}
    proc = run_rlm(env, "query", "refund window days", "--buffer", "proj", "--timeout", "30")
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "cannot reach the broker" in proc.stderr and "RLM_BROKER_URL" in proc.stderr
