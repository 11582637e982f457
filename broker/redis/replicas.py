"""Writes that wait for replicas: a script, then ``WAIT``, on one connection of the master that owns the
written key's slot (broker.streams.replication builds the ``replicated`` durability level on it).

``WAIT`` counts the replicas that acknowledged everything written *on this connection* so far, so the script
and its WAIT go in one pipeline (one connection, one round trip), preceded by a small write of the caller's
(``bump``) that moves the connection's replication offset to "now" even when the script itself wrote nothing
(a retry that finds its work done; a fresh connection has no offset).

On Redis Cluster that connection must reach the master of the key's slot: each write goes through a standalone
client of that master (``connect_node``), and a MOVED/ASK/READONLY answer or a dead connection (StoreUnavailable,
as that client maps them) refreshes the slot map and is retried a few times (every script rsb gates is safe to run
twice) before the caller is told, with that StoreUnavailable, which it retries in turn.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from broker.backoff import Backoff
from broker.errors import StoreUnavailable
from broker.redis.connection import COMMAND_TIMEOUT_S, RedisClient, Script, connect_node
from broker.redis.errors import store_errors

log = logging.getLogger("rsb.redis")

# Tries of one write whose node failed or moved (a fresh slot map each time) before the caller is told.
ROUTE_TRIES = 3
ROUTE_RETRY_BACKOFF = Backoff(base_s=0.05, cap_s=2.0)


def no_replica(message: str) -> Exception:
    """The transient error of a write that no replica acknowledged in time (the caller retries it)."""
    return StoreUnavailable(message)


class ReplicaWaiter:
    """Runs scripts and waits for ``replicas`` replicas to acknowledge them, each WAIT bounded by ``wait_ms``
    (see the module doc). ``bump``: the caller's small write (a registered script taking one key)."""

    def __init__(self, redis: RedisClient, bump: Script, *, wait_ms: int, replicas: int = 1) -> None:
        self.redis = redis
        self.wait_ms = max(1, wait_ms)
        self.replicas = replicas
        self._bump = bump
        self._cluster = redis if isinstance(redis, RedisCluster) else None
        self._nodes: dict[str, Redis] = {}

    async def _node(self, key: str) -> RedisClient:
        """The client whose one pipeline connection reaches the master of ``key``'s slot."""
        cluster = self._cluster
        if cluster is None:
            return self.redis
        with store_errors():
            await cluster.initialize()
            node = cluster.get_node_from_key(key)
        if node is None:
            raise StoreUnavailable(f"no master serves the slot of {key!r} now")
        client = self._nodes.get(node.name)
        if client is None:
            timeout_s = COMMAND_TIMEOUT_S + self.wait_ms / 1000
            client = self._nodes[node.name] = connect_node(cluster, node.host, int(node.port), max_connections=8,
                                                           socket_timeout=timeout_s)
        return client

    async def aclose(self) -> None:
        """Close the per-master clients (the shared client is its owner's to close)."""
        nodes, self._nodes = list(self._nodes.values()), {}
        for client in nodes:
            await client.aclose()

    async def _stale(self) -> None:
        """The slot map is out of date (a failover or a slot move): read it again before the retry."""
        if self._cluster is None:
            return
        try:
            await self._cluster.nodes_manager.initialize()
        except Exception as e:  # the caller retries anyway, and refreshes again then
            log.warning("could not refresh the cluster's slot map: %s", e)

    async def _once(self, key: str, script: Script | None, keys: list[str] | None, args: list[Any] | None
                    ) -> tuple[Any, int]:
        """``script`` (if any), the bump and WAIT in one pipeline: on one connection, in one round trip."""
        try:
            client = await self._node(key)
            async with client.pipeline(transaction=False) as pipe:
                if script is not None:
                    await script(keys=keys, args=args, client=pipe)
                await self._bump(keys=[key], args=[], client=pipe)
                pipe.execute_command("WAIT", self.replicas, self.wait_ms)
                replies = await pipe.execute()
            res, acked = (replies[0] if script is not None else None), replies[-1]
        except StoreUnavailable:  # the node is gone, or answered for a slot it no longer owns (MOVED, READONLY)
            await self._stale()
            raise
        return res, int(acked)

    async def run(self, key: str, script: Script | None = None, keys: list[str] | None = None,
                  args: list[Any] | None = None) -> tuple[Any, int]:
        """Run ``script`` (None: only the bump) on the master of ``key``'s slot and WAIT: (its reply, the
        replicas that acknowledged). A pooled connection to a node that has since died, or a slot map from
        before a failover, fails the first try: the slot map is read again and the script retried, so a
        failover long past costs a caller no error."""
        for tries in range(ROUTE_TRIES):
            try:
                return await self._once(key, script, keys, args)
            except StoreUnavailable:
                if tries == ROUTE_TRIES - 1:
                    raise
                await asyncio.sleep(ROUTE_RETRY_BACKOFF.delay(tries))
        raise AssertionError("unreachable")
