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

from pydantic import ConfigDict

from ..models import ChunkId, Location


class ChunkForPrompt(Location, ChunkId):
    """A chunk as a prompt shows it: its id, where it comes from (a converted document's pages and section
    included) and its text."""

    model_config = ConfigDict(frozen=True)

    text: str

    @classmethod
    def of(cls, row: Any) -> ChunkForPrompt:
        """From a stored chunk (``store.buffers.ChunkRow``, not named: that would close an import circle)."""
        return cls(chunk_id=row.id, text=row.text, **row.location())


@dataclass(frozen=True)
class Question:
    """One question of a read; a shared read (docs/contract.md#shared-reads) numbers them from 1."""

    query: str
    focus_topics: tuple[str, ...] = ()
    records_wanted: bool = False


class ShownFinding(Location, ChunkId):
    """A collected finding as the synthesizer and the completeness check are shown it."""

    model_config = ConfigDict(frozen=True)

    relevance: str
    summary: str = ""
    findings: tuple[str, ...] = ()
    follow_up: tuple[str, ...] = ()

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
            heading_path=list(kept.get("heading_path") or ()),
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
