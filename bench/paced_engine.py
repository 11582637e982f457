"""A deterministic engine that emits tokens at a set rate: for broker-only scenarios, where the cost of
inference would drown what is measured. Named as such in every result that uses it.

Token ``i`` of a generation is the text ``"<i>:<unix time, µs>"`` followed by a space: the index lets a
reader check order and completeness (also across a takeover: numbering continues after the answer
text already appended), the time stamp is taken when the token is produced, just before the worker
hands it to Redis, so a reader can compute append-to-receive latency per token.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator

from broker.request.generation import GenerationRequest
from generator.engines.base import Generation
from generator.engines.pieces import PartialAnswer

NAME = "paced-engine"


def parse_tokens(text: str) -> list[tuple[int, float]]:
    """The (index, produced-at unix time) of every paced token in a delta's text."""
    out: list[tuple[int, float]] = []
    for part in text.split():
        i, _, t = part.partition(":")
        out.append((int(i), float(t)))
    return out


class PacedEngine:
    """``generator.engine.Engine``: ``tokens_per_s`` tokens per second per generation, on an absolute
    schedule (no drift), stopping between tokens as soon as ``stop`` is set. ``on_loop`` (the default): it
    produces on the event loop, as an engine that only waits (an upstream server) can; False: in an
    inference thread per generation, as llama.cpp does."""

    def __init__(self, tokens_per_s: float, *, name: str = NAME, on_loop: bool = True) -> None:
        if tokens_per_s <= 0:
            raise ValueError("tokens_per_s must be positive")
        self.name = name
        self.period_s = 1.0 / tokens_per_s
        self.on_loop = on_loop
        self.caches_prompts = False
        self.sequences = 0

    def observe_steps(self, observer: object) -> None:
        """Not a batching engine: no steps to observe."""

    def start(self, request: GenerationRequest, *, prefix_text: str, max_tokens: int,
              stop: threading.Event, partial: PartialAnswer | None = None, cache_scope: str = "",
              tier: str = "") -> Generation:
        first = len(prefix_text.split())
        gen = Generation(prompt_tokens=1, pieces=iter(()))
        if self.on_loop:
            gen.apieces = self._arun(gen, first, max_tokens, stop)
        else:
            gen.pieces = self._run(gen, first, max_tokens, stop)
        return gen

    async def _arun(self, gen: Generation, first: int, max_tokens: int, stop: threading.Event) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for n in range(max_tokens):
            delay = t0 + (n + 1) * self.period_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)  # the worker cancels the producer when it stops early
            if stop.is_set():
                gen.finish_reason = "stop"
                return
            yield f"{first + n}:{time.time():.6f} "
        gen.finish_reason = "length"

    def _run(self, gen: Generation, first: int, max_tokens: int, stop: threading.Event) -> Iterator[str]:
        t0 = time.monotonic()
        for n in range(max_tokens):
            delay = t0 + (n + 1) * self.period_s - time.monotonic()
            if delay > 0 and stop.wait(delay):
                gen.finish_reason = "stop"
                return
            if stop.is_set():
                gen.finish_reason = "stop"
                return
            yield f"{first + n}:{time.time():.6f} "
        gen.finish_reason = "length"

    def close(self) -> None:
        pass
