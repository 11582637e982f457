"""A worker's generation slots (``--concurrency``), and parking: a generation whose write Redis cannot take
now (no replica acknowledges it at ``--durability replicated``, its shard's primary is down) gives its slot
back while it waits, so the worker serves streams on healthy shards meanwhile.

A parked generation keeps its claim (its fence), its lease (renewed as before) and its place in the stream: its
engine is stopped (an in-process llama.cpp has one context for every generation of the worker), the write it
waits for stays in flight, and the pieces the engine had made past that write are dropped, never appended. When
the write lands, the generation takes a slot again (before any new job: ``resume`` goes first) and continues
from what the stream holds, as a job continued after a crash does (generator.generation). ``--max-parked``
bounds how many a worker holds at once (each keeps its request and one write in memory); past it, a stalled
generation keeps its slot and waits, as every generation did before parking.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class Slots:
    """``concurrency`` slots for generations. New jobs ``take`` one, parked generations ``resume`` into one, and
    a resumer always goes first: while one waits, no new job starts."""

    def __init__(self, concurrency: int, max_parked: int) -> None:
        self.free = max(1, concurrency)
        self.max_parked = max(0, max_parked)
        self.parked = 0  # generations holding no slot while their write waits (and until they resume)
        # Jobs whose engine is done and whose terminal writes are still on their way (``Seat.finish``): their
        # slots went to the next jobs. Past as many as there are slots, no new job starts, so a Redis slow to take
        # the last writes slows the claims instead of piling jobs up.
        self.finishing = 0
        self._bound = self.free
        self._takers: deque[asyncio.Future[None]] = deque()
        self._resumers: deque[asyncio.Future[None]] = deque()

    @property
    def resume_wanted(self) -> bool:
        """A parked generation waits for a slot: a job just polled should be handed back rather than started."""
        return bool(self._resumers)

    async def take(self) -> None:
        """A slot for a new job: waits while none is free, a parked generation waits for one, or more jobs than
        there are slots are still finishing."""
        while self.free <= 0 or self._resumers or self.finishing > self._bound:
            await self._wait(self._takers)
        self.free -= 1
        self._wake()

    async def resume(self) -> None:
        """A slot for a parked generation whose write landed."""
        while self.free <= 0:
            await self._wait(self._resumers)
        self.free -= 1
        self._wake()

    def release(self) -> None:
        self.free += 1
        self._wake()

    def finished(self) -> None:
        """A finishing job's last writes are done."""
        self.finishing -= 1
        self._wake()

    def seat(self) -> Seat:
        """The slot just taken, as the job that runs in it holds it."""
        return Seat(self)

    async def _wait(self, queue: deque[asyncio.Future[None]]) -> None:
        fut = asyncio.get_running_loop().create_future()
        queue.append(fut)
        try:
            await fut
        finally:
            queue.remove(fut)
            self._wake()  # woken and gone (or cancelled): the next in line may go

    def _wake(self) -> None:
        """Wake as many waiters as there are free slots, resumers first (a woken one that has not run yet counts:
        its slot is coming)."""
        budget = self.free if self.finishing <= self._bound else 0
        for queue in (self._resumers, self._takers):
            for fut in queue:
                if budget <= 0:
                    return
                budget -= 1
                if not fut.done():
                    fut.set_result(None)
            if self._resumers:
                return  # no new job starts while a parked generation waits


class Seat:
    """One job's hold on a slot. ``stalled`` parks it (gives the slot back) when its write waits too long; ``resume``
    takes a slot again; ``close`` gives back whatever it holds at the end of the job."""

    def __init__(self, slots: Slots) -> None:
        self._slots = slots
        self.holds_slot = True
        self.parked = False
        self.finishing = False

    def park(self, released: asyncio.Future[None] | None = None) -> bool:
        """Give the slot back while a write waits, once ``released`` is done (the engine has stopped), or at
        once. False at ``--max-parked``: the job keeps its slot."""
        if self.parked:
            return True
        if not self.can_park:
            return False
        self.parked = True
        self._slots.parked += 1
        if released is None or released.done():
            self._give_back()
        else:
            released.add_done_callback(lambda _: self._give_back())
        return True

    @property
    def can_park(self) -> bool:
        return self.parked or self._slots.parked < self._slots.max_parked

    def finish(self) -> None:
        """The job's engine is done: only its terminal writes are left, which need no slot, so the slot goes to the
        next job now rather than after those round trips (the batch would decode a sequence short meanwhile)."""
        if self.parked or not self.holds_slot or self.finishing:
            return
        self.holds_slot = False
        self.finishing = True
        self._slots.finishing += 1
        self._slots.release()

    def _give_back(self) -> None:
        if self.parked and self.holds_slot:
            self.holds_slot = False
            self._slots.release()

    async def resume(self) -> None:
        """Out of the parked state, with a slot (the one it never gave back, if its engine had not stopped yet)."""
        if not self.parked:
            return
        if not self.holds_slot:
            await self._slots.resume()
            self.holds_slot = True
        self.parked = False
        self._slots.parked -= 1

    def close(self) -> None:
        """The job is over: give back its slot, or its place among the parked or the finishing."""
        if self.finishing:
            self.finishing = False
            self._slots.finished()
        if self.parked:
            self.parked = False
            self._slots.parked -= 1
        if self.holds_slot:
            self.holds_slot = False
            self._slots.release()


class StallWatch:
    """Parks ``seat`` when the write awaited inside ``with watch:`` has not landed after ``after_s``, running
    ``on_park`` first (it stops the engine and returns the future its end resolves, or None). At the parked bound
    it looks again every ``after_s``. One write at a time; ``after_s`` None: never parks."""

    def __init__(self, seat: Seat, after_s: float | None) -> None:
        self.seat = seat
        self.after_s = after_s
        self.on_park: Callable[[], asyncio.Future[None] | None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    def never(cls) -> StallWatch:
        """A watch that never parks (a run outside any worker's slots)."""
        return cls(Seat(Slots(1, 0)), None)

    def __enter__(self) -> StallWatch:
        if self.after_s is not None and not self.seat.parked:
            self._timer = asyncio.get_running_loop().call_later(self.after_s, self._stalled)
        return self

    def __exit__(self, *_: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _stalled(self) -> None:
        self._timer = None
        if self.seat.parked:
            return
        if not self.seat.can_park:  # at --max-parked: look again later, one may have resumed by then
            assert self.after_s is not None
            self._timer = asyncio.get_running_loop().call_later(self.after_s, self._stalled)
            return
        released = self.on_park() if self.on_park is not None else None
        self.seat.park(released)
