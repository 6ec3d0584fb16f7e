"""Unit tests for the chunkers: exact offsets, size/overlap invariants, and code-aware splits."""

from __future__ import annotations

import random

import pytest

from rlm_workers.ingest.chunkers import CHUNKERS, Chunk, chunk_text, language_for, validate_chunk_params

PY_SRC = '''"""Order service: HTTP handlers and domain types."""

from __future__ import annotations

import dataclasses
import json

RETRY_LIMIT = 3


# A point on the delivery map.
@dataclasses.dataclass(frozen=True)
class Point:
    x: float
    y: float

    def distance(self, other: Point) -> float:
        return ((self.x - other.x) ** 2 + (self.y - other.y) ** 2) ** 0.5


@app.route(
    "/orders",
    methods=["POST"],
)
def create_order(request):
    """Create an order from the JSON body and return its id."""
    payload = json.loads(request.body)
    order = Order(items=payload["items"], customer=payload["customer"])
    order.save()
    return {"id": order.id}


class Order:
    """An order placed by a customer; the total is computed lazily."""

    def __init__(self, items, customer):
        self.items = items
        self.customer = customer

    @property
    def total(self):
        return sum(item["price"] * item["qty"] for item in self.items)

    def save(self):
        for attempt in range(RETRY_LIMIT):
            if self._try_save(attempt):
                return True
        return False

    def _try_save(self, attempt):
        return attempt >= 0


async def notify(order):
    await send(order.customer, f"order {order.id} received")
'''

GO_SRC = """package store

import (
	"context"
	"errors"
)

// ErrNotFound is returned when a key is missing.
var ErrNotFound = errors.New("not found")

// Store keeps values in memory.
type Store struct {
	data map[string]string
}

// Get returns the value stored under key.
func (s *Store) Get(ctx context.Context, key string) (string, error) {
	v, ok := s.data[key]
	if !ok {
		return "", ErrNotFound
	}
	return v, nil
}

/*
Put stores a value.
It overwrites silently.
*/
func (s *Store) Put(key, value string) {
	s.data[key] = value
}
"""

RUST_SRC = """use std::collections::HashMap;

/// A cache with a fixed capacity.
#[derive(Debug, Clone)]
pub struct Cache {
    entries: HashMap<String, String>,
    capacity: usize,
}

impl Cache {
    /// Creates an empty cache.
    pub fn new(capacity: usize) -> Self {
        Self { entries: HashMap::new(), capacity }
    }

    pub fn insert(&mut self, key: String, value: String) {
        if self.entries.len() >= self.capacity {
            self.entries.clear();
        }
        self.entries.insert(key, value);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn inserts() {
        let mut c = super::Cache::new(1);
        c.insert("a".into(), "b".into());
    }
}
"""

TS_SRC = """import { Injectable } from "@angular/core";

/**
 * Loads user profiles.
 */
@Injectable({
  providedIn: "root",
})
export class ProfileService {
  constructor(private readonly http: HttpClient) {}

  load(id: string): Promise<Profile> {
    return this.http.get(`/profiles/${id}`).toPromise();
  }
}

export interface Profile {
  id: string;
  name: string;
}

export const DEFAULT_PROFILE: Profile = { id: "0", name: "anonymous" };

function helper(x: number): number {
  return x * 2;
}
"""

JAVA_SRC = """package com.example.billing;

import java.math.BigDecimal;
import java.util.List;

/**
 * Computes invoice totals.
 */
@Service
public class InvoiceCalculator {

    private final TaxTable taxes;

    public InvoiceCalculator(TaxTable taxes) {
        this.taxes = taxes;
    }

    /** Sum of line amounts before tax. */
    public BigDecimal subtotal(List<Line> lines) {
        BigDecimal sum = BigDecimal.ZERO;
        for (Line line : lines) {
            sum = sum.add(line.amount());
        }
        return sum;
    }

    @Override
    public String toString() {
        return "InvoiceCalculator[" + taxes + "]";
    }
}

record Line(String sku, BigDecimal amount) {}
"""

MARKDOWN = """# Operations guide

This guide is for the on-call engineer. Read it before your first shift.

## Backups

Nightly backups run at 02:00 UTC and are kept for fourteen days. Restores are
tested every Monday by the on-call engineer. A failed restore is a sev-2.

## Incidents

When the pager fires, acknowledge within five minutes! Open an incident channel,
write down the timeline as you go, and hand over explicitly at the end of a shift.
Who owns the incident? The person who acknowledged it, until they hand it over.

## Café notes 日本 🎉

The café on the ground floor opens at eight. Ask for the 日本 blend; it is excellent.
"""


def spans_of(text: str, chunks: list[Chunk]) -> list[tuple[int, int]]:
    """Each chunk's char span, recovered from its byte offsets (which must be exact)."""
    data = text.encode()
    out = []
    for c in chunks:
        assert data[c.start_byte : c.end_byte].decode() == c.text
        s = len(data[: c.start_byte].decode())
        out.append((s, s + len(c.text)))
    return out


def assert_invariants(text: str, chunks: list[Chunk], size: int, overlap: int) -> None:
    spans = spans_of(text, chunks)
    for c, (s, e) in zip(chunks, spans, strict=True):
        assert text[s:e] == c.text
        assert c.text.strip(), "whitespace-only chunk"
        assert c.text == c.text.rstrip(), "trailing whitespace not trimmed"
        assert len(c.text) <= size
        assert c.start_line == text.count("\n", 0, s) + 1
        assert c.end_line == text.count("\n", 0, e - 1) + 1
    for (s1, e1), (s2, e2) in zip(spans, spans[1:], strict=False):
        assert s1 < s2 and e1 < e2, "chunks out of file order"
        assert e1 - s2 <= overlap, f"overlap {e1 - s2} > {overlap}"
        assert s2 <= e1 or not text[e1:s2].strip(), "content lost between chunks"
    covered = bytearray(len(text))
    for s, e in spans:
        covered[s:e] = b"\x01" * (e - s)
    lost = [i for i, ch in enumerate(text) if not ch.isspace() and not covered[i]]
    assert not lost, f"uncovered chars at {lost[:5]}"


def first_lines(chunks: list[Chunk]) -> list[str]:
    return [c.text.split("\n", 1)[0] for c in chunks]


# --- parameters -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("sentences", 3000, 500), "unknown chunker 'sentences': use one of semantic, fixed, code"),
        (("fixed", 199, 0), "chunk size must be between 200 and 1,000,000 characters (got 199)"),
        (("fixed", 1_000_001, 0), "chunk size must be between 200 and 1,000,000 characters (got 1000001)"),
        (("code", 3000, -1), "overlap must be a whole number of characters, 0 or more (got -1)"),
        (("semantic", 300, 300), "overlap (300) must be smaller than the chunk size (300)"),
        (("semantic", 300, 301), "overlap (301) must be smaller than the chunk size (300)"),
    ],
)
def test_validate_chunk_params_messages(args, message):
    with pytest.raises(ValueError) as info:
        validate_chunk_params(*args)
    assert str(info.value) == message
    assert "\n" not in str(info.value)


def test_validate_accepts_bounds_and_chunk_text_validates():
    validate_chunk_params("semantic", 200, 0)
    validate_chunk_params("code", 1_000_000, 999_999)
    with pytest.raises(ValueError, match="overlap"):
        chunk_text("hello", path="a.md", chunk_size=500, overlap=600)
    assert CHUNKERS == ("semantic", "fixed", "code")


def test_chunk_size_bounds_are_the_shared_limits():
    """The API's upload options read the same constants, so a size one accepts the other never refuses."""
    from rlm_workers.limits import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE

    validate_chunk_params("fixed", MIN_CHUNK_SIZE, 0)
    validate_chunk_params("fixed", MAX_CHUNK_SIZE, 0)
    for size in (MIN_CHUNK_SIZE - 1, MAX_CHUNK_SIZE + 1):
        with pytest.raises(ValueError, match=f"between {MIN_CHUNK_SIZE} and {MAX_CHUNK_SIZE:,}"):
            validate_chunk_params("fixed", size, 0)


@pytest.mark.parametrize("chunker", CHUNKERS)
def test_empty_and_blank_text_give_no_chunks(chunker):
    assert chunk_text("", path="a.py", chunker=chunker) == []
    assert chunk_text(" \n\n\t \n", path="a.py", chunker=chunker) == []


@pytest.mark.parametrize("chunker", CHUNKERS)
def test_small_text_is_one_trimmed_chunk_with_exact_offsets(chunker):
    text = "\n\n  café 日本 🎉 one line\nsecond line\n\n\n"
    [c] = chunk_text(text, path="notes.txt", chunker=chunker)
    assert c.text == "  café 日本 🎉 one line\nsecond line"
    assert (c.start_line, c.end_line) == (3, 4)
    assert (c.start_byte, c.end_byte) == (2, 2 + len(c.text.encode()))
    assert c.end_byte - c.start_byte == 40  # é 2 bytes, 日本 6, 🎉 4


# --- semantic ---------------------------------------------------------------------------------------


def test_semantic_keeps_paragraphs_whole_and_overlaps_whole_units():
    chunks = chunk_text(MARKDOWN, path="ops.md", chunk_size=250, overlap=120)
    assert_invariants(MARKDOWN, chunks, 250, 120)
    assert first_lines(chunks) == [
        "# Operations guide",
        "This guide is for the on-call engineer. Read it before your first shift.",  # overlap: whole paragraph
        "## Incidents",
        "write down the timeline as you go, and hand over explicitly at the end of a shift.",  # a long paragraph's line
        "Who owns the incident? The person who acknowledged it, until they hand it over.",
    ]
    assert [(c.start_line, c.end_line) for c in chunks] == [(1, 3), (3, 8), (10, 14), (13, 16), (14, 18)]
    # a short heading travels with the paragraph under it
    assert "## Backups\n\nNightly backups" in chunks[1].text
    assert chunks[-1].text.endswith(
        "## Café notes 日本 🎉\n\nThe café on the ground floor opens at eight. Ask for the 日本 blend; it is excellent."
    )


def test_semantic_splits_long_paragraph_at_sentences_with_overlap():
    sentences = [f"Sentence number {i} talks about topic {i * 7}." for i in range(40)]
    text = " ".join(sentences)
    chunks = chunk_text(text, path="p.txt", chunk_size=300, overlap=100)
    assert_invariants(text, chunks, 300, 100)
    assert len(chunks) > 3
    for prev, nxt in zip(chunks, chunks[1:], strict=False):
        assert nxt.text.startswith("Sentence number "), nxt.text[:30]
        assert prev.text.endswith("."), prev.text[-30:]
        repeated = prev.end_byte - nxt.start_byte
        assert 0 < repeated <= 100
        assert prev.text.endswith(nxt.text[:repeated])


def test_semantic_falls_back_to_words_then_hard_split():
    words = " ".join(f"w{i:04d}" for i in range(400))  # no sentences, no newlines
    chunks = chunk_text(words, path="w.txt", chunk_size=200, overlap=0)
    assert_invariants(words, chunks, 200, 0)
    assert all(c.text.startswith("w") and c.text[-4:].isdigit() for c in chunks)
    blob = "x" * 1000 + " tail"
    chunks = chunk_text(blob, path="b.txt", chunk_size=200, overlap=50)
    assert_invariants(blob, chunks, 200, 50)
    assert [len(c.text) for c in chunks] == [200, 200, 200, 200, 200, 4]


# --- fixed ------------------------------------------------------------------------------------------


def test_fixed_windows_do_not_cut_words():
    text = " ".join(f"token{i}" for i in range(2000))
    chunks = chunk_text(text, path="t.txt", chunker="fixed", chunk_size=500, overlap=100)
    assert_invariants(text, chunks, 500, 100)
    for s, e in spans_of(text, chunks):
        assert s == 0 or text[s - 1] == " "
        assert e == len(text) or text[e] == " "
        assert e - s >= 500 - 50 - 1 or e == len(text)  # nudged back by at most 10%
    overlaps = [a.end_byte - b.start_byte for a, b in zip(chunks, chunks[1:], strict=False)]
    assert all(60 <= o <= 100 for o in overlaps), overlaps


def test_fixed_hard_cuts_text_without_whitespace():
    text = "é" * 1000
    chunks = chunk_text(text, path="t.txt", chunker="fixed", chunk_size=400, overlap=100)
    assert_invariants(text, chunks, 400, 100)
    assert [(c.start_byte, c.end_byte) for c in chunks] == [(0, 800), (600, 1400), (1200, 2000)]


# --- code -------------------------------------------------------------------------------------------


def test_language_detection_by_extension():
    names = {
        p: (lang.name if (lang := language_for(p)) else None)
        for p in [
            "a/b.py",
            "x.TS",
            "x.tsx",
            "m.mjs",
            "g.go",
            "r.rs",
            "J.java",
            "c.c",
            "h.hpp",
            "k.kt",
            "s.cs",
            "README.md",
            "Makefile",
            "dir.py/file",
            ".py",
        ]
    }
    assert names == {
        "a/b.py": "python",
        "x.TS": "javascript",
        "x.tsx": "javascript",
        "m.mjs": "javascript",
        "g.go": "go",
        "r.rs": "rust",
        "J.java": "java",
        "c.c": "c",
        "h.hpp": "c",
        "k.kt": "kotlin",
        "s.cs": "csharp",
        "README.md": None,
        "Makefile": None,
        "dir.py/file": None,
        ".py": "python",
    }


def test_code_python_keeps_decorators_and_comments_with_definitions():
    chunks = chunk_text(PY_SRC, path="svc/orders.py", chunker="code", chunk_size=300, overlap=60)
    assert_invariants(PY_SRC, chunks, 300, 60)
    assert first_lines(chunks) == [
        '"""Order service: HTTP handlers and domain types."""',
        "# A point on the delivery map.",
        "@app.route(",
        "class Order:",
        "    def save(self):",
        "async def notify(order):",
    ]
    assert [(c.start_line, c.end_line) for c in chunks] == [
        (1, 8),
        (11, 18),
        (21, 30),
        (33, 42),
        (44, 51),
        (54, 55),
    ]
    by_start = {c.start_line: c.text for c in chunks}
    assert "@dataclasses.dataclass(frozen=True)\nclass Point:" in by_start[11]
    assert "def create_order(request):" in by_start[21]


def test_code_packs_small_definitions_and_starts_at_line_starts():
    chunks = chunk_text(PY_SRC, path="orders.py", chunker="code", chunk_size=3000, overlap=500)
    assert len(chunks) == 1 and chunks[0].text == PY_SRC.strip()
    chunks = chunk_text(PY_SRC, path="orders.py", chunker="code", chunk_size=700, overlap=100)
    assert_invariants(PY_SRC, chunks, 700, 100)
    assert first_lines(chunks) == ['"""Order service: HTTP handlers and domain types."""', "class Order:"]
    assert [(c.start_line, c.end_line) for c in chunks] == [(1, 30), (33, 55)]
    for s, _ in spans_of(PY_SRC, chunks):
        assert s == 0 or PY_SRC[s - 1] == "\n"


def test_code_go_block_and_line_comments_attach():
    chunks = chunk_text(GO_SRC, path="store.go", chunker="code", chunk_size=200, overlap=40)
    assert_invariants(GO_SRC, chunks, 200, 40)
    assert first_lines(chunks) == [
        "package store",
        "// Store keeps values in memory.",
        "// Get returns the value stored under key.",
        "/*",
    ]
    assert chunks[-1].text.endswith("func (s *Store) Put(key, value string) {\n\ts.data[key] = value\n}")


def test_code_rust_doc_comments_and_attributes_attach():
    chunks = chunk_text(RUST_SRC, path="cache.rs", chunker="code", chunk_size=200, overlap=40)
    assert_invariants(RUST_SRC, chunks, 200, 40)
    assert "/// A cache with a fixed capacity.\n#[derive(Debug, Clone)]\npub struct Cache {" in chunks[0].text
    assert first_lines(chunks) == [
        "use std::collections::HashMap;",
        "impl Cache {",
        "    pub fn insert(&mut self, key: String, value: String) {",
        "#[cfg(test)]",
    ]


def test_code_typescript_decorator_with_arguments_and_jsdoc_attach():
    chunks = chunk_text(TS_SRC, path="profile.service.ts", chunker="code", chunk_size=200, overlap=40)
    assert_invariants(TS_SRC, chunks, 200, 40)
    assert first_lines(chunks) == [
        'import { Injectable } from "@angular/core";',
        "/**",
        "  load(id: string): Promise<Profile> {",
        "export interface Profile {",
    ]
    assert chunks[1].text.startswith(
        '/**\n * Loads user profiles.\n */\n@Injectable({\n  providedIn: "root",\n})\nexport class ProfileService {'
    )


def test_code_java_splits_big_class_between_members():
    chunks = chunk_text(JAVA_SRC, path="InvoiceCalculator.java", chunker="code", chunk_size=250, overlap=60)
    assert_invariants(JAVA_SRC, chunks, 250, 60)
    assert chunks[0].text.startswith("package com.example.billing;")
    assert chunks[1].text.startswith(
        "/**\n * Computes invoice totals.\n */\n@Service\npublic class InvoiceCalculator {"
    )
    assert any(c.text.startswith("    /** Sum of line amounts before tax. */") for c in chunks)
    assert any(c.text.startswith("    @Override\n    public String toString()") for c in chunks)
    assert chunks[-1].text == "record Line(String sku, BigDecimal amount) {}"


def test_code_long_single_line_is_hard_split():
    text = "def f():\n    return '" + "a" * 900 + "'\n\n\ndef g():\n    return 1\n"
    chunks = chunk_text(text, path="m.py", chunker="code", chunk_size=300, overlap=50)
    assert_invariants(text, chunks, 300, 50)
    assert chunks[-1].text == "def g():\n    return 1"
    assert max(len(c.text) for c in chunks) == 300


def test_code_unknown_extension_falls_back_to_semantic():
    code = chunk_text(MARKDOWN, path="guide.md", chunker="code", chunk_size=250, overlap=120)
    assert code == chunk_text(MARKDOWN, path="guide.md", chunker="semantic", chunk_size=250, overlap=120)


# --- properties -------------------------------------------------------------------------------------

_VOCAB = [
    "alpha",
    "beta",
    "é",
    "日本",
    "🎉",
    "naïve",
    "x" * 60,
    "y" * 450,
    ".",
    "!",
    "?",
    "\n",
    "\n\n",
    "  ",
    "\t",
    "def",
    "class",
    "fn",
    "func",
    "@dec",
    "# c",
    "//",
    "/*",
    "*/",
    "}",
    "{",
    "(",
    ")",
    "\r",
]
_PATHS = ["a.py", "a.go", "a.rs", "a.ts", "a.java", "a.c", "a.cs", "a.kt", "a.md", "noext"]


def _random_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(0, 300)):
        parts.append(rng.choice(["", "\n", "\n    "]) if rng.random() < 0.15 else "")
        parts.append(rng.choice(_VOCAB))
        parts.append(rng.choice([" ", " ", "\n", "", ". ", "\n\t"]))
    return "".join(parts)


def test_invariants_hold_on_random_texts():
    rng = random.Random(20240611)
    for _ in range(400):
        text = _random_text(rng)
        size = rng.choice([200, 230, 333, 1000])
        overlap = min(rng.choice([0, 1, 40, 150, 199]), size - 1)
        chunker, path = rng.choice(CHUNKERS), rng.choice(_PATHS)
        chunks = chunk_text(text, path=path, chunker=chunker, chunk_size=size, overlap=overlap)
        assert_invariants(text, chunks, size, overlap)
        assert bool(chunks) == bool(text.strip())


@pytest.mark.parametrize("chunker", ["fixed", "semantic"])
def test_ten_megabytes_of_non_ascii_text_keep_exact_offsets(chunker):
    # How fast this goes is a figure for bench/chunk.py, not a test; here: every offset stays exact at scale.
    para = "Lorem ipsum dolor sit amet, é consectetur adipiscing elit. " * 20
    text = (para + "\n\n") * 8600  # ~10 MB, non-ASCII so byte offsets take the slow path
    assert len(text) > 10_000_000
    chunks = chunk_text(text, path="big.txt", chunker=chunker)
    data = text.encode()
    assert chunks[0].start_byte == 0 and chunks[0].start_line == 1
    line, prev = 1, chunks[0]
    # one pass over the file (spans_of decodes a prefix per chunk: quadratic at this size)
    for c in chunks:
        assert data[c.start_byte : c.end_byte].decode() == c.text
        assert c.end_line - c.start_line == c.text.count("\n")
        if c is not prev:
            assert prev.start_byte < c.start_byte and prev.end_byte < c.end_byte, "chunks out of file order"
            assert c.start_byte <= prev.end_byte or not data[prev.end_byte : c.start_byte].strip(), "content lost"
            line += data.count(b"\n", prev.start_byte, c.start_byte)
        assert c.start_line == line
        prev = c
    assert chunks[-1].end_byte == len(text.rstrip().encode())
    assert chunks[-1].end_line == text.rstrip().count("\n") + 1
