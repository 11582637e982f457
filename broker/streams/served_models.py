"""Which models the generators serve, as the consumers learn it: every generator announces the name its
engine serves every ``ANNOUNCE_INTERVAL_S``; ``GET /v1/models`` lists the names announced within
``SEEN_WITHIN_S``, newest first. Nothing is ever configured twice: the name a consumer shows is the one
the generator's ``started`` events carry.

Scores are the announcing process's clock: a skew between machines well under ``SEEN_WITHIN_S`` only
shifts when a stopped generator's model leaves the list.
"""

from __future__ import annotations

import time

from broker.redis.connection import RedisClient
from broker.streams.keys import served_models_key

ANNOUNCE_INTERVAL_S = 10.0
# Three missed announcements: a generator that stopped (or lost Redis) leaves the list after this long.
SEEN_WITHIN_S = 35.0
# Names not announced for this long are deleted at the next announcement (the key never grows unbounded).
FORGET_AFTER_S = 7 * 24 * 3600.0


class ServedModels:
    def __init__(self, redis: RedisClient) -> None:
        self.redis = redis
        self.key = served_models_key()

    async def announce(self, name: str, now_s: float | None = None) -> None:
        now_ms = int((time.time() if now_s is None else now_s) * 1000)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(self.key, {name: now_ms})
        pipe.zremrangebyscore(self.key, "-inf", now_ms - int(FORGET_AFTER_S * 1000))
        await pipe.execute()

    async def recent(self, within_s: float = SEEN_WITHIN_S, now_s: float | None = None) -> list[str]:
        """Names announced within ``within_s``, the most recently announced first."""
        now_ms = int((time.time() if now_s is None else now_s) * 1000)
        names = await self.redis.zrevrangebyscore(self.key, "+inf", now_ms - int(within_s * 1000))
        return [n.decode() if isinstance(n, bytes) else str(n) for n in names]
