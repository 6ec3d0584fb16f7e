"""Route: which shape a job runs — one direct call, a fan-out over searched chunks, or one over every chunk.

``--mode`` says how deep the user wants to go; the route is what ran (docs/contract.md#modes).  ``instant``
is always direct.  ``auto`` takes the planner's word where it gave one, else rules: an aggregation question
("how many", "list all", "every", "count"…) over buffers that hold records to count (log lines, JSON lines,
tables: ``records.totals.holds_records`` on a sample) needs every chunk, so it goes exhaustive; the same words over
source code or prose are searched like any question ("how often does the beat wake up" asks about a behaviour,
and is no aggregation at all); otherwise fan-out, and
a fan-out whose selected chunks fit the direct context (``RLM_DIRECT_MAX_TOKENS``, 16K by default: the
crossover of the Oracle design) is answered by one direct call instead.  ``thinking`` always fans out: its
completeness check needs findings.  Children of a tree fan out over what their parent gave them.
The reason for every choice is kept on the job (``--verbose`` prints it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..llm.tokens import CHARS_PER_TOKEN
from ..models import Mode, QueryOptions, Route, Scope
from ..records.totals import aggregation_reason
from ..store.job_state import JobPlan, checked

if TYPE_CHECKING:
    from ..config import Settings

#: a chunk's block in a prompt carries a heading and a source line besides its text
BLOCK_OVERHEAD_CHARS = 120
#: the direct answer's output allowance at most (less under a small RLM_MODEL_CONTEXT: ``direct_answer_tokens``)
DIRECT_MAX_TOKENS = 4096
#: the direct context of ``instant`` when RLM_DIRECT_MAX_TOKENS is 0 (auto never goes direct then)
INSTANT_TOKENS = 16_000


@dataclass(frozen=True)
class Routing:
    route: Route
    reason: str
    #: a fan-out that may still become direct once the selected chunks are known to fit
    may_go_direct: bool = False


def block_tokens(size: int) -> int:
    """Tokens of one chunk's prompt block, estimated from its characters (docs/contract.md#modes)."""
    return -(-(size + BLOCK_OVERHEAD_CHARS) // CHARS_PER_TOKEN)


def estimated_tokens(sizes: list[int]) -> int:
    return sum(block_tokens(s) for s in sizes)


#: a direct prompt's tokens besides its chunks: the system prompt, the query, headings and the closing line
DIRECT_FRAME_TOKENS = 1024
#: the chunks of a direct prompt never get less than this, however small RLM_MODEL_CONTEXT is
MIN_DIRECT_TOKENS = 256


def direct_answer_tokens(settings: Settings) -> int:
    """The direct answer's output allowance: 4,096 tokens, or a quarter of RLM_MODEL_CONTEXT when that is less."""
    if settings.model_context:
        return max(128, min(DIRECT_MAX_TOKENS, settings.model_context // 4))
    return DIRECT_MAX_TOKENS


def context_room(settings: Settings) -> int | None:
    """Tokens of chunks a direct prompt may carry within RLM_MODEL_CONTEXT (None: no model context set): the
    window less the answer's allowance and the prompt's frame, so a small model gets a small prompt."""
    if not settings.model_context:
        return None
    room = settings.model_context - direct_answer_tokens(settings) - DIRECT_FRAME_TOKENS
    return max(MIN_DIRECT_TOKENS, room)


#: an analyst's reply per chunk at most: a grade, a few quoted findings, a summary; a small model's context gets less
ANALYST_TOKENS_PER_CHUNK = 1024
#: an analyst prompt's tokens besides its chunks: the system prompt, the query, the reply instruction
ANALYST_FRAME_TOKENS = 1024


def analyst_reply_tokens(chunks: int, settings: Settings, *, records: bool = False) -> int:
    """What an analyst's reply over ``chunks`` chunks may need, and so its allowance (``max_tokens``): an entry per
    chunk, not the thousands of tokens a rambling model would write; twice that where records are counted."""
    per_chunk = ANALYST_TOKENS_PER_CHUNK
    if settings.model_context:
        per_chunk = max(96, min(per_chunk, settings.model_context // 32))
    return (per_chunk * (2 if records else 1)) * max(1, chunks) + 64


def analyst_batch_tokens(batch_size: int, settings: Settings, *, records: bool = False) -> int | None:
    """Tokens of chunks one analyst prompt may carry within RLM_MODEL_CONTEXT (None: no model context set), so that
    a batch of big chunks is cut smaller rather than overflowing a small model's context."""
    if not settings.model_context:
        return None
    room = settings.model_context - analyst_reply_tokens(batch_size, settings, records=records) - ANALYST_FRAME_TOKENS
    return max(MIN_DIRECT_TOKENS, room)


def direct_budget(settings: Settings) -> int:
    """The chunks' tokens of a direct prompt (instant's, or auto's direct route)."""
    budget = settings.direct_max_tokens or INSTANT_TOKENS
    room = context_room(settings)
    return min(budget, room) if room is not None else budget


def direct_limit(settings: Settings) -> int:
    """auto's crossover: RLM_DIRECT_MAX_TOKENS held to the model's context; 0 when direct routing is off."""
    return direct_budget(settings) if settings.direct_max_tokens else 0


def first_routing(
    opts: QueryOptions,
    plan: JobPlan | Mapping[str, Any] | None,
    query: str,
    *,
    is_child: bool,
    has_records: Callable[[], bool] = lambda: True,
) -> Routing:
    """The route before the search: everything but the fit of the selected chunks.  ``has_records`` says whether
    the buffers hold records to count; it reads a sample of them, so it is asked only of an aggregation question."""
    mode = Mode(opts.mode or Mode.auto)
    if is_child:
        return Routing(Route.fanout, "a child job: its own plan, search and fan-out")
    if mode == Mode.instant:
        return Routing(Route.direct, "--mode instant: one call over the best chunks that fit")
    if opts.scope == Scope.all:
        return Routing(Route.exhaustive, "--scope all: every chunk is analysed")
    given = checked(JobPlan, plan) if plan else None
    planned, why = (given.route, given.route_reason or "") if given else (None, "")
    may_widen = opts.scope != Scope.search
    if planned == Route.exhaustive and may_widen:
        # reads more, never less: kept without the records sample (it costs calls, it loses no evidence)
        return Routing(Route.exhaustive, f"the planner: {why or 'the question needs every chunk'}")
    searched = ""
    if may_widen and (phrase := aggregation_reason(query)):
        # the question's kind beats the planner's route: a small planner gave every question the same
        # direct plan, "how many" included (docs/contract.md#plan-validation)
        if has_records():
            overruled = f"the planner chose {planned!r}, corrected: " if planned else ""
            return Routing(
                Route.exhaustive, f"{overruled}an aggregation question ({phrase!r}): every chunk is analysed"
            )
        planned = None
        searched = (
            f"an aggregation question ({phrase!r}), but the buffers hold no records to count (code or prose): "
            "searched like any question; --scope all reads every chunk"
        )
    if mode == Mode.thinking:
        return Routing(Route.fanout, "--mode thinking: fan-out rounds with a completeness check")
    if opts.batch_size is not None or opts.num_agents is not None:
        return Routing(Route.fanout, "--batch-size/--num-agents ask for a fan-out")
    if planned == Route.direct:
        return Routing(Route.fanout, f"the planner: {why or 'a small context'}", may_go_direct=True)
    return Routing(
        Route.fanout, "the planner" if planned == Route.fanout else searched or "default", may_go_direct=True
    )


#: plan fields that cap how many chunks are read: not for a question whose answer needs every match
READ_CAPS = ("max_chunks", "top_k")


def checked_plan(plan: dict[str, Any] | None, query: str, default_threshold: float) -> tuple[dict[str, Any], list[str]]:
    """The plan held to the question's kind, and what was corrected (said on the job's ``route_reason``).

    A counting or listing-all question ("how many", "list all"…) needs every chunk that matches: the planner's
    cap on how many are read (``max_chunks``, ``top_k``) and a similarity threshold above the configured one
    are dropped, so the search finds them all; the route is checked by ``first_routing``.  Any other plan is
    returned as it is (docs/contract.md#plan-validation)."""
    out = dict(plan or {})
    phrase = aggregation_reason(query)
    if not phrase:
        return out, []
    dropped = [f"{k}={out.pop(k)}" for k in READ_CAPS if k in out]
    if isinstance(out.get("threshold"), int | float) and out["threshold"] > default_threshold:
        dropped.append(f"threshold={out.pop('threshold')}")
    if not dropped:
        return out, []
    return out, [f"the planner's {', '.join(dropped)} dropped: an aggregation question ({phrase!r}) needs every match"]


def final_routing(first: Routing, sizes: list[int], settings: Settings) -> Routing:
    """A fan-out whose selected chunks fit the direct context is answered by one call."""
    if not first.may_go_direct:
        return first
    limit = direct_limit(settings)
    tokens = estimated_tokens(sizes)
    if limit and tokens <= limit:
        return Routing(
            Route.direct,
            f"{first.reason}; {len(sizes)} selected chunks (~{tokens} tokens) fit the {limit}-token context",
        )
    if limit:
        return Routing(Route.fanout, f"{first.reason}; {len(sizes)} selected chunks (~{tokens} tokens) exceed {limit}")
    return Routing(Route.fanout, f"{first.reason}; direct routing off (RLM_DIRECT_MAX_TOKENS=0)")
