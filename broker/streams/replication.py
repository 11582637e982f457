"""Durability levels: when an appended event becomes visible to readers.

``local`` (the default): as soon as the primary has it. Redis replicates asynchronously, so a primary that
dies may take its last appends with it, after readers saw them; readers are then told so (a ``reset``
event, consumer.streaming.reader), never left with text the stream no longer has without notice.

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
wrote: broker.redis.replicas routes each gated script there, and a MOVED/ASK/READONLY answer or a dead
connection refreshes the slot map and is retried (every script is safe to run twice).

What stays ``local`` even at ``replicated``: the ``queued`` position updates that a claim writes for the
streams still waiting behind it (they become visible with that stream's next gated write, its ``started``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from broker.backoff import Backoff
from broker.events import Event, EventPage
from broker.redis.connection import RedisClient, register_script
from broker.redis.lua import Lua
from broker.redis.replicas import ReplicaWaiter, no_replica
from broker.streams.keys import StreamKeys
from broker.streams.lua import PRELUDE

log = logging.getLogger("rsb.replication")

LOCAL = "local"
REPLICATED = "replicated"

# The scripts publish their events through this function (broker.streams.scripts): a real publish at ``local``, a
# no-op at ``replicated`` (ADVANCE publishes once a replica has them).
_PUBLISH = "local function publish_event(ch, msg) redis.call('PUBLISH', ch, msg) end\n"
_NO_PUBLISH = "local function publish_event(ch, msg) end\n"

# Waits between WAITs that found no replica: the generation is paused meanwhile.
WAIT_RETRY_BACKOFF = Backoff(base_s=0.05, cap_s=2.0)

# Makes the events up to ``upto`` visible: sets the watermark and publishes what it passes, from the stream
# itself (so a payload is never built twice). Monotonic: an older ``upto`` changes nothing. Never creates a
# meta hash (an expired stream stays gone).
ADVANCE = Lua(PRELUDE + """
-- A.upto: '' = the stream's last event
if redis.call('EXISTS', K.meta) == 0 then return false end
local upto = A.upto
if upto == '' then
  local last = redis.call('XREVRANGE', K.events, '+', '-', 'COUNT', 1)
  if #last == 0 then return false end
  upto = last[1][1]
end
local wm = redis.call('HGET', K.meta, 'wm') or '0-0'
local entries = redis.call('XRANGE', K.events, '(' .. wm, upto)
if #entries == 0 then return wm end
for _, e in ipairs(entries) do
  redis.call('PUBLISH', A.channel, entry_payload(e))
end
local top = entries[#entries][1]
redis.call('HSET', K.meta, 'wm', top)
return top
""", key_names=("meta", "events"), arg_names=("channel", "upto"))

# A write whose only purpose is to move this connection's replication offset to "now", so that the WAIT that
# follows covers every earlier write, whoever made it (a retried script that finds its work done, e.g. an append
# whose first try landed before its reply was lost, writes nothing itself; a fresh connection has no offset).
# Called by broker.redis.replicas with its one key.
BUMP = Lua("""
if redis.call('EXISTS', K.meta) == 1 then redis.call('HINCRBY', K.meta, 'wb', 1) end
return 0
""", key_names=("meta",))

# What readers may see at ``replicated``: the events after ``after`` up to the watermark, and (``check``)
# whether ``after`` itself is in the stream (consumer.streaming.reader's reset rule).
READ = Lua("""
-- A.after: '' = from the start
local found = 1
if A.after ~= '' and A.check == '1' then found = #redis.call('XRANGE', K.events, A.after, A.after) end
local wm = redis.call('HGET', K.meta, 'wm')
if not wm then return {found, {}} end
local start = '-'
if A.after ~= '' then start = '(' .. A.after end
return {found, redis.call('XRANGE', K.events, start, wm, 'COUNT', tonumber(A.count))}
""", key_names=("meta", "events"), arg_names=("after", "count", "check"))

def prepare(script: str, *, replicated: bool) -> str:
    """The script with its ``publish_event`` defined for the durability level."""
    return (_NO_PUBLISH if replicated else _PUBLISH) + script


class ReplicaGate:
    """Runs the scripts that append events so that their events become visible only once a replica has
    them (see the module doc). One per store (StreamStore, JobStore) at ``replicated``."""

    def __init__(self, redis: RedisClient, *, wait_ms: int, replicas: int = 1,
                 patience_s: float | None = None) -> None:
        self.redis = redis
        # None: wait for a replica as long as it takes (a worker: its generation pauses). Else give up after
        # this long with a transient error (the consumer: the client gets 503 + Retry-After and retries
        # its idempotent request).
        self.patience_s = patience_s
        self.replicas = replicas
        self.wait_ms = max(1, wait_ms)
        self._waiter = ReplicaWaiter(redis, redis.register_script(BUMP.text), wait_ms=wait_ms, replicas=replicas)
        self._advance = register_script(redis, ADVANCE.text)
        self._read = redis.register_script(READ.text)
        self.paused = 0  # WAITs that found no replica (a metric: time spent paused ~ paused x wait_ms)

    async def aclose(self) -> None:
        await self._waiter.aclose()

    async def write(self, keys: StreamKeys, script: Any, script_keys: list[str], args: list[Any]) -> Any:
        """Run ``script``, then wait until a replica has what it wrote (pausing, with retries, while none
        answers). Raises StoreUnavailable (broker.errors) for the caller to retry."""
        res, acked = await self._waiter.run(keys.meta, script, script_keys, args)
        attempt = 0
        give_up = None if self.patience_s is None else time.monotonic() + self.patience_s
        while acked < self.replicas:
            if give_up is not None and time.monotonic() >= give_up:
                raise no_replica(f"no replica acknowledged the write within {self.patience_s:g} s")
            self.paused += 1
            if attempt == 0:
                log.warning("no replica acknowledged within %d ms: pausing the stream until one does",
                            self.wait_ms, extra={"stream_id": str(keys.stream_id)})
            await asyncio.sleep(WAIT_RETRY_BACKOFF.delay(attempt))
            attempt += 1
            _, acked = await self._waiter.run(keys.meta)
        if attempt:
            log.info("a replica acknowledged: the stream goes on", extra={"stream_id": str(keys.stream_id)})
        return res

    async def advance(self, keys: StreamKeys, upto: str) -> None:
        """Make the stream's events up to ``upto`` ('' = its last) visible and publish them."""
        await self._advance(keys=ADVANCE.keys({"meta": keys.meta, "events": keys.events}),
                            args=ADVANCE.args({"channel": keys.channel, "upto": upto}))

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
        found, entries = await self._read(keys=READ.keys({"meta": keys.meta, "events": keys.events}),
                                          args=READ.args({"after": after_id or "", "count": count,
                                                          "check": "1" if check else "0"}))
        return EventPage(entries), bool(found)  # the script returns entries as XRANGE does

    async def watermark(self, keys: StreamKeys) -> str | None:
        raw = await self.redis.hget(keys.meta, "wm")
        return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)
