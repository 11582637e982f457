"""The Redis server's time outside a script, for a time a pod names before a script runs or never hands to one.

A script reads the server's clock itself (``SERVER_MS``). A pod that must state a time (a read token's expiry, a
conversation item's ``created_at``, a budget period's name, a Durable Streams cursor) reads it here: the server's
TIME once, then the offset from this process's monotonic clock, so every pod states the time the server keeps and
none pays a round trip per request. The offset is read again every ``refresh_s`` in the background (a request never
waits for it but the first); a failed re-read keeps the last offset (a monotonic clock drifts by well under a
second a day). On Redis Cluster the clock is partition 0's master's, as the usage report's is.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from broker.redis.connection import RedisClient, register_script
from broker.redis.keyspace import tagged
from broker.redis.lua import SERVER_MS, Lua

#: How often a pod reads the server's TIME again: often enough that a server whose clock was stepped (NTP) is
#: followed within a minute, rarely enough to cost nothing.
REFRESH_S = 30.0

#: The server's time (Unix ms). The route key is never written: it only sends the script to partition 0's shard.
_SERVER_NOW = Lua(SERVER_MS + "return server_ms()\n", key_names=("route",))


async def server_now_s(redis: RedisClient, partitions: int) -> float:
    """The Redis server's time now (Unix seconds, to the millisecond): one round trip."""
    now = register_script(redis, _SERVER_NOW.text)
    return int(await now(keys=_SERVER_NOW.keys({"route": f"{tagged(0, partitions)}:clock"}))) / 1000


class ServerClock:
    """``await now()``: the Redis server's time (Unix seconds) as this process's monotonic clock carries it on."""

    def __init__(self, read: Callable[[], Awaitable[float]], refresh_s: float = REFRESH_S,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._read = read
        self._refresh_s = refresh_s
        self._monotonic = monotonic
        self._offset: float | None = None  # the server's Unix time minus the monotonic clock
        self._read_at = 0.0  # monotonic time of the last read that began
        self._first: asyncio.Future[None] | None = None
        self._again: asyncio.Task[None] | None = None

    @classmethod
    def of(cls, redis: RedisClient, partitions: int, refresh_s: float = REFRESH_S) -> ServerClock:
        return cls(lambda: server_now_s(redis, partitions), refresh_s)

    async def now(self) -> float:
        """The server's time. The first call reads it (raising what the read raises: Redis away, the caller's
        503, and the next call tries again); every later one answers from the offset."""
        if self._offset is None:
            if self._first is None:
                self._first = asyncio.ensure_future(self._sample())
            first = self._first
            try:
                await asyncio.shield(first)  # one read for every request waiting on the first
            finally:
                if first.done() and (first.cancelled() or first.exception() is not None) and self._first is first:
                    self._first = None
            assert self._offset is not None
        elif self._monotonic() - self._read_at >= self._refresh_s and self._again is None:
            self._again = asyncio.ensure_future(self._sample_again())
        return self._monotonic() + self._offset

    async def _sample(self) -> None:
        self._read_at = before = self._monotonic()
        server = await self._read()
        # Sent halfway through the round trip, as near as this process can tell.
        self._offset = server - (before + self._monotonic()) / 2

    async def _sample_again(self) -> None:
        try:
            with contextlib.suppress(Exception):
                await self._sample()
        finally:
            self._again = None
