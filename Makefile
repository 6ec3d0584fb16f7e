# rlm-pipeline developer commands.  Everything runs from .venv, created on demand.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
RLM    := $(VENV)/bin/rlm
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# The suite's parallel processes (pytest-xdist; each has its own embedded servers and runs whole modules,
# --dist loadfile).  4 on 2 cores: many tests wait (on workers, clocks, a restarted server) while others compute;
# a clean clone's .ci/run took 17:39 with 4 and 19:52 with 5 (two tests with short clocks then failed); 3 took
# 21:03 a commit before, when the real-model modules could still run beside each other (bench/RESULTS.md#suite).
# TEST_WORKERS=0 runs one process; a machine with more cores: TEST_WORKERS=8.
# Modules are taken longest first (tests/support/schedule.py, tests/module_seconds.json), not xdist's most tests first;
# the real-model modules are one unit, so two local model servers never share the cores.
TEST_WORKERS ?= 4
XDIST  := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: install lock test test-fast test-real-model local-llm demo lint bench up clean-data

install: $(STAMP)

# Reinstalls when the declared ranges or the lock change.
$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is required")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	# Exactly the versions the suite was tested with (constraints.txt); pyproject.toml only bounds them.
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	# An editable install leaves our own modules uncompiled, and where PYTHONDONTWRITEBYTECODE is set every
	# `rlm` command and worker would compile them again at each start.
	$(PY) -m compileall -q rlm_workers rlm_api > /dev/null
	touch $(STAMP)

# Re-resolve pyproject.toml's ranges in a throw-away venv and rewrite constraints.txt: run on purpose,
# review the diff, `make test`, commit both.
LOCK_VENV := .lock-venv
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(LOCK_VENV)/bin/python -m pip install --quiet '.[dev]'
	sed -n '1,/^[^#]/{/^#/p}' constraints.txt > constraints.txt.new
	$(LOCK_VENV)/bin/python -m pip freeze --exclude-editable | grep -iv '^rlm-pipeline==' >> constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf $(LOCK_VENV)

# The whole suite, slow suites included, against real PostgreSQL+pgvector, Valkey and Celery workers
# (embedded servers are started by the tests unless RLM_TEST_DATABASE_URL / RLM_TEST_BROKER_URL are set).
test: install local-llm
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The real-model tests alone (tests/test_real_model*.py, tests/test_local_default.py): the local model server
# answering every stage.
test-real-model: install local-llm
	$(PY) -m pytest -q -m real_model $(PYTEST_ARGS)

# The local models, fetched from PyPI into RLM_LOCAL_LLM_DIR (the user cache dir) once per machine: seconds, no
# build (docs/contract.md#local-llm). The server is the prebuilt xllamacpp wheel `make install` installed.
# LOCAL_LLM=<model> fetches that one instead of the stages' defaults (and the suite's qwen2.5-coder-0.5b).
LOCAL_LLM ?=
local-llm: install
	$(RLM) services setup-llm $(LOCAL_LLM)
	$(if $(LOCAL_LLM),,$(RLM) services setup-llm qwen2.5-coder-0.5b)

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(XDIST) $(PYTEST_ARGS)

# Ask this codebase about itself: load the project's own source and docs, search them, then run a
# real query through the whole pipeline (plan, search, chord fan-out, collect, synthesize).  With no key or base
# URL a local model answers (fetched on first use, a minute; docs/contract.md#providers); where none can run, the
# offline extractive provider; with OPENAI_API_KEY, the configured models.
demo: install
	$(RLM) load rlm_workers rlm_api README.md --buffer rlm-self
	$(RLM) buffers
	$(RLM) search "how are embedded servers reused by a second process" --buffer rlm-self --top-k 5
	$(RLM) search "BM25Okapi" --buffer rlm-self --mode bm25 --top-k 3
	$(RLM) query "How does a job still end when an analyst worker dies mid fan-out?" --buffer rlm-self --verbose

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: install
	$(PY) bench/search.py
	$(PY) bench/search.py --peer
	$(PY) bench/bm25_many.py
	$(PY) bench/fusion.py
	$(PY) bench/ingest.py
	$(PY) bench/chunk.py
	$(PY) bench/documents.py --load 8
	$(PY) bench/overhead.py
	$(PY) bench/modes.py
	$(PY) bench/batch.py
	$(PY) bench/batch.py --case shared
	$(PY) bench/fairness.py
	$(PY) bench/budget.py
	$(PY) bench/load.py
	$(PY) bench/timings.py
	$(PY) bench/surfaces.py

up: install
	$(RLM) up
