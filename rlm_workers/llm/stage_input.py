"""What a stage put in its prompt, as data: ``CompletionRequest.stage_input``.

Each stage builds one of these records from the values it has (the question, the chunks, the findings) and
renders its prompt from it; the same record travels with the request.  A model reads the prompt; the offline
extractive provider reads the record, so a change to a prompt's wording or layout cannot change what the
offline provider understood it to ask.  The record is never sent to a server nor logged as prompt text.

The text fields hold the values themselves, not their fenced or quoted form in the prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ChunkForPrompt:
    """A chunk as a prompt shows it: its id, where it comes from and its text."""

    chunk_id: int
    buffer: str
    path: str
    start_line: int
    end_line: int
    text: str
    #: a converted document's pages and section (provenance.cite); None / () for plain text and code
    page_start: int | None = None
    page_end: int | None = None
    heading_path: tuple[str, ...] = ()

    @classmethod
    def of(cls, row: Any) -> ChunkForPrompt:
        """From a stored chunk (``store.buffers.ChunkRow``), its place in the document included."""
        return cls(
            chunk_id=row.id,
            buffer=row.buffer,
            path=row.path,
            start_line=row.start_line,
            end_line=row.end_line,
            text=row.text,
            page_start=row.page_start,
            page_end=row.page_end,
            heading_path=tuple(row.heading_path),
        )


@dataclass(frozen=True)
class Question:
    """One question of a read; a shared read (docs/contract.md#shared-reads) numbers them from 1."""

    query: str
    focus_topics: tuple[str, ...] = ()
    records_wanted: bool = False


@dataclass(frozen=True)
class ShownFinding:
    """A collected finding as the synthesizer and the completeness check are shown it."""

    chunk_id: int
    buffer: str
    path: str
    start_line: int
    end_line: int
    relevance: str
    summary: str = ""
    findings: tuple[str, ...] = ()
    follow_up: tuple[str, ...] = ()
    page_start: int | None = None
    page_end: int | None = None
    heading_path: tuple[str, ...] = ()

    @classmethod
    def of(cls, kept: Mapping[str, Any]) -> ShownFinding:
        """From a finding as Collect keeps it (``collected.kept``, a plain dict)."""
        return cls(
            chunk_id=kept["chunk_id"],
            buffer=kept["buffer"],
            path=kept["path"],
            start_line=kept["start_line"],
            end_line=kept["end_line"],
            relevance=kept["relevance"],
            summary=kept.get("summary") or "",
            findings=tuple(kept.get("findings") or ()),
            follow_up=tuple(kept.get("follow_up") or ()),
            # findings collected before documents had pages have no such keys
            page_start=kept.get("page_start"),
            page_end=kept.get("page_end"),
            heading_path=tuple(kept.get("heading_path") or ()),
        )


@dataclass(frozen=True)
class PlanInput:
    """The planner's: the question and the size of what it will search."""

    query: str
    chunk_count: int
    byte_size: int
    buffers: tuple[str, ...]


@dataclass(frozen=True)
class ReadInput:
    """An analyst's read of a chunk batch: one question, or several when ``shared`` (their numbers are their
    places here, from 1)."""

    chunks: tuple[ChunkForPrompt, ...]
    questions: tuple[Question, ...]
    shared: bool = False


@dataclass(frozen=True)
class FindingsInput:
    """The synthesizer's and the completeness check's: the question, the findings shown (collect order, as many
    as fit), how many were left out for length, and (the check only) the follow-ups asked already."""

    query: str
    findings: tuple[ShownFinding, ...]
    omitted: int = 0
    asked: tuple[str, ...] = ()


@dataclass(frozen=True)
class DirectInput:
    """The direct answer's: the question and the chunks shown, in rank order; ``records_wanted``: exact totals of
    the records they show are asked for too."""

    query: str
    chunks: tuple[ChunkForPrompt, ...]
    records_wanted: bool = False


StageInput = PlanInput | ReadInput | FindingsInput | DirectInput
