"""The typed shapes of the job tables' JSON columns (``jobs``, ``job_batches``).

A row is validated when read (``JobRow`` holds these models, not dicts) and a value when written (the store
functions take a model, or a mapping they validate, and store ``stored()``), so a misspelt key or a wrong type
is refused where it is written, not found later by whoever reads the job.

Rows stored before a field existed still read: every field has a default.  ``stored()`` dumps only the keys
that were given (``exclude_unset``), so what a column holds, and what the API prints of it, keeps the shape it
had when it was a dict.  ``result`` is a ``QueryResult`` (models.py), the one shape the API and CLI print.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from ..models import QueryOptions


class StoredModel(BaseModel):
    """A JSON column's value: ``stored()`` is what is written."""

    def stored(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_unset=True)


M = TypeVar("M", bound=BaseModel)


def checked(model: type[M], value: M | Mapping[str, Any]) -> M:
    """``value`` as ``model``: a model passes as it is (it was validated when built), a mapping is validated."""
    return value if isinstance(value, model) else model.model_validate(value)


class JobOptions(QueryOptions):
    """The query's options as kept on the job (``QueryOptions.stored()``)."""

    # "ignore": a knob a later version dropped must not make an old job unreadable; what is known stays checked
    model_config = ConfigDict(extra="ignore")


class JobError(StoredModel):
    """How a job, batch or upload ended in error (``errors.error_record``): never a traceback."""

    # "allow": an error record carries what its kind knows (a budget error its limit), kept as it was written
    model_config = ConfigDict(extra="allow")

    type: str = "error"
    message: str = ""
    #: the same message in an HTTP client's words (a hint naming a CLI command says the HTTP way instead)
    api_message: str | None = None
    #: a budget error: the limit that was spent (max_llm_calls, max_tokens, max_cost, deadline)
    reason: str | None = None
    #: a budget error: how many attempts the batch's call made before the limit stopped it (absent: it never ran)
    sent: str | None = None

    @property
    def shown(self) -> str:
        """The message an HTTP client is shown."""
        return self.api_message or self.message


class JobPlan(StoredModel):
    """The planner's plan as it wrote it: the ``AnalysisPlan`` knobs, its route and why."""

    # "allow": the plan is kept as the planner wrote it (docs/contract.md#plan-validation), knobs and all
    model_config = ConfigDict(extra="allow")

    route: str | None = None
    route_reason: str | None = None


class JobParams(StoredModel):
    """The parameters the search resolved (``ResolvedParams``) and the caps that cut them."""

    # "allow": the resolved knobs are written by pipeline/params.py and printed as they are (``rlm query --debug``)
    model_config = ConfigDict(extra="allow")

    focus_topics: list[str] = Field(default_factory=list)
    #: how many of the job's analysts may call the model at once (None: the worker's own limit)
    concurrency: int | None = None


#: the kind of a child a code-mode program asked for (``rlm_query``): it answers as a query of its own
PROGRAM_CHILD = "program"


class JobSpec(StoredModel):
    """A job's task: a child's (``follow_up``, ``subset``, ``program``), a session turn's (``session``), a shared
    read's group."""

    # "allow": a spec is the task as its writer gave it; a key of an older version is kept as it was
    model_config = ConfigDict(extra="allow")

    kind: str | None = None
    #: a subset child reads exactly these chunks…
    chunk_ids: list[int] | None = None
    #: …or what its own search for this finds
    search: str | None = None
    #: a session turn: the standalone question its query became, and how (none, rules, model)
    question: str | None = None
    #: the shared-read group whose reads the job waits for (docs/contract.md#shared-reads)
    read_group: str | None = None
    #: a session turn (docs/contract.md#sessions): its session, number, words as asked, how they were rewritten…
    session_id: str | None = None
    turn: int | None = None
    asked: str | None = None
    rewrite: str | None = None
    #: …the earlier turns it carries (a prompt section) and how many were left out for length…
    history: list[dict[str, Any]] = Field(default_factory=list)
    history_omitted: int = 0
    #: …and the chunks earlier answers cited, carried forward as evidence
    evidence_chunk_ids: list[int] = Field(default_factory=list)


class Collected(StoredModel):
    """What Collect kept (``collect.CollectedFinding`` rows), how many it dropped, and each chunk's typed records."""

    # "allow": nothing else is written today; a later key must not make an old job unreadable, nor be lost
    model_config = ConfigDict(extra="allow")

    kept: list[dict[str, Any]] = Field(default_factory=list)
    filtered: int = 0
    #: chunk id (as a JSON key) → the records its analyst counted
    records: dict[str, list[dict[str, Any]]] = Field(default_factory=dict)
    #: code mode: the ids of every chunk its programs were handed (what it read)
    read: list[int] = Field(default_factory=list)


class SynthState(StoredModel):
    """A synthesis paused on query_subset children: its conversation and the calls it waits for."""

    # "allow": the conversation is the provider's message dicts; nothing else is expected, nothing is dropped
    model_config = ConfigDict(extra="allow")

    messages: list[dict[str, Any]] = Field(default_factory=list)
    turn: int = 0
    tool_log: list[dict[str, Any]] = Field(default_factory=list)
    #: tool call id → the child job answering it
    pending: dict[str, str] = Field(default_factory=dict)
    reasks: int = 0


class CheckRecord(StoredModel):
    """One round's completeness verdict (thinking mode), as the checker gave it (``check.CheckVerdict``)."""

    # "allow": a verdict is kept as the checker's reply was read; a key of an older reader stays on record
    model_config = ConfigDict(extra="allow")

    round: int | None = None
    complete: bool | None = None
    confidence: float | None = None
    gaps: list[str] = Field(default_factory=list)
    follow_ups: list[str] = Field(default_factory=list)


#: seconds per stage (``jobs.timings``)
TIMINGS = TypeAdapter(dict[str, float])
