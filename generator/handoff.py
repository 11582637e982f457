"""The bounded hand-off from the inference thread to the event loop, and ``produce``, which runs an engine's
generation into it: in a thread of its own, or on the loop for engines that say ``on_loop``.

The thread puts one piece of text per token (and, now and then, a marker that is no token: see
generator.engines.pieces); the loop takes everything available at once, so tokens that arrive while an
append is in flight are coalesced into the next one. Putting costs a lock and,
only when the loop is waiting, one ``call_soon_threadsafe``: cheap enough to keep per-token cost flat.
When the loop falls behind (Redis slow or down) the thread blocks, so memory stays bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from broker.request.generation import GenerationRequest
from generator.engines.base import Engine, Generation
from generator.engines.pieces import PartialAnswer, Piece

log = logging.getLogger("rsb.generator")


class StopSignal(threading.Event):
    """The ``stop`` of a generation: a threading.Event (an inference thread checks it between tokens) that
    also runs callbacks when set, so a loop producer waiting on the network is cancelled at once instead of
    at its next token."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []

    def on_set(self, callback: Callable[[], None]) -> None:
        if self.is_set():
            callback()
        else:
            self._callbacks.append(callback)

    def set(self) -> None:
        super().set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


@dataclass(slots=True)
class Batch:
    pieces: list[Piece]
    closed: bool  # the producer finished (or failed: see ``error``) and nothing more will come
    error: BaseException | None = None
    progress: tuple[int, int] | None = None  # the latest prefill progress, if any came since the last get
    markers: int = 0  # pieces that are no token (markers, Extra text); 0: every piece is a token's text
    # When the batch's first and last tokens were handed over (time.monotonic; None: no token in it): a token's
    # time is when the engine made it, not when the loop took it (under load, or from a fast engine, a whole
    # answer can reach the loop at once, and its time per token would read as 0).
    first_at: float | None = None
    last_at: float | None = None

    @property
    def tokens(self) -> int:
        return len(self.pieces) - self.markers


class TokenHandoff:
    def __init__(self, loop: asyncio.AbstractEventLoop, max_pending: int) -> None:
        self._loop = loop
        self._items: deque[Piece] = deque()
        self._markers = 0
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        self._max_pending = max_pending
        # The loop's waiter while it waits (set from the thread with call_soon_threadsafe): a bare future, not
        # an asyncio.Event awaited through wait_for, which costs a task and a timer per token.
        self._waiter: asyncio.Future[None] | None = None
        # A loop producer (``aput``) waiting for room.
        self._space_waiter: asyncio.Future[None] | None = None
        self._waiting = False
        self._closed = False
        self._error: BaseException | None = None
        self._abandoned = False
        self._progress: tuple[int, int] | None = None
        self._first_at: float | None = None
        self._last_at: float | None = None

    # -- producer (inference thread) -----------------------------------------------------------

    def put(self, piece: Piece) -> bool:
        """Hand over one token's text (or a marker). Blocks while the buffer is full; False once the consumer
        left."""
        with self._space:
            while len(self._items) >= self._max_pending and not self._abandoned:
                self._space.wait(timeout=0.5)
            if self._abandoned:
                return False
            self._add(piece)
            wake = self._waiting
            self._waiting = False
        if wake:
            self._loop.call_soon_threadsafe(self._wake)
        return True

    def _add(self, piece: Piece) -> None:
        """(under the lock)"""
        self._items.append(piece)
        if type(piece) is not str:
            self._markers += 1
            return
        self._last_at = time.monotonic()
        if self._first_at is None:
            self._first_at = self._last_at

    async def aput(self, piece: Piece) -> bool:
        """``put`` for a producer on the event loop: waits (without blocking the loop) while the buffer is full."""
        while len(self._items) >= self._max_pending and not self._abandoned:
            waiter = self._space_waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._space_waiter = None
        if self._abandoned:
            return False
        with self._lock:
            self._add(piece)
            wake = self._waiting
            self._waiting = False
        if wake:
            self._wake()
        return True

    def _room(self) -> None:
        waiter = self._space_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

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
                    markers, self._markers = self._markers, 0
                    progress, self._progress = self._progress, None
                    first_at, last_at, self._first_at, self._last_at = self._first_at, self._last_at, None, None
                    self._space.notify_all()
                    self._room()
                    return Batch(pieces, self._closed and not self._items, self._error, progress, markers,
                                 first_at, last_at)
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
        self._room()


def produce(engine: Engine, request: GenerationRequest, handoff: TokenHandoff, *, prefix_text: str,
            max_tokens: int, stop: threading.Event, on_start: Callable[[Generation], None] | None = None,
            partial: PartialAnswer | None = None, cache_scope: str = "", tier: str = "") -> asyncio.Future[None]:
    """Run a generation of ``engine`` into ``handoff`` (closed at the end, with the error if one was raised);
    ``on_start`` gets the Generation; ``cache_scope`` (what the engine's caches are scoped to) and ``tier`` are
    Engine.start's. In an inference thread of its own, or, for an engine that says
    ``on_loop``, as a task on the running loop. The future ends when the producer has.

    A thread per generation, not a pool's: asyncio's default executor (``asyncio.to_thread``) holds
    ``min(32, cores + 4)`` threads, so past that a worker's ``--concurrency`` generations would be claimed,
    send ``started`` and then wait, silent, for another one to end."""

    def started(gen: Generation) -> None:
        gen.on_progress = handoff.progress
        if on_start is not None:
            on_start(gen)

    if engine.on_loop:
        async def on_loop() -> None:
            try:
                gen = engine.start(request, prefix_text=prefix_text, max_tokens=max_tokens, stop=stop, partial=partial,
                                   cache_scope=cache_scope, tier=tier)
                started(gen)
                assert gen.apieces is not None, "an on_loop engine fills apieces"
                apieces = gen.apieces
                try:
                    async for piece in apieces:
                        if not await handoff.aput(piece):
                            break
                finally:
                    aclose = getattr(apieces, "aclose", None)
                    if aclose is not None:  # its upstream response, closed now rather than when collected
                        await aclose()
                handoff.close()
            except asyncio.CancelledError:
                handoff.close()
                raise
            except Exception as e:  # handed to the loop, which ends the stream with `error`
                handoff.close(e)

        task = asyncio.ensure_future(on_loop())
        if isinstance(stop, StopSignal):
            loop = asyncio.get_running_loop()
            def cancel() -> None:
                loop.call_soon_threadsafe(task.cancel)

            stop.on_set(cancel)
        return task

    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()

    def in_thread() -> None:
        after: Callable[[], None] | None = None
        try:
            gen = engine.start(request, prefix_text=prefix_text, max_tokens=max_tokens, stop=stop, partial=partial,
                                   cache_scope=cache_scope, tier=tier)
            started(gen)
            text: list[str] | None = [] if gen.after is not None else None
            ended = True
            pieces = gen.pieces
            try:
                for piece in pieces:
                    if text is not None:
                        if type(piece) is str:
                            text.append(piece)
                        else:  # typed output (a call, reasoning): not a plain answer to prepare a turn from
                            text = None
                    if not handoff.put(piece):
                        ended = False
                        break
            finally:
                # Left suspended (the loop stopped reading), a generation would hold what it holds (llama.cpp's one
                # context, behind the engine's lock) until collected: the next generation would wait for it.
                close = getattr(pieces, "close", None)
                if close is not None:
                    close()
            handoff.close()
            prepare = gen.after
            if prepare is not None and text is not None and ended and not stop.is_set():
                answer = prefix_text + "".join(text)

                def after() -> None:
                    prepare(answer)
        except BaseException as e:  # handed to the loop, which ends the stream with `error`
            handoff.close(e)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for this any more
                loop.call_soon_threadsafe(_resolve, finished)
        if after is not None:  # once the job can end: nothing waits for this
            try:
                after()
            except Exception:  # only a cache's preparation: the answer is delivered already
                log.exception("preparing the next turn failed")

    # Not a daemon, like the executor's threads were: the interpreter lets a generation leave its C call
    # (the worker sets ``stop`` at shutdown) before it exits.
    threading.Thread(target=in_thread, name="rsb-generation").start()
    return finished


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
