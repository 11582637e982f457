"""Anthropic's errors: ``{"type": "error", "error": {"type": "...", "message": "..."}}`` with Anthropic's HTTP status
codes and error types, for every answer of the Messages view, and the same object as a stream's ``event: error``.

rsb's errors keep their one HTTP status (consumer.edge.errors.STATUS); here that status is said in Anthropic's
terms: a status Anthropic's API does not use becomes the one it uses for the same situation (410 expired: 404, as
for an id that never existed; 503 and 507, "this server cannot serve now": 529 overloaded). The SDKs retry 409,
429 and 5xx by themselves: a refusal a retry cannot fix says ``x-should-retry: false`` (they obey it)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from broker.errors import BudgetExceeded, Conflict, OverStorageQuota, RetryLater, RsbError
from consumer.edge.errors import anthropic_error_object as error_object
from consumer.edge.errors import as_rsb_error, status_of

log = logging.getLogger("rsb.consumer")

#: Anthropic's error type for each status it answers with (its API reference, "Errors").
TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error", 403: "permission_error",
         404: "not_found_error", 409: "conflict_error", 413: "request_too_large", 429: "rate_limit_error",
         500: "api_error", 504: "timeout_error", 529: "overloaded_error"}
#: rsb's statuses that Anthropic's API does not use, as the status it answers the same situation with.
_STATUS = {410: 404, 421: 400, 503: 529, 507: 529}
#: Refusals that a retry cannot fix before something changes: the SDKs must not retry them by themselves.
NO_RETRY = {"x-should-retry": "false"}


class AnthropicError(RsbError):
    """An error said in Anthropic's terms at this view's edge: its status and type, and headers of its own."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status
        self.type = TYPES.get(status, "api_error")
        self.headers = dict(headers or {})


def invalid(message: str) -> AnthropicError:
    """A 400 ``invalid_request_error``: the request cannot be served as it is."""
    return AnthropicError(400, message)


def error_json(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_object(TYPES.get(status, "api_error"), message), status_code=status,
                        headers=dict(headers) if headers else None)


def error_response(exc: RsbError) -> JSONResponse:
    """Anthropic's answer to an rsb error: its status said in Anthropic's terms, with ``Retry-After`` when rsb
    knows when to retry."""
    if isinstance(exc, AnthropicError):
        return error_json(exc.status_code, exc.message, exc.headers)
    status = status_of(exc)
    status = _STATUS.get(status, status)
    headers: dict[str, str] = {}
    if isinstance(exc, RetryLater):
        headers["Retry-After"] = str(exc.retry_after_s)
    if isinstance(exc, Conflict | BudgetExceeded | OverStorageQuota):
        headers.update(NO_RETRY)
    return error_json(status, exc.message, headers)


Handler = Callable[[Request], Awaitable[ASGIApp]]


def anthropic_route(handler: Handler) -> Handler:
    """Answer rsb's errors in Anthropic's shape on these routes (the app-wide handlers answer rsb's)."""

    async def wrapped(request: Request) -> ASGIApp:
        try:
            return await handler(request)
        except Exception as e:
            err = as_rsb_error(e)
            if err is None:  # a bug: logged with its traceback, answered as Anthropic's 500
                log.exception("unhandled error on %s %s", request.method, request.url.path)
                return error_json(500, "internal error")
            return error_response(err)

    wrapped.__name__ = handler.__name__
    wrapped.__doc__ = handler.__doc__
    return wrapped
