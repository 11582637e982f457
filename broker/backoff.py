"""The one backoff of rsb: exponential, capped, with jitter. Workers waiting for Redis, the pub/sub
reconnect loop, redis-py's own command retries (through ``broker.redis.connection``) and the Python client's
reconnects all wait by it, so clients that lost the same server never come back in lockstep.

Attempt ``n`` (from 0) waits a random time in ``[floor * d, d]`` with ``d = min(cap_s, base_s * 2**n)``:
``floor`` 0 is "full jitter" (the client's choice: many independent browsers and scripts), 0.5 keeps a
worker's retries from coming back too early. A server's ``Retry-After`` raises the wait, still capped.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    base_s: float = 0.1
    cap_s: float = 5.0
    floor: float = 0.5

    def delay(self, attempt: int, retry_after_s: float | None = None) -> float:
        top = min(self.cap_s, self.base_s * 2 ** min(attempt, 62))
        d = random.uniform(self.floor * top, top)
        if retry_after_s is not None:  # the server said when; still bounded, so a huge value cannot hang us
            d = max(d, min(retry_after_s, self.cap_s))
        return d


class Attempts:
    """Consecutive failures of one operation, and the wait before the next try (``reset`` on success)."""

    __slots__ = ("attempt", "backoff")

    def __init__(self, backoff: Backoff | None = None) -> None:
        self.backoff = backoff or Backoff()
        self.attempt = 0

    def next_delay(self, retry_after_s: float | None = None) -> float:
        d = self.backoff.delay(self.attempt, retry_after_s)
        self.attempt += 1
        return d

    async def sleep(self, retry_after_s: float | None = None) -> None:
        await asyncio.sleep(self.next_delay(retry_after_s))

    def reset(self) -> None:
        self.attempt = 0
