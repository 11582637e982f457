"""What every view does with a request before its protocol matters: read the body, bounded."""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from broker.ascii import decimal
from broker.errors import InvalidRequest, PayloadTooLarge


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) as soon as it passes ``limit`` bytes, declared or not."""
    declared = request.headers.get("content-length")
    if (n := decimal(declared)) is not None and n > limit:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    except ClientDisconnect:
        # The client left, or was cut off for sending too slowly (--body-timeout-s): an ordinary refusal
        # (nobody reads it), not an error with a traceback per slow client.
        raise InvalidRequest("the request body did not arrive whole") from None
    return bytes(body)
