"""generator.handoff: a token's time is when the engine handed it over, not when the loop took it."""

from __future__ import annotations

import asyncio
import time

from generator.engines.pieces import REASONING
from generator.handoff import TokenHandoff


def _after(t: float) -> float:
    """The first clock reading past ``t`` (two puts in a row may share a reading on a coarse clock)."""
    while (now := time.monotonic()) <= t:
        pass
    return now


async def test_tokens_taken_at_once_keep_the_times_they_were_made() -> None:
    handoff = TokenHandoff(asyncio.get_running_loop(), max_pending=16)
    before_first = time.monotonic()
    assert handoff.put("a")
    after_first = _after(time.monotonic())
    assert handoff.put(REASONING)  # a marker: no token, no time
    before_last = _after(after_first)
    assert handoff.put("b")
    after_last = _after(time.monotonic())
    taken_at = _after(after_last)

    batch = await handoff.get()

    assert (batch.pieces, batch.tokens) == (["a", REASONING, "b"], 2)
    assert batch.first_at is not None and batch.last_at is not None
    assert before_first <= batch.first_at < after_first < before_last <= batch.last_at < after_last < taken_at
    # The next batch's times are its own.
    assert handoff.put(REASONING)
    only_marker = await handoff.get()
    assert (only_marker.tokens, only_marker.first_at, only_marker.last_at) == (0, None, None)
