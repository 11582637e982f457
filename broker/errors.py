"""The exception hierarchy, in one place. The consumer maps these to HTTP at one boundary."""

from __future__ import annotations


class RsbError(Exception):
    """Base of every error rsb raises on purpose. ``code`` is the JSON error code clients see."""

    code: str = "internal"
    status_code: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(RsbError):
    code = "invalid_request"
    status_code = 400


class PayloadTooLarge(RsbError):
    code = "payload_too_large"
    status_code = 413


class NotFound(RsbError):
    code = "not_found"
    status_code = 404


class Expired(RsbError):
    code = "expired"
    status_code = 410


class Unauthorized(RsbError):
    code = "unauthorized"
    status_code = 401


class Conflict(RsbError):
    code = "conflict"
    status_code = 409


class TooManyStreams(RsbError):
    """An API key holds as many Durable Streams as it may (``--ds-max-streams``, or the key's ``max_ds_streams``)."""

    code = "too_many_streams"
    status_code = 429


class RetryLater(RsbError):
    """Base for errors that carry a ``Retry-After``."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(RetryLater):
    code = "queue_full"
    status_code = 429


class TooManyConnections(RetryLater):
    """Open streams per client address or per API key at their limit (counted per pod)."""

    code = "too_many_connections"
    status_code = 429


class TooManyGenerations(RetryLater):
    """An API key's ``max_active`` unfinished generations are all in use (checked atomically in Redis)."""

    code = "too_many_generations"
    status_code = 429


class Unavailable(RetryLater):
    """Redis is unreachable (or loading): every Redis error reaching the HTTP boundary becomes this."""

    code = "unavailable"
    status_code = 503
