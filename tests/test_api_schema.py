"""Property-based run of the API against its own OpenAPI spec: whatever the body, never a 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from tests.test_api import Api

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def api_key(rlm_env, conn):
    from rlm_api.auth import create_key

    key, _ = create_key(conn, tenant="fuzz")
    conn.commit()
    return key


@pytest.fixture(scope="module")
def api_schema(rlm_env, api_key, tmp_path_factory):
    # The small body limit keeps generated uploads cheap; uploads over it must be a clean 413.
    server = Api(
        {**rlm_env, "HF_HUB_OFFLINE": "1", "RLM_MAX_REQUEST_BYTES": "200000"},
        tmp_path_factory.mktemp("fuzz") / "api.log",
    )
    yield schemathesis.openapi.from_url(f"{server.base}/openapi.json")
    server.stop()


def test_no_server_errors(api_schema, api_key):
    """Every operation, a dozen generated requests each (valid and invalid bodies, odd headers)."""
    from hypothesis import given

    failures = []
    operations = [r.ok() for r in api_schema.get_all_operations()]
    assert len(operations) >= 8
    for op in operations:

        @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=op.as_strategy())
        def run(case):
            case.call_and_validate(
                headers={"Authorization": f"Bearer {api_key}"}, checks=[not_a_server_error], timeout=60
            )

        try:
            run()
        except Exception as exc:  # collect every operation's failure, then report them all
            failures.append(f"{op.method.upper()} {op.path}: {str(exc)[:800]}")
    assert not failures, "\n\n".join(failures)
