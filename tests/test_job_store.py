"""The claim/salvage protocol on a real PostgreSQL: a batch is never billed for a job already reported."""

from __future__ import annotations

import pytest

from tests.support.jobs import stored_fan_out_job


@pytest.fixture()
def job(settings):
    return stored_fan_out_job("js", [[1], [2], [3]])


def _age(conn, job_id, seconds):
    """Pretend the job's last sign of life (stage change, batch start, heartbeat or end) was ``seconds`` ago."""
    ago = "now() - make_interval(secs => %s)"
    conn.execute(f"UPDATE jobs SET stage_at = {ago} WHERE id = %s", (seconds, job_id))
    conn.execute(
        f"UPDATE job_batches SET started_at = {ago}, heartbeat_at = {ago} WHERE job_id = %s AND started_at IS NOT NULL",
        (seconds, seconds, job_id),
    )


def test_a_claim_counts_as_progress_and_a_salvage_backs_off(job):
    from rlm_workers.pipeline.salvage import salvage_job
    from rlm_workers.store import jobs as job_store
    from rlm_workers.store.db import connection

    with connection() as conn:
        _age(conn, job, 600)
        assert [j for j, _, idle in job_store.stale_jobs(conn, idle_seconds=300) if idle >= 600] == [job]
        assert job_store.claim_batch(conn, job_id=job, batch_no=0) == [1]
        assert job not in [j for j, _, _ in job_store.stale_jobs(conn, idle_seconds=300)]
        assert not salvage_job(conn, job, "test", min_idle_seconds=300)  # batch 0 just started
        assert job_store.get_job(conn, job_id=job).status == "running"
        assert job_store.finish_batch(conn, job_id=job, batch_no=0)
        assert not job_store.finish_batch(conn, job_id=job, batch_no=0)  # stored once


def test_after_a_salvage_no_batch_can_start_or_store(job):
    from rlm_workers.pipeline.salvage import salvage_job
    from rlm_workers.store import jobs as job_store
    from rlm_workers.store.db import connection

    with connection() as conn:
        assert job_store.claim_batch(conn, job_id=job, batch_no=0) == [1]  # in flight when the salvage comes
        _age(conn, job, 600)
        assert salvage_job(conn, job, "test", min_idle_seconds=300)
        row = job_store.get_job(conn, job_id=job)
        assert row.status == "done" and row.result.batches_failed == 3 and row.result.total_tokens == 0
        assert job_store.claim_batch(conn, job_id=job, batch_no=1) is None
        assert not job_store.finish_batch(conn, job_id=job, batch_no=0)  # its late answer stays out
        assert {b.status for b in job_store.batches(conn, job_id=job)} == {"failed"}
        assert not salvage_job(conn, job, "twice")


def test_a_claim_waits_for_a_salvage_in_progress_and_then_declines(job, settings):
    import threading

    import psycopg

    from rlm_workers.pipeline.collect import LOST
    from rlm_workers.store import jobs as job_store

    got: list[bool] = []
    with (
        psycopg.connect(settings.database_url, autocommit=True) as salvager,
        psycopg.connect(settings.database_url, autocommit=True) as analyst,
    ):
        with salvager.transaction():
            assert job_store.lock_for_salvage(salvager, job_id=job)
            claim = threading.Thread(target=lambda: got.append(job_store.claim_batch(analyst, job_id=job, batch_no=1)))
            claim.start()
            claim.join(1.0)
            assert claim.is_alive() and not got  # blocked on the job row
            job_store.fail_unfinished_batches(salvager, job_id=job, reason=LOST)
        claim.join(10)
    assert got == [None]


def test_one_heartbeat_renews_every_pending_batch_held_and_names_them(job):
    from rlm_workers.store import jobs as job_store
    from rlm_workers.store.db import connection

    with connection() as conn:
        assert job_store.claim_batch(conn, job_id=job, batch_no=0) == [1]
        assert job_store.claim_batch(conn, job_id=job, batch_no=1) == [2]
        assert job_store.finish_batch(conn, job_id=job, batch_no=1)  # ended: no lease left to renew
        _age(conn, job, 600)
        renewed = job_store.heartbeat_batches(conn, batches=[(job, 0), (job, 1), (job, 7), ("no-such-job", 0)])
        assert renewed == {(job, 0)}
        ages = dict(
            conn.execute(
                "SELECT batch_no, extract(epoch FROM now() - heartbeat_at) FROM job_batches WHERE job_id = %s",
                (job,),
            ).fetchall()
        )
        assert ages[0] < 60 and ages[1] >= 600  # only the pending batch's lease moved
        assert job_store.heartbeat_batches(conn, batches=[]) == set()


def test_a_batch_s_findings_are_stored_in_one_go_and_read_back_as_given(job):
    from rlm_workers.models import Finding, Record
    from rlm_workers.store import jobs as job_store
    from rlm_workers.store.db import connection

    findings = [
        Finding(chunk_id=1, relevance="high", findings=["a", 'quote "b"'], summary="s", follow_up=["f?"]),
        Finding(chunk_id=9, relevance="none", records=[Record(label="level", value="ERROR", count=3)]),
        Finding(chunk_id=1, relevance="low", findings=["later"], summary="t"),  # the same chunk again: it wins
    ]
    with connection() as conn:
        assert job_store.claim_batch(conn, job_id=job, batch_no=0) == [1]
        assert job_store.finish_batch(conn, job_id=job, batch_no=0, findings=findings)
        rows = conn.execute(
            """SELECT chunk_id, relevance, findings, summary, follow_up, records FROM job_findings
               WHERE job_id = %s AND batch_no = 0 ORDER BY chunk_id""",
            (job,),
        ).fetchall()
    assert rows == [
        (1, "low", ["later"], "t", [], []),
        (9, "none", [], "", [], [{"label": "level", "value": "ERROR", "count": 3}]),
    ]


def test_a_malformed_json_column_is_refused_when_written_and_names_the_key(job):
    from pydantic import ValidationError

    from rlm_workers.store import jobs as job_store
    from rlm_workers.store.db import connection

    with connection() as conn:
        with pytest.raises(ValidationError, match="chunk_ids"):
            job_store.create_job(
                conn, job_id="bad" + job, tenant="local", query="q", buffers=["b"], options={}, spec={"chunk_ids": "7"}
            )
        with pytest.raises(ValidationError, match="filtered"):
            job_store.save_collected(conn, job_id=job, collected={"kept": [], "filtered": "some"})
        with pytest.raises(ValidationError, match="depth"):
            job_store.create_job(
                conn, job_id="bad2" + job, tenant="local", query="q", buffers=["b"], options={"depth": 9}
            )
        with pytest.raises(ValidationError, match="message"):
            job_store.finish_batch(conn, job_id=job, batch_no=0, error={"type": "x", "message": ["not", "text"]})
        assert job_store.get_job(conn, job_id="bad" + job) is None  # nothing was written
        assert job_store.get_job(conn, job_id=job).collected is None


def test_a_row_stored_in_an_older_shape_still_reads(job):
    """Keys written before the models existed read with their defaults; keys the models do not name are kept
    where a column is open-ended (spec, plan, errors) and ignored where it is not (options)."""
    from psycopg.types.json import Jsonb

    from rlm_workers.store import jobs as job_store
    from rlm_workers.store.db import connection

    with connection() as conn:
        conn.execute(
            """UPDATE jobs SET options = %s, plan = %s, collected = %s, spec = %s, error = %s, synth_state = %s
               WHERE id = %s""",
            (
                Jsonb({"mode": "thinking", "retired_knob": 3}),
                Jsonb({"top_k": 50}),
                Jsonb({"kept": []}),  # before records were collected
                Jsonb({"kind": "follow_up", "note": "old"}),
                Jsonb({"type": "lost"}),  # no message
                Jsonb({"messages": [], "turn": 2}),  # before reasks were counted
                job,
            ),
        )
        row = job_store.get_job(conn, job_id=job)
        assert row.options.mode == "thinking" and "retired_knob" not in row.options.stored()
        assert row.plan.route is None and row.plan.stored() == {"top_k": 50}
        assert row.collected.records == {} and row.collected.filtered == 0
        assert row.spec.kind == "follow_up" and row.spec.stored() == {"kind": "follow_up", "note": "old"}
        assert row.error.type == "lost" and row.error.message == ""
        assert row.synth_state.turn == 2 and row.synth_state.reasks == 0
        assert row.params.stored() == {} and row.params.focus_topics == []
