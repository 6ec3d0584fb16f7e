"""A real model driving the synthesizer's tools natively in a `thinking` job with a child, every stage asked
(plan included): the shared corpus and fixtures of tests/support/real_model.py, with workers of its own so that
these settings are theirs.

Native tool calls, not the local default of JSON actions (docs/contract.md#json-actions): offered a choice
between a JSON action and the answer, the 0.5B model answers at once whatever the prompt asks, so only the
server's own tool calling makes it reach the tool runner every run.
"""

from __future__ import annotations

import pytest

from tests.support.real_model import calls_of, corpus, env, local_model, run_job, tree, workers

__all__ = ["corpus", "env", "local_model", "workers"]  # fixtures, used by name

pytestmark = [pytest.mark.slow, pytest.mark.real_model, pytest.mark.timeout(1800)]

#: the server's own tool calling (llama.cpp reads the calls out of the model's chat template), and the plan stage
#: too (a local model's default is JSON actions and no plan call, docs/contract.md#providers)
EXTRA_ENV = {"RLM_TOOL_CALLS": "native", "RLM_PLANNER": "model"}


def test_thinking_with_a_child_and_a_tool_call(conn, workers):
    job_id, result = run_job(conn, "Where does the billing team's service store its data?", mode="thinking", depth=1)
    ids = tree(conn, job_id)
    assert result.response.strip()
    assert result.tool_calls, "the synthesizer made no tool call"
    # which tool a 0.5B model picks, and with which arguments, varies from run to run (it once asked get_buffer
    # for a buffer named "chunks_available"): what must hold is that its calls reached the tool runner
    from rlm_workers.pipeline.synthesize import QUERY_SUBSET_SPEC
    from rlm_workers.pipeline.tools import TOOL_SPECS

    offered = {t["function"]["name"] for t in [*TOOL_SPECS, QUERY_SUBSET_SPEC]}
    assert {t.name for t in result.tool_calls} <= offered, result.tool_calls
    stages = {stage for stage, *_ in calls_of(conn, ids)}
    assert {"plan", "analyst", "check", "synthesize"} <= stages, stages
    checks = conn.execute("SELECT checks FROM jobs WHERE id = %s", (job_id,)).fetchone()[0]
    conn.commit()
    assert len(ids) > 1, f"thinking started no child job; the checks said {checks}"
