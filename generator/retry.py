"""Redis operations a worker must not give up on: it outlives Redis restarts, failovers and Redis running out of
memory.

Two transient conditions, each an error of rsb's Store family (broker.errors, mapped from redis-py's once, in
broker.redis.connection): Redis away (``StoreUnavailable``: retried, logged per retry) and Redis full
(``StoreFull``: the server refuses writes until memory is freed). A full Redis pauses every write of the worker
(appends, terminal events, claims) until memory returns: retried by the backoff, with one log line when the pause
starts and one when it ends for the whole process (``OUT_OF_MEMORY``, broker.storage), never one per retry, and
the refusals counted (``rsb_generator_storage_full_total``). Fencing and the appends' sequence numbers make every
retry safe: nothing is lost or written twice.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from broker.backoff import Attempts, Backoff
from broker.errors import StoreFull, StoreUnavailable
from broker.storage import OutOfMemoryEpisodes

log = logging.getLogger("rsb.generator")

T = TypeVar("T")

#: This process's episodes of a full Redis (the worker wires its metric in: generator.worker).
OUT_OF_MEMORY = OutOfMemoryEpisodes(log, "the generator")
#: Waiting for memory: soon at first (a filler freed at once), then every 2 s at most, so a generation goes on
#: within about 2 s of memory coming back.
OUT_OF_MEMORY_BACKOFF = Backoff(base_s=0.1, cap_s=2.0)


async def until_done(op: Callable[[], Awaitable[T]], what: str = "redis unavailable") -> T:
    """Run ``op`` until it succeeds, waiting by the backoff between transient failures."""
    attempts = Attempts()
    full = Attempts(OUT_OF_MEMORY_BACKOFF)
    while True:
        try:
            result = await op()
        except StoreUnavailable as e:  # Redis away for now: retried; anything else is a bug and propagates
            log.warning("%s, retrying: %s", what, e)
            await attempts.sleep()
            continue
        except StoreFull:
            OUT_OF_MEMORY.refused(what)
            await full.sleep()
            continue
        if OUT_OF_MEMORY.active:
            OUT_OF_MEMORY.recovered()
        return result
