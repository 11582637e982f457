"""The Durable Streams protocol's HTTP vocabulary: header names, the parsing of what a request carries (path,
offsets, TTL, producers, fork headers), the cursor, the headers every response carries, and the boundary
where rsb's errors become responses with those headers."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime

from starlette.requests import Request
from starlette.responses import Response

from broker.ascii import decimal
from broker.durable.format import DEFAULT_TYPE, entry_id_of
from broker.durable.store import Producer
from broker.errors import InvalidRequest, NotFound
from consumer.edge.errors import as_rsb_error, internal_error, rsb_error
from consumer.state import state_of

PREFIX = "/v1/stream/"
MAX_PATH = 1024
MAX_CONTENT_TYPE = 255
MAX_SEQ = 2**53 - 1

NEXT_OFFSET = "Stream-Next-Offset"
UP_TO_DATE = "Stream-Up-To-Date"
CLOSED = "Stream-Closed"
CURSOR = "Stream-Cursor"
TTL = "Stream-TTL"
EXPIRES_AT = "Stream-Expires-At"
SSE_ENCODING = "Stream-SSE-Data-Encoding"
PRODUCER_EPOCH = "Producer-Epoch"
PRODUCER_SEQ = "Producer-Seq"
EXPECTED_SEQ = "Producer-Expected-Seq"
RECEIVED_SEQ = "Producer-Received-Seq"

#: Headers a browser client must be allowed to send and to read (consumer.app's CORS settings use them).
REQUEST_HEADERS = ("Content-Type", "Authorization", "If-None-Match", "Stream-Seq", "Stream-TTL", "Stream-Expires-At",
                   "Stream-Closed", "Stream-Forked-From", "Stream-Fork-Offset", "Stream-Fork-Sub-Offset",
                   "Producer-Id", "Producer-Epoch", "Producer-Seq")
RESPONSE_HEADERS = (NEXT_OFFSET, UP_TO_DATE, CLOSED, CURSOR, TTL, EXPIRES_AT, SSE_ENCODING, PRODUCER_EPOCH,
                    PRODUCER_SEQ, EXPECTED_SEQ, RECEIVED_SEQ, "ETag", "Location", "Retry-After")
METHODS = ("GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS")

# On every response, errors and SSE included. CORP only governs no-cors loads (an <img>, a <script>):
# clients read streams with CORS fetches, which it does not affect. A stream's content type is the writer's
# choice: text/html, image/svg+xml, XML or JavaScript opened by URL would run on rsb's origin, where the chat
# page keeps its history and API key in localStorage. ``sandbox`` (no allow-scripts, no allow-same-origin) makes
# any document served here an opaque origin that runs no script, whatever its type; nosniff stops a browser
# from guessing an active type for an inactive one. Fetch and EventSource readers are not affected by either.
SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "Cross-Origin-Resource-Policy": "same-origin",
                    "Content-Security-Policy": "sandbox"}

_TTL = re.compile(r"\A(0|[1-9][0-9]{0,9})\Z")  # ASCII digits only (broker.ascii)
_SUB_OFFSET = re.compile(r"\A(0|[1-9][0-9]{0,15})\Z")
_MEDIA_TYPE = re.compile(r"\A[\w-]+/[\w-]+")
_PATH = re.compile(r"\A[\x21-\x7e]+\Z")  # the raw (percent-encoded) path: printable ASCII, no spaces
_MAX_TTL_S = 2**31

# Cursors (spec section 10.1): 20 s intervals since 2024-10-09T00:00:00Z.
_CURSOR_EPOCH_S = 1728432000
_CURSOR_INTERVAL_S = 20


def stream_path(request: Request) -> str:
    """The stream's path after /v1/stream/, as the client sent it (percent-encoding kept: it names the stream)."""
    raw = request.scope.get("raw_path")
    full = raw.decode("latin-1") if isinstance(raw, bytes) else request.url.path
    path = full[len(PREFIX):] if full.startswith(PREFIX) else ""
    if not path or len(path) > MAX_PATH or not _PATH.match(path):
        raise NotFound("no stream at this path")
    return path


def source_path(raw: str) -> str:
    """A ``Stream-Forked-From`` value (the source's URL path, or its absolute URL) as a stream path."""
    value = raw.strip()
    if "://" in value:
        value = "/" + value.split("://", 1)[1].partition("/")[2]
    value = value.partition("?")[0]
    if not value.startswith(PREFIX) or not _PATH.match(value[len(PREFIX):] or " ") or len(value) > MAX_PATH:
        raise InvalidRequest("Stream-Forked-From must be a stream's path (/v1/stream/...)")
    return value[len(PREFIX):]


def offset_param(request: Request) -> str | None:
    """``?offset=``: None when absent; ``-1``, ``now`` or an entry id. One value, well-formed, else 400."""
    values = request.query_params.getlist("offset")
    if not values:
        return None
    if len(values) > 1:
        raise InvalidRequest("one offset parameter at most")
    raw = values[0]
    if raw in ("-1", "now"):
        return raw
    entry_id = entry_id_of(raw)
    if entry_id is None:
        raise InvalidRequest("malformed offset: use -1, now, or a Stream-Next-Offset value as sent")
    return entry_id


def is_true(request: Request, name: str) -> bool:
    return (request.headers.get(name) or "").strip().lower() == "true"


def expiry(request: Request) -> tuple[int | None, str | None, int | None]:
    """``Stream-TTL`` (seconds) or ``Stream-Expires-At`` (as given, and in ms); both at once is a 400."""
    ttl_raw, exp_raw = request.headers.get(TTL), request.headers.get(EXPIRES_AT)
    if ttl_raw is not None and exp_raw is not None:
        raise InvalidRequest("Stream-TTL and Stream-Expires-At exclude each other")
    if ttl_raw is not None:
        if not _TTL.match(ttl_raw) or int(ttl_raw) >= _MAX_TTL_S:
            raise InvalidRequest("Stream-TTL must be a whole number of seconds (no sign, no leading zeros)")
        return int(ttl_raw), None, None
    if exp_raw is not None:
        try:
            when = datetime.fromisoformat(exp_raw.strip())
        except ValueError:
            raise InvalidRequest("Stream-Expires-At must be an RFC 3339 timestamp") from None
        if when.tzinfo is None:
            raise InvalidRequest("Stream-Expires-At needs a timezone (Z or +hh:mm)")
        return None, exp_raw, max(1, int(when.timestamp() * 1000))
    return None, None, None


def content_type(request: Request, *, fork: bool) -> str:
    """A PUT's content type as given; a missing or malformed one is application/octet-stream, or, for a fork,
    '' (the source's is inherited)."""
    raw = (request.headers.get("content-type") or "").strip()
    if not raw or not _MEDIA_TYPE.match(raw) or len(raw) > MAX_CONTENT_TYPE:
        return "" if fork else DEFAULT_TYPE
    return raw


def fork_headers(request: Request) -> tuple[str | None, str | None, int]:
    """(source path, fork offset as an entry id, sub-offset) of a fork PUT; (None, None, 0) for a plain one."""
    source = request.headers.get("stream-forked-from")
    offset_raw = request.headers.get("stream-fork-offset")
    sub_raw = request.headers.get("stream-fork-sub-offset")
    offset = None
    if offset_raw is not None:
        offset = entry_id_of(offset_raw.strip())
        if offset is None:
            raise InvalidRequest("malformed Stream-Fork-Offset")
    sub = 0
    if sub_raw is not None:
        if not source:
            raise InvalidRequest("Stream-Fork-Sub-Offset requires Stream-Forked-From")
        if not _SUB_OFFSET.match(sub_raw):
            raise InvalidRequest("Stream-Fork-Sub-Offset must be a non-negative integer")
        sub = int(sub_raw)
    if not source:
        return None, None, 0
    return source_path(source), offset, sub


def producer(request: Request) -> Producer | None:
    """Producer-Id/-Epoch/-Seq: all three or none; a present but empty id counts as present."""
    pid, epoch, seq = (request.headers.get(h) for h in ("producer-id", PRODUCER_EPOCH, PRODUCER_SEQ))
    if pid is None and epoch is None and seq is None:
        return None
    if pid is None or epoch is None or seq is None:
        raise InvalidRequest("Producer-Id, Producer-Epoch and Producer-Seq go together")
    if not pid or len(pid) > MAX_PATH:
        raise InvalidRequest("Producer-Id must not be empty")
    epoch_n, seq_n = decimal(epoch, max_digits=16), decimal(seq, max_digits=16)
    if epoch_n is None or seq_n is None or epoch_n > MAX_SEQ or seq_n > MAX_SEQ:
        raise InvalidRequest("Producer-Epoch and Producer-Seq must be integers from 0 to 2^53-1")
    return Producer(pid, epoch_n, seq_n)


async def cursor(request: Request) -> str:
    """The response cursor (spec 10.1): the current 20 s interval, or, when the client's ``cursor`` is not behind
    it, a jittered later one, so that cached long-poll responses cannot loop. The interval is the Redis server's:
    a client that a balancer sends to pods whose clocks disagree would otherwise see its cursor go back."""
    now = int((await state_of(request).store.clock.now() - _CURSOR_EPOCH_S) // _CURSOR_INTERVAL_S)
    given = decimal(request.query_params.get("cursor"), max_digits=18)
    if given is not None and given >= now:
        return str(given + max(1, math.ceil(random.randint(1, 3600) / _CURSOR_INTERVAL_S)))
    return str(now)


def respond(status: int, headers: Mapping[str, str] | None = None, body: bytes = b"") -> Response:
    """A response with its headers exactly as given: a content type is sent as the stream has it (Starlette
    would add ``; charset=utf-8`` to a ``text/*`` media type)."""
    return Response(body, status_code=status, headers=dict(headers or {}))


Endpoint = Callable[[Request], Awaitable[Response]]


def endpoint(handler: Endpoint) -> Endpoint:
    """The view's error boundary: rsb's errors become the app's JSON errors, and every response, errors
    included, carries the security headers."""

    async def wrapped(request: Request) -> Response:
        try:
            response = await handler(request)
        except Exception as exc:
            err = as_rsb_error(exc)
            if err is None:
                response = await internal_error(request, exc)
            else:
                response = await rsb_error(request, err)
        for name, value in SECURITY_HEADERS.items():
            response.headers[name] = value
        return response

    return wrapped
