"""Chat-affine claiming in Redis: which worker ran a chat last (so holds its prompt in its cache), the inbox
of jobs left for each worker, and the scripts that leave a job there and take it out
(broker.streams.scripts.DEFER and TAKE: why a left job never strands). generator.jobs drives them."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from broker.redis.connection import RedisClient, ensure_group, reply_text
from broker.streams import scripts
from broker.streams.keys import JOBS_GROUP, StreamKeys, affinity_key, inbox_prefix
from broker.streams.records import Job


class ChatAffinity:
    def __init__(self, redis: RedisClient, partitions: int, register: Callable[[str], Any]) -> None:
        self.redis = redis
        self.partitions = partitions
        self._defer = register(scripts.DEFER)
        self._take = register(scripts.TAKE)
        self._ack = register(scripts.ACK)

    def _keys(self, stream_id: uuid.UUID) -> StreamKeys:
        return StreamKeys.of(stream_id, self.partitions)

    def inbox_key(self, partition: int, worker_id: str) -> str:
        """The stream of jobs other workers left for ``worker_id`` (read with the job streams)."""
        return inbox_prefix(partition, self.partitions) + worker_id

    async def ensure_inbox(self, partition: int, worker_id: str) -> None:
        await ensure_group(self.redis, self.inbox_key(partition, worker_id), JOBS_GROUP)

    async def note(self, affinity: str, worker_id: str, ttl_s: int) -> None:
        """``worker_id`` holds this chat's prefix now: its next turns wait for it (a hint: last writer wins).
        In every partition, since the next turn's stream may be in any."""
        for p in range(self.partitions):
            await self.redis.set(affinity_key(p, self.partitions, affinity), worker_id, ex=ttl_s)

    async def defer(self, job: Job, worker_id: str, wait_ms: int, lease_ms: int) -> bool:
        """Leave ``job`` (delivered to this worker) for the worker that holds its chat, if another does and
        the job is younger than ``wait_ms``: True if it was left."""
        if not job.affinity or wait_ms <= 0:
            return False
        k = self._keys(job.stream_id)
        res = await self._defer(keys=[k.jobs, affinity_key(job.partition, self.partitions, job.affinity), k.meta],
                                args=[JOBS_GROUP, worker_id, job.entry_id, wait_ms, lease_ms,
                                      inbox_prefix(job.partition, self.partitions), str(job.stream_id)])
        return reply_text(res) == "deferred"

    async def take(self, job: Job, worker_id: str) -> Job | None:
        """The job an inbox entry names, now this worker's; None if another worker claimed it meanwhile."""
        k = self._keys(job.stream_id)
        got = await self._take(keys=[k.jobs, self.inbox_key(job.partition, worker_id), k.meta],
                               args=[JOBS_GROUP, worker_id, job.entry_id, job.inbox_entry])
        return Job(job.partition, job.entry_id, job.stream_id, job.affinity) if int(got) else None

    async def drop_inbox_entry(self, job: Job, worker_id: str) -> None:
        """An inbox entry this worker will not act on: its job goes to any worker once its wait is over."""
        await self._ack(keys=[self.inbox_key(job.partition, worker_id)], args=[JOBS_GROUP, job.inbox_entry])
