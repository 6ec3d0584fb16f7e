"""The same sentence-transformers model run by ONNX Runtime, in float32 or int8.

Encoding is nearly all of ``rlm load``.  PyTorch's float32 forward pass is the
reference; this module exports that model once to ONNX (from the local files,
never a download), optionally quantizes its matrix products to int8, and runs it
with ONNX Runtime on one thread per batch, several batches at a time.  Why these
choices, and what they cost in quality, is in docs/architecture.md#encoder-runtimes.

Exported files are cached under ``RLM_ENCODER_DIR`` (default ``RLM_DATA_DIR/encoders``),
keyed by the model files and ``EXPORT_VERSION``; several processes may ask at once
(a file lock, then an atomic rename).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import inspect
import json
import logging
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import ConfigError
from .windows import DEFAULT_WINDOWS, WindowSpec, cut, query_windows

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("rlm.embed")

#: bump when the export or the quantization recipe changes: cached files are then rebuilt
EXPORT_VERSION = 1
ONNX_RUNTIMES = ("onnx", "onnx-int8")
_OPSET = 17


def pooling_of(model_dir: Path) -> str | None:
    """``mean`` or ``cls`` for a sentence-transformers folder this module can export, else None."""
    try:
        pooling = json.loads((model_dir / "1_Pooling" / "config.json").read_text())
        modules = json.loads((model_dir / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    modes = {k for k, v in pooling.items() if k.startswith("pooling_mode_") and v is True}
    if modes == {"pooling_mode_mean_tokens"}:
        mode = "mean"
    elif modes == {"pooling_mode_cls_token"}:
        mode = "cls"
    else:
        return None
    kinds = [m.get("type", "") for m in modules]
    # Transformer, Pooling and an optional Normalize: anything more (a Dense head, say) is not exported
    if len(kinds) > 3 or not all(k.endswith(("Transformer", "Pooling", "Normalize")) for k in kinds):
        return None
    if not (model_dir / "tokenizer.json").exists():
        return None
    return mode


def available() -> bool:
    """Whether the ``onnxruntime`` package can be imported (without importing it)."""
    return importlib.util.find_spec("onnxruntime") is not None


def _fingerprint(model_id: str, model_dir: Path) -> str:
    """Names the cached export: the model's files by name, size and mtime, and the recipe version."""
    h = hashlib.sha256(f"{model_id}\0{EXPORT_VERSION}\0".encode())
    for p in sorted(model_dir.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(model_dir)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:16]


def exported_path(model_id: str, model_dir: Path, runtime: str, cache_dir: Path) -> Path:
    """The ONNX file for ``runtime``, exported (and quantized) first if it is not cached yet."""
    if runtime not in ONNX_RUNTIMES:
        raise ValueError(runtime)
    pooling = pooling_of(model_dir)
    if pooling is None:
        raise ConfigError(
            f"the embedding model {model_id!r} cannot run on ONNX Runtime here (its pooling or modules are not "
            "mean/CLS + optional Normalize); set RLM_EMBEDDING_RUNTIME=torch"
        )
    folder = cache_dir / _fingerprint(model_id, model_dir)
    fp32, int8 = folder / "model.onnx", folder / "model-int8.onnx"
    want = int8 if runtime == "onnx-int8" else fp32
    if want.exists():
        return want
    folder.mkdir(parents=True, exist_ok=True)
    with _file_lock(folder / ".lock"):
        if want.exists():  # another process finished it while this one waited
            return want
        t0 = time.perf_counter()
        if not fp32.exists():
            _export(model_dir, fp32, pooling)
        if runtime == "onnx-int8" and not int8.exists():
            _quantize(fp32, int8)
        (folder / "meta.json").write_text(
            json.dumps({"model_id": model_id, "model_dir": str(model_dir), "export_version": EXPORT_VERSION})
        )
        log.info("exported %s for %s in %.1fs (cached in %s)", runtime, model_id, time.perf_counter() - t0, folder)
    return want


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _export(model_dir: Path, dest: Path, pooling: str) -> None:
    """Trace transformer + pooling + normalization into one graph: inputs ids and mask, output the vector.

    Normalized always, as ``Embedder.encode`` asks sentence-transformers to (cosine is all search uses).
    """

    import torch
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModel.from_pretrained(str(model_dir)).eval()
    takes_types = "token_type_ids" in inspect.signature(model.forward).parameters

    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            extra = {"token_type_ids": torch.zeros_like(input_ids)} if takes_types else {}
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state
            if pooling == "cls":
                v = hidden[:, 0]
            else:
                mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
                v = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
            return torch.nn.functional.normalize(v, dim=-1)

    tmp = dest.with_suffix(f".tmp{os.getpid()}")
    sample = torch.ones(2, 8, dtype=torch.long)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # tracer warnings about Python control flow, harmless for fixed graphs
        torch.onnx.export(
            Pooled(),
            (sample, sample),
            str(tmp),
            dynamo=False,
            opset_version=_OPSET,
            input_names=["input_ids", "attention_mask"],
            output_names=["embedding"],
            dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}},
        )
    os.replace(tmp, dest)


def _quantize(src: Path, dest: Path) -> None:
    """int8 weights per output channel, activations quantized per batch at run time (dynamic).

    Only matrix products with a constant weight are quantized, except each feed-forward block's
    down-projection (the one weight with more rows than columns): it reads the GELU's output, whose
    few very large values make one scale per tensor too coarse.  Keeping those six in float32 took
    the mean cosine to the reference from 0.993 to 0.996 at a third of the throughput, still over twice
    the float32 reference's (docs/architecture.md#encoder-runtimes).  The embedding lookups stay float32:
    they cost nothing.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(src))
    shapes = {t.name: numpy_helper.to_array(t).shape for t in model.graph.initializer}
    keep = [
        n.name
        for n in model.graph.node
        if n.op_type == "MatMul" and len(shape := shapes.get(n.input[1], ())) == 2 and shape[0] > shape[1]
    ]
    del model
    tmp = dest.with_suffix(f".tmp{os.getpid()}")
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizer advises pre-processing on the root logger, every time
    try:
        quantize_dynamic(
            str(src),
            str(tmp),
            weight_type=QuantType.QInt8,
            per_channel=True,
            op_types_to_quantize=["MatMul"],
            nodes_to_exclude=keep,
        )
    finally:
        root.setLevel(level)
    os.replace(tmp, dest)


class OnnxEncoder:
    """Drop-in for ``embed.Embedder``: same windows, same ``encode``/``encode_query`` contract."""

    def __init__(self, model_id: str, model_dir: Path, runtime: str, cache_dir: Path, threads: int) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.model_id = model_id
        self.runtime = runtime
        path = exported_path(model_id, model_dir, runtime, cache_dir)
        st_cfg = json.loads((model_dir / "sentence_bert_config.json").read_text())
        self.max_len = int(st_cfg.get("max_seq_length", 256))
        self.window_tokens = max(16, self.max_len - 2)
        self.spec = DEFAULT_WINDOWS.capped(self.window_tokens)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        # the model's own tokenizer settings cut at max_seq_length with [CLS]/[SEP] kept, as sentence-transformers does
        self._batch_tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._batch_tok.no_padding()
        self._batch_tok.enable_truncation(self.max_len)
        opts = ort.SessionOptions()
        # One thread per run and several runs at once: on small batches of short windows, intra-op threads
        # spend more time in hand-offs than they save (bench/RESULTS.md, encoder runtimes).
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.dim = int(self.session.get_outputs()[0].shape[-1])
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # -- windows (the same cutter over the same tokenizer.json as the torch encoder) ----------------------
    def window_spans(self, text: str, spec: WindowSpec | None = None) -> list[tuple[int, int]]:
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return cut(text, enc.offsets, (spec or self.spec).capped(self.window_tokens))

    def window_texts(self, text: str, spec: WindowSpec | None = None) -> list[str]:
        return [text[a:b] for a, b in self.window_spans(text, spec)]

    # -- vectors ------------------------------------------------------------------------------------------
    def encode(self, texts: list[str], *, batch_size: int = 64) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        encs = self._batch_tok.encode_batch(texts)
        order = sorted(range(len(texts)), key=lambda i: len(encs[i].ids))  # little padding per batch
        batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]

        def run(idx: list[int]) -> None:
            width = max(len(encs[i].ids) for i in idx)
            ids = np.zeros((len(idx), width), dtype=np.int64)
            mask = np.zeros((len(idx), width), dtype=np.int64)
            for r, i in enumerate(idx):
                n = len(encs[i].ids)
                ids[r, :n] = encs[i].ids
                mask[r, :n] = 1
            out[idx] = self.session.run(None, {"input_ids": ids, "attention_mask": mask})[0]

        if len(batches) == 1 or self.threads == 1:
            for b in batches:
                run(b)
        else:
            list(self._executor().map(run, batches))  # a failed batch raises here
        return out

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="rlm-encode")
            return self._pool

    def encode_query(self, query: str) -> np.ndarray:
        """A long query is embedded in model-sized pieces and their mean taken, as the torch encoder does."""
        vecs = self.encode(self.window_texts(query, query_windows(self.window_tokens)) or [query])
        v = vecs.mean(axis=0)
        return (v / (float(np.linalg.norm(v)) or 1.0)).astype(np.float32)
