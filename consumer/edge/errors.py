"""The one boundary where errors become HTTP: every error is JSON with a code, never a traceback. A failed Redis
command reaches here as rsb's Store family (broker.errors, mapped from redis-py's in broker.redis.connection)
and is answered here, once: Redis being away (``StoreUnavailable``) is ``Unavailable`` (503 + Retry-After);
Redis refusing a write for lack of memory (``StoreFull``) is ``StorageFull`` (507 + Retry-After), whichever
route wrote; any other (a plain ``StoreError``) is a bug (500)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from broker.errors import (
    RetryLater,
    RsbError,
    ShuttingDown,
    StorageFull,
    StoreError,
    StoreFull,
    StoreUnavailable,
    Unavailable,
)
from broker.storage import STORAGE_FULL_RETRY_AFTER_S, OutOfMemoryEpisodes

log = logging.getLogger("rsb.consumer")

REDIS_RETRY_AFTER_S = 2
# A drained request's retry goes to another pod (the balancer no longer sends it here): soon.
DRAIN_RETRY_AFTER_S = 1
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 400: "invalid_request", 413: "payload_too_large"}

#: This process's episodes of a full Redis: one log line each, every refusal counted (consumer.app wires the
#: metric ``rsb_storage_full_total`` in).
OUT_OF_MEMORY = OutOfMemoryEpisodes(log, "the consumer")

#: The HTTP status of each of rsb's error codes (broker.errors), here and nowhere else: 429 when the caller is
#: over one of its own limits, 503 when this pod or Redis cannot serve now (another pod, or later, may), 507 when
#: Redis is out of memory (no pod can write until memory is freed; reads still work).
STATUS: dict[str, int] = {
    "invalid_request": 400, "unauthorized": 401, "not_found": 404, "model_not_found": 404, "conflict": 409,
    "conversation_full": 409,
    "expired": 410, "payload_too_large": 413, "too_many_streams": 429, "too_many_conversations": 429,
    "queue_full": 429, "too_many_connections": 429,
    "too_many_generations": 429, "rate_limited": 429, "internal": 500, "overloaded": 503, "starting": 503,
    "unavailable": 503, "draining": 503, "storage_full": 507, "storage_quota": 429,
    "budget_exceeded": 429, "too_many_refusals": 429, "webhook_backlog": 429,
    "host_not_allowed": 421,  # an open API reached by a name it does not answer (consumer.edge.hosts)
}


def status_of(err: RsbError) -> int:
    """The HTTP status ``err`` is answered with."""
    return STATUS[err.code]


def refusal(err: RetryLater, headers: dict[str, str] | None = None) -> JSONResponse:
    """The response of a RetryLater: its status, code and message, and its ``Retry-After``."""
    return error_response(status_of(err), err.code, err.message, {"Retry-After": str(err.retry_after_s),
                                                                  **(headers or {})})


def anthropic_error_object(type_: str, message: str) -> dict[str, Any]:
    """Anthropic's error shape, which its clients read on the Messages view's routes (consumer.views.anthropic):
    the body of an error answer there, and the data of a stream's ``event: error``."""
    return {"type": "error", "error": {"type": type_, "message": message}}


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def as_rsb_error(exc: Exception) -> RsbError | None:
    """rsb's error for ``exc``: itself, or Unavailable for Redis being away; None for anything else (a bug)."""
    if isinstance(exc, RsbError):
        return exc
    if isinstance(exc, StoreUnavailable):
        log.warning("redis unavailable: %s", exc)
        return Unavailable("the stream store is unreachable; retry shortly", REDIS_RETRY_AFTER_S)
    if isinstance(exc, StoreFull):
        OUT_OF_MEMORY.refused(type(exc.__cause__ or exc).__name__)
        return StorageFull("the stream store is out of memory and refuses writes; retry shortly",
                           STORAGE_FULL_RETRY_AFTER_S)
    return None


async def rsb_error(request: Request, exc: Exception) -> Response:
    err = as_rsb_error(exc)
    if err is None:
        return await internal_error(request, exc)
    if isinstance(err, RetryLater):
        return refusal(err)
    return error_response(status_of(err), err.code, err.message)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(exc.status_code, _HTTP_CODES.get(exc.status_code, "http_error"), str(exc.detail),
                          dict(exc.headers) if exc.headers else None)


async def internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, "internal", "internal error")


# A failed Redis command goes through rsb_error too: away or full are answered (as_rsb_error says which); any
# other is a bug, answered by internal_error from there.
HANDLERS = {RsbError: rsb_error, HTTPException: http_error, StoreError: rsb_error, Exception: internal_error}


async def error_for(request: Request, exc: Exception) -> Response:
    """The response the app's exception handlers give ``exc`` (the most specific class wins, as in Starlette),
    for code served below Starlette's own error boundary (consumer.edge.front)."""
    for cls in type(exc).__mro__:
        handler = HANDLERS.get(cls)
        if handler is not None:
            return await handler(request, exc)
    return await internal_error(request, exc)


class ShutdownBoundary:
    """The outermost ASGI layer. When a draining pod's grace period (``--shutdown-grace-s``) ends, uvicorn cancels
    the requests still being answered (a create waiting for a replica, a read waiting on a Redis that does not
    answer) and answers each one it finds unstarted with a bare 500 and a traceback in the log; here such a
    request answers 503 ``draining`` with ``Retry-After`` instead: it is safe to retry (creates are idempotent),
    elsewhere. A response already started (an SSE stream ends itself at an event boundary when the drain begins)
    can only be cut: uvicorn closes its connection."""

    def __init__(self, app: ASGIApp, draining: asyncio.Event) -> None:
        self.app = app
        self.draining = draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if scope["type"] != "http" or not self.draining.is_set() or task is None:
                raise
            task.uncancel()  # the task ends here, with its answer: nothing above waits for the cancellation
            answer = refusal(ShuttingDown("this server is shutting down; retry", DRAIN_RETRY_AFTER_S))
            try:
                await answer(scope, receive, send)
            except RuntimeError:  # the response had started: nothing more can be said on it
                log.info("a response still being sent was cut at the end of the drain",
                         extra={"path": scope.get("path", "")})
