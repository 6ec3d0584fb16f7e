"""A small torch forward pass for BERT sentence encoders, for query time.

Importing sentence-transformers (and through it transformers) costs ~3.5 s,
more than a whole ``rlm search`` may take.  For the bundled MiniLM (and any
BERT model pooled by mean and normalised), this module computes the same
vector from ``tokenizers`` + ``safetensors`` + plain torch in well under a
second of start-up.  Ingest keeps using sentence-transformers; a test checks
both give the same vectors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .windows import cut, query_windows

if TYPE_CHECKING:
    import numpy as np
    import torch

    from .windows import WindowSpec


def supports(model_dir: Path) -> bool:
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
        pooling = json.loads((model_dir / "1_Pooling" / "config.json").read_text())
        modules = json.loads((model_dir / "modules.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        cfg.get("model_type") == "bert"
        and cfg.get("position_embedding_type", "absolute") == "absolute"
        and cfg.get("hidden_act") == "gelu"
        and pooling.get("pooling_mode_mean_tokens") is True
        and not any(
            pooling.get(k)
            for k in (
                "pooling_mode_cls_token",
                "pooling_mode_max_tokens",
                "pooling_mode_mean_sqrt_len_tokens",
            )
        )
        and any(m.get("type", "").endswith("Normalize") for m in modules)
        and (model_dir / "model.safetensors").exists()
        and (model_dir / "tokenizer.json").exists()
    )


class FastBertEncoder:
    def __init__(self, model_dir: Path, model_id: str) -> None:
        import torch
        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        self.model_id = model_id
        cfg = json.loads((model_dir / "config.json").read_text())
        st_cfg = json.loads((model_dir / "sentence_bert_config.json").read_text())
        self.max_len = int(st_cfg.get("max_seq_length", 256))
        self.heads = int(cfg["num_attention_heads"])
        self.layers = int(cfg["num_hidden_layers"])
        self.eps = float(cfg.get("layer_norm_eps", 1e-12))
        self.w = load_file(str(model_dir / "model.safetensors"))
        self.dim = int(cfg["hidden_size"])
        self.window_tokens = self.max_len - 2
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self._torch = torch

    def _ln(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        F = self._torch.nn.functional
        return F.layer_norm(x, (x.shape[-1],), self.w[prefix + ".weight"], self.w[prefix + ".bias"], self.eps)

    def _lin(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return self._torch.nn.functional.linear(x, self.w[prefix + ".weight"], self.w[prefix + ".bias"])

    def _forward(self, ids: list[int]) -> torch.Tensor:
        import torch  # already loaded by __init__; a module name (not an attribute) types the nested split

        F, w = torch.nn.functional, self.w
        t = torch.tensor([ids], dtype=torch.long)
        pos = torch.arange(len(ids)).unsqueeze(0)
        x = (
            w["embeddings.word_embeddings.weight"][t]
            + w["embeddings.position_embeddings.weight"][pos]
            + w["embeddings.token_type_embeddings.weight"][torch.zeros_like(t)]
        )
        x = self._ln(x, "embeddings.LayerNorm")
        n, d = x.shape[1], x.shape[2]
        hd = d // self.heads
        for i in range(self.layers):
            p = f"encoder.layer.{i}"

            def split(y: torch.Tensor) -> torch.Tensor:
                return y.view(1, n, self.heads, hd).transpose(1, 2)

            q, k, v = (split(self._lin(x, f"{p}.attention.self.{m}")) for m in ("query", "key", "value"))
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), dim=-1) @ v
            att = att.transpose(1, 2).reshape(1, n, d)
            x = self._ln(self._lin(att, f"{p}.attention.output.dense") + x, f"{p}.attention.output.LayerNorm")
            h = F.gelu(self._lin(x, f"{p}.intermediate.dense"))
            x = self._ln(self._lin(h, f"{p}.output.dense") + x, f"{p}.output.LayerNorm")
        return x[0].mean(dim=0)

    def window_spans(self, text: str, spec: WindowSpec) -> list[tuple[int, int]]:
        """How ingest cut ``text`` into windows under ``spec`` (same tokenizer file, same cutter)."""
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return cut(text, enc.offsets, spec.capped(self.window_tokens))

    def window_texts(self, text: str) -> list[str]:
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return [text[a:b] for a, b in cut(text, enc.offsets, query_windows(self.window_tokens))]

    def encode_query(self, query: str) -> np.ndarray:
        with self._torch.inference_mode():
            vecs = []
            for piece in self.window_texts(query):
                ids = self.tokenizer.encode(piece, add_special_tokens=True).ids[: self.max_len]
                v = self._forward(ids)
                vecs.append(v / v.norm().clamp_min(1e-12))
            v = self._torch.stack(vecs).mean(dim=0)
            v = v / v.norm().clamp_min(1e-12)
        return v.numpy().astype(np.float32)
