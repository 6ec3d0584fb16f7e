"""Code mode's sub-model calls: a program's ``llm_query_batched`` is one flat chord (docs/architecture.md#code-mode).

The header is an ``rlm.subcall`` task per call on the analyst queue, so the calls share the analysts' workers,
limiter, fair share and the job tree's budget; the callback, ``rlm.subcalls_done``, says the chord is over.  The
code stage that sent it waits in its own task, which runs on the control queue, so waiting never holds a
slot a sub-call needs.

Task arguments are ids: each call's prompt and text, and later its reply, live in one Redis hash per chord
(``rlm:code:<job>:<n>``, fields ``in:<i>`` and ``out:<i>``), which expires after a day in case nobody reads it.
A sub-call that fails (the model's error, a spent budget, an ended job) writes why as its reply, so a chord
always completes; the program sees that reply as an ``[sub-call …]`` line in the list it gets back.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..celery_app import get_app
from ..config import get_settings
from ..constants import CODE_KEY_PREFIX
from ..errors import BudgetExhausted, JobCancelled, LLMError
from ..llm import fair
from ..llm.protocol import CompletionRequest
from ..runtime.resources import redis_client
from ..store import jobs as job_store
from .calls import call_llm
from .fanout import send_chord
from .prompts import content_block, load_prompt, system_message

if TYPE_CHECKING:
    import psycopg

    from ..store.jobs import JobRow

log = logging.getLogger("rlm.pipeline.subcalls")

#: how long a chord's prompts and replies stay in Redis when nobody collects them (the stage deletes them)
KEY_TTL_SECONDS = 86400
#: tokens a sub-model may write: an answer about one piece of text, not a report
SUBCALL_MAX_TOKENS = 1024
#: how often the waiting stage looks at the job (cancelled, ended) between the chord's signals
_WAIT_TICK_SECONDS = 1


@dataclass(frozen=True)
class SubCall:
    """One sub-model call a program asked for: its instruction and, apart, the text it is about."""

    prompt: str
    text: str = ""


def _key(job_id: str, chord_no: int) -> str:
    return f"{CODE_KEY_PREFIX}{job_id}:{chord_no}"


def launch(conn: psycopg.Connection, job: JobRow, chord_no: int, calls: Sequence[SubCall]) -> None:
    """Store the calls and send the chord: one ``rlm.subcall`` per call, ``rlm.subcalls_done`` after them.  Its
    task ids join the job's, so Flower links them and a cancel revokes those still queued."""
    app = get_app()
    r = redis_client()
    key = _key(job.id, chord_no)
    pipe = r.pipeline()
    pipe.delete(key, f"{key}:done")  # a stage sent again after a worker died starts this chord afresh
    pipe.hset(key, mapping={f"in:{i}": json.dumps({"prompt": c.prompt, "text": c.text}) for i, c in enumerate(calls)})
    pipe.expire(key, KEY_TTL_SECONDS)
    pipe.execute()
    own = fair.current_priority()
    n = len(calls)
    header = [
        app.signature("rlm.subcall", (job.id, chord_no, i), immutable=True).set(
            argsrepr=f"job={job.id} chord={chord_no} call={i + 1}/{n}", priority=own
        )
        for i in range(n)
    ]
    body = app.signature("rlm.subcalls_done", (job.id, chord_no), immutable=True).set(
        argsrepr=f"job={job.id} chord={chord_no}", priority=own
    )
    job_store.add_task_ids(conn, job_id=job.id, task_ids=send_chord(app, header, body, tenant=job.tenant))


def wait(job_id: str, chord_no: int, n: int, *, should_stop: Callable[[], bool], timeout: float) -> list[str]:
    """The chord's replies in call order, once its callback has run (or every reply is in); ``JobCancelled`` when
    the job ends meanwhile.  A reply still missing at ``timeout`` says so in its place."""
    r = redis_client()
    key = _key(job_id, chord_no)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if r.blpop([f"{key}:done"], timeout=_WAIT_TICK_SECONDS) is not None:
                break
            if r.hlen(key) >= 2 * n:  # every reply is in: the callback's message may have been lost
                break
            if should_stop():
                raise JobCancelled(f"job {job_id} has ended; its program's sub-calls were abandoned")
            if time.monotonic() > deadline:
                log.warning(
                    "job %s: chord %d not done after %.0f s; missing replies are marked", job_id, chord_no, timeout
                )
                break
        raw = r.hmget(key, [f"out:{i}" for i in range(n)])
    finally:
        r.delete(key, f"{key}:done")
    return [_reply_text(v, timeout) for v in raw]


def _reply_text(raw: bytes | None, timeout: float) -> str:
    if raw is None:
        return f"[sub-call gave no reply within {timeout:.0f} s]"
    out = json.loads(raw)
    return out["text"] if "text" in out else f"[sub-call {out.get('error', 'failed')}]"


def run_subcall(job_id: str, chord_no: int, index: int) -> dict[str, object]:
    """``rlm.subcall``: one call of the chord, its reply written beside its prompt; a redelivery after the reply
    is written (or after the stage gave the chord up) calls nothing."""
    r = redis_client()
    key = _key(job_id, chord_no)
    raw = r.hget(key, f"in:{index}")
    if raw is None or r.hexists(key, f"out:{index}"):
        return {"job": job_id, "call": index, "skipped": True}
    asked = json.loads(raw)
    settings = get_settings()
    content = asked["prompt"]
    if asked.get("text"):
        content = f"{content}\n\n## Text\n\n{content_block(asked['text'])}"
    request = CompletionRequest(
        role="subcall",
        model=settings.subcall_model,
        messages=[
            system_message(load_prompt("subquery", prompt_dir=settings.prompt_dir)),
            {"role": "user", "content": content},
        ],
        max_tokens=SUBCALL_MAX_TOKENS,
    )
    try:
        out: dict[str, str] = {"text": call_llm(None, job_id=job_id, stage="subcall", request=request).text}
    except BudgetExhausted as exc:
        out = {"error": f"not run: the budget is spent ({exc.reason})"}
    except JobCancelled:
        out = {"error": "not run: the job has ended"}
    except LLMError as exc:
        out = {"error": f"failed: {exc.message[:300]}"}
    pipe = r.pipeline()
    pipe.hset(key, f"out:{index}", json.dumps(out))
    pipe.expire(key, KEY_TTL_SECONDS)  # the stage may have given the chord up and deleted it meanwhile
    pipe.execute()
    return {"job": job_id, "call": index, "ok": "text" in out}


def subcalls_done(job_id: str, chord_no: int) -> str:
    """``rlm.subcalls_done``: the chord's callback wakes the stage that waits on it."""
    r = redis_client()
    done = f"{_key(job_id, chord_no)}:done"
    r.rpush(done, "1")
    r.expire(done, KEY_TTL_SECONDS)
    return "woken"
