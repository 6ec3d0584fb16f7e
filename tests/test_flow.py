"""The stage order and the shared prologue (pipeline/flow.py) on a real PostgreSQL, no broker needed:
every path below ends before a message would be sent."""

from __future__ import annotations

import uuid

import pytest


def _job(stage: str, **fields: object) -> str:
    from rlm_workers.store import jobs as job_store
    from rlm_workers.store.db import connection

    job_id = "fl" + uuid.uuid4().hex
    with connection() as conn:
        job_store.create_job(conn, job_id=job_id, tenant="local", query="q", buffers=["nope"], options={})
        job_store.set_stage(conn, job_id=job_id, stage=stage)
        if fields.get("task_ids"):
            job_store.add_task_ids(conn, job_id=job_id, task_ids=fields["task_ids"])
        if fields.get("batches"):
            job_store.save_search(
                conn,
                job_id=job_id,
                params={},
                tier="tiny",
                chunks_available=1,
                chunk_load_failures=0,
                batches=fields["batches"],
            )
    return job_id


def _get(job_id: str):
    from rlm_workers.store import jobs as job_store
    from rlm_workers.store.db import connection

    with connection() as conn:
        return job_store.get_job(conn, job_id=job_id)


def test_the_order_is_written_once_and_covers_every_task():
    from rlm_workers.pipeline.flow import CHAINED, ORDER, RESEND, TASK, Stage, position
    from rlm_workers.pipeline.stages import RUNNERS

    assert ORDER[0] == Stage.queued and set(ORDER) == set(Stage)
    # a chained stage always comes after the one that chains it (a thinking job loops only through a task: merge)
    assert all(position(b) > position(a) for a, b in CHAINED.items())
    # every stage but the two waits (queued, children: no task runs then) has its task and its runner
    assert set(TASK) == set(RUNNERS) == set(ORDER) - {Stage.queued, Stage.children}
    # a job whose chord was sent is salvaged from what is stored, never sent through the fan-out again
    assert not {Stage.fan_out, Stage.collect, Stage.synthesize} & set(RESEND)
    assert position("done") > position(Stage.synthesize) and position("failed") == position("cancelled")


def test_a_redelivered_plan_never_moves_a_job_back(settings):
    from rlm_workers.pipeline.flow import Stage
    from rlm_workers.pipeline.stages import run_stage

    job_id = _job("fan_out", batches=[[1]], task_ids=["chord-id"])
    # plan and search pass on (the job is past them) and the fan-out sees its chord already sent
    assert run_stage(job_id, Stage.plan) == "already launched"
    job = _get(job_id)
    assert job.stage == "fan_out" and job.status == "running" and "plan" not in job.timings


def test_a_known_error_ends_the_job_with_its_message_and_the_stage_timing(settings):
    from rlm_workers.pipeline.flow import Stage
    from rlm_workers.pipeline.stages import run_stage

    job_id = _job("queued")  # its buffer does not exist: the search's known error
    assert run_stage(job_id, Stage.search) == "failed"
    job = _get(job_id)
    assert job.status == "failed" and job.error.type == "buffer_not_found" and "nope" in job.error.message
    assert "search" in job.timings


def test_a_crash_ends_the_job_as_the_stage_failing(settings, monkeypatch):
    from rlm_workers.pipeline import flow, stages

    def boom(ctx: object) -> str:
        raise ZeroDivisionError("bad arithmetic")

    monkeypatch.setattr(stages, "RUNNERS", dict.fromkeys(flow.Stage, boom))
    job_id = _job("queued")
    assert stages.run_stage(job_id, flow.Stage.collect) == "failed"
    job = _get(job_id)
    assert job.status == "failed" and job.error.stored() == {
        "type": "ZeroDivisionError",
        "message": "collect failed: bad arithmetic",
    }


def test_an_ended_job_is_skipped_untouched(settings):
    from rlm_workers.pipeline.flow import Stage
    from rlm_workers.pipeline.stages import run_stage
    from rlm_workers.store import jobs as job_store
    from rlm_workers.store.db import connection

    job_id = _job("plan")
    with connection() as conn:
        job_store.cancel_job(conn, job_id=job_id, tenant="local")
    assert run_stage(job_id, Stage.search) == "skipped"
    assert _get(job_id).stage == "cancelled"


@pytest.mark.parametrize("stage", ["plan", "search", "collect", "synthesize"])
def test_a_database_outage_is_left_to_the_task_to_retry(settings, monkeypatch, stage):
    import psycopg

    from rlm_workers.pipeline import flow, stages

    def away(ctx: object) -> str:
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(stages, "RUNNERS", dict.fromkeys(flow.Stage, away))
    job_id = _job("queued")
    with pytest.raises(psycopg.OperationalError):
        stages.run_stage(job_id, flow.Stage(stage))
    assert _get(job_id).status == "running"  # not failed: a retry goes on where it was


def test_tasks_declare_their_outage_retries():
    from rlm_workers.celery_app import app
    from rlm_workers.store.db import DB_OUTAGE

    app.loader.import_default_modules()
    names = [
        "rlm.plan",
        "rlm.search",
        "rlm.fan_out",
        "rlm.analyst",
        "rlm.collect",
        "rlm.synthesize",
        "rlm.salvage",
        "rlm.watchdog",
        "rlm.ingest",
        "rlm.embed",
        "rlm.batch.tick",
        "rlm.batch.reconcile",
    ]
    for name in names:
        task = app.tasks[name]
        assert tuple(task.autoretry_for) == DB_OUTAGE and task.max_retries == 30, name


def test_a_delivery_beside_a_launch_in_progress_sends_no_second_chord(settings):
    """A stage message restored while its first delivery is still sending the chord (a worker that lost Redis
    mid-send) finds the job's launch lock taken and sends nothing; once released, a stored launch is seen."""
    import psycopg

    from rlm_workers.pipeline.flow import Stage
    from rlm_workers.pipeline.stages import run_stage
    from rlm_workers.store import jobs as job_store

    job_id = _job("search", batches=[[1], [2]])
    with psycopg.connect(settings.database_url, autocommit=True) as first:
        with job_store.launch_lock(first, job_id=job_id) as held:
            assert held
            assert run_stage(job_id, Stage.fan_out) == "being launched by another delivery"
            job_store.add_task_ids(first, job_id=job_id, task_ids=["chord-id"])  # the first delivery's send
        assert run_stage(job_id, Stage.fan_out) == "already launched"
        with job_store.launch_lock(first, job_id=job_id) as again:
            assert again  # released by the delivery that ran, and by the one that held it
    assert _get(job_id).task_ids == ["chord-id"]


def test_a_broker_outage_leaves_the_job_where_it_was(settings, monkeypatch):
    """Sending the chord with the broker gone fails the task, not the job: recovery (the reconciler, an overnight
    batch's broker-epoch check) picks the job up where it stopped."""
    import kombu.exceptions

    from rlm_workers.pipeline import flow, stages

    def away(ctx: object) -> str:
        raise kombu.exceptions.OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(stages, "RUNNERS", dict.fromkeys(flow.Stage, away))
    job_id = _job("search", batches=[[1]])
    with pytest.raises(kombu.exceptions.OperationalError):
        stages.run_stage(job_id, flow.Stage.fan_out)
    job = _get(job_id)
    assert job.status == "running" and job.stage == "fan_out" and job.error is None
