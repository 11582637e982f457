"""``Idempotency-Key``, as the protocol views that take it read it (OpenAI's chat and Responses creates, Anthropic's
Messages create): a create that carries the header names its stream after the caller and the key, so its retries
land on that one stream and its CREATE (idempotent per id) makes one generation; the same key with another body is
a conflict. The caller is part of the name, so two tenants' keys never meet."""

from __future__ import annotations

import uuid

from broker.errors import InvalidRequest
from consumer.streaming.service import Caller

HEADER = "idempotency-key"
MAX_CHARS = 256
# Stream ids made from Idempotency-Key headers live in their own namespace (uuid5 of caller and key).
_NAMESPACE = uuid.UUID("6f1c2a0e-5d3b-4c1e-9b7a-2e4f8d9c0a11")


def stream_id_for_key(key: str | None, caller: Caller) -> uuid.UUID:
    """A new stream id per create, unless ``key`` (the header's value) is given: then the id it and the caller name.
    Raises InvalidRequest for a key that is empty or longer than MAX_CHARS."""
    if key is None:
        return uuid.uuid4()
    if not 0 < len(key) <= MAX_CHARS:
        raise InvalidRequest(f"Idempotency-Key must be 1 to {MAX_CHARS} characters")
    return uuid.uuid5(_NAMESPACE, f"{caller.key_id}\n{key}")
