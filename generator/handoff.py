"""The bounded hand-off from the inference thread to the event loop.

The thread puts one piece of text per token; the loop takes everything available at once, so tokens
that arrive while an append is in flight are coalesced into the next one. Putting costs a lock and,
only when the loop is waiting, one ``call_soon_threadsafe``: cheap enough to keep per-token cost flat.
When the loop falls behind (Redis slow or down) the thread blocks, so memory stays bounded.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class Batch:
    pieces: list[str]
    closed: bool  # the producer finished (or failed: see ``error``) and nothing more will come
    error: BaseException | None = None
    progress: tuple[int, int] | None = None  # the latest prefill progress, if any came since the last get


class TokenHandoff:
    def __init__(self, loop: asyncio.AbstractEventLoop, max_pending: int) -> None:
        self._loop = loop
        self._items: deque[str] = deque()
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        self._max_pending = max_pending
        # The loop's waiter while it waits (set from the thread with call_soon_threadsafe): a bare future, not
        # an asyncio.Event awaited through wait_for, which costs a task and a timer per token.
        self._waiter: asyncio.Future[None] | None = None
        self._waiting = False
        self._closed = False
        self._error: BaseException | None = None
        self._abandoned = False
        self._progress: tuple[int, int] | None = None

    # -- producer (inference thread) -----------------------------------------------------------

    def put(self, piece: str) -> bool:
        """Hand over one token's text. Blocks while the buffer is full; False once the consumer left."""
        with self._space:
            while len(self._items) >= self._max_pending and not self._abandoned:
                self._space.wait(timeout=0.5)
            if self._abandoned:
                return False
            self._items.append(piece)
            wake = self._waiting
            self._waiting = False
        if wake:
            self._loop.call_soon_threadsafe(self._wake)
        return True

    def progress(self, processed: int, total: int) -> None:
        """Prefill progress (only the latest value is kept: it replaces, never queues)."""
        with self._lock:
            self._progress = (processed, total)
            wake = self._waiting
            self._waiting = False
        if wake:
            self._loop.call_soon_threadsafe(self._wake)

    def close(self, error: BaseException | None = None) -> None:
        with self._lock:
            self._closed = True
            self._error = error
            self._waiting = False
        self._loop.call_soon_threadsafe(self._wake)

    # -- consumer (event loop) -----------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self, timeout_s: float | None = None) -> Batch:
        """Everything handed over so far (at least one piece unless closed or timed out)."""
        while True:
            with self._space:
                if self._items or self._closed or self._progress is not None:
                    pieces = list(self._items)
                    self._items.clear()
                    progress, self._progress = self._progress, None
                    self._space.notify_all()
                    return Batch(pieces, self._closed and not self._items, self._error, progress)
                self._waiting = True
                waiter = self._waiter = self._loop.create_future()
            timer = self._loop.call_later(timeout_s, self._wake) if timeout_s is not None else None
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            with self._lock:
                if not (self._items or self._closed or self._progress is not None):
                    self._waiting = False
                    return Batch([], False)  # timed out

    def abandon(self) -> None:
        """The consumer stops reading: unblock the producer for good."""
        with self._space:
            self._abandoned = True
            self._space.notify_all()
