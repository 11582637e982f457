"""Live tailing for every reader of this pod over ONE pub/sub connection.

Appends are PUBLISHed (by the append scripts) on the stream's channel with the event itself, so a pod
needs no Redis connection per reader and no XREAD per reader per event: it subscribes a channel while
at least one local reader tails that stream and fans each message out to that stream's readers.

The Redis Stream stays the source of truth. A reader replays from the stream only after its
subscription is confirmed (so nothing appended in between is missed), skips live events it already
has, and re-reads the range whenever the hub tells it to resync: after a reconnect (messages may
have been lost while down) or when the reader fell so far behind that its buffer overflowed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections import deque
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from broker.events import Event

log = logging.getLogger("rsb.consumer.hub")

SUBSCRIBE_TIMEOUT_S = 5.0


class Subscription:
    """One reader's live feed. Holds at most ``max_buffered`` events; past that it asks for a resync."""

    __slots__ = ("_wake", "buffer", "channel", "max_buffered", "resync", "stream_id")

    def __init__(self, channel: bytes, stream_id: uuid.UUID, max_buffered: int) -> None:
        self.channel = channel
        self.stream_id = stream_id
        self.buffer: deque[Event] = deque()
        self.max_buffered = max_buffered
        self.resync = False
        self._wake = asyncio.Event()

    def push(self, event: Event) -> None:
        if self.resync:
            return  # the reader will re-read the range anyway
        if len(self.buffer) >= self.max_buffered:
            self.buffer.clear()
            self.resync = True
        else:
            self.buffer.append(event)
        self._wake.set()

    def request_resync(self) -> None:
        self.buffer.clear()
        self.resync = True
        self._wake.set()

    async def wait(self, timeout_s: float) -> bool:
        """Wait for events or a resync request; False on timeout."""
        if self.buffer or self.resync:
            return True
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def take(self) -> tuple[list[Event], bool]:
        """The buffered events and whether the reader must re-read the range first."""
        events = list(self.buffer)
        self.buffer.clear()
        resync, self.resync = self.resync, False
        return events, resync


class LiveHub:
    def __init__(self, redis: Redis, *, max_buffered: int = 1024) -> None:
        self._redis = redis
        self._max_buffered = max_buffered
        self._subs: dict[bytes, set[Subscription]] = {}
        self._confirmations: dict[bytes, deque[asyncio.Future[None]]] = {}
        self._pubsub: PubSub | None = None
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.reconnects = 0

    @property
    def readers(self) -> int:
        return sum(len(s) for s in self._subs.values())

    @property
    def channels(self) -> int:
        return len(self._subs)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="live-hub")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()

    def stream_ids(self) -> list[uuid.UUID]:
        """The streams that have at least one reader on this pod now."""
        return [next(iter(subs)).stream_id for subs in self._subs.values() if subs]

    async def subscribe(self, channel: str, stream_id: uuid.UUID) -> Subscription:
        """A live feed of ``channel``; returns once Redis confirmed the subscription (or a resync is due)."""
        ch = channel.encode()
        sub = Subscription(ch, stream_id, self._max_buffered)
        subs = self._subs.get(ch)
        if subs:
            subs.add(sub)
            # A subscription is in place, but possibly not confirmed yet: wait behind its confirmation.
            pending = self._confirmations.get(ch)
            if pending:
                await self._await_confirmation(sub, pending[-1])
            return sub
        self._subs[ch] = {sub}
        ps = self._pubsub
        if ps is None or not self._connected.is_set():
            sub.request_resync()  # the (re)connect resubscribes everything, then resyncs every reader
            return sub
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._confirmations.setdefault(ch, deque()).append(fut)
        try:
            await ps.subscribe(ch)
        except (RedisError, OSError):
            sub.request_resync()
            return sub
        await self._await_confirmation(sub, fut)
        return sub

    async def _await_confirmation(self, sub: Subscription, fut: asyncio.Future[None]) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(fut), SUBSCRIBE_TIMEOUT_S)
        except (TimeoutError, RedisError, OSError, asyncio.CancelledError) as e:
            if isinstance(e, asyncio.CancelledError) and not fut.cancelled():
                raise
            sub.request_resync()

    def unsubscribe(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.channel)
        if subs is None:
            return
        subs.discard(sub)
        if subs:
            return
        del self._subs[sub.channel]
        ps = self._pubsub
        if ps is not None and self._connected.is_set():
            asyncio.get_running_loop().create_task(self._unsubscribe(ps, sub.channel))

    async def _unsubscribe(self, ps: PubSub, channel: bytes) -> None:
        if channel in self._subs:  # a new reader came back meanwhile
            return
        with contextlib.suppress(RedisError, OSError):
            await ps.unsubscribe(channel)

    # -- the one connection --------------------------------------------------------------------

    async def _run(self) -> None:
        attempt = 0
        while True:
            ps = self._redis.pubsub()
            try:
                await ps.connect()
                channels = list(self._subs)
                if channels:
                    await ps.subscribe(*channels)
                self._pubsub = ps
                self._connected.set()
                if attempt:
                    self.reconnects += 1
                    log.info("live hub reconnected", extra={"channels": len(channels)})
                attempt = 0
                # After (re)subscribing, anything published while we were away is only in the streams.
                for subs in self._subs.values():
                    for sub in subs:
                        sub.request_resync()
                await self._dispatch(ps)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as e:
                self._connected.clear()
                self._pubsub = None
                for futs in self._confirmations.values():
                    for f in futs:
                        if not f.done():
                            f.set_exception(e if isinstance(e, RedisError) else RedisError(str(e)))
                self._confirmations.clear()
                for subs in self._subs.values():
                    for sub in subs:
                        sub.request_resync()
                with contextlib.suppress(Exception):
                    await ps.aclose()
                delay = min(5.0, 0.05 * 2**attempt) * random.uniform(0.5, 1.0)
                attempt += 1
                log.warning("live hub lost redis, reconnecting in %.2fs: %s", delay, e)
                await asyncio.sleep(delay)

    async def _dispatch(self, ps: PubSub) -> None:
        while True:
            msg: dict[str, Any] | None = await ps.get_message(ignore_subscribe_messages=False, timeout=30.0)
            if msg is None:
                continue
            kind = msg["type"]
            if kind == "message":
                subs = self._subs.get(msg["channel"])
                if subs:
                    event = Event.from_payload(msg["data"])
                    for sub in subs:
                        sub.push(event)
            elif kind == "subscribe":
                futs = self._confirmations.get(msg["channel"])
                if futs:
                    fut = futs.popleft()
                    if not futs:
                        del self._confirmations[msg["channel"]]
                    if not fut.done():
                        fut.set_result(None)
