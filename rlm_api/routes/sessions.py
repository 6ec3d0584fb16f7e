"""Chat sessions (docs/contract.md#sessions): create one, post a turn (a query job with the conversation as its
context), read the turns back.  Another tenant's session is simply not found."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response, status

from rlm_workers import engine

from ..deps import ConnDep, ParseOffLoop, TenantDep, found_or_404
from ..schemas import MessageAccepted, MessageRequest, SessionCreate, SessionCreated, SessionView

router = APIRouter(prefix="/v1/sessions", tags=["sessions"], route_class=ParseOffLoop)
#: typed as FastAPI's ``responses`` takes it (a dict is invariant: an inferred ``dict[int, …]`` does not fit)
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "no such session for this tenant"}}


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=SessionCreated,
    responses={
        404: {"description": "a named buffer does not exist for this tenant"},
        422: {"description": "invalid body: no buffers, a bad buffer name, an unknown option, …"},
    },
)
def create(body: SessionCreate, response: Response, conn: ConnDep, tenant: TenantDep) -> SessionCreated:
    """Start a session over some buffers; every turn runs with these buffers and options."""
    row = engine.create_session(conn, tenant=tenant, buffers=body.buffers, options=body.options.stored())
    url = f"{router.prefix}/{row.id}"
    response.headers["Location"] = url
    return SessionCreated(session_id=row.id, buffers=row.buffers, options=row.options, session_url=url)


@router.post(
    "/{session_id}/messages",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=MessageAccepted,
    responses={
        **NOT_FOUND,
        409: {"description": "the previous turn's job is still queued or running: one turn at a time"},
        422: {"description": "invalid body: empty content, over 10 KB, …"},
        429: {"description": "the tenant already has RLM_MAX_JOBS_IN_FLIGHT_PER_TENANT queries queued or running"},
    },
)
def post_message(
    session_id: str, body: MessageRequest, response: Response, conn: ConnDep, tenant: TenantDep
) -> MessageAccepted:
    """Ask the next question; it runs as a query job whose context carries the earlier turns."""
    posted = found_or_404(
        lambda i: engine.post_message(conn, tenant=tenant, session_id=i, content=body.content),
        session_id,
        "session",
    )  # SessionBusy is answered 409 by the app's RLMError handler
    turn, job_id = posted
    url = f"/v1/queries/{job_id}"
    response.headers["Location"] = url
    return MessageAccepted(session_id=session_id, turn=turn, job_id=job_id, status_url=url)


@router.get("/{session_id}", response_model=SessionView, responses=NOT_FOUND)
def get_session(session_id: str, conn: ConnDep, tenant: TenantDep) -> SessionView:
    """The session and its turns: each question, its job's status, and once done the answer and its citations."""
    view = found_or_404(lambda i: engine.session_view(conn, tenant=tenant, session_id=i), session_id, "session")
    return SessionView.model_validate(view)
