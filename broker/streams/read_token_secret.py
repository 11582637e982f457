"""The key that signs read tokens (consumer.edge.auth) when the operator configures none: random, made once per
deployment and kept in Redis, so every pod signs and checks with the same one and nothing public derives it.

The first pod that needs it writes a fresh random value with ``SET NX``; whichever write wins, every pod then
reads the one stored (no check-then-act: the SET is the only write and it never overwrites). Deleting the key
rotates it: the next pod that starts (or restarts) makes a new one; docs/security.md says what old tokens do.
"""

from __future__ import annotations

import secrets

from broker.redis.connection import RedisClient
from broker.streams.keys import read_token_secret_key

# 256 bits, hex: HMAC-SHA256 takes a key of any length; 32 random bytes is its block-size-safe strength.
SECRET_BYTES = 32


async def shared_read_token_secret(redis: RedisClient) -> bytes:
    """The deployment's read-token key, made now if no pod has made it yet."""
    key = read_token_secret_key()
    await redis.set(key, secrets.token_hex(SECRET_BYTES), nx=True)
    stored = await redis.get(key)
    if not stored:  # deleted between the two commands (a rotation): make it again
        return await shared_read_token_secret(redis)
    return stored if isinstance(stored, bytes) else str(stored).encode()
