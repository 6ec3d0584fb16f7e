"""Each worker command the deploy files run, started for real, consumes exactly the queues its -Q names.

`rlm worker -Q rlm.ingest -P prefork -c 2` once consumed all three queues: sharing the cores between prefork
children re-read the settings, and the settings reset rebuilt the Celery app's queue list over the worker's
-Q choice.  At -c 1 nothing was shared, so both concurrencies are started.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from rlm_workers.constants import ALL_QUEUES
from tests.support.workers import ROOT, WorkerProcess

DEPLOY = ROOT / "deploy"


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _with_option(args: list[str], name: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(name) + 1] = value
    return out


def deploy_worker_commands() -> dict[tuple[str, str], list[str]]:
    """`rlm worker` options of docker-compose and every k8s manifest, one per (queues, pool): the files repeat
    the same command, and starting it twice would test nothing more."""
    found: list[tuple[str, list]] = []
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    found += [(f"compose {n}", s.get("command") or []) for n, s in compose["services"].items()]
    for path in sorted((DEPLOY / "k8s").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = ((doc or {}).get("spec") or {}).get("template", {}).get("spec", {})
            for ctr in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
                found.append((f"{path.relative_to(DEPLOY)} {ctr['name']}", ctr.get("command") or []))
    commands: dict[tuple[str, str], list[str]] = {}
    for where, cmd in found:
        if list(cmd[:2]) != ["rlm", "worker"]:
            continue
        args = [str(a) for a in cmd[2:]]
        for opt in ("-Q", "-P", "-c", "-n"):
            assert opt in args, f"{where}: {opt} is not spelled as this test reads it: {cmd}"
        commands.setdefault((_option(args, "-Q"), _option(args, "-P")), args)
    return commands


class DeployedWorker(WorkerProcess):
    """A worker run with a deploy file's options, only its concurrency and node name changed."""

    def __init__(self, name: str, args: list[str], concurrency: int, env: dict[str, str], log_dir: Path) -> None:
        super().__init__(name, queues=_option(args, "-Q"), env=env, log_dir=log_dir, concurrency=concurrency)
        self.args = args

    def worker_options(self) -> list[str]:
        return _with_option(_with_option(self.args, "-c", str(self.concurrency)), "-n", f"{self.name}@%h")


def test_the_deploy_files_run_one_pool_per_queue():
    commands = deploy_worker_commands()
    assert {q for queues, _ in commands for q in queues.split(",")} == set(ALL_QUEUES), commands
    assert ("rlm.ingest", "prefork") in commands, "the prefork ingest pool is the case that broke"


def test_each_deployed_worker_command_serves_exactly_its_queues(rlm_env, tmp_path):
    from rlm_workers.celery_app import get_app

    workers = [
        DeployedWorker(f"deploy-{queues.replace('rlm.', '').replace(',', '-')}-c{c}", args, c, rlm_env, tmp_path)
        for (queues, _pool), args in deploy_worker_commands().items()
        for c in (1, 2)
    ]
    try:
        with ThreadPoolExecutor(len(workers)) as pool:  # started side by side: each start is mostly imports
            list(pool.map(lambda w: w.start(timeout=180), workers))
        served: dict[str, set[str]] = {}
        deadline = time.monotonic() + 60
        while len(served) < len(workers) and time.monotonic() < deadline:
            replies = get_app().control.inspect(timeout=2.0).active_queues() or {}
            for node, queues in replies.items():
                served[node.split("@")[0]] = {q["name"] for q in queues}
            served = {name: qs for name, qs in served.items() if any(w.name == name for w in workers)}
        for w in workers:
            assert served.get(w.name) == set(w.queues.split(",")), (w.name, w.argv(), served.get(w.name), w.tail())
    finally:
        for w in workers:
            w.stop()


def test_prefork_children_share_the_cores_without_touching_the_settings():
    """What the core share did by re-reading the settings (and so rebuilding the app) it now does alone."""
    from rlm_workers import config

    settings = config.Settings(encode_threads=None)
    whole = settings.resolved_encode_threads
    config.share_cores(2)
    try:
        assert settings.resolved_encode_threads == max(1, whole // 2)
        assert config.Settings(encode_threads=3).resolved_encode_threads == 3  # an explicit value is kept
    finally:
        config.share_cores(1)
