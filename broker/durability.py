"""Durability levels: when an appended event becomes visible to readers.

``local`` (the default): as soon as the primary has it. Redis replicates asynchronously, so a primary that
dies may take its last appends with it, after readers saw them; readers are then told so (a ``reset``
event, consumer.reader), never left with text the stream no longer has without notice.

``replicated``: only once a replica has it too. The scripts still write events to the stream, but do not
publish them (``publish_event`` is a no-op in their ``replicated`` form); the writer then issues ``WAIT 1
<replica_wait_ms>`` on the same connection (a pipeline: one round trip with the script), and only when a
replica acknowledged it does ADVANCE move the stream's *watermark* (``wm`` in its meta hash: the newest
event id known to be on a replica) and publish the events up to it. Readers read up to the watermark only.
A replica's acknowledgement covers everything the primary wrote before (replication is one ordered log per
primary), so the watermark never passes an event that a failover could lose.

Each gated pipeline is [script, BUMP, WAIT]: BUMP, a small write, makes the WAIT cover everything written so
far on that master, even when the script itself wrote nothing (a retry that finds its work done). When no
replica answers within ``replica_wait_ms``, the writer WAITs again (BUMP, WAIT) with a backoff, for as long as it takes:
the generation pauses (its bounded token hand-off fills, then the inference thread blocks), readers get
heartbeats, and nothing that could be lost is delivered. Terminal events go through the same gate.

On Redis Cluster the WAIT must run on the master that holds the stream's slot, on the connection that
wrote: the gate sends each gated script through a standalone client of that master (broker.connection
``connect_node``), and a MOVED/ASK/READONLY answer or a dead connection refreshes the slot map and raises
a transient error, which the caller's retry loop retries (every script is safe to run twice).

What stays ``local`` even at ``replicated``: the ``queued`` position updates that a claim writes for the
streams still waiting behind it (they become visible with that stream's next gated write, its ``started``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    ReadOnlyError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker.backoff import Backoff
from broker.connection import COMMAND_TIMEOUT_S, RedisClient, connect_node
from broker.events import Event, EventPage, read_range
from broker.keys import StreamKeys

log = logging.getLogger("rsb.durability")

LOCAL = "local"
REPLICATED = "replicated"

# The scripts publish their events through this function (broker.scripts): a real publish at ``local``, a
# no-op at ``replicated`` (ADVANCE publishes once a replica has them).
_PUBLISH = "local function publish_event(ch, msg) redis.call('PUBLISH', ch, msg) end\n"
_NO_PUBLISH = "local function publish_event(ch, msg) end\n"

# Tries of one gated write whose node failed or moved (a fresh slot map each time) before the caller is told.
ROUTE_TRIES = 3
# Waits between WAITs that found no replica: the generation is paused meanwhile.
WAIT_RETRY_BACKOFF = Backoff(base_s=0.05, cap_s=2.0)

# Makes the events up to ``upto`` visible: sets the watermark and publishes what it passes, from the stream
# itself (so a payload is never built twice). Monotonic: an older ``upto`` changes nothing. Never creates a
# meta hash (an expired stream stays gone).
ADVANCE = """
-- KEYS: meta, events ; ARGV: channel, upto ('' = the stream's last event)
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local upto = ARGV[2]
if upto == '' then
  local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
  if #last == 0 then return false end
  upto = last[1][1]
end
local wm = redis.call('HGET', KEYS[1], 'wm') or '0-0'
local entries = redis.call('XRANGE', KEYS[2], '(' .. wm, upto)
if #entries == 0 then return wm end
for _, e in ipairs(entries) do
  redis.call('PUBLISH', ARGV[1], e[1] .. '\\n' .. e[2][2] .. '\\n' .. e[2][4])
end
local top = entries[#entries][1]
redis.call('HSET', KEYS[1], 'wm', top)
return top
"""

# A write whose only purpose is to move this connection's replication offset to "now", so that the WAIT that
# follows covers every earlier write, whoever made it (a retried script that finds its work done, e.g. an append
# whose first try landed before its reply was lost, writes nothing itself; a fresh connection has no offset).
BUMP = """
-- KEYS: meta
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HINCRBY', KEYS[1], 'wb', 1) end
return 0
"""

# What readers may see at ``replicated``: the events after ``after`` up to the watermark, and (``check``)
# whether ``after`` itself is in the stream (consumer.reader's reset rule).
READ = """
-- KEYS: meta, events ; ARGV: after ('' = from the start), count, check
local found = 1
if ARGV[1] ~= '' and ARGV[3] == '1' then found = #redis.call('XRANGE', KEYS[2], ARGV[1], ARGV[1]) end
local wm = redis.call('HGET', KEYS[1], 'wm')
if not wm then return {found, {}} end
local start = '-'
if ARGV[1] ~= '' then start = '(' .. ARGV[1] end
return {found, redis.call('XRANGE', KEYS[2], start, wm, 'COUNT', tonumber(ARGV[2]))}
"""

#: A node answered for a slot it no longer owns, or is no longer a master: refresh the slot map and retry.
_STALE_ROUTE = (MovedError, AskError, ReadOnlyError, ClusterDownError, TryAgainError, RedisConnectionError,
                RedisTimeoutError, OSError)


def prepare(script: str, *, replicated: bool) -> str:
    """The script with its ``publish_event`` defined for the durability level."""
    return (_NO_PUBLISH if replicated else _PUBLISH) + script


class ReplicaGate:
    """Runs the scripts that append events so that their events become visible only once a replica has
    them (see the module doc). One per Store at ``replicated``."""

    def __init__(self, redis: RedisClient, *, wait_ms: int, replicas: int = 1,
                 patience_s: float | None = None) -> None:
        self.redis = redis
        self.wait_ms = max(1, wait_ms)
        # None: wait for a replica as long as it takes (a worker: its generation pauses). Else give up after
        # this long with a transient error (the consumer: the client gets 503 + Retry-After and retries
        # its idempotent request).
        self.patience_s = patience_s
        self.replicas = replicas
        self._cluster = redis if isinstance(redis, RedisCluster) else None
        self._nodes: dict[str, Redis] = {}
        self._bump: Any = redis.register_script(BUMP)
        self._advance = redis.register_script(
            ADVANCE.replace("redis.call('PUBLISH',", "redis.call('SPUBLISH',") if self._cluster else ADVANCE)
        self._read = redis.register_script(READ)
        self.paused = 0  # WAITs that found no replica (a metric: time spent paused ~ paused x wait_ms)

    async def _node(self, key: str) -> RedisClient:
        """The client whose one pipeline connection reaches the master of ``key``'s slot."""
        cluster = self._cluster
        if cluster is None:
            return self.redis
        await cluster.initialize()
        node = cluster.get_node_from_key(key)
        if node is None:
            raise TryAgainError(f"no master serves the slot of {key!r} now")
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

    async def _wait(self, client: RedisClient, meta: str, script: Any | None = None, keys: list[str] | None = None,
                    args: list[Any] | None = None) -> tuple[Any, int]:
        """``script`` (if any), BUMP and WAIT in one pipeline: on one connection, in one round trip."""
        try:
            async with client.pipeline(transaction=False) as pipe:
                if script is not None:
                    await script(keys=keys, args=args, client=pipe)
                await self._bump(keys=[meta], args=[], client=pipe)
                pipe.execute_command("WAIT", self.replicas, self.wait_ms)
                replies = await pipe.execute()
            res, acked = (replies[0] if script is not None else None), replies[-1]
        except _STALE_ROUTE as e:
            await self._stale()
            if isinstance(e, RedisConnectionError | RedisTimeoutError | OSError):
                raise
            raise TryAgainError(f"the stream's slot moved or its master changed: {e}") from e
        return res, int(acked)

    async def write(self, keys: StreamKeys, script: Any, script_keys: list[str], args: list[Any]) -> Any:
        """Run ``script``, then wait until a replica has what it wrote (pausing, with retries, while none
        answers). Raises transient errors (broker.connection.UNAVAILABLE_ERRORS) for the caller to retry."""
        for tries in range(ROUTE_TRIES):
            # A pooled connection to a node that has since died, or a slot map from before a failover, fails
            # the first try: the slot map is read again (``_wait``) and the script retried (they are all safe
            # to run twice), so a failover long past costs a caller no error.
            try:
                client = await self._node(keys.meta)
                res, acked = await self._wait(client, keys.meta, script, script_keys, args)
                break
            except _STALE_ROUTE:
                if tries == ROUTE_TRIES - 1:
                    raise
                await asyncio.sleep(WAIT_RETRY_BACKOFF.delay(tries))
        attempt = 0
        give_up = None if self.patience_s is None else time.monotonic() + self.patience_s
        while acked < self.replicas:
            if give_up is not None and time.monotonic() >= give_up:
                raise TryAgainError(f"no replica acknowledged the write within {self.patience_s:g} s")
            self.paused += 1
            if attempt == 0:
                log.warning("no replica acknowledged within %d ms: pausing the stream until one does",
                            self.wait_ms, extra={"stream_id": str(keys.stream_id)})
            await asyncio.sleep(WAIT_RETRY_BACKOFF.delay(attempt))
            attempt += 1
            _, acked = await self._wait(client, keys.meta)
        if attempt:
            log.info("a replica acknowledged: the stream goes on", extra={"stream_id": str(keys.stream_id)})
        return res

    async def advance(self, keys: StreamKeys, upto: str) -> None:
        """Make the stream's events up to ``upto`` ('' = its last) visible and publish them."""
        await self._advance(keys=[keys.meta, keys.events], args=[keys.channel, upto])

    async def call(self, keys: StreamKeys, script: Any, script_keys: list[str], args: list[Any],
                   visible: Callable[[Any], str | None]) -> Any:
        """``write``, then ``advance`` up to what ``visible(result)`` names (None: nothing to show)."""
        res = await self.write(keys, script, script_keys, args)
        upto = visible(res)
        if upto is not None:
            await self.advance(keys, upto)
        return res

    async def read(self, keys: StreamKeys, after_id: str | None, count: int, *,
                   check: bool) -> tuple[Sequence[Event], bool]:
        """Visible events after ``after_id`` and whether ``after_id`` is in the stream (always True
        unless ``check``)."""
        found, entries = await self._read(keys=[keys.meta, keys.events],
                                          args=[after_id or "", count, "1" if check else "0"])
        return EventPage(entries), bool(found)  # the script returns entries as XRANGE does

    async def watermark(self, keys: StreamKeys) -> str | None:
        raw = await self.redis.hget(keys.meta, "wm")
        return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)


async def read_after(redis: RedisClient, gate: ReplicaGate | None, keys: StreamKeys, after_id: str,
                     count: int) -> tuple[Sequence[Event], bool]:
    """Up to ``count`` readable events after ``after_id``, and whether ``after_id`` is in the stream. One
    round trip: the range starts AT ``after_id`` (inclusive) and drops it when it is there."""
    if gate is not None:
        return await gate.read(keys, after_id, count, check=True)
    events = await read_range(redis, keys.events, after_id, count + 1)
    if events and events[0].id == after_id:
        return events[1:], True
    return events[:count], False


async def last_common_id(redis: RedisClient, keys: StreamKeys, after_id: str) -> str | None:
    """The newest event id of the stream that is not newer than ``after_id`` (None: no such event)."""
    entries: Any = await redis.xrevrange(keys.events, max=after_id, min="-", count=1)
    if not entries:
        return None
    eid = entries[0][0]
    return eid.decode() if isinstance(eid, bytes) else str(eid)
