"""What a newcomer with no key meets (docs/contract.md#providers): RLM_PROVIDER=auto picks the stages' default
local models, `rlm query` fetches and starts them itself, and the output says who answered.

A module of its own, with no workers of its own: the command must start its in-process worker with its own
settings (workers another module started for another model would answer for it, and the line would name theirs).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.real_model, pytest.mark.timeout(1800)]

BUFFER = "teams"


@pytest.fixture(scope="module")
def corpus(rlm_env, conn, embedder, tmp_path_factory):
    from rlm_workers.ingest.loader import load_paths
    from rlm_workers.runtime.local_models import wheel_problem

    if why := wheel_problem():
        pytest.skip(f"the prebuilt local model server cannot run here: {why}")
    root = tmp_path_factory.mktemp("teams")
    (root / "teams.md").write_text("# Teams\n\nThe billing team maintains the Zephyrine service.\n")
    (root / "parking.md").write_text("# Parking\n\nVisitors park on level two of the east garage.\n")
    load_paths(conn, buffer=BUFFER, paths=[root], embedder=embedder)
    conn.commit()
    return root


@pytest.fixture(scope="module")
def server_stopped(rlm_env):
    """The server the command starts lives past it (for the next command); the module stops it."""
    from rlm_workers.config import get_settings
    from rlm_workers.runtime.local_llm import stop_server

    yield
    stop_server(get_settings().data_dir)


def test_with_no_key_rlm_query_answers_with_a_local_model_and_says_so(rlm_env, corpus, server_stopped):
    from rlm_workers.runtime.local_models import DEFAULT_STAGE_MODELS

    drop = ("RLM_LOCAL_LLM", "RLM_PROVIDER", "OPENAI_API_KEY", "RLM_API_KEY", "OPENAI_BASE_URL", "RLM_BASE_URL")
    env = {k: v for k, v in {**os.environ, **rlm_env}.items() if k not in drop}
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", "query", "Which service does the billing team maintain?"]
        + ["--buffer", BUFFER, "--mode", "instant"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Zephyrine" in proc.stdout, proc.stdout
    answered = proc.stdout.rstrip().splitlines()[-1]
    assert answered.startswith("Answered by: a local model on this machine: "), proc.stdout
    assert set(answered.split(": ", 2)[2].split(", ")) <= set(DEFAULT_STAGE_MODELS.values()), answered
