"""What a read becomes on the wire, for Durable Streams and rsb generations alike: a catch-up or long-poll
response from a ``Page``, a long-poll's 204, and SSE ``data`` / ``control`` events."""

from __future__ import annotations

import base64
import re

import orjson
from starlette.requests import Request
from starlette.responses import Response

from broker.durable.format import JSON_TYPE, normalize_content_type, offset_of
from broker.durable.store import Page
from broker.sse import frame_lines
from consumer.views.durable.protocol import CLOSED, CURSOR, NEXT_OFFSET, SSE_ENCODING, UP_TO_DATE, respond

_LINE_BREAK = re.compile(rb"\r\n|\r|\n")
# Catch-up reads are per API key: a shared cache must not keep them; a private one may, revalidating its
# ETag (a read of a given offset only ever grows until the stream is closed).
CATCH_UP_CACHE = "private, no-cache"


def is_text(content_type: str) -> bool:
    """SSE carries text/* and JSON streams as text; anything else as base64."""
    ctn = normalize_content_type(content_type)
    return ctn.startswith("text/") or ctn == JSON_TYPE


def sse_headers(content_type: str) -> dict[str, str]:
    # Exactly text/event-stream: Starlette would add a charset parameter, which the protocol does not send.
    headers = {"content-type": "text/event-stream"}
    if not is_text(content_type):
        headers[SSE_ENCODING] = "base64"
    return headers


def page_response(request: Request, page: Page, offset: str | None, *, cursor: str | None = None) -> Response:
    """A catch-up read (``cursor`` None) or a long-poll that has data (200), or 304 when the client's
    ``If-None-Match`` names this exact response."""
    headers = {"content-type": page.content_type, NEXT_OFFSET: offset_of(page.next_id)}
    if page.up_to_date:
        headers[UP_TO_DATE] = "true"
    if page.closed_here:
        headers[CLOSED] = "true"
    if cursor is not None:
        headers[CURSOR] = cursor
    if offset == "now":
        headers["Cache-Control"] = "no-store"  # the tail moves: nothing to cache
        return respond(200, headers, page.body())
    start = offset if offset in (None, "-1") else offset_of(offset)
    etag = f'"{page.gen}:{start or "-1"}:{headers[NEXT_OFFSET]}{":c" if page.closed_here else ""}"'
    headers["ETag"] = etag
    headers["Cache-Control"] = CATCH_UP_CACHE
    if request.headers.get("if-none-match") == etag:
        return respond(304, {"ETag": etag, "Cache-Control": CATCH_UP_CACHE})
    return respond(200, headers, page.body())


def no_content(tail: str, *, closed: bool, cursor: str) -> Response:
    """A long-poll that got no data: it timed out, or the stream is closed at the reader's offset."""
    headers = {NEXT_OFFSET: offset_of(tail), UP_TO_DATE: "true", CURSOR: cursor}
    if closed:
        headers[CLOSED] = "true"
    return respond(204, headers)


def data_event(page: Page, *, text: bool) -> bytes:
    """The page's data as one SSE ``data`` event: a JSON array, the text split into lines (so a payload cannot
    frame events of its own), or base64 of the bytes."""
    body = page.body()
    if page.json:
        return frame_lines(b"data", [body])  # compact JSON: one line
    if not text:
        return frame_lines(b"data", [base64.b64encode(body)])
    # Invalid UTF-8 in a text stream cannot travel as SSE text: it becomes U+FFFD.
    return frame_lines(b"data", _LINE_BREAK.split(body.decode("utf-8", "replace").encode()))


def control_event(entry_id: str, *, cursor: str, up_to_date: bool, closed: bool) -> bytes:
    """An SSE ``control`` event; a closed stream's final one carries no cursor (it implies up-to-date)."""
    control: dict[str, object] = {"streamNextOffset": offset_of(entry_id)}
    if closed:
        control["streamClosed"] = True
    else:
        control["streamCursor"] = cursor
        if up_to_date:
            control["upToDate"] = True
    return frame_lines(b"control", [orjson.dumps(control)])


def page_events(page: Page, *, text: bool, cursor: str) -> bytes:
    """A page as SSE: its data event (if any) and the control event that follows every data event, in one
    chunk (one send)."""
    out = data_event(page, text=text) if page.entries else b""
    return out + control_event(page.next_id, cursor=cursor, up_to_date=page.up_to_date, closed=page.closed_here)
