"""Document conversion throughput: how many MB/s ``read_document`` turns into text, per format.

    .venv/bin/python bench/documents.py [--seconds 1.0] [--rounds 3]
    .venv/bin/python bench/documents.py --load 8     # also: `rlm load` of a folder of 8 copies of the real PDFs
    .venv/bin/python bench/documents.py --hostile [--scale 1.0] [--no-write] [--whole]   # issue #41 (~10-20 min)

The corpus is the real files of tests/data/documents (tests/data/documents/README.md says where each comes
from); the ones the loader skips (encrypted, scanned) are left out, as they cost next to nothing.  Each file is
converted over and over, in this process and on one thread, until ``--seconds`` have passed; the figure is the
best of ``--rounds`` such runs (the least disturbed by other work on the machine).  MB = 10^6 bytes of the
*input* file, so a format whose files are mostly images or zip overhead reads fast; chars/s says how much text
came out.  The import of each format's library is paid once, before timing.

``--load N`` then times the whole ``rlm load DIR --format json`` (the real CLI, as a subprocess, into a fresh
embedded PostgreSQL under bench/_data/documents) of a folder holding N copies of each real text PDF under
distinct names, beside the conversion alone of the same files in this process: the rest is chunking,
embedding and the database.

Prints markdown tables; nothing is written to bench/RESULTS.md.

``--hostile`` instead measures the files of issue #41, built here in a temporary folder: a DOCX whose body is
460 MB of ordinary paragraphs, one of ~460 MB of junk packed ~100:1 or tighter, the same with its member's
header declaring 20,000 bytes, a PDF whose pages share one 70 MB content stream, and a 20 MB HTML page.  Each is
converted by ``read_document`` in a fresh process (``--one``), which reports its resident memory when idle
(this module imported), its peak, its conversion child's peak, the seconds and the outcome.  ``--scale 0.1``
builds them at a tenth of the size; ``--whole`` then also loads each with the real ``rlm load`` (time, peak
memory, chunks and windows: the embedding after conversion is most of a large document's load).  Writes the
section ``documents-hostile`` of bench/RESULTS.md unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import re
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

sys.path.insert(0, str(harness.REPO))

from rlm_workers.ingest.documents import read_document  # noqa: E402

DATA = harness.REPO / "tests" / "data" / "documents"


def corpus() -> list[Path]:
    """The real files that convert (a skipped file costs a header check, not a conversion)."""
    out = []
    for path in sorted(DATA.iterdir()):
        if path.name == "README.md" or not path.is_file():
            continue
        doc, _reason, _ = read_document(path, path.name)
        if doc is not None:
            out.append(path)
    return out


#: a run of letters this long is words joined together (the longest English words in technical text, such as
#: "internationalization", are 20)
JOINED_LETTERS = 21


def joined_words(text: str) -> int:
    """Runs of ``JOINED_LETTERS`` letters or more: words a converter glued together ("Otherthantheyearly…")."""
    return sum(1 for w in re.findall(r"[^\W\d_]+", text) if len(w) >= JOINED_LETTERS)


def timed(path: Path, seconds: float) -> tuple[float, int, str, int]:
    """(seconds per conversion, repeats, format, characters out) over about ``seconds`` of converting."""
    n, t0 = 0, time.perf_counter()
    while True:
        doc, _, _ = read_document(path, path.name)
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            break
    assert doc is not None
    return elapsed / n, n, doc.format, len(doc.text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="converting time per file and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per file; the best counts")
    parser.add_argument("--load", type=int, default=0, metavar="N", help="also time `rlm load` of N copies of the PDFs")
    parser.add_argument("--hostile", action="store_true", help="measure the hostile files of issue #41 instead")
    parser.add_argument("--scale", type=float, default=1.0, help="--hostile: the files' size, 1 = as in the issue")
    parser.add_argument("--no-write", action="store_true", help="--hostile: print, leave RESULTS.md alone")
    parser.add_argument(
        "--whole", action="store_true", help="--hostile: also time the whole `rlm load` of each file (~10 min more)"
    )
    parser.add_argument("--one", metavar="FILE", help=argparse.SUPPRESS)  # one file's conversion, as JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(Path(args.one))))
        return
    if args.hostile:
        hostile(args.scale, write=not args.no_write, whole=args.whole)
        return

    files = corpus()  # also imports every format's library, outside the timing
    rows = []
    per_format: dict[str, list[float]] = {}
    for path in files:
        best = min((timed(path, args.seconds) for _ in range(args.rounds)), key=lambda r: r[0])
        per_conv, n, fmt, chars = best
        size = path.stat().st_size
        doc, _, _ = read_document(path, path.name)
        assert doc is not None
        joined = f"{joined_words(doc.text)} in {len(doc.pages)} pages" if doc.pages else str(joined_words(doc.text))
        rows.append((fmt, path.name, size, chars, per_conv, n, joined))
        acc = per_format.setdefault(fmt, [0.0, 0.0, 0.0])
        acc[0] += size
        acc[1] += per_conv
        acc[2] += chars

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [
        "## Document conversion (`bench/documents.py`)",
        "",
        f"- command: `{harness.command_line()}` at {harness.revision()}",
        f"- run finished (`date -u`): {harness.sh('date -u')}",
        f"- machine: {platform.platform()}, {cores} cores usable ({harness.cpu_model()}), "
        f"python {platform.python_version()}; {harness.machine_line()}",
        f"- `read_document` on each real file of tests/data/documents, repeated for ≥ {args.seconds:g} s, best of "
        f"{args.rounds} rounds, one thread; MB = 10^6 bytes of input file",
        "",
        f"- joined words: runs of {JOINED_LETTERS}+ letters in the text (words a converter glued together)",
        "",
        "| format | file | input KB | text chars | ms per file | MB/s | chars/s | joined words |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for fmt, name, size, chars, per_conv, _n, joined in sorted(rows):
        lines.append(
            f"| {fmt} | `{name}` | {size / 1e3:,.0f} | {chars:,} | {per_conv * 1e3:,.1f} | "
            f"{size / 1e6 / per_conv:,.2f} | {chars / per_conv:,.0f} | {joined} |"
        )
    lines += [
        "",
        "| format | files | MB/s (all its files) | chars/s |",
        "| --- | ---: | ---: | ---: |",
    ]
    for fmt, (size, secs, chars) in sorted(per_format.items()):
        count = sum(1 for r in rows if r[0] == fmt)
        lines.append(f"| {fmt} | {count} | {size / 1e6 / secs:,.2f} | {chars / secs:,.0f} |")
    if args.load:
        lines += ["", *load_folder(files, args.load)]
    print("\n".join(lines))


def load_folder(files: list[Path], copies: int) -> list[str]:
    """The whole `rlm load` of a folder of PDFs, and how much of it is conversion."""
    pdfs = [p for p in files if p.suffix == ".pdf"]
    data_dir = harness.isolated_env("documents")
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="rlm-bench-pdfs-") as tmp:
        folder = Path(tmp) / "pdfs"
        folder.mkdir()
        for i in range(copies):
            for p in pdfs:
                shutil.copy(p, folder / f"{p.stem}-{i:03d}.pdf")
        size = sum(p.stat().st_size for p in folder.iterdir())
        t0 = time.perf_counter()
        for p in sorted(folder.iterdir()):
            read_document(p, p.name)
        convert_s = time.perf_counter() - t0
        env = harness.child_env()
        cmd = [sys.executable, "-m", "rlm_api.cli", "load", str(folder), "-b", "pdfs", "--format", "json"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
    try:
        harness.stop_servers(data_dir)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"rlm load failed: {proc.stderr.strip()[-500:]}")
    report = json.loads(proc.stdout)
    n = copies * len(pdfs)
    return [
        f"### `rlm load` of a folder of {n} PDFs ({size / 1e6:.1f} MB: {copies} copies of "
        f"{', '.join(p.name for p in pdfs)})",
        "",
        "| what | seconds | MB/s of PDF |",
        "| --- | ---: | ---: |",
        f"| conversion alone (`read_document`, one thread, this process) | {convert_s:.1f} | "
        f"{size / 1e6 / convert_s:.2f} |",
        f"| the load as the loader times it (convert, chunk, embed, write) | {report['seconds']:.1f} | "
        f"{size / 1e6 / report['seconds']:.2f} |",
        f"| the whole `rlm load` process (imports, embedded servers, model) | {wall:.1f} | {size / 1e6 / wall:.2f} |",
        "",
        f"{report['files_loaded']} files, {report['chunks_written']:,} chunks, {report['windows_embedded']:,} windows "
        "embedded (runtime: the default).",
    ]


# --- the hostile files of issue #41 ----------------------------------------------------------------------------

_W = b'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'
_WORDS = b"the of and a to in is for on that by this with from as are be at an or it not which have".split()


def measure_one(path: Path) -> dict:
    """One conversion in this (fresh) process: idle and peak resident memory, the child's peak, seconds."""
    idle = harness.own_memory_mb("VmRSS")["VmRSS"]
    t0 = time.perf_counter()
    doc, reason, _ = read_document(path, path.name)
    seconds = time.perf_counter() - t0
    own = harness.own_memory_mb("VmHWM")["VmHWM"]  # VmHWM, not ru_maxrss (see own_memory_mb)
    # The child's ru_maxrss carries this process's size at the fork over the same way: an upper bound.
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {
        "idle_mb": idle,
        "peak_mb": own,
        "child_peak_mb": child / 1024,
        "seconds": seconds,
        "reason": reason,
        "cuts": doc.cuts if doc else [],
        "chars": len(doc.text) if doc else 0,
    }


def _docx_template() -> dict[str, bytes]:
    with zipfile.ZipFile(DATA / "officer-example.docx") as zf:
        return {i.filename: zf.read(i) for i in zf.infolist() if i.filename != "word/document.xml"}


def _write_docx(path: Path, body_bytes: int, paragraph) -> int:
    """A DOCX whose document.xml is ``body_bytes`` of paragraphs from ``paragraph(i)``, streamed into the zip."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in _docx_template().items():
            zf.writestr(name, data)
        with zf.open("word/document.xml", "w", force_zip64=True) as out:
            out.write(b"<w:document " + _W + b"><w:body>")
            written, i, piece = 0, 0, []
            while written < body_bytes:
                p = paragraph(i)
                piece.append(p)
                written += len(p)
                i += 1
                if len(piece) >= 4096:
                    out.write(b"".join(piece))
                    piece = []
            out.write(b"".join(piece) + b"</w:body></w:document>")
    with zipfile.ZipFile(path) as zf:
        return zf.getinfo("word/document.xml").file_size


def _ordinary(i: int) -> bytes:
    # Prose-like paragraphs with numbers in them: XML that packs about as well as a real document's (~15:1).
    words = b" ".join(_WORDS[(i * 7 + k * 13) % len(_WORDS)] for k in range(12 + i % 17))
    return b"<w:p><w:r><w:t>%d %s %d.</w:t></w:r></w:p>" % (i, words.capitalize(), i * 31 % 9973)


def _junk(i: int) -> bytes:
    # A counter that changes every few paragraphs: packs ~100-150:1, under the 200:1 ratio refused outright.
    return b"<w:p><w:r><w:t>junk junk junk junk junk %d</w:t></w:r></w:p>" % (i // 16)


def _lie(path: Path, member: str, size: int) -> None:
    """``member``'s header, local and central, declares ``size`` bytes unpacked (a zip64 member's extra field too)."""
    data = bytearray(path.read_bytes())
    info = zipfile.ZipFile(path).getinfo(member)
    struct.pack_into("<I", data, info.header_offset + 22, size)
    at = data.find(b"PK\x01\x02")
    while at != -1:
        name_len, extra_len = struct.unpack_from("<HH", data, at + 28)
        if data[at + 46 : at + 46 + name_len] == member.encode():
            struct.pack_into("<I", data, at + 24, size)
            extra = at + 46 + name_len
            end = extra + extra_len
            while extra + 4 <= end:  # a zip64 extra field carries the 64-bit sizes: the lie goes there too
                tag, length = struct.unpack_from("<HH", data, extra)
                if tag == 1 and length >= 8:
                    struct.pack_into("<Q", data, extra + 4, size)
                extra += 4 + length
        at = data.find(b"PK\x01\x02", at + 4)
    path.write_bytes(bytes(data))


def _write_pdf(path: Path, stream_bytes: int, pages: int) -> None:
    """A PDF whose ``pages`` pages all draw one shared FlateDecode content stream of ``stream_bytes``: long
    strings, so pypdf's token budget does not stop it and each page's text is the whole stream's."""
    line = b"BT /F1 10 Tf 50 700 Td (" + b"Shared stream words and more words " * 140 + b") Tj ET\n"
    content = line * (stream_bytes // len(line) + 1)
    packed = zlib.compress(content, 6)
    objs = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [" + b" ".join(b"%d 0 R" % (5 + k) for k in range(pages)) + b"] /Count %d >>" % pages,
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(packed) + packed + b"\nendstream",
    ]
    for _ in range(pages):
        objs.append(
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
            b"/Contents 4 0 R >>"
        )
    out = io.BytesIO()
    out.write(b"%PDF-1.7\n")
    offsets = []
    for n, body in enumerate(objs, 1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % n + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1))
    for off in offsets:
        out.write(b"%010d 00000 n \n" % off)
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref))
    path.write_bytes(out.getvalue())


def _write_html(path: Path, size: int) -> None:
    row = b"<div class='c'><p>Paragraph with a <a href='#x'>link</a> and <b>bold</b> words.</p></div>\n"
    path.write_bytes(b"<html><body><main>" + row * (size // len(row)) + b"</main></body></html>")


def hostile(scale: float, *, write: bool, whole: bool) -> None:
    mb = int(1e6 * scale)
    rows = []
    loads: list[tuple[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="rlm-bench-hostile-") as tmp:
        folder = Path(tmp)
        cases: list[tuple[str, Path]] = []
        p = folder / "ordinary.docx"
        _write_docx(p, 460 * mb, _ordinary)
        cases.append(("DOCX, document.xml 460 MB of ordinary paragraphs", p))
        p = folder / "junk.docx"
        _write_docx(p, 462 * mb, _junk)
        cases.append(("DOCX, document.xml 462 MB of junk paragraphs", p))
        lying = folder / "lying.docx"
        shutil.copy(p, lying)
        _lie(lying, "word/document.xml", 20_000)
        cases.append(("the same, its header declaring 20,000 bytes", lying))
        p = folder / "shared-stream.pdf"
        _write_pdf(p, 70 * mb, 50)
        cases.append(("PDF, 50 pages sharing one 70 MB content stream", p))
        p = folder / "page.html"
        _write_html(p, 20 * mb)
        cases.append(("HTML page of 20 MB", p))
        env = harness.child_env()
        for label, path in cases:
            unpacked = _declared(path)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--one", str(path)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
            if proc.returncode != 0:
                raise SystemExit(f"{path.name}: {proc.stderr.strip()[-500:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append((label, path.stat().st_size, unpacked, r))
            print(label, r, flush=True)
        if whole:
            loads = whole_loads(folder, cases)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [
        "## Hostile documents (`bench/documents.py --hostile`, issue #41)",
        "",
        f"- command: `{harness.command_line()}` at {harness.revision()}",
        f"- run finished (`date -u`): {harness.sh('date -u')}",
        f"- machine: {platform.platform()}, {cores} cores usable ({harness.cpu_model()}), "
        f"python {platform.python_version()}; {harness.machine_line()}",
        "- each file converted by `read_document` in a fresh process; idle = its resident memory with "
        "`rlm_workers.ingest.documents` imported; peak = its own high-water mark (`VmHWM`); child = the "
        "conversion child's `ru_maxrss`, the whole process with its interpreter and library (an upper bound: "
        "Linux counts the forking process's size in it); the bound is 1 GiB of address space above the "
        "child's idle size and 300 s",
        "",
        "| file | input MB | declared unpacked MB | outcome | chars kept | seconds | idle MB | peak MB | "
        "peak above idle MB | child peak MB |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, size, unpacked, r in rows:
        outcome = f"skipped: {r['reason']}" if r["reason"] else ", ".join(["loaded", *r["cuts"]])
        lines.append(
            f"| {label} | {size / 1e6:,.1f} | {unpacked / 1e6:,.0f} | {outcome} | {r['chars']:,} | "
            f"{r['seconds']:,.1f} | {r['idle_mb']:,.0f} | {r['peak_mb']:,.0f} | {r['peak_mb'] - r['idle_mb']:,.0f} | "
            f"{r['child_peak_mb']:,.0f} |"
        )
    if loads:
        lines += [
            "",
            "### The whole `rlm load` of each file (`--whole`)",
            "",
            "Each file loaded alone into a fresh buffer by the real CLI (`rlm load FILE -b NAME --format json`, a "
            "subprocess; the first load also starts the embedded servers): convert, chunk, embed, write.  Peak = "
            "the `rlm` process's own high-water mark with the children it reaped (the conversion child "
            "included), from `wait4`; "
            "idle = the same for the load of a one-line text file (imports, encoder, database).",
            "",
            "| file | outcome | chunks | windows | seconds (load's report) | seconds (wall) | peak MB | "
            "peak above idle MB |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        idle = loads[0][1]["peak_mb"]
        for label, r in loads:
            lines.append(
                f"| {label} | {r['outcome']} | {r['chunks']:,} | {r['windows']:,} | {r['seconds']:,.1f} | "
                f"{r['wall']:,.1f} | {r['peak_mb']:,.0f} | {max(0.0, r['peak_mb'] - idle):,.0f} |"
            )
    harness.publish("documents-hostile", "\n".join(lines), None, write=write)


def whole_loads(folder: Path, cases: list[tuple[str, Path]]) -> list[tuple[str, dict]]:
    """Each case loaded by the real CLI into its own buffer, after a one-line text file as the idle baseline."""
    data_dir = harness.isolated_env("documents-hostile")
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.mkdir(parents=True)
    small = folder / "one-line.txt"
    small.write_text("One line of text, to measure the load's own size.\n")
    env = harness.child_env()
    out = []
    try:
        # The first load starts the embedded servers (their start is reaped by the `rlm` process and would count
        # in its peak): the second load of the same line is the idle baseline.
        runs = [("servers started", small), ("a one-line text file (idle)", small), *cases]
        for k, (label, path) in enumerate(runs):
            cmd = [sys.executable, "-m", "rlm_api.cli", "load", str(path), "-b", f"hostile-{k}", "--format", "json"]
            with tempfile.TemporaryFile("w+") as so, tempfile.TemporaryFile("w+") as se:
                t0 = time.perf_counter()
                proc = subprocess.Popen(cmd, stdout=so, stderr=se, text=True, env=env)
                # wait4, not Popen.wait: its rusage is this child's own peak, not the bench's children's
                _, status, usage = os.wait4(proc.pid, 0)
                wall = time.perf_counter() - t0
                proc.returncode = os.waitstatus_to_exitcode(status)
                so.seek(0)
                se.seek(0)
                r = _load_row(so.read(), se.read(), proc.returncode, wall, usage.ru_maxrss / 1024)
            print("whole load:", label, r, flush=True)
            if k:
                out.append((label, r))
    finally:
        harness.stop_servers(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)
    return out


def _load_row(stdout: str, stderr: str, rc: int, wall: float, peak: float) -> dict:
    if rc == 0:
        report = json.loads(stdout)
        outcome = ", ".join(["loaded", *sorted(report.get("cut") or {})])
        return {
            "outcome": outcome,
            "chunks": report["chunks_written"],
            "windows": report["windows_embedded"],
            "seconds": report["seconds"],
            "wall": wall,
            "peak_mb": peak,
        }
    # "nothing to load: 1 file skipped (1 unpack-limit: lying.docx); …": the reasons in the parentheses
    counted = re.search(r"skipped \(([^)]*)\)", (stderr.strip().splitlines() or [""])[-1])
    reasons = re.findall(r"(?:^|, )\d+ ([\w-]+)", counted.group(1)) if counted else []
    return {
        "outcome": f"refused (exit {rc}): skipped, {', '.join(reasons) or 'see its error'}",
        "chunks": 0,
        "windows": 0,
        "seconds": wall,
        "wall": wall,
        "peak_mb": peak,
    }


def _declared(path: Path) -> int:
    """What a zip's headers say its members unpack to (0 for a file that is no zip)."""
    if not zipfile.is_zipfile(path):
        return 0
    with zipfile.ZipFile(path) as zf:
        return sum(i.file_size for i in zf.infolist())


if __name__ == "__main__":
    main()
