"""consumer.streaming.clock: the pod's one clock for every reader's heartbeat and wake-up."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from consumer.streaming.clock import Clock


def test_callbacks_fire_never_early_at_most_a_granule_late_and_share_one_timer() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        clock = Clock(granule_s=0.05)
        fired: dict[str, float] = {}
        start = loop.time()
        due = {"a": start + 0.10, "b": start + 0.11, "c": start + 0.30}

        def firing(name: str) -> Callable[[], None]:
            return lambda: fired.__setitem__(name, loop.time())

        keys = {name: clock.call_at(when, firing(name)) for name, when in due.items()}
        assert keys["a"] == keys["b"]  # one granule: one loop timer for both
        await asyncio.sleep(0.7)
        for name, when in due.items():
            # never early; late by at most the granule (plus what a busy shared machine adds to any timer)
            assert when <= fired[name] <= when + 0.05 + 0.2, (name, fired[name] - when)

    asyncio.run(main())


def test_a_cancelled_callback_never_runs() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        clock = Clock(granule_s=0.02)
        fired: list[str] = []

        def early() -> None:
            fired.append("early")

        def kept() -> None:
            fired.append("kept")

        key = clock.call_at(loop.time() + 0.05, early)
        clock.call_at(loop.time() + 0.05, kept)
        clock.cancel(key, early)
        await asyncio.sleep(0.15)
        assert fired == ["kept"]

    asyncio.run(main())
