"""Live tailing for every reader of this pod over ONE pub/sub connection (one per master on a cluster).

Appends are PUBLISHed (by the append scripts; SPUBLISHed on Redis Cluster) on the stream's channel with
the event itself, so a pod needs no Redis connection per reader and no XREAD per reader per event: it
subscribes a channel while at least one local reader tails that stream and fans each message out to that
stream's readers. broker.redis.pubsub routes the channels to connections: one on a standalone server, one per
master that owns a tailed stream's slot on a cluster.

The Redis Stream stays the source of truth. A reader replays from the stream only after its
subscription is confirmed (so nothing appended in between is missed), skips live events it already
has, and re-reads the range whenever the hub tells it to resync: after a reconnect (messages may
have been lost while down) or when the reader fell so far behind that its buffer overflowed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Iterable

from broker.errors import StoreUnavailable
from broker.events import Event
from broker.redis.connection import RedisClient
from broker.redis.pubsub.channels import Channels
from consumer.streaming.clock import Clock

log = logging.getLogger("rsb.consumer.hub")

SUBSCRIBE_TIMEOUT_S = 5.0


class Subscription:
    """One reader's live feed. Holds at most ``max_buffered`` events; past that it drops them and asks for
    a resync: a reader that falls behind (a slow client) costs at most ``max_buffered`` events of memory
    here, and catches up from the Redis Stream, page by page, at its own pace."""

    # Per reader, so lean: a list (a deque starts with a 600-byte block) and a future made only while the
    # reader waits (an asyncio.Event holds a deque of its own).
    __slots__ = ("_clock", "_waiter", "buffer", "channel", "max_buffered", "resync", "stream_id", "watched")

    def __init__(self, channel: bytes, stream_id: uuid.UUID | None, max_buffered: int, watched: bool = False,
                 clock: Clock | None = None) -> None:
        self.channel = channel
        self.stream_id = stream_id
        # Whether the stream's generation depends on having readers (cancel_on_disconnect, abandonment).
        self.watched = watched
        self.buffer: list[Event] = []
        self.max_buffered = max_buffered
        self.resync = False
        self._waiter: asyncio.Future[None] | None = None
        self._clock = clock or Clock()

    def push(self, event: Event) -> None:
        if self.resync:
            return  # the reader will re-read the range anyway
        if len(self.buffer) >= self.max_buffered:
            self.buffer = []
            self.resync = True
        else:
            self.buffer.append(event)
        self._wake()

    def request_resync(self) -> None:
        self.buffer = []
        self.resync = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout_s: float) -> bool:
        """Wait for events or a resync request; False on timeout (which may come a clock granule late)."""
        if self.buffer or self.resync:
            return True
        if timeout_s <= 0:
            return False
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        # The pod's shared clock, not a timer of our own per wait (consumer.streaming.clock); a cancellation while
        # waiting propagates as is.
        wake = self._wake
        key = self._clock.call_at(self._clock.now() + timeout_s, wake)
        try:
            await waiter
        finally:
            self._waiter = None
            self._clock.cancel(key, wake)
        return bool(self.buffer or self.resync)

    def take(self) -> tuple[list[Event], bool]:
        """The buffered events and whether the reader must re-read the range first."""
        events, self.buffer = self.buffer, []
        resync, self.resync = self.resync, False
        return events, resync


class LiveHub:
    def __init__(self, redis: RedisClient, *, max_buffered: int = 256) -> None:
        self._max_buffered = max_buffered
        self.clock = Clock()
        self._subs: dict[bytes, set[Subscription]] = {}
        # Each channel's subscription while Redis has not confirmed it: every reader of the channel waits for it.
        self._pending: dict[bytes, asyncio.Future[bool]] = {}
        self._confirming: set[asyncio.Future[bool]] = set()  # those tasks, the ones no reader waits for included
        self._channels = Channels(redis, on_message=self._on_message, on_reset=self._on_reset)

    @property
    def readers(self) -> int:
        return sum(len(s) for s in self._subs.values())

    @property
    def channels(self) -> int:
        return len(self._subs)

    @property
    def connections(self) -> int:
        """Pub/sub connections this pod holds: 1, or one per master in use on a cluster."""
        return self._channels.connections

    @property
    def reconnects(self) -> int:
        return self._channels.reconnects

    @property
    def healthy(self) -> bool:
        """The pub/sub connections are up and alive (broker.redis.pubsub.liveness): live events reach readers."""
        return self._channels.healthy

    async def start(self) -> None:
        await self._channels.start()

    async def stop(self) -> None:
        for task in list(self._confirming):
            task.cancel()
        await asyncio.gather(*self._confirming, return_exceptions=True)
        await self._channels.stop()

    def stream_ids(self) -> list[uuid.UUID]:
        """The watched streams (see Subscription.watched) that have at least one reader on this pod now."""
        out = []
        for subs in self._subs.values():
            first = next(iter(subs), None)
            if first is not None and first.watched and first.stream_id is not None:
                out.append(first.stream_id)
        return out

    async def subscribe(self, channel: str, stream_id: uuid.UUID | None = None, *,
                        watched: bool = False) -> Subscription:
        """A live feed of ``channel``; returns once Redis confirmed the subscription (or a resync is due).
        ``stream_id``: the rsb stream behind the channel, if any (Durable Streams channels have none: their
        messages, ``<offset>\\n<kind>\\n``, only wake readers, who then read the stream).

        A reader that leaves while it waits (its task is cancelled: a page reload) takes its subscription
        with it: the channel is not left subscribed for nobody, nor the stream touched as if it had a reader."""
        ch = channel.encode()
        sub = Subscription(ch, stream_id, self._max_buffered, watched, self.clock)
        subs = self._subs.setdefault(ch, set())
        subs.add(sub)
        try:
            pending = self._pending.get(ch)
            if pending is None:
                # The channel's first reader: its subscription is a task of its own, which every reader of the
                # channel waits for and none cancels, so that it outlives a reader that leaves meanwhile.
                pending = self._pending[ch] = asyncio.ensure_future(self._confirm(ch))
                self._confirming.add(pending)
                pending.add_done_callback(functools.partial(self._confirmed, ch))
            await self._await_confirmation(sub, pending)
        except BaseException:
            self.unsubscribe(sub)
            raise
        return sub

    async def _confirm(self, ch: bytes) -> bool:
        """Subscribe ``ch`` on Redis: True once Redis confirmed it; False when the pub/sub connection is away
        (its (re)connect subscribes the channel, then resets, i.e. resyncs, its readers)."""
        try:
            fut = await self._channels.subscribe(ch)
        except StoreUnavailable:
            return False
        finally:
            if ch not in self._subs:  # every reader left while the command was sent: take it back
                self._channels.unsubscribe(ch)
        if fut is None:
            return False
        try:
            await fut
        except StoreUnavailable:
            return False
        return True

    def _confirmed(self, ch: bytes, task: asyncio.Future[bool]) -> None:
        self._confirming.discard(task)
        if self._pending.get(ch) is task:
            del self._pending[ch]
        if not task.cancelled():
            task.exception()  # retrieved: its readers, if any are left, got it (or a resync) themselves

    @staticmethod
    async def _await_confirmation(sub: Subscription, pending: asyncio.Future[bool]) -> None:
        try:
            async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
                # Shared by every reader of the channel: shielded, so a reader that leaves never cancels it.
                confirmed = await asyncio.shield(pending)
        except TimeoutError:
            confirmed = False
        if not confirmed:
            sub.request_resync()  # not confirmed: replay after the (re)connect confirms it instead

    def unsubscribe(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.channel)
        if subs is None:
            return
        subs.discard(sub)
        if subs:
            return
        del self._subs[sub.channel]
        # A subscription still being confirmed finishes on its own (LiveHub._confirm takes it back).
        self._pending.pop(sub.channel, None)
        self._channels.unsubscribe(sub.channel)

    def _on_message(self, channel: bytes, data: bytes) -> None:
        subs = self._subs.get(channel)
        if subs:
            event = Event.from_payload(data)
            for sub in subs:
                sub.push(event)

    def _on_reset(self, channels: Iterable[bytes]) -> None:
        # Messages of these channels may have been lost: their readers re-read the range from the stream.
        for ch in channels:
            for sub in self._subs.get(ch, ()):
                sub.request_resync()
