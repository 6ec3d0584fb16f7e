"""Where a job's size comes from, and how big one job may get.

An operator's RLM_SEARCH_TOP_K / RLM_BATCH_SIZE beat the scaling tier; the per-job caps
(RLM_MAX_CHUNKS_PER_JOB, RLM_MAX_BATCHES_PER_JOB) refuse a request over them (CLI exit 2, HTTP 422,
nothing stored) and cut a plan over them, saying so on the result.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlm_workers.config import Settings
from rlm_workers.models import AnalysisPlan, QueryOptions
from rlm_workers.pipeline.params import resolve_params
from rlm_workers.pipeline.scale import scaling_profile
from tests.support.workers import ROOT


def _env_settings(monkeypatch, **env: str) -> Settings:
    for name in ("RLM_BATCH_SIZE", "RLM_SEARCH_TOP_K", "RLM_MAX_CHUNKS_PER_JOB", "RLM_MAX_BATCHES_PER_JOB"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return Settings(_env_file=None)


# ---------------------------------------------------------------- resolution order


def test_search_top_k_and_batch_size_set_by_the_operator_beat_the_tier(monkeypatch):
    medium = scaling_profile(150)  # the tier says: top_k 200, batch 10
    r = resolve_params(
        QueryOptions(), None, medium, _env_settings(monkeypatch, RLM_SEARCH_TOP_K="40", RLM_BATCH_SIZE="4")
    )
    assert (r.top_k, r.sources["top_k"]) == (40, "config")
    assert (r.batch_size, r.sources["batch_size"]) == (4, "config")
    # the CLI flag and the plan still come first
    r = resolve_params(
        QueryOptions(batch_size=3),
        AnalysisPlan(top_k=50),
        medium,
        _env_settings(monkeypatch, RLM_SEARCH_TOP_K="40", RLM_BATCH_SIZE="4"),
    )
    assert (r.top_k, r.sources["top_k"], r.batch_size, r.sources["batch_size"]) == (50, "plan", 3, "cli")
    # left at their defaults they only fill in after the tier
    r = resolve_params(QueryOptions(), None, medium, _env_settings(monkeypatch))
    assert (r.top_k, r.sources["top_k"], r.batch_size, r.sources["batch_size"]) == (200, "scale", 10, "scale")


# ---------------------------------------------------------------- caps on a plan


def test_a_plan_asking_for_too_much_is_cut_to_the_caps_and_the_cut_is_reported(monkeypatch):
    from rlm_workers.pipeline.report import build_result

    settings = _env_settings(monkeypatch)  # defaults: 10,000 chunks, 200 batches
    greedy = AnalysisPlan(top_k=10_000, max_chunks=100_000, batch_size=1)
    r = resolve_params(QueryOptions(), greedy, scaling_profile(500_000), settings)
    assert r.max_chunks == settings.max_chunks_per_job == 10_000
    assert r.batch_size == 50  # 10,000 chunks in at most 200 batches
    assert len(r.caps_applied) == 2
    assert "RLM_MAX_CHUNKS_PER_JOB" in r.caps_applied[0] and "RLM_MAX_BATCHES_PER_JOB" in r.caps_applied[1]
    result = build_result(
        job_id="j",
        response="",
        provider="extractive",
        tier="xlarge",
        params=r.as_dict(),
        collected=[],
        findings_filtered=0,
        batches=[],
        chunks_available=500_000,
        chunk_load_failures=0,
        usage=(0, 0, 0),
        elapsed_seconds=1.0,
    )
    assert result.caps_applied == r.caps_applied
    assert result.plan.max_chunks == 10_000 and result.plan.batch_size == 50
    # a plan within the caps is left alone
    modest = resolve_params(QueryOptions(), AnalysisPlan(max_chunks=50, batch_size=5), scaling_profile(500), settings)
    assert (modest.max_chunks, modest.batch_size, modest.caps_applied) == (50, 5, [])


def test_lower_caps_from_the_environment_apply(monkeypatch):
    settings = _env_settings(monkeypatch, RLM_MAX_CHUNKS_PER_JOB="30", RLM_MAX_BATCHES_PER_JOB="3")
    r = resolve_params(QueryOptions(), AnalysisPlan(max_chunks=100, batch_size=2), scaling_profile(500), settings)
    assert (r.max_chunks, r.batch_size) == (30, 10)


# ---------------------------------------------------------------- a request over the caps


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--max-chunks", "20000"], "RLM_MAX_CHUNKS_PER_JOB"),
        (["--max-chunks", "2000", "--batch-size", "1"], "RLM_MAX_BATCHES_PER_JOB"),
        (["--num-agents", "500"], "RLM_MAX_BATCHES_PER_JOB"),
    ],
)
def test_the_cli_refuses_a_request_over_the_caps_with_one_line_and_exit_2(rlm_env, conn, flags, needle):
    before = conn.execute("SELECT count(*) FROM jobs").fetchone()[0]
    conn.commit()
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", "query", "what is in here?", "--buffer", "nothing-here", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert conn.execute("SELECT count(*) FROM jobs").fetchone()[0] == before
    conn.commit()


def test_the_api_refuses_a_request_over_the_caps_with_422(rlm_env, conn, embedder, tmp_path):
    from fastapi.testclient import TestClient

    from rlm_api.app import create_app
    from rlm_api.auth import create_key
    from rlm_workers.ingest.loader import load_paths

    (tmp_path / "a.md").write_text("# Caps\n\nA buffer that exists, so only the options can be wrong.\n")
    load_paths(conn, buffer="caps", paths=[tmp_path], tenant="capped", embedder=embedder)
    key, _ = create_key(conn, tenant="capped")
    conn.commit()
    with TestClient(create_app(), headers={"Authorization": f"Bearer {key}"}) as client:
        r = client.post(
            "/v1/queries",
            json={"query": "what is here?", "buffers": ["caps"], "options": {"max_chunks": 20_000, "skip_plan": True}},
        )
    assert r.status_code == 422, r.text
    assert "RLM_MAX_CHUNKS_PER_JOB" in r.json()["error"]["message"]
    assert conn.execute("SELECT count(*) FROM jobs WHERE tenant = 'capped'").fetchone()[0] == 0
    conn.commit()
