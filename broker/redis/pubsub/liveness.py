"""Whether a pub/sub connection is alive: a quiet one is pinged, a silent one is declared dead.

A pub/sub connection waits for messages with no command in flight, so no socket timeout can tell a quiet link
from a half-open one (no FIN, no RST: the network stopped delivering). Silent for PING_AFTER_S, it is sent a
PING; silent for DEAD_AFTER_S (the pong never came), ``watch`` raises, its shard drops it and makes it again,
and its channels are reset (their readers re-read the stream). So a dead link is noticed within
DEAD_AFTER_S + WATCH_TICK_S.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError

PING_AFTER_S = 3.0
DEAD_AFTER_S = 8.0
WATCH_TICK_S = 1.0


async def watch(ps: PubSub, heard_at: Callable[[], float], lock: asyncio.Lock) -> None:
    """Ping ``ps`` when quiet; raise once it stayed silent past DEAD_AFTER_S. ``heard_at`` is when Redis was last
    heard on it (the loop's clock); ``lock`` orders the PING with the shard's other commands."""
    loop = asyncio.get_running_loop()
    pinged_at = 0.0
    while True:
        await asyncio.sleep(WATCH_TICK_S)
        now = loop.time()
        last = heard_at()
        silent = now - last
        if silent >= DEAD_AFTER_S:
            raise RedisConnectionError(f"the pub/sub connection was silent for {silent:.1f}s: a dead link")
        if silent >= PING_AFTER_S and pinged_at <= last:
            pinged_at = now
            async with lock:  # never between the parts of another command
                await ps.ping()
