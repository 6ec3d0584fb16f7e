"""Document converters on real files (tests/data/documents/README.md says where each comes from) and on the
bad inputs a load meets: encrypted, corrupt, scanned, zip bombs, too long, too slow (no services needed)."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import zipfile
from bisect import bisect_right
from pathlib import Path
from urllib.parse import quote

import pytest

from rlm_workers.ingest import documents
from rlm_workers.ingest.documents import Document, markdown_headings, read_document
from rlm_workers.ingest.files import decode_text

DATA = Path(__file__).resolve().parent / "data" / "documents"
VOTING = "Voting is conducted via OpenPGP-signed/encrypted email messages."


def read(path: Path, rel: str | None = None) -> tuple[Document | None, str | None, str]:
    return read_document(path, rel or path.name)


def convert(path: Path, rel: str | None = None) -> Document:
    doc, reason, _ = read(path, rel)
    assert reason is None, reason
    assert doc is not None
    return doc


def write(tmp_path: Path, name: str, data: bytes | str) -> Path:
    path = tmp_path / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def page_of(doc: Document, offset: int) -> int:
    return bisect_right(doc.pages, offset)


def section_of(doc: Document, offset: int) -> tuple[str, ...]:
    before = [h for h in doc.headings if h.start <= offset]
    return before[-1].path if before else ()


def check_shape(doc: Document) -> None:
    """What every converted document promises the chunker: headings rendered where they say, in order, pages
    non-decreasing from 0, paths ending in their own title, no NUL, no CR."""
    assert "\x00" not in doc.text and "\r" not in doc.text
    starts = [h.start for h in doc.headings]
    assert starts == sorted(starts)
    for h in doc.headings:
        assert doc.text.startswith("#" * h.level + " " + h.title + "\n", h.start) or doc.format == "markdown"
        assert h.start == 0 or doc.text[h.start - 1] == "\n"
        assert h.path[-1] == h.title and len(h.path) <= h.level
        assert "\n" not in h.title and len(h.title) <= 200
    if doc.pages:
        assert doc.pages[0] == 0 and doc.pages == sorted(doc.pages)  # an empty page starts where the next does


# --- PDF -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def manual() -> Document:
    return convert(DATA / "developers-reference.pdf")


def test_pdf_pages_and_outline(manual: Document):
    check_shape(manual)
    assert manual.format == "pdf" and manual.cuts == []
    assert len(manual.pages) == 114
    assert len(manual.headings) == 281  # every outline entry
    assert {h.level for h in manual.headings} == {1, 2, 3, 4, 5}
    first = manual.headings[0]
    assert (first.title, first.level, page_of(manual, first.start)) == ("Scope of This Document", 1, 11)
    voting = next(h for h in manual.headings if h.title == "Voting")
    assert voting.path == ("Debian Developer's Duties", "Administrative Duties", "Voting")
    assert page_of(manual, voting.start) == 19
    # The heading line goes right above the line that prints the title, not at the top of the page.
    assert manual.text[voting.start :].startswith("### Voting\n\n3.2.3 Voting\n")


def test_pdf_fact_on_its_page_and_section(manual: Document):
    at = manual.text.index(VOTING)
    assert page_of(manual, at) == 19
    assert section_of(manual, at)[-1] == "Voting"
    assert "https://db.debian.org/" in manual.text[manual.pages[18] : manual.pages[19]]


def test_pdf_heading_found_where_the_title_wraps_with_a_hyphen(manual: Document):
    # The PDF wraps this title after "reintro-"; its page text rejoins the word, and the heading sits above it.
    title = "Moving, removing, renaming, orphaning, adopting, and reintroducing packages"
    h = next(h for h in manual.headings if h.title == title)
    assert manual.text[h.start :].split("\n")[2] == f"5.9 {title}"
    # Where a page's text keeps the wrap (pypdf's, for a PDF that PDFium cannot open), the title is still found.
    out = documents._Builder("pdf")
    documents._pdf_page(
        out,
        "Intro text.\n5.9 Moving, removing, renaming, orphaning, adopting, and reintro-\nducing packages\n",
        [(2, title)],
    )
    assert out.document().text.split("\n")[2] == "## " + title


def test_pdf_words_are_spaced_and_running_heads_and_page_numbers_left_out(manual: Document):
    words = re.findall(r"[A-Za-z]+", manual.text)
    # pypdf's text joined whole sentences into one "word" here ("AcopyoftheGNUGeneralPublicLicense…": 1,018
    # words of 18 letters or more); the longest English words in this manual are such as "Internationalization"
    assert sum(len(w) >= 18 for w in words) < 40
    assert "A copy of the GNU General Public License is available as" in " ".join(manual.text.split())
    # the running head printed on every page ("Debian Developer's Reference, Release 12.18") is not in the text
    # more than once per page of the title block, and no page ends with its bare number
    assert manual.text.count("Developer’s Reference, Release 12.18") <= 2
    for k, start in enumerate(manual.pages):
        end = manual.pages[k + 1] if k + 1 < len(manual.pages) else len(manual.text)
        lines = [line for line in manual.text[start:end].split("\n") if line.strip()]
        assert not lines or not re.fullmatch(r"\d+|[ivxlc]+", lines[-1].strip())


def test_running_heads_need_pages_enough_to_repeat_on():
    pages = ["Title\nbody one\n1", "Title\nbody two\n2"]
    assert documents._without_running_lines(pages) == pages  # two pages: a repeat proves nothing
    pages = [
        f"Report 2026\nbody {'abcd'[k - 1]} says something\nmore of it\nTotal: {k * 7}\nPage {k} of 4"
        for k in range(1, 5)
    ]
    assert documents._without_running_lines(pages) == [
        f"body {'abcd'[k - 1]} says something\nmore of it\nTotal: {k * 7}" for k in range(1, 5)
    ]


def test_pdf_encrypted_with_the_empty_password_opens():
    doc = convert(DATA / "pypdf-r6-empty-password.pdf")  # AES-256: pypdf decrypts it with `cryptography`
    assert doc.text.startswith("pdf encryption test\n")
    assert doc.pages == [0]


def test_pdf_with_a_user_password_is_skipped():
    doc, reason, digest = read(DATA / "pypdf-r4-aes-user-password.pdf")
    assert (doc, reason) == (None, "encrypted")
    assert len(digest) == 64


def test_pdf_scanned_has_no_text_layer():
    assert read(DATA / "pypdf-imagemagick-lzw.pdf")[:2] == (None, "no-text-layer")


@pytest.mark.parametrize("cut", [1000, 286_715, 571_430])
def test_pdf_truncated_is_corrupt(tmp_path: Path, cut: int):
    data = (DATA / "developers-reference.pdf").read_bytes()[:cut]
    assert read(write(tmp_path, "manual.pdf", data))[:2] == (None, "corrupt")


def test_pdf_garbage_is_corrupt_even_when_named_otherwise(tmp_path: Path):
    # The %PDF- header decides, whatever the name: this is no text file.
    assert read(write(tmp_path, "notes.txt", b"%PDF-1.7\n" + bytes(range(256)) * 40))[:2] == (None, "corrupt")


def many_pages_pdf(n: int) -> bytes:
    """A valid PDF of ``n`` pages, each one line of text, written byte by byte (fast: pypdf's writer takes
    seconds for thousands of pages)."""
    kids = " ".join(f"{4 + 2 * i} 0 R" for i in range(n))
    objs = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        f"<< /Type /Pages /Kids [{kids}] /Count {n} >>".encode(),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    for i in range(n):
        stream = f"BT /F1 12 Tf 72 720 Td (Page {i + 1} of the generated file) Tj ET".encode()
        objs.append(
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
            b"/Contents %d 0 R >>" % (5 + 2 * i)
        )
        objs.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream))
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for k, body in enumerate(objs, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (k, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref)
    return bytes(out)


def test_pdf_over_the_page_limit_is_cut(tmp_path: Path):
    doc = convert(write(tmp_path, "big.pdf", many_pages_pdf(5000)))
    assert doc.cuts == ["cut-pages"]
    assert len(doc.pages) == documents.MAX_DOCUMENT_PAGES == 2000
    assert doc.text[doc.pages[-1] :] == "Page 2000 of the generated file\n"
    assert "Page 2001 " not in doc.text


def test_pdf_over_the_time_limit_keeps_what_was_converted(monkeypatch: pytest.MonkeyPatch):
    real_page = documents._Builder.page

    def page(self: documents._Builder) -> None:
        real_page(self)
        self.deadline = 0.0  # the clock runs out once the first page's text is in

    monkeypatch.setattr(documents._Builder, "page", page)
    doc = convert(DATA / "developers-reference.pdf")
    assert doc.cuts == ["cut-time"]
    assert doc.pages == [0]
    assert doc.text.startswith("Debian Developer’s Reference")


def test_pdf_out_of_time_on_its_first_page_is_refused(monkeypatch: pytest.MonkeyPatch):
    # The time is checked before each operator of a page's content, not only between pages: with none left the
    # first page is not converted either, and a document with no text converted is refused.
    monkeypatch.setattr(documents, "MAX_CONVERT_SECONDS", 0)
    assert read(DATA / "developers-reference.pdf")[:2] == (None, "convert-limit")


def test_converted_text_over_the_limit_is_cut(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(documents, "MAX_DOCUMENT_CHARS", 5000)
    doc = convert(DATA / "developers-reference.pdf")
    assert doc.cuts == ["cut-text"]
    assert len(doc.text) == 5000
    assert all(h.start < 5000 for h in doc.headings) and all(p < 5000 for p in doc.pages)
    assert len(doc.pages) < 10


# --- DOCX ----------------------------------------------------------------------------------------------------


def test_docx_headings_lists_and_table_in_place():
    doc = convert(DATA / "officer-example.docx")
    check_shape(doc)
    assert (doc.format, doc.pages, doc.cuts) == ("docx", [], [])
    assert [(h.level, h.path) for h in doc.headings] == [
        (1, ("Title 1",)),
        (1, ("Title 2",)),
        (2, ("Title 2", "Sub title 1")),
        (2, ("Title 2", "Sub title 2")),
    ]
    assert "# Title 2\n- Quisque tristique\n- Augue nisi, et convallis\n" in doc.text
    # The table sits in body order: after the paragraph above it, before the one below it.
    morbi = doc.text.index("Morbi rhoncus sapien")
    header = doc.text.index("\nPetals | Internode | Sepal | Bract\n")
    assert morbi < header < doc.text.index("\nNote\n")
    assert section_of(doc, header) == ("Title 2", "Sub title 2")
    # A cell merged across two grid columns is one cell of the row, not two.
    assert "\n5,621498349 | 2,462106579 18,2034091\n" in doc.text
    assert "\n5,645575295 | Merged cell | 2,278691288 | " in doc.text


def test_docx_encrypted_is_skipped():
    assert read(DATA / "officer-template-encrypted.docx")[:2] == (None, "encrypted")


def test_office_file_that_is_not_its_format_is_corrupt(tmp_path: Path):
    # A real DOCX named .xlsx: a valid zip, but openpyxl finds no workbook in it.
    docx_bytes = (DATA / "officer-example.docx").read_bytes()
    assert read(write(tmp_path, "sheet.xlsx", docx_bytes))[:2] == (None, "corrupt")
    assert read(write(tmp_path, "slides.pptx", docx_bytes))[:2] == (None, "corrupt")


@pytest.mark.parametrize("name", ["a.docx", "a.pptx", "a.xlsx", "a.epub"])
def test_broken_zip_is_corrupt(tmp_path: Path, name: str):
    head = (DATA / "officer-example.docx").read_bytes()[:3000]  # a zip's first entries, no central directory
    assert read(write(tmp_path, name, head))[:2] == (None, "corrupt")


def zip_bomb(member: str, size: int) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("[Content_Types].xml", "<Types/>")
        zf.writestr(member, b"\0" * size)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("name", "member"),
    [
        ("bomb.docx", "word/document.xml"),
        ("bomb.pptx", "ppt/slides/slide1.xml"),
        ("bomb.xlsx", "xl/worksheets/sheet1.xml"),
        ("bomb.epub", "text/chapter.xhtml"),
    ],
)
def test_zip_member_packed_too_tightly_is_refused(tmp_path: Path, name: str, member: str):
    data = zip_bomb(member, 3 * 1024 * 1024)  # zeros pack about 1000:1
    assert len(data) < 10_000
    assert read(write(tmp_path, name, data))[:2] == (None, "unpack-limit")


def test_zip_declaring_too_much_in_total_is_refused(monkeypatch: pytest.MonkeyPatch):
    # The real file's members all pack under 12:1; only the total declared size is over (a lowered) limit.
    monkeypatch.setattr(documents, "MAX_UNPACKED_BYTES", 100_000)
    assert read(DATA / "officer-example.docx")[:2] == (None, "unpack-limit")


def test_small_member_may_pack_tightly(tmp_path: Path):
    # 512 KiB of zeros packs ~1000:1, but under 1 MiB the ratio is not checked: the file is judged on its content.
    data = zip_bomb("word/document.xml", 512 * 1024)
    assert read(write(tmp_path, "tight.docx", data))[:2] == (None, "corrupt")  # zeros are no XML


# --- PPTX ----------------------------------------------------------------------------------------------------


def test_pptx_slides_titles_and_tables():
    doc = convert(DATA / "officer-example.pptx")
    check_shape(doc)
    assert doc.format == "pptx" and len(doc.pages) == 3
    # The title alone (the page already names the slide); an untitled slide is "Slide N".
    assert [(h.title, page_of(doc, h.start)) for h in doc.headings] == [("Title", 1), ("Hi", 2), ("Slide 3", 3)]
    slide1 = doc.text[: doc.pages[1]]
    assert "A table \nand some text\nand some list (1)\n" in slide1
    assert "\nHeader 1 | Header 2 | Header 3\nA | 12.23 | blah blah\n" in slide1
    assert "This is an ordered\nlist of paragraphs" in doc.text[doc.pages[1] : doc.pages[2]]
    assert doc.text[doc.pages[2] :].startswith("# Slide 3\n\na |  |  |  | d\n")


def test_pptx_speaker_notes():
    doc = convert(DATA / "pptx-ph-inherit-props.pptx")
    check_shape(doc)
    assert doc.text[: doc.pages[1]] == (
        "# Title Text\n\nBody Text\n\nNotes:\nNotes in inherited position and size.\n\n"
    )
    assert doc.text[doc.pages[1] :] == "# Slide 2\n\nNotes:\nNotes in modified position and size.\n"


# --- XLSX ----------------------------------------------------------------------------------------------------


def test_xlsx_every_sheet_and_row():
    doc = convert(DATA / "readxl-datasets.xlsx")
    check_shape(doc)
    assert (doc.format, doc.pages, doc.cuts) == ("xlsx", [], [])
    assert [h.title for h in doc.headings] == ["iris", "mtcars", "chickwts", "quakes"]
    # The sheets declare their size as A1: every row is read all the same (a header and the data rows).
    ends = [*(h.start for h in doc.headings[1:]), None]
    sections = [doc.text[h.start : end] for h, end in zip(doc.headings, ends, strict=True)]
    assert [s.strip().count("\n") - 1 for s in sections] == [1 + 150, 1 + 32, 1 + 71, 1 + 1000]
    assert sections[0].startswith("# iris\n\nSepal.Length | Sepal.Width | Petal.Length | Petal.Width | Species\n")
    assert "\n5.1 | 3.5 | 1.4 | 0.2 | setosa\n" in sections[0]


def test_xlsx_empty_rows_dropped_and_dates_as_dates():
    doc = convert(DATA / "readxl-deaths.xlsx")
    check_shape(doc)
    assert [h.title for h in doc.headings] == ["arts", "other"]
    assert "\nDavid Bowie | musician | 69 | True | 1947-01-08 | 2016-01-10\n" in doc.text
    lines = doc.text.split("\n")
    assert not any(line and not line.replace("|", "").strip() for line in lines)
    assert "\n |  | at the | bottom,\n" in doc.text  # inner empty cells kept: columns stay where they were


# --- HTML ----------------------------------------------------------------------------------------------------


def test_html_main_text_without_navigation():
    doc = convert(DATA / "developer-duties.html")
    check_shape(doc)
    assert (doc.format, doc.pages) == ("html", [])
    assert [h.title for h in doc.headings[:3]] == [
        "3. Debian Developer's Duties",
        "3.1. Package Maintainer's Duties",
        "3.1.1. Work towards the next stable release",
    ]
    voting = next(h for h in doc.headings if h.title == "3.2.3. Voting")
    assert voting.path == ("3. Debian Developer's Duties", "3.2. Administrative Duties", "3.2.3. Voting")
    assert section_of(doc, doc.text.index(VOTING)) == voting.path
    assert "- Mail nm@debian.org for further instructions.\n" in doc.text
    for chrome in ("Quick search", "Table of Contents", "Navigation", "¶", "DOCUMENTATION_OPTIONS", "_static"):
        assert chrome not in doc.text


def test_html_megabytes_of_inline_script_stay_out(tmp_path: Path):
    script = "var blob = '" + "A" * (5 * 1024 * 1024) + "';"
    page = f"""<!doctype html><html><head><title>T</title><script>{script}</script><style>p {{color: red}}</style>
</head><body><header><a href="/">Site name</a><nav><a>Home</a><a>Blog</a></nav></header>
<div role="navigation">Sidebar links</div>
<article><header><h1>Small  teaser</h1></header><p>Short.</p></article>
<article><header><h1>Main   story</h1></header><p>First <b>bold</b>
paragraph   here.</p><script>alert('inline')</script>
<h2>Data</h2><table><tr><th>Name</th><th>Value</th></tr><tr><td>alpha</td><td> 1 </td></tr></table>
<pre>  code   line 1
    indented line 2</pre><ul><li>one</li><li>two <i>items</i></li></ul>
<footer>Article footer</footer></article><aside>Related posts</aside><footer>Copyright</footer>
<form><input value="q">Search box</form><noscript>Enable JS</noscript><template>Hidden</template></body></html>"""
    doc = convert(write(tmp_path, "page.html", page))
    check_shape(doc)
    # The largest article; its own header keeps its title; scripts, site chrome and the other article are gone.
    assert doc.text == (
        "# Main story\n\nFirst bold paragraph here.\n\n## Data\n\nName | Value\nalpha | 1\n\n"
        "  code   line 1\n    indented line 2\n- one\n- two items\n"
    )
    assert [h.path for h in doc.headings] == [("Main story",), ("Main story", "Data")]


def test_html_prefers_main(tmp_path: Path):
    page = "<html><body><p>Cookie banner</p><main><h2>Only  this</h2><p>Body text.</p></main></body></html>"
    doc = convert(write(tmp_path, "page.htm", page))
    assert doc.text == "## Only this\n\nBody text.\n"


def test_html_that_is_binary_stays_binary(tmp_path: Path):
    assert read(write(tmp_path, "x.html", b"\x89PNG\r\n\x1a\n" + b"\0" * 100))[:2] == (None, "binary")


def test_nul_characters_are_stripped(tmp_path: Path):
    # pypdf hands out U+0000 for a character code its font maps to nothing; PostgreSQL text cannot hold it.
    data = many_pages_pdf(1).replace(b"(Page 1 of", b"(Pa\\000ge 1 of")
    doc = convert(write(tmp_path, "nul.pdf", data))
    assert doc.text == "Page 1 of the generated file\n"
    assert documents.clean("a\x00b\r\nc\rd\ud800") == "ab\nc\nd\ufffd"


# --- EPUB ----------------------------------------------------------------------------------------------------


def test_epub_spine_order_and_continuing_headings():
    doc = convert(DATA / "developers-reference.epub")
    check_shape(doc)
    assert (doc.format, doc.pages) == ("epub", [])
    titles = [h.title for h in doc.headings]
    assert titles[:3] == ["Debian Developer's Reference", "1. Scope of This Document", "2. Applying to Become a Member"]
    assert titles[-1] == "Index"
    # Chapters come in spine order (index, scope, new-maintainer, developer-duties, …), each file's h1 a top level.
    chapters = [t for t in titles if re.match(r"\d+\. ", t)]
    assert chapters[:5] == [
        "1. Scope of This Document",
        "2. Applying to Become a Member",
        "3. Debian Developer's Duties",
        "4. Resources for Debian Members",
        "5. Managing Packages",
    ]
    at = doc.text.index(VOTING)
    assert section_of(doc, at) == ("3. Debian Developer's Duties", "3.2. Administrative Duties", "3.2.3. Voting")


def make_epub(chapters: list[tuple[str, str]], *, container: bool = True) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("mimetype", "application/epub+zip")
        if container:
            zf.writestr(
                "META-INF/container.xml",
                '<?xml version="1.0"?><container version="1.0" '
                'xmlns="urn:oasis:names:tc:opendocument:xmlns:container"><rootfiles>'
                '<rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/>'
                "</rootfiles></container>",
            )
        items = "".join(
            f'<item id="c{i}" href="{quote(name)}" media-type="application/xhtml+xml"/>'
            for i, (name, _) in enumerate(chapters)
        )
        # Spine order is the reverse of the manifest's: the spine decides.
        refs = "".join(f'<itemref idref="c{i}"/>' for i in reversed(range(len(chapters))))
        zf.writestr(
            "OEBPS/content.opf",
            '<?xml version="1.0"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0">'
            f"<manifest>{items}</manifest><spine>{refs}</spine></package>",
        )
        for name, body in chapters:
            zf.writestr(f"OEBPS/{name}", f"<html><body>{body}</body></html>")
    return buf.getvalue()


def test_epub_spine_decides_and_hrefs_are_urls(tmp_path: Path):
    data = make_epub([("b.xhtml", "<h2>Second</h2><p>two</p>"), ("a b.xhtml", "<h1>First</h1><p>one</p>")])
    doc = convert(write(tmp_path, "book.epub", data))
    assert doc.text == "# First\n\none\n\n## Second\n\ntwo\n"
    assert [h.path for h in doc.headings] == [("First",), ("First", "Second")]


def test_epub_without_container_is_corrupt(tmp_path: Path):
    data = make_epub([("a.xhtml", "<p>x</p>")], container=False)
    assert read(write(tmp_path, "book.epub", data))[:2] == (None, "corrupt")


# --- Markdown, text and code ---------------------------------------------------------------------------------


def test_markdown_text_unchanged_headings_outside_code_and_front_matter():
    path = DATA / "typer-SKILL.md"
    doc = convert(path)
    assert doc.format == "markdown" and doc.pages == [] and doc.cuts == []
    assert doc.text.encode() == path.read_bytes()  # byte for byte
    assert [(h.level, h.title) for h in doc.headings] == [
        (1, "Typer"),
        (2, "Installing typer"),
        (2, "Use an explicit `Typer` app"),
        (2, "Execute the app"),
        (2, "Use `Annotated`"),
        (2, "CLI Options"),
        (3, "CLI options with multiple values"),
        (2, "Rich"),
        (3, "Rich markdown"),
        (2, "Click"),
    ]
    assert all(doc.text.startswith("#", h.start) for h in doc.headings)
    assert doc.headings[6].path == ("Typer", "CLI Options", "CLI options with multiple values")


def test_markdown_setext_and_fences(tmp_path: Path):
    text = (
        "Intro line\nstill intro\n---\n\n"  # a rule under a two-line paragraph, not a heading
        "Guide\n=====\n\nText.\n\n"
        "Install\n-------\n\n"
        "~~~~\n# not a heading\nNot either\n---\n~~~~\n\n"
        "```python\n## nor this\n```\n\n"
        "    # indented code\n\n"
        "#hashtag is no heading\n"
        "### Deep ###\n"
        "- item\n---\n"
    )
    doc = convert(write(tmp_path, "g.markdown", text))
    assert doc.text == text
    got = [(h.start, h.level, h.title, h.path) for h in doc.headings]
    g, i, d = text.index("Guide\n"), text.index("Install\n"), text.index("### Deep")
    assert got == [
        (g, 1, "Guide", ("Guide",)),
        (i, 2, "Install", ("Guide", "Install")),
        (d, 3, "Deep", ("Guide", "Install", "Deep")),
    ]


def test_markdown_crlf_is_normalised_like_text(tmp_path: Path):
    raw = b"# Title\r\n\r\nBody\r\n"
    doc = convert(write(tmp_path, "README.MD", raw))
    assert doc.text == decode_text(raw)[0] == "# Title\n\nBody\n"
    assert doc.headings[0].start == 0


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("src/app.py", "# a comment, not a heading\ndef f():\n    return 1\n"),
        ("notes.txt", "Title\n=====\n# hash\r\nend\r\n"),
        ("Makefile", "all:\n\techo hi\n"),
    ],
)
def test_text_and_code_go_the_plain_path(tmp_path: Path, name: str, data: str):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode())
    doc, reason, digest = read_document(path, name)
    assert reason is None and doc is not None
    expected = decode_text(data.encode())[0]
    assert (doc.format, doc.text, doc.headings, doc.pages, doc.cuts) == ("text", expected, [], [], [])


@pytest.mark.parametrize(
    ("name", "data", "reason"),
    [
        ("blob.bin", b"PK\x03\x04" + b"\0" * 50, "binary"),
        ("doc.md", b"\0\0\0 binary markdown", "binary"),
        ("empty.pdf", b"", "empty"),
        ("empty.txt", b"", "empty"),
        ("latin1.txt", "caf\xe9".encode("latin-1"), "not-utf8"),
        ("scripts.html", b"<html><head><script>var a = 1;</script></head><body> </body></html>", "empty"),
    ],
)
def test_plain_skip_reasons_stay(tmp_path: Path, name: str, data: bytes, reason: str):
    assert read(write(tmp_path, name, data))[:2] == (None, reason)


def test_unreadable(tmp_path: Path):
    assert read_document(tmp_path / "gone.pdf", "gone.pdf") == (None, "unreadable", "")


def test_markdown_headings_on_their_own():
    assert markdown_headings("") == []
    assert [h.title for h in markdown_headings("#\n# \n#  Two   spaces  #\n")] == ["Two spaces"]


def test_importing_the_converters_loads_no_document_library():
    code = (
        "import sys, rlm_workers.ingest.documents\n"
        "heavy = {'pypdf', 'docx', 'pptx', 'openpyxl', 'bs4', 'lxml'} & set(sys.modules)\n"
        "print(sorted(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
