"""The one boundary where errors become HTTP: every error is JSON with a code, never a traceback."""

from __future__ import annotations

import logging

from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from broker.errors import RetryLater, RsbError

log = logging.getLogger("rsb.consumer")

REDIS_RETRY_AFTER_S = 2
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 400: "invalid_request", 413: "payload_too_large"}


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


async def rsb_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RsbError)
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, RetryLater) else None
    return error_response(exc.status_code, exc.code, exc.message, headers)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(exc.status_code, _HTTP_CODES.get(exc.status_code, "http_error"), str(exc.detail),
                          dict(exc.headers) if exc.headers else None)


async def redis_error(request: Request, exc: Exception) -> Response:
    log.warning("redis unavailable: %s", type(exc).__name__)
    return error_response(503, "unavailable", "the stream store is unreachable; retry shortly",
                          {"Retry-After": str(REDIS_RETRY_AFTER_S)})


async def internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, "internal", "internal error")


HANDLERS = {RsbError: rsb_error, HTTPException: http_error, RedisConnectionError: redis_error,
            RedisTimeoutError: redis_error, BusyLoadingError: redis_error,
            Exception: internal_error}
