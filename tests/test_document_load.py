"""A folder of real documents through both ingest paths (docs/contract.md#documents): every convertible file
loaded with its pages and sections, the rest counted and named by reason, and a document that stops
converting keeping its earlier version."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rlm_workers.ingest.loader import load_paths
from rlm_workers.store import buffers as store
from tests.support.envpatch import patched_env

DATA = Path(__file__).parent / "data" / "documents"
#: the real files that convert, by the format they are stored as
CONVERTIBLE = {
    "developers-reference.pdf": "pdf",
    "pypdf-r6-empty-password.pdf": "pdf",
    "officer-example.docx": "docx",
    "officer-example.pptx": "pptx",
    "readxl-datasets.xlsx": "xlsx",
    "developer-duties.html": "html",
    "developers-reference.epub": "epub",
    "typer-SKILL.md": "markdown",
}
SKIPPED = {
    "officer-template-encrypted.docx": "encrypted",
    "pypdf-r4-aes-user-password.pdf": "encrypted",
    "pypdf-imagemagick-lzw.pdf": "no-text-layer",
}


def _folder(root: Path) -> Path:
    docs = root / "library"
    docs.mkdir()
    for name in [*CONVERTIBLE, *SKIPPED]:
        shutil.copy(DATA / name, docs / name)
    real = (DATA / "developers-reference.pdf").read_bytes()
    (docs / "truncated.pdf").write_bytes(real[: len(real) // 3])  # a download cut short
    (docs / "notes.txt").write_text("Plain notes stay plain.\nSecond line.\n")
    (docs / "tool.py").write_text("def tool():\n    return 42\n")
    return docs


def _files(conn, buffer_id: int) -> dict[str, tuple[str, object]]:
    rows = conn.execute("SELECT path, format, outline FROM files WHERE buffer_id = %s", (buffer_id,)).fetchall()
    return {r[0].split("/", 1)[1]: (r[1], r[2]) for r in rows}


def _chunks(conn, buffer_id: int, name: str) -> list[tuple]:
    return conn.execute(
        """SELECT page_start, page_end, heading_path, start_line, end_line, text FROM chunks
           WHERE buffer_id = %s AND path = %s ORDER BY seq""",
        (buffer_id, f"library/{name}"),
    ).fetchall()


@pytest.fixture(scope="module")
def loaded(conn, embedder, tmp_path_factory):
    folder = _folder(tmp_path_factory.mktemp("docs"))
    report = load_paths(conn, buffer="library", paths=[folder], embedder=embedder)
    conn.commit()
    return folder, report, store.get_buffer(conn, tenant="local", name="library")


def test_every_convertible_file_loads_and_the_rest_are_counted_and_named(conn, loaded):
    _, report, buf = loaded
    assert report.files_loaded == len(CONVERTIBLE) + 2  # and the two plain files
    assert report.skipped == {"encrypted": 2, "no-text-layer": 1, "corrupt": 1}
    assert sorted(report.named["encrypted"]) == [
        "library/officer-template-encrypted.docx",
        "library/pypdf-r4-aes-user-password.pdf",
    ]
    assert report.named["no-text-layer"] == ["library/pypdf-imagemagick-lzw.pdf"]
    assert report.named["corrupt"] == ["library/truncated.pdf"]
    files = _files(conn, buf.id)
    assert {n: f for n, (f, _) in files.items()} == {**CONVERTIBLE, "notes.txt": "text", "tool.py": "text"}
    assert files["notes.txt"][1] is None and files["developers-reference.pdf"][1]


def test_pdf_chunks_carry_pages_and_sections(conn, loaded):
    _, _, buf = loaded
    rows = _chunks(conn, buf.id, "developers-reference.pdf")
    assert all(r[0] is not None and r[0] <= r[1] for r in rows)
    assert [r[0] for r in rows] == sorted(r[0] for r in rows)
    assert sum(1 for r in rows if r[2]) > len(rows) // 2  # the outline gives most chunks a section
    assert max(r[1] for r in rows) > 50  # a long manual: pages far in are reached


def test_slides_are_pages_and_other_formats_have_sections_only(conn, loaded):
    _, _, buf = loaded
    slides = _chunks(conn, buf.id, "officer-example.pptx")
    assert slides and all(r[0] is not None for r in slides)
    for name in ("officer-example.docx", "developer-duties.html", "developers-reference.epub", "typer-SKILL.md"):
        rows = _chunks(conn, buf.id, name)
        assert rows and all(r[0] is None and r[1] is None for r in rows), name
        assert any(r[2] for r in rows), name
    sheets = _chunks(conn, buf.id, "readxl-datasets.xlsx")
    assert {r[2][0] for r in sheets if r[2]} >= {"iris"}, sheets[:1]


def test_plain_text_and_code_carry_no_provenance(conn, loaded):
    _, _, buf = loaded
    for name in ("notes.txt", "tool.py"):
        assert _chunks(conn, buf.id, name) and all(r[:3] == (None, None, None) for r in _chunks(conn, buf.id, name))


def test_markdown_is_stored_as_it_is(conn, loaded):
    _, _, buf = loaded
    rows = _chunks(conn, buf.id, "typer-SKILL.md")
    original = (DATA / "typer-SKILL.md").read_text()
    assert all(r[5] in original for r in rows)
    lines = original.split("\n")
    for r in rows:  # line numbers are the file's own
        assert lines[r[3] - 1].strip() in r[5].split("\n")[0] or r[5].split("\n")[0] in lines[r[3] - 1]


def test_a_document_that_stops_converting_keeps_its_earlier_version(conn, embedder, loaded):
    folder, _, buf = loaded
    before = _chunks(conn, buf.id, "officer-example.docx")
    (folder / "officer-example.docx").write_bytes(b"PK\x03\x04 not a zip any more")
    report = load_paths(conn, buffer="library", paths=[folder], embedder=embedder)
    conn.commit()
    assert report.skipped.get("corrupt") == 2 and report.named["corrupt"] == [
        "library/officer-example.docx",
        "library/truncated.pdf",
    ]
    assert report.files_removed == 0
    assert _chunks(conn, buf.id, "officer-example.docx") == before


def test_the_upload_path_stores_the_same_provenance(conn, loaded, rlm_env):
    """An upload loaded as file groups (what the ingest workers run) keeps pages, sections and the outline."""
    from rlm_workers.config import get_settings
    from rlm_workers.ingest import groups
    from rlm_workers.store.uploads import create_upload, get_upload, start_upload

    names = ["developers-reference.pdf", "officer-example.pptx", "developer-duties.html", "readxl-deaths.xlsx"]
    files = [(f"up/{n}", (DATA / n).read_bytes()) for n in names]
    files.append(("up/broken.epub", b"PK\x05\x06" + b"\x00" * 18))
    create_upload(conn, upload_id="docupload0001", tenant="local", buffer="uploaded", options={}, files=files)
    conn.commit()
    with patched_env({"RLM_INGEST_GROUP_BYTES": "4096"}):  # one group a file: each staged apart, then committed
        up = start_upload(conn, upload_id="docupload0001")
        conn.commit()
        nos = groups.plan(conn, up, get_settings())
        conn.commit()
        assert nos is not None and len(nos) == len(files)
        for n in nos:
            groups.run_group("docupload0001", n)
    done = get_upload(conn, upload_id="docupload0001")
    conn.commit()
    assert done.status == "done", done
    assert done.report["files_loaded"] == 4 and done.report["named"] == {"corrupt": ["up/broken.epub"]}
    ub = store.get_buffer(conn, tenant="local", name="uploaded")
    local = _chunks(conn, loaded[2].id, "developers-reference.pdf")
    pdf = conn.execute(
        "SELECT page_start, page_end, heading_path FROM chunks WHERE buffer_id = %s AND path = %s ORDER BY seq",
        (ub.id, "up/developers-reference.pdf"),
    ).fetchall()
    assert pdf == [r[:3] for r in local]
    outline = conn.execute(
        "SELECT outline FROM files WHERE buffer_id = %s AND path = 'up/developers-reference.pdf'", (ub.id,)
    ).fetchone()[0]
    assert outline and {"level", "title", "path", "start_line", "end_line", "page"} <= set(outline[0])


def test_a_load_of_only_unconvertible_documents_names_them_and_changes_nothing(conn, embedder, tmp_path):
    from rlm_workers.errors import InvalidInput

    for name in SKIPPED:
        shutil.copy(DATA / name, tmp_path / name)
    with pytest.raises(InvalidInput) as err:
        load_paths(conn, buffer="unreadable", paths=sorted(tmp_path.iterdir()), embedder=embedder)
    conn.rollback()
    message = str(err.value)
    assert "3 files skipped (2 encrypted: officer-template-encrypted.docx, pypdf-r4-aes-user-password.pdf" in message
    assert "1 no-text-layer: pypdf-imagemagick-lzw.pdf)" in message and "\n" not in message
    # each reason says what to do about it; none reads as if documents were not loaded at all
    assert "encrypted: documents that need a password are not opened (decrypt them first); " in message
    assert "no-text-layer: a PDF of scanned pages holds no text (OCR it first); " in message
    assert "only UTF-8 text" not in message
    assert store.get_buffer(conn, tenant="local", name="unreadable") is None
