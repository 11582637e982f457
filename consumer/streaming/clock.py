"""One clock for every reader of the pod: heartbeats and wake-ups fall on shared granules.

A reader waiting for its next event with a timeout (the heartbeat due ``heartbeat_s`` after its last
write) would otherwise arm a timer of its own for every wait: one timer set and cancelled per event per
reader, a fifth of the consumer's CPU with many live readers. Here deadlines are rounded up to the next
``granule_s`` and every callback due in one granule shares one loop timer, so a pod holds at most one
timer per granule however many readers wait, and an event that wakes a reader early costs a set removal.
A wake-up comes at most ``granule_s`` late, never early.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

GRANULE_S = 0.05


class Clock:
    def __init__(self, granule_s: float = GRANULE_S) -> None:
        self.granule_s = granule_s
        self._buckets: dict[int, set[Callable[[], None]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def now(self) -> float:
        return self._get_loop().time()

    def call_at(self, when: float, callback: Callable[[], None]) -> int:
        """Run ``callback`` at ``when`` (loop time) or up to a granule later; returns the key ``cancel``
        takes. A callback is one entry of a set: schedule a bound method or a closure per waiter."""
        key = math.ceil(when / self.granule_s)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = set()
            self._get_loop().call_at(key * self.granule_s, self._fire, key)
        bucket.add(callback)
        return key

    def cancel(self, key: int, callback: Callable[[], None]) -> None:
        bucket = self._buckets.get(key)
        if bucket is not None:
            bucket.discard(callback)  # an empty bucket's timer still fires once, and finds nothing

    def _fire(self, key: int) -> None:
        for callback in self._buckets.pop(key, ()):
            callback()

    def _get_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop
