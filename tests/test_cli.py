"""The ``rlm`` CLI as users run it: real processes, real exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.corpus import write_mixed_tree


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
    assert set(first) == {"chunk_id", "buffer", "path", "start_line", "end_line", "score", "text"}
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
    ],
)
def test_bad_input_exits_2_with_one_line(cli_env, loaded, args, needle):
    before = run_rlm(cli_env, "buffers", "--format", "json", check=0).stdout
    proc = run_rlm(cli_env, *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert run_rlm(cli_env, "buffers", "--format", "json", check=0).stdout == before  # nothing lost or added


def test_no_results_exits_3_with_hints(cli_env, loaded):
    proc = run_rlm(cli_env, "search", "zyzzyva", "--buffer", "proj", "--mode", "bm25")
    assert proc.returncode == 3
    assert "--threshold" in proc.stderr and "--search-mode" in proc.stderr


def test_buffer_rm(cli_env, loaded, tmp_path):
    (tmp_path / "a.md").write_text("# A\n\nSomething to remove later.\n")
    run_rlm(cli_env, "load", str(tmp_path / "a.md"), "--buffer", "tmp-buf", check=0)
    run_rlm(cli_env, "buffer", "rm", "tmp-buf", check=0)
    assert run_rlm(cli_env, "buffer", "rm", "tmp-buf").returncode == 2
