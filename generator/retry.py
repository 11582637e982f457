"""Redis operations a worker must not give up on: it outlives Redis restarts and failovers."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from broker.backoff import Attempts
from broker.redis.connection import UNAVAILABLE_ERRORS

log = logging.getLogger("rsb.generator")

T = TypeVar("T")


async def until_done(op: Callable[[], Awaitable[T]], what: str = "redis unavailable") -> T:
    """Run ``op`` until it succeeds, waiting by the backoff between transient failures."""
    attempts = Attempts()
    while True:
        try:
            return await op()
        except UNAVAILABLE_ERRORS as e:  # Redis away for now: retried; anything else is a bug and propagates
            log.warning("%s, retrying: %s", what, e)
            await attempts.sleep()
