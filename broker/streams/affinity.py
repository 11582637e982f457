"""Chat-affine claiming: which worker ran a chat last, so holds its prompt's prefix in its cache. A claim that meets
a job of that chat leaves it for that worker for a while (broker.streams.queue_scripts.CLAIM_NEXT: why a left job
never strands); this module records the owner, a hint any worker may overwrite."""

from __future__ import annotations

from broker.redis.connection import RedisClient
from broker.streams.keys import affinity_key


class ChatAffinity:
    def __init__(self, redis: RedisClient, partitions: int) -> None:
        self.redis = redis
        self.partitions = partitions

    async def note(self, affinity: str, worker_id: str, ttl_s: int) -> None:
        """``worker_id`` holds this chat's prefix now: its next turns wait for it (a hint: last writer wins).
        In every partition, since the next turn's stream may be in any: one pipeline, not P round trips."""
        if not affinity:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for p in range(self.partitions):
                pipe.set(affinity_key(p, self.partitions, affinity), worker_id, ex=ttl_s)
            await pipe.execute()
