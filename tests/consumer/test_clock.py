"""consumer.streaming.clock: the pod's one clock for every reader's heartbeat and wake-up."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from helpers import eventually_async

from consumer.streaming.clock import Clock


def test_callbacks_fire_never_early_at_most_a_granule_late_and_share_one_timer() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        clock = Clock(granule_s=0.05)
        fired: dict[str, float] = {}
        # a and b inside one granule whatever the loop's time now (start + 0.10 and + 0.11 straddled a granule's
        # edge one run in five); c six granules on.
        edge = (math.ceil(loop.time() / 0.05) + 1) * 0.05
        due = {"a": edge + 0.001, "b": edge + 0.011, "c": edge + 0.301}

        def firing(name: str) -> Callable[[], None]:
            return lambda: fired.__setitem__(name, loop.time())

        keys = {name: clock.call_at(when, firing(name)) for name, when in due.items()}
        assert keys["a"] == keys["b"]  # one granule: one loop timer for both
        async def all_fired() -> bool:
            return fired.keys() == due.keys()

        await eventually_async(all_fired, 5, "every callback firing")
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
        async def kept_fired() -> bool:
            return "kept" in fired

        await eventually_async(kept_fired, 5, "the kept callback firing")
        assert fired == ["kept"]  # the cancelled one was due in the same granule: it would have run with it

    asyncio.run(main())
