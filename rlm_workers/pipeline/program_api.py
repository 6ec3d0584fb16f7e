"""What a code-mode program can call (docs/contract.md#code-mode): the job's buffers as data, search, sub-model
calls and, where ``--depth`` allows, child jobs.  Every function runs here, in the worker, when the sandbox asks
(``sandbox/runner.py``).

The arguments come from a model-written program, so each is checked (type, size) and a bad one is a
``CallError`` the program sees as ``ApiError``; reads are scoped to the job's tenant and buffers.  The chunk ids
the program was handed are remembered (``seen``): the answer may cite those, and only those.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator
from contextlib import closing
from typing import TYPE_CHECKING, Any

from ..limits import MAX_CODE_FRAME_BYTES, MAX_QUERY_BYTES
from ..models import JobStatus, SearchMode
from ..runtime.local_servers import database_url
from ..sandbox.runner import CallError
from ..search.sections import stitch
from ..search.service import search
from ..store.buffers import chunks_in_lines, file_outline, iter_chunk_texts, list_buffers, list_files, require_buffers
from . import subcalls, tree
from .tools import ToolError, compile_regex

if TYPE_CHECKING:
    import psycopg

    from ..config import Settings
    from ..store.jobs import JobRow

#: characters of chunk text one chunks() call hands a program: more is a file at a time (the sandbox has 1 GiB)
MAX_CHUNKS_CHARS = MAX_CODE_FRAME_BYTES * 4
#: lines one grep() returns
MAX_GREP_LINES = 10_000
#: files per buffer the outline lists
MAX_OUTLINE_FILES = 1000
#: calls one llm_query_batched may send, and characters of one call's prompt and text together
MAX_SUBCALLS_PER_BATCH = 1000
MAX_SUBCALL_CHARS = 400_000
#: how long the program waits on one chord before the missing replies are marked
SUBCALL_WAIT_SECONDS = 3600.0


#: questions one rlm_query_batched may ask: each is a whole query of its own
MAX_CHILDREN_PER_BATCH = 100
#: how long the program waits on its child jobs before it is told which are still running
CHILD_WAIT_SECONDS = 3600.0


#: what a program may call besides ``final`` (the sandbox's own): the names ``ProgramApi.functions`` hands in
API_NAMES = frozenset({"outline", "read", "chunks", "grep", "search", "llm_query", "llm_query_batched"})
#: handed in too where the query allows child jobs (``--depth`` of at least 1 in code mode)
CHILD_API_NAMES = frozenset({"rlm_query", "rlm_query_batched"})


class ProgramApi:
    """The functions handed to one job's sandbox, and what they handed out."""

    def __init__(
        self, conn: psycopg.Connection, job: JobRow, settings: Settings, should_stop: Callable[[], bool]
    ) -> None:
        self.conn, self.job, self.settings, self.should_stop = conn, job, settings, should_stop
        #: chunk ids the program received from chunks(), grep() or search()
        self.seen: set[int] = set()
        self.sub_calls = 0
        self._chords = itertools.count(1)

    @property
    def children_allowed(self) -> bool:
        """Whether the query's ``--depth`` lets the program start child jobs (code mode's default is 0: none)."""
        return self.job.depth + 1 <= (self.job.options.depth or 0)

    def functions(self) -> dict[str, Callable[..., Any]]:
        names = API_NAMES | CHILD_API_NAMES if self.children_allowed else API_NAMES
        return {name: getattr(self, name) for name in sorted(names)}

    def outline(self) -> dict[str, Any]:
        """The job's buffers, their files (path, bytes, chunks) and totals."""
        out = []
        for name in self.job.buffers:
            [row] = require_buffers(self.conn, tenant=self.job.tenant, names=[name])
            [info] = list_buffers(self.conn, tenant=self.job.tenant, name=name)
            files = list_files(self.conn, buffer_id=row.id, limit=MAX_OUTLINE_FILES + 1)
            entry: dict[str, Any] = {
                "name": name,
                "files": [{"path": f.path, "bytes": f.bytes, "chunks": f.chunks} for f in files[:MAX_OUTLINE_FILES]],
                "file_count": info.files,
                "chunk_count": info.chunks,
                "bytes": info.bytes,
            }
            if len(files) > MAX_OUTLINE_FILES:
                entry["files_cut"] = f"first {MAX_OUTLINE_FILES} of {info.files} files listed"
            out.append(entry)
        return {"buffers": out}

    def read(self, path: str, start_line: int = 1, end_line: int | None = None, buffer: str | None = None) -> str:
        """A file's text, or its lines ``start_line``..``end_line``, stitched from its chunks with each overlap
        taken once: what a program counts lines in."""
        if not isinstance(path, str):
            raise CallError("path must be a str")
        _bounded_int(start_line, "start_line", 1, 2**31 - 1)
        if end_line is not None:
            _bounded_int(end_line, "end_line", start_line, 2**31 - 1)
        names = self._buffers(buffer)
        for row in require_buffers(self.conn, tenant=self.job.tenant, names=names):
            f = file_outline(self.conn, buffer_id=row.id, path=path)
            if f is None:
                continue
            last = end_line or 2**31 - 1
            spans = chunks_in_lines(
                self.conn,
                buffer_id=row.id,
                file_id=f.id,
                start_line=start_line,
                end_line=last,
                max_chars=MAX_CHUNKS_CHARS,
            )
            if sum(len(c.text) for c in spans) >= MAX_CHUNKS_CHARS:  # the read stopped there: more may follow
                raise CallError(f"{path} is larger than {MAX_CHUNKS_CHARS} characters: read it in line ranges")
            text, first = stitch(spans)
            self.seen.update(c.id for c in spans)
            lines = text.split("\n")[start_line - first : (last - first + 1)] if spans else []
            return "\n".join(lines)
        raise CallError(f"no file {path!r} in {', '.join(names)}; outline() lists the files")

    def chunks(self, path: str | None = None, buffer: str | None = None) -> list[dict[str, Any]]:
        """Every chunk of the job's buffers (or of one buffer, or one file) in reading order, with its text.
        Neighbouring chunks may overlap by a few lines: count lines with ``read`` or ``grep``, not here."""
        _optional_str(path, "path")
        names = self._buffers(buffer)
        too_much = (
            f"chunks() would hand over more than {MAX_CHUNKS_CHARS} characters; "
            "read one file at a time (chunks(path=...)) or grep()/search() first"
        )
        with closing(self._texts(names, too_much, path=path)) as texts:
            out: list[dict[str, Any]] = [
                {
                    "id": cid,
                    "buffer": buf,
                    "path": p,
                    "start_line": start,
                    "end_line": start + text.count("\n"),
                    "text": text,
                }
                for cid, buf, p, start, text in texts
            ]
        if path is not None and not out:
            raise CallError(f"no file {path!r} in {', '.join(names)}; outline() lists the files")
        self.seen.update(c["id"] for c in out)
        return out

    def grep(self, pattern: str, max_results: int = 1000, buffer: str | None = None) -> list[dict[str, Any]]:
        """Lines matching an RE2 pattern: chunk id, buffer, path, line number and the line."""
        try:
            regex = compile_regex(pattern)
        except ToolError as exc:
            raise CallError(str(exc)) from None
        _bounded_int(max_results, "max_results", 1, MAX_GREP_LINES)
        matches: list[dict[str, Any]] = []
        #: (buffer, path) → the last line already searched: chunks overlap, and a line is matched once
        done: dict[tuple[str, str], int] = {}
        too_much = (
            f"grep() reads at most {MAX_CHUNKS_CHARS} characters a call and these buffers hold more; "
            "give buffer=, or search() first"
        )
        with closing(self._texts(self._buffers(buffer), too_much)) as texts:
            for cid, buf, path, start, text in texts:
                upto = done.get((buf, path), 0)
                lines = text.split("\n")
                done[(buf, path)] = max(upto, start + len(lines) - 1)
                for offset, line in enumerate(lines):
                    if start + offset <= upto:
                        continue
                    if regex.search(line):
                        matches.append(
                            {"chunk_id": cid, "buffer": buf, "path": path, "line_number": start + offset, "text": line}
                        )
                        if len(matches) >= max_results:
                            break
                if len(matches) >= max_results:
                    break
        self.seen.update(m["chunk_id"] for m in matches)
        return matches

    def search(self, query: str, top_k: int = 10, mode: str = "hybrid") -> list[dict[str, Any]]:
        """The chunks a hybrid (or bm25, semantic) search ranks first, with their text."""
        if not isinstance(query, str) or not query.strip() or len(query.encode()) > MAX_QUERY_BYTES:
            raise CallError(f"query must be a non-empty string of at most {MAX_QUERY_BYTES} bytes")
        _bounded_int(top_k, "top_k", 1, 200)
        if mode not in {m.value for m in SearchMode}:
            raise CallError(f"mode must be one of {', '.join(m.value for m in SearchMode)}")
        hits = search(
            self.conn,
            settings=self.settings,
            url=database_url(self.settings),
            tenant=self.job.tenant,
            buffers=self.job.buffers,
            query=query,
            mode=mode,
            top_k=top_k,
        )
        self.seen.update(h.chunk_id for h in hits)
        return [
            {
                "chunk_id": h.chunk_id,
                "buffer": h.buffer,
                "path": h.path,
                "start_line": h.start_line,
                "end_line": h.end_line,
                "score": h.score,
                "text": h.text,
            }
            for h in hits
        ]

    def llm_query(self, prompt: str, text: str = "") -> str:
        """One sub-model call (a chord of one): the model's reply."""
        return self.llm_query_batched([[prompt, text]])[0]

    def llm_query_batched(self, prompts: list[Any]) -> list[str]:
        """Sub-model calls run at once across the workers, as one chord; replies in the order asked."""
        if not isinstance(prompts, list) or not prompts:
            raise CallError("llm_query_batched() takes a non-empty list of prompts (str, or [prompt, text] pairs)")
        if len(prompts) > MAX_SUBCALLS_PER_BATCH:
            raise CallError(f"at most {MAX_SUBCALLS_PER_BATCH} prompts per llm_query_batched() call")
        calls = [_subcall(p, i) for i, p in enumerate(prompts)]
        chord_no = next(self._chords)
        subcalls.launch(self.conn, self.job, chord_no, calls)
        self.sub_calls += len(calls)
        return subcalls.wait(
            self.job.id, chord_no, len(calls), should_stop=self.should_stop, timeout=SUBCALL_WAIT_SECONDS
        )

    def rlm_query(self, question: str) -> str:
        """One question answered by a child job: the whole pipeline (plan, search, analysts, report)."""
        return self.rlm_query_batched([question])[0]

    def rlm_query_batched(self, questions: list[Any]) -> list[str]:
        """Questions answered by child jobs run at once, one level down the tree, over the same buffers and on the
        tree's budget; each reply is the child's report, and the chunks of its sources become citable here."""
        if not isinstance(questions, list) or not questions:
            raise CallError("rlm_query_batched() takes a non-empty list of questions (str)")
        if len(questions) > MAX_CHILDREN_PER_BATCH:
            raise CallError(f"at most {MAX_CHILDREN_PER_BATCH} questions per rlm_query_batched() call")
        for i, q in enumerate(questions):
            if not isinstance(q, str) or not q.strip() or len(q.encode()) > MAX_QUERY_BYTES or "\x00" in q:
                raise CallError(f"question {i}: give a non-empty str of at most {MAX_QUERY_BYTES} bytes, without NUL")
        limit = self.settings.code_child_waits
        with tree.child_wait_claim(self.job.id, limit) as renew:
            if renew is None:
                raise CallError(
                    f"{limit} programs wait on child jobs already, the most at once (RLM_CODE_CHILD_WAITS): "
                    "answer without them, or ask again in a later round"
                )
            ids = tree.start_program_children(self.conn, self.job, questions)
            done = tree.wait_children(
                self.conn, ids, should_stop=self.should_stop, timeout=CHILD_WAIT_SECONDS, on_tick=renew
            )
        return [self._child_reply(kid, done.get(kid)) for kid in ids]

    def _child_reply(self, kid: str, child: JobRow | None) -> str:
        if child is None or not child.terminal:
            return f"[child job {kid} has not ended after {CHILD_WAIT_SECONDS:.0f} s; ask again later for its answer]"
        if child.status != JobStatus.done or child.result is None:
            why = child.error.message if child.error else child.status
            return f"[child job {kid} {child.status}: {why[:300]}]"
        cited = [s.chunk_id for s in child.result.sources]
        self.seen.update(cited)
        ids = ", ".join(str(c) for c in cited) or "none"
        return f"{child.result.response}\n\n[child job {kid}; its sources: {ids}]"

    def _texts(
        self, names: list[str], too_much: str, *, path: str | None = None
    ) -> Generator[tuple[int, str, str, int, str], None, None]:
        """(chunk id, buffer, path, start line, text) of the buffers' chunks (one file's, with ``path``) in reading
        order; past ``MAX_CHUNKS_CHARS`` characters, ``too_much`` as a ``CallError``: the worker's time is the job's
        too, so one call reads a bounded amount.  Close it (``contextlib.closing``) to end the cursor at once."""
        rows = require_buffers(self.conn, tenant=self.job.tenant, names=names)
        size = 0
        texts = iter_chunk_texts(self.conn, buffer_ids=[r.id for r in rows])
        try:
            for row in texts:
                if path is not None and row[2] != path:
                    continue
                size += len(row[4])
                if size > MAX_CHUNKS_CHARS:
                    raise CallError(too_much)
                yield row
        finally:
            texts.close()

    def _buffers(self, buffer: str | None) -> list[str]:
        _optional_str(buffer, "buffer")
        if buffer is None:
            return list(self.job.buffers)
        if buffer not in self.job.buffers:
            raise CallError(f"buffer {buffer!r} is not one this query reads ({', '.join(self.job.buffers)})")
        return [buffer]


def _subcall(item: Any, i: int) -> subcalls.SubCall:
    prompt, text = (
        (item, "") if isinstance(item, str) else (item if isinstance(item, list) and len(item) == 2 else (None, None))
    )
    if not isinstance(prompt, str) or not isinstance(text, str) or not prompt.strip():
        raise CallError(f"prompt {i}: give a non-empty str, or a [prompt, text] pair of str")
    if len(prompt) + len(text) > MAX_SUBCALL_CHARS:
        raise CallError(
            f"prompt {i}: prompt and text hold {len(prompt) + len(text)} characters; at most {MAX_SUBCALL_CHARS}"
        )
    if "\x00" in prompt or "\x00" in text:
        raise CallError(f"prompt {i}: contains a NUL character")
    return subcalls.SubCall(prompt=prompt, text=text)


def _optional_str(value: Any, name: str) -> None:
    if value is not None and not isinstance(value, str):
        raise CallError(f"{name} must be a str")


def _bounded_int(value: Any, name: str, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise CallError(f"{name} must be an integer from {low} to {high}")
