"""What the two stores of rsb's streams share: the consumer's StreamStore (broker.streams.stream_store) and the
generator's JobStore (broker.streams.job_store).

They are the only modules that talk to Redis about streams and jobs. Every change to a stream and its job is one Lua
script of broker.streams.scripts or broker.streams.queue_scripts, so each is atomic; reads are plain commands, made
there too, so that no other module names a Redis key or a command. Here: the client and its partitions, the
scripts' registration for the durability level and their calls through the replica gate, the read batcher, and
reading a stream's events (a reader's replay, a worker continuing a stream).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any, Self

from broker.events import Event, EventPage
from broker.redis.batching import CommandBatcher
from broker.redis.connection import RAW_ENTRIES, RedisClient, is_cluster, register_script, xrange_raw
from broker.redis.lua import Lua
from broker.streams import replication
from broker.streams.keys import QueueKeys, StreamKeys

# Waiting streams whose `queued` position is refreshed on each claim, create and unhold (bounds the script's work).
POSITION_UPDATES = 32


class StoreBase:
    """A client of rsb's streams in Redis. Holds no state beyond the client and the registered scripts.

    Works unchanged on a standalone server and on Redis Cluster (``redis`` a RedisCluster): every call touches the
    keys of one partition, i.e. one hash slot, except the per-partition loops."""

    def __init__(self, redis: RedisClient, partitions: int = 1, *, durability_level: str = replication.LOCAL,
                 replica_wait_ms: int = 1000, replica_patience_s: float | None = None,
                 gate: replication.ReplicaGate | None = None) -> None:
        self.redis = redis
        self.partitions = partitions
        self.cluster = is_cluster(redis)
        # The reads every attaching reader makes (status, replay) and a worker's renewals go out in shared
        # pipelines (a reconnect storm makes thousands at once: broker.redis.batching).
        self._batch = CommandBatcher(redis)
        self._replicated = durability_level == replication.REPLICATED
        # replicated: events become visible (published, readable) only once a replica has them. ``gate``: another
        # store's (``beside``), which stays that store's to close.
        self._own_gate = gate is None
        self.gate = (gate or replication.ReplicaGate(redis, wait_ms=replica_wait_ms, patience_s=replica_patience_s)
                     if self._replicated else None)

    @classmethod
    def beside(cls, other: StoreBase) -> Self:
        """A store of this kind on ``other``'s client, partitions and durability (its replica gate too): a worker
        that ends a conversation's turn starts the next one, which is the consumer's StreamStore's to do."""
        return cls(other.redis, other.partitions,
                   durability_level=replication.REPLICATED if other._replicated else replication.LOCAL,
                   gate=other.gate)

    def _register(self, script: Lua) -> Any:
        return register_script(self.redis, replication.prepare(script.text, replicated=self._replicated))

    def queue(self, partition: int, model: str) -> QueueKeys:
        return QueueKeys(partition, self.partitions, model)

    def keys(self, stream_id: uuid.UUID) -> StreamKeys:
        return StreamKeys.of(stream_id, self.partitions)

    async def _call(self, k: StreamKeys, script: Any, keys: list[str], args: list[Any],
                    visible: Callable[[Any], str | None]) -> Any:
        """Run one of a stream's scripts. At ``replicated`` through the gate: its events become visible up to
        ``visible(result)`` ('' = the stream's last; None: nothing new) once a replica has them."""
        if self.gate is None:
            return await script(keys=keys, args=args)
        return await self.gate.call(k, script, keys, args, visible)

    async def read(self, stream_id: uuid.UUID, after_id: str | None, count: int = 512, *,
                   visible_only: bool = True) -> Sequence[Event]:
        """Events strictly after ``after_id`` (None: from the start), at most ``count``. ``visible_only``:
        what readers may see (at ``replicated``, up to the watermark); a worker continuing a stream reads it all."""
        k = self.keys(stream_id)
        if self.gate is not None and visible_only:
            return (await self.gate.read(k, after_id, count, check=False))[0]
        return EventPage(await self._xrange(k.events, "-" if after_id is None else f"({after_id}", count))

    async def _xrange(self, key: str, start: str, count: int) -> Any:
        """``xrange_raw`` through the read batcher: a burst of attaching readers' replays go out together."""
        if self._batch.direct:
            return await xrange_raw(self.redis, key, start, count)
        return await self._batch.execute("XRANGE", key, start, "+", "COUNT", count, keys=[key], **{RAW_ENTRIES: True})

    async def aclose(self) -> None:
        """Close what the store opened itself (the replica gate's per-master clients); the client is the caller's."""
        if self.gate is not None and self._own_gate:
            await self.gate.aclose()
