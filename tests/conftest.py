"""Shared fixtures: real PostgreSQL+pgvector and Valkey/Redis, isolated per test module."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# mypy starts with the session and runs beside the tests (tests/test_types.py reads its result); modules are
# taken longest first (tests/support/schedule.py)
pytest_plugins = ["tests.support.typecheck", "tests.support.schedule"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Exported ONNX encoders are cached across modules (each module has its own RLM_DATA_DIR) and across test runs:
# the cache is keyed by the model files and the export recipe (ingest/onnxenc.py), so a stale one is never used.
os.environ.setdefault("RLM_ENCODER_DIR", str(Path(tempfile.gettempdir()) / "rlm-test-encoders"))
# No test may reach a real LLM by accident: with no key, the offline extractive provider answers, never a local model
# fetched and started behind a test's back (tests/test_real_model*.py name one on purpose, test_local_default.py
# leaves it unset on purpose).
for _var in ("OPENAI_API_KEY", "RLM_API_KEY", "OPENAI_BASE_URL", "RLM_BASE_URL", "RLM_PROVIDER"):
    os.environ.pop(_var, None)
os.environ["RLM_LOCAL_LLM"] = "off"
# The local model server writes replies on one thread: the suite runs 4 processes on 2 cores, where a second thread
# mostly waits for the first (bench/RESULTS.md#suite; tests/support/real_model.py reads prompts on two)
os.environ.setdefault("RLM_LOCAL_LLM_THREADS", "1")
# Every data dir of embedded servers the test processes start lies under one directory per run, made by the first
# process (the xdist controller, or the only one) and removed when it ends: a worker stopped before its teardown
# (Ctrl-C under xdist) leaves its servers running, and their watchers stop them once their data dir is gone.
_OWNS_RUN_DIR = "RLM_TEST_RUN_DIR" not in os.environ
if _OWNS_RUN_DIR:
    os.environ["RLM_TEST_RUN_DIR"] = tempfile.mkdtemp(prefix="rlm-test-run-")
# Nor the user's own data dir: code that runs outside a module's rlm_env (the limiter's metrics, a settings reset
# at teardown) would start an embedded server there.  This one is removed at the end, and its servers' watchers
# stop them once it is gone (docs/architecture.md#embedded-servers).  Each pytest process has its own: an xdist
# worker inherits the controller's environment, and would otherwise share (and never remove) the controller's.
_FALLBACK_DATA_DIR = tempfile.mkdtemp(prefix="rlm-test-fallback-", dir=os.environ["RLM_TEST_RUN_DIR"])
if os.environ.get("RLM_DATA_DIR") in (None, os.environ.get("RLM_TEST_FALLBACK_DATA_DIR")):
    os.environ["RLM_DATA_DIR"] = _FALLBACK_DATA_DIR
os.environ["RLM_TEST_FALLBACK_DATA_DIR"] = _FALLBACK_DATA_DIR


def pytest_unconfigure(config):
    # here rather than in a session fixture: an xdist controller runs no fixtures, but made one too
    shutil.rmtree(_FALLBACK_DATA_DIR, ignore_errors=True)
    if _OWNS_RUN_DIR:
        shutil.rmtree(os.environ["RLM_TEST_RUN_DIR"], ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _encoder_exported():
    """Export the default ONNX encoder once, in this process, before any test: otherwise whichever `rlm`
    subprocess first needs it pays the export (torch + transformers + quantizer, ~0.9 GB at peak), which
    would land in one test's memory or time budget (a fresh venv has new mtimes, hence a new cache key)."""
    from rlm_workers.ingest import onnxenc
    from rlm_workers.ingest.embed import _resolve_model

    if onnxenc.available():
        model_id, path = _resolve_model(None)
        onnxenc.exported_path(model_id, Path(path), "onnx-int8", Path(os.environ["RLM_ENCODER_DIR"]))


@pytest.fixture(scope="session")
def test_services():
    from tests.support.services import run_data_dir, start_services

    # one per pytest process: under xdist each worker has its own servers, so one module's flushdb or queues never
    # reach another's
    svc = start_services(run_data_dir("rlm-test-"))
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def db_url(test_services) -> str:
    return test_services.new_database()


@pytest.fixture(scope="module")
def rlm_env(test_services, db_url, tmp_path_factory):
    """Environment for one module: its own database and data dir, the shared broker."""
    from tests.support.envpatch import patched_env

    data_dir = tmp_path_factory.mktemp("rlm-data")
    env = {
        "RLM_DATABASE_URL": db_url,
        "RLM_BROKER_URL": test_services.broker_url,
        "RLM_DATA_DIR": str(data_dir),
        "RLM_PROMPT_DIR": str(data_dir / "prompts"),
        # The suites written before modes expect a fan-out on their small corpora; tests of routing set it back.
        "RLM_DIRECT_MAX_TOKENS": "0",
    }
    with patched_env(env):
        yield env


@pytest.fixture(scope="module")
def settings(rlm_env):
    from rlm_workers.config import get_settings

    return get_settings()


@pytest.fixture(scope="module")
def conn(settings):
    from rlm_workers.store.db import connect

    c = connect(settings)
    yield c
    c.close()


@pytest.fixture(scope="session")
def embedder():
    """The default encoder (RLM_EMBEDDING_RUNTIME=auto: ONNX Runtime int8 where it can run)."""
    from rlm_workers.ingest.embed import get_embedder

    return get_embedder()


@pytest.fixture(scope="session")
def torch_embedder():
    """The reference: sentence-transformers on PyTorch, float32."""
    from rlm_workers.ingest.embed import get_embedder

    return get_embedder(runtime="torch")


# --- a scripted model and its server, for modules that run the pipeline on real workers ---------------
# Each such module defines its own ``workers`` fixture (which processes, which env); ``fresh`` resets
# everything a test may have changed.


@pytest.fixture(scope="module")
def model():
    from tests.support.pipeline_model import Model

    return Model()


@pytest.fixture(scope="module")
def llm(model):
    from tests.support.scripted_llm import ScriptedLLM

    with ScriptedLLM(model) as srv:
        yield srv


@pytest.fixture()
def fresh(llm, model, workers):
    """An idle model with open gates, reset counters, and every worker of the module up."""
    model.plan_reply, model.analyst_delay, model.check_reply = None, 0.0, None
    model.gate.set()
    for w in workers.values():
        if not w.alive:
            w.start()
    llm.reset()
    return llm
