"""Code mode's stage (docs/contract.md#code-mode, docs/architecture.md#code-mode): the model programs its own reading.

Each round the root model (``RLM_PRIMARY_MODEL``) is shown the question, the buffers' outline and what its last
program printed, and writes a Python program; the sandbox (``sandbox/runner.py``) runs it with the functions of
``program_api.py``, whose ``llm_query_batched`` fans sub-model calls out as a chord.  The rounds end when a
program calls ``final(answer, citations)``, the rounds run out (``RLM_CODE_MAX_ROUNDS``: the job fails, its
rounds kept), the budget is spent (the job ends with what the last round printed, said so) or the job is
cancelled (the sandbox is killed).

The stage holds the job's lease for its whole life and its task runs on the control queue, so a chord it waits
on never needs the slot it holds.  A sandbox cannot outlive its worker: a stage sent again after a worker died
starts the program over, from round 1.
"""

from __future__ import annotations

import ast
import logging
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import BudgetExhausted, ContextExceeded, JobCancelled, RLMError
from ..limits import MAX_CODE_OUTPUT_CHARS
from ..llm.protocol import CompletionRequest
from ..llm.replies import cited_chunk_ids
from ..llm.stage_input import ChunkForPrompt
from ..llm.structured import CitedAnswer, render_cited
from ..models import CodeRound, Stage
from ..runtime.resources import provider
from ..sandbox.runner import RoundResult, Sandbox
from ..store import code as code_store
from ..store import jobs as job_store
from ..store.buffers import get_chunks
from ..store.db import durable_write
from ..store.job_state import Collected
from .calls import call_llm
from .flow import OK, StageContext, StageLease, StageTimer, fail_job
from .program_api import ProgramApi
from .prompts import content_block, escape_content, load_prompt, quote_field, system_message
from .report import cited_entry, result_for, store_report
from .tools import as_chunk_id

if TYPE_CHECKING:
    import psycopg

    from ..config import Settings
    from ..store.jobs import JobRow

log = logging.getLogger("rlm.pipeline.program")

#: tokens the root model may write a round: a program, not an essay (a small model that runs on writes the
#: same lines again until it is cut, at a minute a thousand tokens on two cores)
CODE_MAX_TOKENS = 1024
#: characters of an older round's output kept in the conversation; the last round's is shown whole
OLD_OUTPUT_CHARS = 1500
#: files the first message lists per buffer (outline() gives them all)
SHOWN_FILES = 40
#: round 0, the stage's own program (no model call): the files and their first lines.  The model starts from a
#: conversation that already calls the API on its data, which a small model follows instead of writing its own
#: ``read()``, and writes its first filter against how the lines really look
LOOK_PROGRAM = """\
files = [(b["name"], f["path"]) for b in outline()["buffers"] for f in b["files"]]
print(len(files), "files")
for buffer, path in files[:3]:
    print(f"--- {path} ({buffer}), lines 1-8:")
    print(read(path, 1, 8, buffer=buffer))"""
#: characters of round 0's output the model is shown: eight lines of a minified file can be one long line
LOOK_OUTPUT_CHARS = 4000
#: a round message's words around its output, and each message's own overhead, in tokens
_ROUND_FRAME_TOKENS = 200
_MESSAGE_TOKENS = 4
#: the least of a round's output the model is shown, however small its context
_MIN_OUTPUT_TOKENS = 100
#: characters a token of a round's output: the data it quotes tokenizes denser than prose (llm/tokens.py's 4)
_DATA_CHARS_PER_TOKEN = 3
#: the temperature of the ask after a repeated program: at 0 a small model that ignored the note writes it again
REPEAT_TEMPERATURE = 0.7
#: asks of one round's reply, each smaller, when the server says the conversation is over its context
_FIT_ATTEMPTS = 4
#: what cutting the newest message keeps of its end: the round's error, the question, the rounds left
_KEPT_TAIL_CHARS = 600
#: how often a running round asks whether the job was cancelled
_STOP_CHECK_SECONDS = 1.0
_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)


def extract_program(reply: str) -> str | None:
    """The program a reply holds: its fenced Python blocks, joined (a block the reply's length limit cut ends
    where the reply does), or the whole reply when it parses as Python and does something; None when there is
    none."""
    blocks = [b.strip("\n") for b in _FENCE.findall(reply or "") if b.strip()]
    if blocks:
        return "\n\n".join(blocks)
    text = (reply or "").strip()
    if not text:
        return None
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    # a bare name or a sentence that happens to parse is not a program
    return text if any(not isinstance(n, ast.Expr) or isinstance(n.value, ast.Call) for n in tree.body) else None


class _StopCheck:
    """Whether the job has ended (cancelled, or ended elsewhere), asked at most once a second."""

    def __init__(self, conn: psycopg.Connection, job_id: str) -> None:
        self.conn, self.job_id = conn, job_id
        self.stopped = False
        self._next = 0.0

    def __call__(self) -> bool:
        now = time.monotonic()
        if not self.stopped and now >= self._next:
            self._next = now + _STOP_CHECK_SECONDS
            self.stopped = not job_store.is_open(self.conn, job_id=self.job_id)
        return self.stopped


def system_prompt(settings: Settings, *, children: bool) -> str:
    """The root model's instructions; where the query allows child jobs, with the functions that start them."""
    prompt = load_prompt("code", prompt_dir=settings.prompt_dir)
    if children:
        prompt += "\n\n" + load_prompt("code_children", prompt_dir=settings.prompt_dir)
    return prompt


def first_message(job: JobRow, outline: dict[str, Any], max_rounds: int) -> str:
    """The question and the buffers' files (names quoted: they are the uploader's)."""
    lines = []
    for b in outline["buffers"]:
        lines.append(
            f"- buffer {quote_field(b['name'])}: {b['file_count']} files, {b['chunk_count']} chunks, {b['bytes']} bytes"
        )
        lines += [
            f"  - {quote_field(f['path'])} ({f['bytes']} bytes, {f['chunks']} chunks)" for f in b["files"][:SHOWN_FILES]
        ]
        if b["file_count"] > SHOWN_FILES:
            lines.append(f"  - … {b['file_count'] - SHOWN_FILES} more: outline() lists them")
    return (
        f"## Question\n\n{escape_content(job.query)}\n\n## Buffers\n\n"
        + "\n".join(lines)
        + f"\n\n## Reply\n\nWrite the first program: one ```python block. You have {max_rounds} rounds; "
        "call final(answer, citations) as soon as the output shows the answer."
    )


def keep_api(program: str, names: set[str]) -> tuple[str, list[str]]:
    """The program to run, without its own top-level definitions of the API's names (a small model writes its own
    ``read()``, ``final()``… with ``open()`` and placeholders, which would shadow the real ones), and those names.
    A program that does not parse is run as written, for its error."""
    try:
        tree = ast.parse(program)
    except SyntaxError:
        return program, []
    dropped: set[str] = set()
    kept = []
    for node in tree.body:
        own = _defined_names(node)
        if own and own <= names:
            dropped |= own
            continue
        kept.append(node)
    if not dropped:
        return program, []
    tree.body = kept
    return ast.unparse(tree), sorted(dropped)


def _defined_names(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    return set()


def round_message(
    result: RoundResult,
    number: int,
    left: int,
    *,
    question: str,
    max_output_chars: int | None = None,
    redefined: Sequence[str] = (),
) -> str:
    """What the model is shown of a round: its output (at most ``max_output_chars``, the cut said), its error,
    what it did wrong that raised no error (``redefined`` the API), and the question again, which a small model
    loses after a few rounds of output."""
    shown = result.output[:max_output_chars] if max_output_chars is not None else result.output
    nothing = "(nothing printed: print() what you need to see)"
    parts = [f"## Round {number} output\n\n{content_block(shown) if shown else nothing}"]
    if redefined:
        listed = ", ".join(f"{n}()" for n in redefined)
        parts.append(
            f"Your program wrote its own {listed}. They already exist and read the real data: call them, never "
            "define them. Your definitions were left out and the rest of the program ran with the real ones."
        )
    if result.output_chars > len(shown):
        parts.append(f"[output cut: {len(shown)} of {result.output_chars} characters shown]")
    if result.error:
        parts.append(f"## Error\n\n{content_block(result.error)}")
    if result.ended:
        parts.append("The sandbox was restarted: variables from earlier rounds are gone.")
    return "\n\n".join([*parts, _closing(question, left)])


def repeat_note(number: int, first: int, left: int, question: str) -> str:
    """What replaces a round that ran an earlier round's program again and printed the same."""
    return (
        f"## Round {number}\n\nRound {number} wrote the program of round {first} again and it printed the same, "
        "so it is left out here. Write a different program: one that computes the answer from what you have seen, "
        f"or call final(answer, citations).\n\n{_closing(question, left)}"
    )


def _closing(question: str, left: int) -> str:
    """How every message after a round ends: the question again, and the rounds left."""
    if left == 1:
        then = "This is your last round: call final(answer, citations) with the best answer you have."
    else:
        then = f"{left} rounds left. Write the next program, or call final(answer, citations)."
    return f"The question: {escape_content(question)}\n\n{then}"


def reply_tokens(settings: Settings) -> int:
    """What a round's reply may take: a program, within a quarter of a small model's context."""
    return min(CODE_MAX_TOKENS, settings.model_context // 4) if settings.model_context else CODE_MAX_TOKENS


def _conversation_tokens(messages: list[dict[str, Any]]) -> int:
    # output quotes data (times, ids, numbers), which tokenizes denser than prose: counted at 3 characters a token
    return sum(len(m["content"]) // _DATA_CHARS_PER_TOKEN + _MESSAGE_TOKENS for m in messages)


def _ask(
    conn: psycopg.Connection, job_id: str, settings: Settings, messages: list[dict[str, Any]], temperature: float
) -> str:
    """The root model's reply to the conversation; a server that finds it longer than its context has it made
    smaller (``shrink``) and asked again, a few times, instead of failing the job."""
    for attempt in range(_FIT_ATTEMPTS):
        request = CompletionRequest(
            role="code",
            model=settings.primary_model,
            messages=messages,
            max_tokens=reply_tokens(settings),
            temperature=temperature,
        )
        try:
            return call_llm(conn, job_id=job_id, stage="code", request=request).text
        except ContextExceeded:
            if attempt == _FIT_ATTEMPTS - 1 or not shrink(messages):
                raise
            log.info("job %s: the conversation was over the model's context; asking again smaller", job_id)
    raise AssertionError("unreachable")


def shrink(messages: list[dict[str, Any]]) -> bool:
    """Make the conversation smaller: drop the oldest round, or, with none left to drop, cut the newest message
    to half, keeping its end (the question and what to do next).  False when there is nothing left to cut."""
    if _drop_oldest_round(messages):
        return True
    last = messages[-1]
    text = last["content"]
    if len(messages) < 3 or len(text) < 2 * _KEPT_TAIL_CHARS:
        return False
    head = text[: max(0, len(text) // 2 - _KEPT_TAIL_CHARS)]
    last["content"] = f"{head}\n[…cut to fit the model's context]\n{text[-_KEPT_TAIL_CHARS:]}"
    return True


def _drop_oldest_round(messages: list[dict[str, Any]], keep: int = 2) -> bool:
    """Drop the oldest round (its program and what it printed) when more than ``keep`` messages follow the system
    prompt and the question; whether one was dropped."""
    if len(messages) - 2 <= keep:
        return False
    del messages[2:4]
    return True


def output_room(messages: list[dict[str, Any]], settings: Settings) -> int:
    """Characters of the newest round's output the model can be shown, after making room: older rounds' outputs
    are cut to ``OLD_OUTPUT_CHARS`` and, under a small context (``RLM_MODEL_CONTEXT``), the oldest rounds are
    dropped, their programs with them (``messages`` ends with the reply of the round being shown)."""
    for m in messages[2:]:
        if m["role"] == "user" and len(m["content"]) > OLD_OUTPUT_CHARS:
            m["content"] = m["content"][:OLD_OUTPUT_CHARS] + "\n[…older output cut]"
    if not settings.model_context:
        return MAX_CODE_OUTPUT_CHARS
    limit = settings.model_context - reply_tokens(settings) - _ROUND_FRAME_TOKENS
    while _conversation_tokens(messages) > limit - _MIN_OUTPUT_TOKENS and _drop_oldest_round(messages, keep=1):
        pass
    room = (limit - _conversation_tokens(messages)) * _DATA_CHARS_PER_TOKEN
    return max(_MIN_OUTPUT_TOKENS * _DATA_CHARS_PER_TOKEN, min(MAX_CODE_OUTPUT_CHARS, room))


def run(ctx: StageContext) -> str:
    conn, settings = ctx.conn, ctx.settings
    if provider().name == "extractive":
        raise RLMError(
            "mode code needs a model that writes programs, and none is configured (the offline provider answers "
            "by rules): set OPENAI_API_KEY or OPENAI_BASE_URL, or RLM_LOCAL_LLM (docs/contract.md#providers)"
        )
    with StageLease(conn, ctx.job.id, settings) as lease:
        if not lease.acquired:
            return "running elsewhere"
        job = job_store.get_job(conn, job_id=ctx.job.id)
        if job is None or job.terminal:
            return "skipped"
        with StageTimer(conn, job.id, Stage.code):
            return _rounds(conn, job, settings, lease)


def _rounds(conn: psycopg.Connection, job: JobRow, settings: Settings, lease: StageLease) -> str:
    code_store.clear_rounds(conn, job_id=job.id)  # a sandbox cannot be resumed: a new delivery starts over
    stop = _StopCheck(conn, job.id)
    api = ProgramApi(conn, job, settings, stop)
    max_rounds = settings.code_max_rounds
    messages: list[dict[str, Any]] = [
        system_message(system_prompt(settings, children=api.children_allowed)),
        {"role": "user", "content": first_message(job, api.outline(), max_rounds)},
    ]
    last: RoundResult | None = None
    spent: BudgetExhausted | None = None
    #: each program run, by its text: the round it first ran in, and what it printed and raised there
    ran: dict[str, tuple[int, str, str | None]] = {}
    repeated = False
    functions = api.functions()
    with Sandbox(functions, should_stop=stop) as box:
        try:
            look = box.run(LOOK_PROGRAM, 0)
        except JobCancelled:
            return "cancelled"
        code_store.save_round(conn, job_id=job.id, entry=_entry(0, LOOK_PROGRAM, look, 0))
        ran[LOOK_PROGRAM] = (0, look.output, look.error)  # a model that writes it again is told so, as any repeat
        messages.append({"role": "assistant", "content": f"```python\n{LOOK_PROGRAM}\n```"})
        messages.append(
            {
                "role": "user",
                "content": round_message(look, 0, max_rounds, question=job.query, max_output_chars=LOOK_OUTPUT_CHARS),
            }
        )
        for number in range(1, max_rounds + 1):
            lease.beat()
            try:
                reply = _ask(conn, job.id, settings, messages, REPEAT_TEMPERATURE if repeated else 0.0)
            except BudgetExhausted as exc:
                spent = exc
                break
            program = extract_program(reply)
            sub_before = api.sub_calls
            mine: list[str] = []
            if program is None:
                said = " ".join(reply.split())[:300]
                last = RoundResult(error=f"the reply held no program: write one ```python block (it said: {said!r})")
            else:
                runnable, mine = keep_api(program, {*functions, "final"})
                try:
                    last = box.run(runnable, number)
                except JobCancelled:
                    return "cancelled"
            code_store.save_round(
                conn, job_id=job.id, entry=_entry(number, program or "", last, api.sub_calls - sub_before)
            )
            log.info(
                "job %s: round %d: %d calls, error=%s, final=%s",
                job.id,
                number,
                last.calls,
                bool(last.error),
                bool(last.final),
            )
            if stop.stopped:
                return "cancelled"
            if last.final is not None:
                return _finish(conn, job, api, last)
            first = ran.get(program) if program else None
            if first is not None and first[1:] == (last.output, last.error):
                # the same program, printing the same: kept out of the conversation, whose last message now
                # says so, so a small model does not take its own repeat as the pattern to follow again
                messages[-1]["content"] += "\n\n" + repeat_note(number, first[0], max_rounds - number, job.query)
                repeated = True
                continue
            repeated = False
            messages.append({"role": "assistant", "content": reply})
            room = output_room(messages, settings)
            shown = round_message(
                last, number, max_rounds - number, question=job.query, max_output_chars=room, redefined=mine
            )
            if program and first is None:
                ran[program] = (number, last.output, last.error)
            messages.append({"role": "user", "content": shown})
    if spent is not None:
        said = f"\n\n```text\n{last.output}\n```" if last is not None and last.output else ""
        response = (
            f"_The budget was exhausted ({spent.reason}) before the program gave its answer; its last output:_{said}"
        )
        _store(conn, job, response, Collected(read=sorted(api.seen)))
        return OK
    error = RLMError(
        f"the program gave no answer within {max_rounds} rounds (RLM_CODE_MAX_ROUNDS); its rounds are in the report"
    )
    durable_write(
        conn,
        lambda c: fail_job(
            c,
            job_id=job.id,
            exc=error,
            result=result_for(c, job_store.reread_job(c, job_id=job.id), "", Collected(read=sorted(api.seen)), []),
        ),
        what=f"code mode's end of job {job.id}",
    )
    return "failed"


def _entry(number: int, code: str, result: RoundResult, sub_calls: int) -> CodeRound:
    return CodeRound(
        round=number,
        code=code,
        output=result.output,
        output_chars=result.output_chars,
        error=result.error,
        calls=result.calls,
        sub_calls=sub_calls,
        seconds=result.seconds,
        ended=result.ended,
    )


def _finish(conn: psycopg.Connection, job: JobRow, api: ProgramApi, last: RoundResult) -> str:
    """The report of ``final()``: the answer, its citations resolved to the chunks the program was handed."""
    assert last.final is not None
    citations = last.final.citations
    ids = [as_chunk_id(c) for c in citations]
    usable = [i for i in dict.fromkeys(ids) if i is not None and i in api.seen]
    rows = get_chunks(conn, tenant=job.tenant, chunk_ids=usable)
    shown = {cid: ChunkForPrompt.of(rows[cid]) for cid in usable if cid in rows}
    response = render_cited(CitedAnswer(answer=last.final.answer or "(empty answer)", cited_chunks=list(shown)), shown)
    if left_out := [str(c)[:40] for c, i in zip(citations, ids, strict=True) if i not in shown]:
        more = " …" if len(left_out) > 20 else ""
        response += f"\n\n_Cited but left out, not chunks the program was handed: {', '.join(left_out[:20])}{more}_"
    cited = cited_chunk_ids(response, shown)
    kept = [cited_entry(rows[cid], shown[cid].text, "cited by the program's answer") for cid in cited if cid in rows]
    _store(conn, job, response, Collected(kept=kept, read=sorted(api.seen)))
    return OK


def _store(conn: psycopg.Connection, job: JobRow, response: str, collected: Collected) -> None:
    """End the job done, with its report."""

    def store(c: psycopg.Connection) -> None:
        with c.transaction():
            job_store.save_collected(c, job_id=job.id, collected=collected)
            store_report(c, job_store.reread_job(c, job_id=job.id), response, collected, None)

    durable_write(conn, store, what=f"code mode's report of job {job.id}")
