"""What one hostile file may cost the ingest process (docs/contract.md#documents, issue #41): zip members counted
as they really unpack whatever their headers say, a DOCX body parsed as a stream and stopped at the character
limit, and the child process whose memory and time are bounded whatever a library does.  The files are built
here, small, against lowered limits; the full-size cases and their memory and seconds are in bench/documents.py.
"""

from __future__ import annotations

import io
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rlm_workers.ingest import documents, loader
from rlm_workers.ingest.documents import Document, read_document
from rlm_workers.ingest.loader import load_paths
from rlm_workers.store import buffers as store
from rlm_workers.store import vectors

DATA = Path(__file__).parent / "data" / "documents"
_W = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'


def read(path: Path) -> tuple[Document | None, str | None]:
    doc, reason, _ = read_document(path, path.name)
    return doc, reason


def write(tmp_path: Path, name: str, data: bytes | str) -> Path:
    path = tmp_path / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def docx_with_body(body: bytes) -> bytes:
    """A real DOCX (officer-example.docx: its styles, relationships, content types) with ``body`` as the XML
    of its main part."""
    src = zipfile.ZipFile(DATA / "officer-example.docx")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            out.writestr(info.filename, body if info.filename == "word/document.xml" else src.read(info))
    return buf.getvalue()


def paragraphs(n: int, start: int = 0) -> bytes:
    return b"".join(b"<w:p><w:r><w:t>Paragraph %d of a long body.</w:t></w:r></w:p>" % i for i in range(start, n))


def declare_size(data: bytes, member: str, size: int) -> bytes:
    """``data`` with ``member``'s uncompressed size in its local header and the central directory set to
    ``size``: a header that lies about what the member unpacks to."""
    out = bytearray(data)
    info = zipfile.ZipFile(io.BytesIO(data)).getinfo(member)
    struct.pack_into("<I", out, info.header_offset + 22, size)
    at = out.find(b"PK\x01\x02")
    while at != -1:
        name_len = struct.unpack_from("<H", out, at + 28)[0]
        if out[at + 46 : at + 46 + name_len] == member.encode():
            struct.pack_into("<I", out, at + 24, size)
        at = out.find(b"PK\x01\x02", at + 4)
    return bytes(out)


# --- zip members counted as they really unpack ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "member"),
    [
        ("lying.docx", "word/document.xml"),
        ("lying.pptx", "ppt/slides/slide1.xml"),
        ("lying.xlsx", "xl/worksheets/sheet1.xml"),
        ("lying.epub", "text/chapter.xhtml"),
    ],
)
def test_a_member_unpacking_to_more_than_its_header_declares_is_refused(tmp_path: Path, name: str, member: str):
    # 2 MB of XML-like text packs well under the ratio limit, and its header declares 20,000 bytes: the
    # declared sizes pass every check, the real ones do not.
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("[Content_Types].xml", "<Types/>")
        zf.writestr(member, paragraphs(40_000))
    data = declare_size(buf.getvalue(), member, 20_000)
    assert read(write(tmp_path, name, data)) == (None, "unpack-limit")


def test_an_honest_member_is_counted_to_its_size():
    data = (DATA / "officer-example.docx").read_bytes()
    zf = zipfile.ZipFile(io.BytesIO(data))
    for info in zf.infolist():
        size, head = documents._unpacked_size(data, info)
        assert size == info.file_size == len(zf.read(info)) and zf.read(info).startswith(head)


# --- the DOCX body as a stream -------------------------------------------------------------------------------


def test_docx_body_stops_being_parsed_at_the_character_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # Past the limit the body is not even well-formed: a parser that reads the whole body first fails on it;
    # the stream stops before it gets there and loads what came before, cut.
    monkeypatch.setattr(documents, "MAX_DOCUMENT_CHARS", 5000)
    body = b"<w:document %s><w:body>" % _W.encode() + paragraphs(20_000) + b"<w:p><w:r><w:t>broken</w:r>" * 1000
    doc, reason = read(write(tmp_path, "long.docx", docx_with_body(body)))
    assert reason is None and doc is not None
    assert doc.cuts == ["cut-text"]
    assert len(doc.text) == 5000
    assert doc.text.startswith("Paragraph 0 of a long body.\n\nParagraph 1 of a long body.\n")


def test_docx_body_that_is_broken_before_the_limit_is_corrupt(tmp_path: Path):
    body = b"<w:document %s><w:body>" % _W.encode() + paragraphs(10) + b"<w:p><w:r><w:t>broken</w:r>"
    assert read(write(tmp_path, "broken.docx", docx_with_body(body))) == (None, "corrupt")


def test_docx_whose_main_part_is_no_word_document_is_corrupt(tmp_path: Path):
    body = b'<p:presentation xmlns:p="http://schemas.openxmlformats.org/presentationml/2006/main"/>'
    assert read(write(tmp_path, "slides.docx", docx_with_body(body))) == (None, "corrupt")


def test_docx_body_never_resolves_entities(tmp_path: Path):
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET")
    body = (
        b'<!DOCTYPE w:document [<!ENTITY x SYSTEM "file://%s">]>' % str(secret).encode()
        + b"<w:document %s><w:body><w:p><w:r><w:t>before &x; after</w:t></w:r></w:p></w:body></w:document>"
        % _W.encode()
    )
    doc, _ = read(write(tmp_path, "xxe.docx", docx_with_body(body)))
    assert doc is None or "SECRET" not in doc.text


# --- the child process ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["officer-example.docx", "readxl-deaths.xlsx", "developer-duties.html"])
def test_a_large_file_converts_in_a_child_to_the_same_document(monkeypatch: pytest.MonkeyPatch, name: str):
    here = read(DATA / name)
    monkeypatch.setattr(documents, "_INPROCESS_MAX_BYTES", 0)  # every file counts as large
    assert read(DATA / name) == here


def test_the_child_gets_the_limits_of_this_process(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(documents, "_INPROCESS_MAX_BYTES", 0)
    monkeypatch.setattr(documents, "MAX_DOCUMENT_CHARS", 300)
    doc, reason = read(DATA / "officer-example.docx")
    assert reason is None and doc is not None
    assert doc.cuts == ["cut-text"] and len(doc.text) == 300


def test_what_a_library_prints_in_the_child_does_not_spoil_its_answer(monkeypatch: pytest.MonkeyPatch):
    here = read(DATA / "officer-example.docx")
    monkeypatch.setattr(documents, "_INPROCESS_MAX_BYTES", 0)
    # The conversion in the child prints, from Python and straight to file descriptor 1, before converting.
    noisy = (
        "import os; from rlm_workers.ingest import documents as d; real = d._convert; "
        "d._convert = lambda *a, **k: (print('chatter'), os.write(1, b'more chatter'), real(*a, **k))[-1]; "
        "d._child_main()"
    )
    monkeypatch.setattr(documents, "_CHILD_CODE", noisy)
    assert read(DATA / "officer-example.docx") == here


def test_a_child_over_its_memory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # A page of 200,000 small tags: Beautiful Soup's tree of it takes far more than the 32 MB allowed here.
    page = b"<html><body>" + b"<div><p>cell</p></div>" * 200_000 + b"</body></html>"
    monkeypatch.setattr(documents, "_INPROCESS_MAX_BYTES", 0)
    monkeypatch.setattr(documents, "MAX_CONVERT_MEMORY_BYTES", 32 * 1024 * 1024)
    assert read(write(tmp_path, "big.html", page)) == (None, "convert-limit")


def test_a_child_over_its_time_is_killed_and_refused(monkeypatch: pytest.MonkeyPatch):
    # A conversion that never checks the clock (a library stuck in one call): the child is killed at the limit.
    monkeypatch.setattr(documents, "_INPROCESS_MAX_BYTES", 0)
    monkeypatch.setattr(documents, "MAX_CONVERT_SECONDS", 1)
    monkeypatch.setattr(documents, "_CHILD_CODE", "import time; time.sleep(120)")
    assert read(DATA / "officer-example.docx") == (None, "convert-limit")


def test_a_child_that_dies_is_refused(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(documents, "_INPROCESS_MAX_BYTES", 0)
    monkeypatch.setattr(documents, "_CHILD_CODE", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert read(DATA / "officer-example.docx") == (None, "convert-limit")


@pytest.fixture
def sent_to_child(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The formats of the files converted in a child from here on, each still converted there."""
    sent: list[str] = []
    real = documents._convert_in_child

    def counted(fmt: str, data: bytes) -> Document:
        sent.append(fmt)
        return real(fmt, data)

    monkeypatch.setattr(documents, "_convert_in_child", counted)
    return sent


def test_a_small_pdf_over_this_process_stream_limit_converts_in_a_child(
    monkeypatch: pytest.MonkeyPatch, sent_to_child: list[str]
):
    here = read(DATA / "developers-reference.pdf")
    sent_to_child.clear()
    monkeypatch.setattr(documents, "_INPROCESS_PDF_STREAM_BYTES", 1000)  # every page's stream decodes to more
    assert read(DATA / "developers-reference.pdf") == here
    assert sent_to_child == ["pdf"]


def test_a_small_zip_whose_markup_unpacks_large_converts_in_a_child(
    monkeypatch: pytest.MonkeyPatch, sent_to_child: list[str]
):
    here = read(DATA / "officer-example.docx")
    sent_to_child.clear()
    monkeypatch.setattr(documents, "_INPROCESS_MAX_MARKUP", 1000)  # the file is 79 KB, its XML more than this
    assert read(DATA / "officer-example.docx") == here
    assert sent_to_child == ["docx"]


def test_only_markup_counts_towards_the_child(monkeypatch: pytest.MonkeyPatch):
    data = (DATA / "officer-example.docx").read_bytes()
    zf = zipfile.ZipFile(io.BytesIO(data))
    xml = sum(i.file_size for i in zf.infolist() if zf.read(i).lstrip().startswith(b"<"))
    assert 0 < xml < sum(i.file_size for i in zf.infolist())  # it holds a picture
    assert documents._check_zip(data) == xml


# --- HTML ----------------------------------------------------------------------------------------------------


def test_html_doctype_with_an_internal_subset_leaves_no_text(tmp_path: Path):
    page = '<!DOCTYPE html [\n  <!ENTITY company "Example">\n]>\n<html><body><p>Hello world</p></body></html>'
    doc, _ = read(write(tmp_path, "subset.html", page))
    assert doc is not None and doc.text == "Hello world\n"


def test_xml_parsed_as_html_says_nothing_on_stderr(tmp_path: Path):
    path = write(tmp_path, "page.xhtml", '<?xml version="1.0" encoding="utf-8"?>\n<root><p>Hello xml</p></root>')
    code = (
        "import sys; from pathlib import Path; from rlm_workers.ingest.documents import read_document; "
        "print(read_document(Path(sys.argv[1]), 'page.xhtml')[0].text, end='')"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "Hello xml\n", "")


def test_html_parse_stops_at_its_share_of_the_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # Fed a piece at a time, the parse stops once its time is up: the first piece is converted, cut.
    monkeypatch.setattr(documents, "_HTML_FEED_PIECE", 1000)
    monkeypatch.setattr(documents, "MAX_CONVERT_SECONDS", 0)
    page = "<html><body>" + "".join(f"<p>Paragraph {i}</p>" for i in range(1000)) + "</body></html>"
    doc, reason = read(write(tmp_path, "slow.html", page))
    assert reason is None and doc is not None
    assert doc.cuts == ["cut-time"]
    assert doc.text.startswith("Paragraph 0\n") and "Paragraph 999" not in doc.text


# --- the loader ----------------------------------------------------------------------------------------------


def test_a_document_refused_at_the_limits_keeps_its_earlier_version(
    conn, embedder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    folder = tmp_path / "docs"
    folder.mkdir()
    shutil.copy(DATA / "officer-example.docx", folder / "report.docx")
    load_paths(conn, buffer="limits", paths=[folder], embedder=embedder)
    conn.commit()
    buf = store.get_buffer(conn, tenant="local", name="limits")
    query = "SELECT seq, text FROM chunks WHERE buffer_id = %s ORDER BY path, seq"
    before = conn.execute(query, (buf.id,)).fetchall()
    assert before

    # The same name now holds a version whose conversion runs past the limits.
    changed = docx_with_body(b"<w:document %s><w:body>" % _W.encode() + paragraphs(50) + b"</w:body></w:document>")
    (folder / "report.docx").write_bytes(changed)
    monkeypatch.setattr(documents, "_INPROCESS_MAX_BYTES", 0)
    monkeypatch.setattr(documents, "MAX_CONVERT_SECONDS", 1)
    monkeypatch.setattr(documents, "_CHILD_CODE", "import time; time.sleep(120)")
    report = load_paths(conn, buffer="limits", paths=[folder], embedder=embedder)
    conn.commit()
    assert report.skipped == {"convert-limit": 1}
    assert report.named == {"convert-limit": ["docs/report.docx"]}
    assert report.files_removed == 0
    assert conn.execute(query, (buf.id,)).fetchall() == before


def test_a_document_past_the_window_limit_is_cut_at_a_chunk_and_plain_text_is_not(
    conn, embedder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Embedding is most of a large document's load: the text kept stops before the chunk whose windows pass
    the limit, and the file's size and outline describe only what was kept.  A plain text file is the size the
    user chose (``RLM_MAX_FILE_BYTES``) and is never cut."""
    heading = b'<w:p><w:pPr><w:pStyle w:val="Titre1"/></w:pPr><w:r><w:t>Part %d</w:t></w:r></w:p>'
    body = b"".join(heading % k + paragraphs(40 * (k + 1), 40 * k) for k in range(10))
    folder = tmp_path / "docs"
    folder.mkdir()
    write(
        folder, "long.docx", docx_with_body(b"<w:document %s><w:body>" % _W.encode() + body + b"</w:body></w:document>")
    )
    whole, _ = read(folder / "long.docx")
    assert whole is not None and not whole.cuts
    write(folder, "long.txt", whole.text)
    monkeypatch.setattr(loader, "MAX_DOCUMENT_WINDOWS", 40)

    report = load_paths(conn, buffer="windows", paths=[folder], embedder=embedder, chunk_size=1000, overlap=100)
    conn.commit()
    assert report.cut == {"cut-text": 1} and report.named == {"cut-text": ["docs/long.docx"]}
    buf = store.get_buffer(conn, tenant="local", name="windows")
    file_rows = {
        path: (size, outline)
        for path, size, outline in conn.execute(
            "SELECT path, size_bytes, outline FROM files WHERE buffer_id = %s", (buf.id,)
        ).fetchall()
    }
    kept = conn.execute(
        f"SELECT c.text, c.end_byte, (SELECT count(*) FROM {vectors.vector_table(buf.id)} v WHERE v.chunk_id = c.id) "
        "FROM chunks c WHERE c.buffer_id = %s AND c.path = 'docs/long.docx' ORDER BY c.seq",
        (buf.id,),
    ).fetchall()
    assert 0 < sum(n for _, _, n in kept) <= 40
    assert kept[0][0].startswith("# Part 0")
    size, outline = file_rows["docs/long.docx"]
    assert size == kept[-1][1] < len(whole.text)
    titles = [h["title"] for h in outline]
    assert titles == [f"Part {k}" for k in range(len(titles))] and 0 < len(titles) < 10
    text_chunks = conn.execute(
        "SELECT count(*) FROM chunks WHERE buffer_id = %s AND path = 'docs/long.txt'", (buf.id,)
    ).fetchone()[0]
    assert text_chunks > len(kept) and file_rows["docs/long.txt"][0] == len(whole.text.encode())
