"""Documents are cut at their headings and each chunk knows its section and pages (docs/contract.md#documents)."""

from __future__ import annotations

import re

from rlm_workers.ingest.chunkers import chunk_document, chunk_text, outline
from rlm_workers.ingest.documents import Document, Heading


def _doc(parts: list[tuple[int, str, str]], *, page_every: int = 0, fmt: str = "pdf") -> Document:
    """A document from (level, title, body) parts rendered as the converters render them."""
    text, heads, stack = "", [], []
    for level, title, body in parts:
        stack = [*stack[: level - 1], title]
        heads.append(Heading(start=len(text), level=level, title=title, path=tuple(stack)))
        text += f"{'#' * level} {title}\n\n{body}\n\n"
    pages = list(range(0, len(text), page_every)) if page_every else []
    return Document(text=text, format=fmt, headings=heads, pages=pages, cuts=[])


def _covered(text: str, chunks) -> None:
    """Every non-whitespace character lies in some chunk, and chunks are exact slices in order."""
    seen = [False] * len(text)
    pos = 0
    for ch in chunks:
        start = text.index(ch.text, pos)
        for i in range(start, start + len(ch.text)):
            seen[i] = True
        pos = start + 1
    assert all(seen[i] or text[i].isspace() for i in range(len(text)))


def _sentences(n: int, word: str) -> str:
    return " ".join(f"The {word} sentence number {i} says something about {word}." for i in range(n))


def test_plain_text_and_code_are_cut_exactly_as_before() -> None:
    text = "def f():\n    return 1\n\n" * 200
    doc = Document(text=text, format="text", headings=[], pages=[], cuts=[])
    for chunker in ("semantic", "fixed", "code"):
        kw = {"chunker": chunker, "chunk_size": 400, "overlap": 50}
        assert chunk_document(doc, path="a.py", **kw) == chunk_text(text, path="a.py", **kw)
    assert all(c.heading_path == () and c.page_start is None for c in chunk_document(doc, path="a.py"))


def test_sections_start_chunks_and_carry_their_heading_path() -> None:
    doc = _doc(
        [
            (1, "1 Introduction", _sentences(12, "intro")),
            (1, "2 Transport", ""),  # a heading right above its first subheading joins it
            (2, "2.1 Framing", _sentences(12, "framing")),
            (2, "2.2 Errors", _sentences(12, "errors")),
            (1, "3 Security", _sentences(12, "security")),
        ]
    )
    chunks = chunk_document(doc, path="spec.pdf", chunk_size=1500, overlap=200)
    _covered(doc.text, chunks)
    assert [c.heading_path for c in chunks] == [
        ("1 Introduction",),
        ("2 Transport", "2.1 Framing"),
        ("2 Transport", "2.2 Errors"),
        ("3 Security",),
    ]
    assert all(c.text.startswith("#") for c in chunks)
    assert "framing" not in chunks[2].text and "errors" not in chunks[1].text


def test_a_long_section_is_cut_inside_itself_never_across_a_heading() -> None:
    doc = _doc([(1, "Long", _sentences(80, "long")), (1, "Short", _sentences(3, "short"))])
    chunks = chunk_document(doc, path="a.md", chunk_size=800, overlap=100)
    _covered(doc.text, chunks)
    assert len(chunks) > 3 and all(len(c.text) <= 800 for c in chunks)
    long_ones = [c for c in chunks if c.heading_path == ("Long",)]
    assert len(long_ones) == len(chunks) - 1
    assert all("short" not in c.text for c in long_ones)
    assert chunks[-1].heading_path == ("Short",) and chunks[-1].text.startswith("# Short")


def test_small_sections_join_until_a_chunk_is_worth_its_own() -> None:
    doc = _doc([(2, f"Item {i}", f"Item {i} is small.") for i in range(30)])
    chunks = chunk_document(doc, path="a.md", chunk_size=600, overlap=0)
    _covered(doc.text, chunks)
    assert 3 <= len(chunks) < 30
    assert all(len(c.text) <= 600 for c in chunks)
    for c in chunks:  # cited by a section the chunk holds
        assert f"## {c.heading_path[-1]}" in c.text


def test_pages_span_the_chunk() -> None:
    doc = _doc([(1, f"Part {i}", _sentences(6, f"p{i}")) for i in range(6)], page_every=500)
    chunks = chunk_document(doc, path="a.pdf", chunk_size=700, overlap=0)
    for c in chunks:
        start = doc.text.index(c.text)
        assert c.page_start == start // 500 + 1
        assert c.page_end == (start + len(c.text) - 1) // 500 + 1
        assert c.page_start <= c.page_end


def test_a_pdf_chunk_never_runs_over_a_page_so_a_passage_is_cited_by_its_own_page() -> None:
    pages = [_sentences(3, "opening"), "The yearly levy was raised to 4.5 per cent in March.", _sentences(3, "closing")]
    text, starts = "", []
    for body in pages:
        starts.append(len(text))
        text += body + "\n\n"
    pdf = Document(text=text, format="pdf", headings=[], pages=starts, cuts=[])
    chunks = chunk_document(pdf, path="report.pdf")  # the default size would hold all three pages at once
    assert [(c.page_start, c.page_end) for c in chunks] == [(1, 1), (2, 2), (3, 3)]
    assert "levy" in chunks[1].text
    _covered(text, chunks)
    # a slide deck's slides are too short to stand alone: they still join
    deck = Document(text=text, format="pptx", headings=[], pages=starts, cuts=[])
    assert [(c.page_start, c.page_end) for c in chunk_document(deck, path="deck.pptx")] == [(1, 3)]


def test_text_above_the_first_heading_has_no_section() -> None:
    body = _sentences(20, "preface")
    doc = Document(
        text=f"{body}\n\n# One\n\n{_sentences(20, 'one')}\n",
        format="markdown",
        headings=[Heading(start=len(body) + 2, level=1, title="One", path=("One",))],
        pages=[],
        cuts=[],
    )
    chunks = chunk_document(doc, path="a.md", chunk_size=1200, overlap=0)
    assert chunks[0].heading_path == () and "preface" in chunks[0].text
    assert chunks[-1].heading_path == ("One",)


def test_fixed_chunks_are_annotated_too() -> None:
    doc = _doc([(1, f"S{i}", _sentences(5, f"s{i}")) for i in range(5)], page_every=300)
    chunks = chunk_document(doc, path="a.pdf", chunker="fixed", chunk_size=400, overlap=40)
    assert chunks == [c for c in chunks if c.page_start is not None and c.heading_path]


def test_outline_sections_run_to_the_next_heading_of_their_level() -> None:
    doc = _doc([(1, "A", "alpha"), (2, "A.1", "alpha one"), (2, "A.2", "alpha two"), (1, "B", "beta")], page_every=20)
    items = outline(doc)
    lines = doc.text.split("\n")
    assert [i["path"] for i in items] == [["A"], ["A", "A.1"], ["A", "A.2"], ["B"]]
    a, a1, _, b = items
    assert lines[a["start_line"] - 1] == "# A" and lines[a["end_line"] - 1] == "alpha two"
    assert lines[a1["start_line"] - 1] == "## A.1" and lines[a1["end_line"] - 1] == "alpha one"
    assert lines[b["end_line"] - 1] == "beta"
    assert all(isinstance(i["page"], int) for i in items)
    assert re.fullmatch(r"# B", lines[b["start_line"] - 1])
