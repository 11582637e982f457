"""The client's exception family: one base, one class per thing a caller handles differently. HTTP
responses and transport failures are mapped to it in one place (``error_from_response`` and the client's
request loop); nothing of httpx leaks to the caller."""

from __future__ import annotations

import email.utils
import json
import re
import time
from collections.abc import Mapping


class RsbClientError(Exception):
    """Base of every error this client raises. ``status_code`` is the HTTP status (None: no response) and
    ``code`` the contract's error code (``not_found``, ``conflict``, ...)."""

    def __init__(self, message: str, *, status_code: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.code = code


class InvalidRequestError(RsbClientError):
    """400: the server refused the request as malformed (bad id, bad fields, bad resume id)."""


class AuthenticationError(RsbClientError):
    """401: a missing or unknown API key."""


class NotFoundError(RsbClientError):
    """404: no stream with this id (or not one the API key may see)."""


class ConflictError(RsbClientError):
    """409: a stream with this id exists with a different request."""


class ExpiredError(RsbClientError):
    """410: the stream existed and passed its retention period."""


class PayloadTooLargeError(RsbClientError):
    """413: the request body is larger than the server accepts."""


class RateLimitedError(RsbClientError):
    """429: the queue is full or too many connections are open; try again after ``retry_after`` seconds."""

    def __init__(self, message: str, *, retry_after: float | None = None, status_code: int | None = 429,
                 code: str | None = None) -> None:
        super().__init__(message, status_code=status_code, code=code)
        self.retry_after = retry_after


class UnavailableError(RsbClientError):
    """The server could not be reached or answered 502/503/504, through every retry."""

    def __init__(self, message: str, *, retry_after: float | None = None, status_code: int | None = None,
                 code: str | None = None) -> None:
        super().__init__(message, status_code=status_code, code=code)
        self.retry_after = retry_after


class StreamInterrupted(UnavailableError):
    """Reading a stream failed ``attempts`` times in a row. ``last_event_id`` is where to resume."""

    def __init__(self, message: str, *, last_event_id: str | None, attempts: int) -> None:
        super().__init__(message)
        self.last_event_id = last_event_id
        self.attempts = attempts


_BY_STATUS: dict[int, type[RsbClientError]] = {
    400: InvalidRequestError,
    401: AuthenticationError,
    404: NotFoundError,
    409: ConflictError,
    410: ExpiredError,
    413: PayloadTooLargeError,
}


_SECONDS = re.compile(r"\A[0-9]{1,9}(\.[0-9]{1,6})?\Z")


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds: a number, or an HTTP date."""
    if not value:
        return None
    seconds = value.strip()
    # ASCII digits only (float() takes other scripts' digits, "inf" and "nan": a hostile proxy's "inf" would
    # make the client wait for ever).
    if _SECONDS.match(seconds):
        return float(seconds)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def error_from_response(status_code: int, headers: Mapping[str, str], body: bytes) -> RsbClientError:
    """The typed exception for an error response (``{"error": {"code", "message"}}`` by the contract)."""
    code: str | None = None
    message = body.decode("utf-8", "replace").strip()[:500] or f"HTTP {status_code}"
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict):
            code = err.get("code")
            message = str(err.get("message") or message)
    except (ValueError, AttributeError):
        pass  # not the contract's JSON (a proxy's error page): keep the raw text
    retry_after = parse_retry_after(headers.get("retry-after"))
    if status_code == 429:
        return RateLimitedError(message, retry_after=retry_after, code=code)
    if status_code in (502, 503, 504):
        return UnavailableError(message, retry_after=retry_after, status_code=status_code, code=code)
    cls = _BY_STATUS.get(status_code, RsbClientError)
    return cls(message, status_code=status_code, code=code)
