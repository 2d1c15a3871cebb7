"""The chat page at / (`serve --no-webui` turns it off): static files shipped in the package.

The page (llm/serving/static: index.html, app.js, style.css; no build step, no CDN) talks to
/v1/chat/completions like any client. Its files are public, as llama-server's page is: with
an API key the page asks for it and sends it with each request. The Content-Security-Policy
lets the page run only its own script and style, a second wall behind its escaping of model
output.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

STATIC = Path(__file__).parent / "static"
PAGES = ("/", "/app.js", "/style.css")      # the page's paths, public with an API key
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}

router = APIRouter()


def static_file(name: str, media_type: str) -> FileResponse:
    return FileResponse(STATIC / name, media_type=media_type, headers=HEADERS)


@router.get("/")
async def index():
    return static_file("index.html", "text/html; charset=utf-8")


@router.get("/app.js")
async def app_js():
    return static_file("app.js", "text/javascript; charset=utf-8")


@router.get("/style.css")
async def style_css():
    return static_file("style.css", "text/css; charset=utf-8")
