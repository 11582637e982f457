"""The chat page served at ``/`` and its ES module client, from ``consumer/static/``.

No build step and no CDN: the browser loads plain ES modules and CSS from ``/static/``. The API routes need
no change for the page: it is a client of the public contract like any other (``rsb-client.js``).
"""

from __future__ import annotations

import mimetypes
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route, request_response
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

# Browsers refuse to run a module script served with a non-JavaScript type, and the platform's MIME table
# decides what StaticFiles answers (some hosts map .js to text/plain): pin the types the page depends on.
mimetypes.add_type("text/javascript", ".js")
mimetypes.add_type("text/css", ".css")

# The page loads nothing from elsewhere and runs no inline script: a strict policy costs nothing and turns
# an HTML-escaping bug in the Markdown renderer into a blocked script instead of an XSS.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'self'"
)


async def index(request: Request) -> Response:
    """The chat page. ``/?stream=<uuid>`` opens an existing stream; the script reads the query itself."""
    # no-cache (revalidate, not no-store): a deploy must reach open tabs on their next reload.
    return FileResponse(
        STATIC_DIR / "index.html",
        media_type="text/html; charset=utf-8",
        headers={"Cache-Control": "no-cache", "Content-Security-Policy": CONTENT_SECURITY_POLICY,
                 "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"},
    )


class WithoutRanges:
    """``app`` with the requests' ``Range`` headers dropped: the page and its assets are small files, always sent
    whole, and Starlette's range parser answers a malformed one in text/plain, where every error is JSON."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k != b"range"])
        await self.app(scope, receive, send)


ROUTES: list[BaseRoute] = [
    Route("/", WithoutRanges(request_response(index)), methods=["GET", "HEAD"]),
    # check_dir=False: a missing folder (a broken install) should fail the asset requests, not the app start.
    Mount("/static", app=WithoutRanges(StaticFiles(directory=STATIC_DIR, check_dir=False)), name="static"),
]
