"""The /ui pages (docs/web-view.md): shells rendered here, filled by static/app.js from the /v1 API.

The pages carry no data and need no key: the browser signs in with an API key kept in sessionStorage and
sends it as a bearer token on every /v1 call, so tenant scoping stays the API's own.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape

from rlm_workers.config import get_settings

HERE = Path(__file__).resolve().parent
STATIC_DIR = HERE / "static"

router = APIRouter(prefix="/ui", include_in_schema=False)

#: no inline script or style, nothing from another origin (docs/web-view.md#security)
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
        "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@lru_cache(maxsize=1)
def _templates():
    return Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True))


def _page(template: str, **context: object) -> HTMLResponse:
    flower = get_settings().flower_url or ""
    # Only a web address becomes a link target; anything else configured is ignored rather than trusted.
    flower = flower.rstrip("/") if flower.lower().startswith(("http://", "https://")) else ""
    html = _templates().get_template(template).render(flower_url=flower, **context)
    return HTMLResponse(html, headers=SECURITY_HEADERS)


def static_files():
    """The app mounts this at /ui/static: the script and style sheet, no build step."""
    return StaticFiles(directory=STATIC_DIR)


@router.get("")
def home() -> RedirectResponse:
    return RedirectResponse("/ui/", status_code=307)


@router.get("/", response_class=HTMLResponse)
def jobs() -> HTMLResponse:
    return _page("jobs.html", page="jobs", title="Jobs")


@router.get("/signin", response_class=HTMLResponse)
def signin() -> HTMLResponse:
    return _page("signin.html", page="signin", title="Sign in")


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job(job_id: str) -> HTMLResponse:
    return _page("job.html", page="job", title="Job", subject=job_id[:64])


@router.get("/buffers", response_class=HTMLResponse)
def buffers() -> HTMLResponse:
    return _page("buffers.html", page="buffers", title="Buffers")


@router.get("/buffers/{name}", response_class=HTMLResponse)
def buffer(name: str) -> HTMLResponse:
    return _page("buffer.html", page="buffer", title="Buffer", subject=name[:128])
