"""rsb: resumable streams for LLM generation. This package is the public Python client and the ``rsb``
command line; the server roles live in ``broker`` (what they share), ``generator`` and ``consumer``.

    from rsb import Client

    with Client("http://127.0.0.1:8000") as rsb:
        info = rsb.create(messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=200)
        for event in rsb.stream(info.id):
            print(event.text, end="", flush=True)
"""

from rsb._client import DEFAULT_URL, AsyncClient, Client, RetryPolicy
from rsb._exceptions import (
    AuthenticationError,
    ConflictError,
    ExpiredError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitedError,
    RsbClientError,
    StreamInterrupted,
    UnavailableError,
)
from rsb._types import Answer, Event, StreamInfo, StreamStatus, ToolCall

__version__ = "0.2.0"

__all__ = [
    "DEFAULT_URL",
    "Answer",
    "AsyncClient",
    "AuthenticationError",
    "Client",
    "ConflictError",
    "Event",
    "ExpiredError",
    "InvalidRequestError",
    "NotFoundError",
    "PayloadTooLargeError",
    "RateLimitedError",
    "RetryPolicy",
    "RsbClientError",
    "StreamInfo",
    "StreamInterrupted",
    "StreamStatus",
    "ToolCall",
    "UnavailableError",
    "__version__",
]
