"""The web console: static pages (HTML, CSS, ES modules) served at /console/ that use the public API from the browser.

Nothing is built: the files under static/ are what the browser gets. The pages hold the API key in sessionStorage
and send it as the API's bearer header; no route here reads a key, so serving them needs none.
"""

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse

from inkwell.service.errors import not_found

STATIC = Path(__file__).parent / "static"
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8", ".js": "text/javascript"}
# The pages load only their own files and talk only to this origin; nothing may frame them.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; object-src 'none'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False)


def _file(name: str) -> FileResponse:
    path = STATIC / name
    media_type = MEDIA_TYPES.get(path.suffix)
    if "/" in name or media_type is None or not path.is_file():
        raise not_found("console file", name)
    return FileResponse(path, media_type=media_type, headers=HEADERS)


@router.get("/")
@router.get("/console")
def to_console() -> RedirectResponse:
    return RedirectResponse("/console/")


@router.get("/console/")
def console_index() -> FileResponse:
    return _file("index.html")


@router.get("/console/{name}")
def console_file(name: str) -> FileResponse:
    return _file(name)
