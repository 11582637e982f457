"""Which pub/sub connection holds which channel: one on a standalone server, one per master on a Redis Cluster.

``Channels`` is what its owner (consumer.streaming.hub, generator.lease) subscribes through: it makes a shard
(broker.redis.pubsub.shard) per connection, keeps each channel on the shard of the master that owns its slot,
moves channels when slots move (``reroute``) and drops a shard left with none (``retire``), so connections
stay bounded by the masters in use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import SlotNotCoveredError

from broker.redis.connection import RedisClient, connect_node
from broker.redis.errors import UNAVAILABLE_ERRORS, is_unavailable, store_errors
from broker.redis.pubsub.dispatch import OnMessage
from broker.redis.pubsub.shard import Shard

log = logging.getLogger("rsb.pubsub")

OnReset = Callable[[Iterable[bytes]], None]


class Channels:
    """Channels of one process over one pub/sub connection per server (standalone) or per master (cluster)."""

    def __init__(self, redis: RedisClient, *, on_message: OnMessage, on_reset: OnReset) -> None:
        self._redis = redis
        self._cluster = redis if isinstance(redis, RedisCluster) else None
        self.on_message = on_message
        self.on_reset = on_reset
        self._shards: dict[str, Shard] = {}
        self._where: dict[bytes, Shard] = {}
        self._retired_reconnects = 0
        self._reroute_lock = asyncio.Lock()

    @property
    def connections(self) -> int:
        """Pub/sub connections held (or being re-established) now."""
        return len(self._shards)

    @property
    def reconnects(self) -> int:
        return self._retired_reconnects + sum(s.reconnects for s in self._shards.values())

    @property
    def healthy(self) -> bool:
        """Every pub/sub connection is up and alive (broker.redis.pubsub.liveness): what this process hears is live."""
        return all(s.healthy for s in self._shards.values())

    async def start(self) -> None:
        if self._cluster is None:
            # Connect now, so the first readers find a live connection and need no resync.
            self._shard("", lambda: self._redis.pubsub(), sharded=False)
            return
        with contextlib.suppress(*UNAVAILABLE_ERRORS):
            await self._cluster.initialize()  # the slot map; retried at the first subscribe otherwise

    async def stop(self) -> None:
        shards = list(self._shards.values())
        self._shards.clear()
        self._where.clear()
        await asyncio.gather(*(s.stop() for s in shards), return_exceptions=True)

    async def subscribe(self, ch: bytes, *, moved: bool = False) -> asyncio.Future[None] | None:
        """See ``Shard.subscribe``. Raises StoreUnavailable when the command could not be sent; the future fails
        with rsb's error (broker.errors.StoreError) of a lost connection."""
        with store_errors():
            return await self._subscribe(ch, moved)

    async def _subscribe(self, ch: bytes, moved: bool) -> asyncio.Future[None] | None:
        shard = self._where.get(ch)
        if shard is None:
            shard = await self._shard_for(ch)
            self._where[ch] = shard
        if moved:
            shard.resubscribe(ch)
        try:
            return await shard.subscribe(ch)
        except asyncio.CancelledError:
            if ch not in shard.channels and self._where.get(ch) is shard:
                del self._where[ch]  # the shard took it back (see Shard.subscribe)
            raise

    def unsubscribe(self, ch: bytes) -> None:
        shard = self._where.pop(ch, None)
        if shard is not None:
            shard.unsubscribe(ch)

    async def _shard_for(self, ch: bytes) -> Shard:
        if self._cluster is None:
            return self._shard("", lambda: self._redis.pubsub(), sharded=False)
        cluster = self._cluster
        await cluster.initialize()
        node = cluster.get_node_from_key(ch.decode())
        if node is None:
            raise SlotNotCoveredError(f"no master owns the slot of {ch!r}")
        host, port = node.host, int(node.port)
        return self._shard(node.name, lambda: _node_pubsub(cluster, host, port), sharded=True)

    def _shard(self, name: str, connect: Callable[[], PubSub], *, sharded: bool) -> Shard:
        shard = self._shards.get(name)
        if shard is None:
            shard = self._shards[name] = Shard(self, name, connect, sharded)
            shard.start()
        return shard

    def retire(self, shard: Shard) -> bool:
        """Drop a shard left with no channels (its node failed and its slots moved): connections stay
        bounded by the masters in use. False when it got channels meanwhile."""
        if shard.channels or self._shards.get(shard.name) is not shard:
            return False
        del self._shards[shard.name]
        self._retired_reconnects += shard.reconnects
        return True

    async def reroute(self, shard: Shard) -> None:
        """Cluster: refresh the slot map and move the channels this master no longer owns to their owner.
        Their readers are reset (messages published while the slot moved may be lost)."""
        cluster = self._cluster
        if cluster is None:
            return
        async with self._reroute_lock:
            try:
                await cluster.nodes_manager.initialize()
            except Exception as e:  # it runs in a shard's reconnect loop, which must go on whatever this raised
                if not is_unavailable(e):
                    log.error("could not refresh the cluster's slot map", exc_info=e)
                else:
                    log.warning("could not refresh the cluster's slot map: %s", e)
                return
            moved: list[bytes] = []
            for ch in list(shard.channels):
                try:
                    node = cluster.get_node_from_key(ch.decode())
                except UNAVAILABLE_ERRORS:  # no master owns it in this map: the next reroute looks again
                    continue
                if node is None or node.name == shard.name:
                    continue
                shard.channels.discard(ch)
                self._where.pop(ch, None)
                moved.append(ch)
            for ch in moved:
                with contextlib.suppress(*UNAVAILABLE_ERRORS):  # the shard's reconnect subscribes it
                    await self._subscribe(ch, moved=True)
            if moved:
                log.info("channels moved to another master", extra={"node": shard.name, "channels": len(moved)})
                self.on_reset(moved)


def _node_pubsub(cluster: RedisCluster, host: str, port: int) -> PubSub:
    client: Redis = connect_node(cluster, host, port, health_check_s=0)
    return client.pubsub()
