"""What the OpenAI-compatible views share: OpenAI's error shape, creating the rsb stream behind a request,
and the ASGI plumbing that serves a view over the same reader as ``/v1/streams/{id}/events``.

These routes are views onto rsb streams, not a second pipeline: a create is ``Store.create`` with a request
validated by ``parse_create_body``, and every read is ``read_stream`` (replay, then the live hub).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing
from typing import Any, cast

import orjson
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker.errors import Conflict, Expired, InvalidRequest, RetryLater, RsbError
from broker.events import Event
from broker.request import parse_create_body
from broker.store import StreamStatus
from consumer.auth import principal
from consumer.limits import ConnectionLimiter, Counted
from consumer.reader import read_stream
from consumer.routes import app_state, key_limit, known_status, read_body
from consumer.sse import RECONNECT_HINT, SSEResponse

# Lets a client find the rsb stream behind an OpenAI object (to resume it over /v1/streams/{id}/events).
STREAM_ID_HEADER = b"x-rsb-stream-id"
IDEMPOTENCY_HEADER = "idempotency-key"
MAX_IDEMPOTENCY_KEY = 256
# Stream ids made from Idempotency-Key headers live in their own namespace (uuid5 of caller and key).
_IDEMPOTENCY_NS = uuid.UUID("6f1c2a0e-5d3b-4c1e-9b7a-2e4f8d9c0a11")
# The parameter an rsb validation message is about: "'max_tokens' must be ..." or "messages[3].role ...".
_PARAM = re.compile(r"\A'?([a-z_]+)(?:'|\[)")

Handler = Callable[[Request], Awaitable[ASGIApp]]


class OpenAIError(RsbError):
    """An error with OpenAI's fields, for what rsb's own exceptions cannot say (the parameter, the type)."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status
        self.type = type_
        self.oai_code = code
        self.param = param
        self.headers = dict(headers or {})


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, code=code, param=param)


def error_json(status: int, message: str, *, type_: str, code: str | None, param: str | None = None,
               headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=dict(headers) if headers else None)


def error_response(exc: Exception) -> JSONResponse:
    """OpenAI's error shape for an rsb error. Statuses are chosen for how the SDK reacts to them: it
    retries 408/409/429/5xx, so a 409 that a retry cannot fix says ``x-should-retry: false``."""
    if isinstance(exc, OpenAIError):
        return error_json(exc.status_code, exc.message, type_=exc.type, code=exc.oai_code, param=exc.param,
                          headers=exc.headers)
    if isinstance(exc, RedisError):
        return error_json(503, "the stream store is unreachable; retry shortly", type_="server_error",
                          code="unavailable", headers={"Retry-After": "2"})
    assert isinstance(exc, RsbError)
    if isinstance(exc, Expired):
        # The SDK has no class for 410; what a client can do is the same as for an unknown id.
        return error_json(404, exc.message, type_="invalid_request_error", code="expired")
    if isinstance(exc, Conflict):
        return error_json(409, exc.message, type_="invalid_request_error", code=exc.code,
                          headers={"x-should-retry": "false"})
    if isinstance(exc, RetryLater):
        type_ = "requests" if exc.status_code == 429 else "server_error"
        return error_json(exc.status_code, exc.message, type_=type_, code=exc.code,
                          headers={"Retry-After": str(exc.retry_after_s)})
    if exc.status_code == 401:
        return error_json(401, exc.message, type_="invalid_request_error", code="invalid_api_key")
    type_ = "server_error" if exc.status_code >= 500 else "invalid_request_error"
    return error_json(exc.status_code, exc.message, type_=type_, code=exc.code)


def openai_route(handler: Handler) -> Handler:
    """Answer rsb's errors in OpenAI's shape on these routes (the app-wide handlers use rsb's)."""

    async def wrapped(request: Request) -> ASGIApp:
        try:
            return await handler(request)
        except (RsbError, RedisError) as e:
            return error_response(e)

    wrapped.__name__ = handler.__name__
    wrapped.__doc__ = handler.__doc__
    return wrapped


async def read_json(request: Request) -> dict[str, Any]:
    settings = request.app.state.settings
    raw = await read_body(request, settings.max_body_bytes)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise invalid("the body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    return body


def text_of(content: object, where: str, part_types: frozenset[str]) -> str:
    """A message's text: a string, or a list of text parts (joined); anything else is refused."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in part_types and isinstance(part.get("text"), str)):
                raise invalid(f"{where}.content[{j}]: only text parts ({', '.join(sorted(part_types))}) are "
                              "supported", where.split("[", 1)[0])
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"{where}.content must be a string or a list of text parts", where.split("[", 1)[0])


def _stream_id(request: Request, caller: str) -> uuid.UUID:
    """A new stream per call, unless the client sends an Idempotency-Key: then retries of the call land on
    the same stream (one generation). The caller is part of the name, so tenants never share one."""
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is None:
        return uuid.uuid4()
    if not 0 < len(key) <= MAX_IDEMPOTENCY_KEY:
        raise invalid(f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} characters", code="invalid_header")
    return uuid.uuid5(_IDEMPOTENCY_NS, f"{caller}\n{key}")


async def create_stream(request: Request, rsb_body: dict[str, Any],
                        renames: Mapping[str, str]) -> tuple[uuid.UUID, StreamStatus]:
    """Validate ``rsb_body`` (a ``POST /v1/streams`` body) exactly as the native route does, create the
    stream, and return it with its status. ``renames`` maps rsb field names to the client's, for errors."""
    settings, store, _, metrics = app_state(request)
    caller = principal(request)
    key_max_tokens = int(key_limit(request, caller, "max_tokens"))
    max_tokens = min(settings.max_tokens_limit, key_max_tokens) if key_max_tokens else settings.max_tokens_limit
    try:
        _, gen_request = parse_create_body(
            orjson.dumps(rsb_body), max_tokens_limit=max_tokens,
            default_max_tokens=min(settings.default_max_tokens, max_tokens),
            max_messages=settings.max_messages, max_prompt_chars=settings.max_prompt_chars,
        )
    except InvalidRequest as e:
        message = e.message
        for ours, theirs in renames.items():
            message = message.replace(f"'{ours}'", f"'{theirs}'").replace(f"{ours}[", f"{theirs}[")
        m = _PARAM.match(message)
        param = m.group(1) if m else renames.get("messages", "messages") if "messages" in message else None
        raise invalid(message, param) from None
    stream_id = _stream_id(request, caller)
    res = await store.create(stream_id, gen_request, default_model=request.app.state.default_model,
                             max_queue=settings.max_queue, retention_s=settings.retention_s,
                             abandon_after_s=settings.abandon_after_s, key_id=caller,
                             max_active=int(key_limit(request, caller, "max_active")))
    if res.outcome == "conflict":
        raise Conflict("this Idempotency-Key was used with a different request")
    if res.outcome == "expired":
        raise OpenAIError(409, "this Idempotency-Key was used for a generation that has expired; use a new key",
                          code="expired", headers={"x-should-retry": "false"})
    if res.outcome == "key_busy":
        metrics.inc("rsb_creates_rejected_total")
        raise OpenAIError(429, "this API key has as many unfinished generations as it may", type_="requests",
                          code="too_many_generations", headers={"Retry-After": str(res.retry_after_s)})
    if res.outcome == "queue_full":
        metrics.inc("rsb_creates_rejected_total")
        raise OpenAIError(429, f"the generation queue is full ({res.waiting} waiting)", type_="requests",
                          code="queue_full", headers={"Retry-After": str(res.retry_after_s)})
    metrics.inc("rsb_streams_created_total" if res.outcome == "created" else "rsb_creates_replayed_total")
    return stream_id, await known_status(store, stream_id, caller)


class Frame(Event):
    """A ready SSE frame in the place of an rsb event: SSEResponse writes ``to_sse()`` and nothing else, so
    the views reuse its heartbeat, disconnect, send-timeout and shutdown handling as they are."""

    __slots__ = ()

    def __init__(self, frame: bytes) -> None:
        super().__init__("", "", frame)

    def to_sse(self) -> bytes:
        return self.data


def data_frame(obj: object) -> Frame:
    return Frame(b"data: " + orjson.dumps(obj) + b"\n\n")


def event_frame(obj: dict[str, Any]) -> Frame:
    return Frame(b"event: " + str(obj["type"]).encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n")


DONE_FRAME = Frame(b"data: [DONE]\n\n")


class Connection:
    """One long-lived connection (an SSE view or a wait for the end), counted against the per-IP and per-key
    limits from before the stream is created, so a refused connection never leaves a generation behind."""

    def __init__(self, request: Request) -> None:
        self.caller = principal(request)
        self.ip = request.client.host if request.client else ""
        self.limiter: ConnectionLimiter = request.app.state.limiter
        self.limiter.acquire(self.ip, self.caller, int(key_limit(request, self.caller, "max_sse")))
        self._handed_over = False

    def serve(self, app: ASGIApp) -> ASGIApp:
        self._handed_over = True
        return Counted(app, self.limiter, self.ip, self.caller)

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._handed_over:  # the handler failed before a response took over the count
            self.limiter.release(self.ip, self.caller)


class SSEView:
    """SSEResponse with the stream id header, and with its reconnect hint (a bare ``retry:`` field, which
    the OpenAI SDK would try to parse as a JSON event) replaced by a frame that this view's clients read."""

    def __init__(self, request: Request, stream_id: uuid.UUID, frames: AsyncIterator[Event | None],
                 on_shutdown: bytes) -> None:
        settings = request.app.state.settings
        self.inner = SSEResponse(frames, shutdown=request.app.state.draining, send_timeout_s=settings.send_timeout_s)
        self.stream_id = str(stream_id).encode()
        self.on_shutdown = on_shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message["headers"], (STREAM_ID_HEADER, self.stream_id)]}
            elif message.get("body") == RECONNECT_HINT:
                message = {**message, "body": self.on_shutdown}
            await send(message)

        await self.inner(scope, receive, send_)


class Deferred:
    """A JSON answer that needs the end of a generation. The wait is abandoned when the client goes away
    (nobody to answer) or the pod drains (503: retry elsewhere), like an SSE response's."""

    def __init__(self, request: Request, stream_id: uuid.UUID, compute: Callable[[], Awaitable[Response]]) -> None:
        self.compute = compute
        self.draining: asyncio.Event = request.app.state.draining
        self.stream_id = str(stream_id)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.ensure_future(self.compute())
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        drain = asyncio.ensure_future(self.draining.wait())
        try:
            done, _ = await asyncio.wait({work, gone, drain}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _cancel_all(work, gone, drain)
        if work in done:
            try:
                response = work.result()
            except (RsbError, RedisError) as e:
                response = error_response(e)
        elif gone in done:
            return
        else:
            response = error_json(503, "this server is shutting down; retry", type_="server_error",
                                  code="shutting_down", headers={"Retry-After": "1"})
        response.headers[STREAM_ID_HEADER.decode()] = self.stream_id
        await response(scope, receive, send)


async def _cancel_all(*tasks: asyncio.Future[Any]) -> None:
    """Cancel and wait, cancelling again what shrugged a cancellation off: on Python 3.11 a wait_for (in
    redis-py, say) swallows one that lands as its inner future completes, and the wait would go on."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)
    for t in tasks:
        if not t.cancelled():
            t.exception()  # retrieved: an outcome nobody needs is not logged as lost


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def fold_to_end(request: Request, stream_id: uuid.UUID, feed: Callable[[Event], object],
                      timeout_s: float | None = None) -> bool:
    """Feed every event of the stream to ``feed``, live ones included, until the terminal event (True) or
    ``timeout_s`` (False)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            async with aclosing(tail(request, stream_id)) as events:
                async for ev in events:
                    if ev is None:
                        continue
                    feed(ev)
                    if ev.is_terminal:
                        return True
    return False


def tail(request: Request, stream_id: uuid.UUID) -> AsyncGenerator[Event | None, None]:
    """The stream from its first event, live ones included: ``None`` for each heartbeat due. Close it
    (``aclosing``) so its live subscription ends with the reader, not at garbage collection."""
    settings, store, hub, _ = app_state(request)
    # read_stream is an async generator, annotated by what it yields.
    return cast(AsyncGenerator[Event | None, None], read_stream(store, hub, stream_id, None, settings.heartbeat_s))


def usage_tokens(usage: Mapping[str, Any] | None) -> tuple[int, int]:
    """(prompt, completion) tokens of an rsb usage object."""
    if not usage:
        return 0, 0
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)

