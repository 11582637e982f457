"""One pub/sub connection and the channels it should hold: it connects, subscribes them (again after a loss),
resolves their confirmations, reports their resets to its owner, and reconnects by itself.

A connection's whole life is one loop (``Shard._run``): connect, subscribe every wanted channel, then read
(dispatch) while liveness watches, until either fails; then every pending confirmation fails, every channel is
reset, the owner may move channels a cluster master no longer owns (``reroute``) or drop the shard (``retire``),
and after a backoff it connects again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Protocol

from redis.asyncio.client import PubSub
from redis.crc import key_slot

from broker.backoff import Backoff
from broker.redis.errors import UNAVAILABLE_ERRORS, is_unavailable, store_error
from broker.redis.pubsub.dispatch import dispatch
from broker.redis.pubsub.liveness import DEAD_AFTER_S, watch

log = logging.getLogger("rsb.pubsub")

RECONNECT_BACKOFF = Backoff(base_s=0.05, cap_s=5.0)


class Owner(Protocol):
    """What a shard reports to (broker.redis.pubsub.channels.Channels)."""

    def on_message(self, channel: bytes, data: bytes) -> None: ...

    def on_reset(self, channels: Iterable[bytes]) -> None: ...

    async def reroute(self, shard: Shard) -> None:
        """Move the channels the shard's node no longer owns to their owner (a cluster's slots moved)."""

    def retire(self, shard: Shard) -> bool:
        """Drop the shard, left with no channels; False when it got channels meanwhile."""


class Shard:
    """One pub/sub connection and the channels it should hold; reconnects (and resubscribes) by itself."""

    def __init__(self, owner: Owner, name: str, connect: Callable[[], PubSub], sharded: bool) -> None:
        self.owner = owner
        self.name = name
        self._connect = connect
        self._sharded = sharded
        self._msg_type = "smessage" if sharded else "message"
        self._ack_type = "ssubscribe" if sharded else "subscribe"
        self._unack_type = "sunsubscribe" if sharded else "unsubscribe"
        self.channels: set[bytes] = set()
        self._confirmations: dict[bytes, deque[asyncio.Future[None]]] = {}
        # Channels subscribed again after a loss: their confirmation is reported as a reset.
        self._resubscribed: set[bytes] = set()
        # Unsubscribes we sent and whose reply has not come: any other unsubscribe reply is the server
        # dropping the channel (its slot moved to another master).
        self._unsubscribing: dict[bytes, int] = {}
        self._pubsub: PubSub | None = None
        self._connected = asyncio.Event()
        # Orders subscribe/unsubscribe commands with the checks that decide them (see unsubscribe).
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        # Side tasks (an unsubscribe, a reroute) held until they end: the loop keeps only weak references to
        # tasks, so one nobody holds may be collected mid-run; stop() ends them with the shard.
        self._side_tasks: set[asyncio.Task[None]] = set()
        self.reconnects = 0
        #: When Redis was last heard on this connection (the loop's clock): a message, a reply, a pong.
        self.heard_at = 0.0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"pubsub-{self.name or 'main'}")

    async def stop(self) -> None:
        here = asyncio.current_task()
        tasks = [t for t in (self._task, *self._side_tasks) if t is not None and t is not here]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._close()

    @property
    def healthy(self) -> bool:
        """Connected, and heard from within DEAD_AFTER_S (a dead link is not healthy before it is noticed)."""
        return self._connected.is_set() and asyncio.get_running_loop().time() - self.heard_at < DEAD_AFTER_S

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _close(self) -> None:
        ps, self._pubsub = self._pubsub, None
        self._connected.clear()
        if ps is not None:
            with contextlib.suppress(Exception):
                await ps.aclose()  # disconnects its connection (never the pool: others may share it)

    async def subscribe(self, ch: bytes) -> asyncio.Future[None] | None:
        """Subscribe ``ch``; the future resolves on Redis's confirmation. None: not connected now; the
        (re)connect subscribes it and reports a reset. Cancelled while it waits for the lock or sends, it
        leaves nothing behind: a channel it added is dropped again (and unsubscribed, if the command went
        out), so no caller that gave up leaves a channel subscribed for nobody. A failed send leaves the
        channel wanted: the reconnect that follows subscribes it."""
        added = ch not in self.channels
        self.channels.add(ch)
        try:
            async with self._lock:
                ps = self._pubsub
                if ps is None or not self._connected.is_set():
                    return None
                fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                # Queued before the send, so the confirmations stay in step with the commands sent: a send cut
                # by a cancellation either went out (its confirmation comes, and resolves nothing) or dropped
                # the connection (whose loss fails every confirmation).
                self._confirmations.setdefault(ch, deque()).append(fut)
                try:
                    await self._send_subscribe(ps, [ch])
                except asyncio.CancelledError:
                    fut.cancel()
                    raise
        except asyncio.CancelledError:
            if added:
                self.unsubscribe(ch)
            raise
        return fut

    async def _send_subscribe(self, ps: PubSub, channels: list[bytes]) -> None:
        if not self._sharded:
            await ps.subscribe(*channels)
            return
        # One SSUBSCRIBE may only name channels of one slot (else CROSSSLOT): one per partition's slot.
        by_slot: dict[int, list[bytes]] = {}
        for ch in channels:
            by_slot.setdefault(key_slot(ch), []).append(ch)
        for group in by_slot.values():
            await ps.ssubscribe(*group)

    def resubscribe(self, ch: bytes) -> None:
        """Report ``ch`` as reset once its next subscription is confirmed (it moved here from a master
        that lost its slot)."""
        self._resubscribed.add(ch)

    def unsubscribe(self, ch: bytes) -> None:
        self.channels.discard(ch)
        ps = self._pubsub
        if ps is not None and self._connected.is_set():
            self._spawn(self._unsubscribe(ps, ch))

    async def _unsubscribe(self, ps: PubSub, ch: bytes) -> None:
        # Under the lock: a subscribe of the same channel that comes meanwhile is either sent before this
        # check (and the channel is wanted again: no unsubscribe) or after the UNSUBSCRIBE (and wins).
        async with self._lock:
            if ch in self.channels or ps is not self._pubsub:
                return
            self._unsubscribing[ch] = self._unsubscribing.get(ch, 0) + 1
            with contextlib.suppress(*UNAVAILABLE_ERRORS):  # the connection is going: so is the channel
                await (ps.sunsubscribe(ch) if self._sharded else ps.unsubscribe(ch))

    async def _run(self) -> None:
        attempt = 0
        while True:
            ps = self._connect()
            try:
                await ps.connect()
                self.heard_at = asyncio.get_running_loop().time()
                async with self._lock:
                    # Every channel is (re)subscribed here, and reset once confirmed: its readers were told
                    # of the loss when the connection dropped (or started reading before we connected).
                    channels = list(self.channels)
                    self._resubscribed.update(channels)
                    if channels:
                        await self._send_subscribe(ps, channels)
                    self._unsubscribing.clear()
                    self._pubsub = ps
                    self._connected.set()
                if attempt:
                    self.reconnects += 1
                    log.info("pub/sub reconnected", extra={"node": self.name, "channels": len(channels)})
                attempt = 0
                await self._listen(ps)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                # Redis away (UNAVAILABLE_ERRORS) is the ordinary case. Anything else (a refused SUBSCRIBE, a
                # reply this loop cannot read) is a bug: logged as one, and handed to whoever waits for a
                # confirmation; the loop still reconnects, since a pod without its pub/sub hears no stream.
                if not is_unavailable(e):
                    log.error("pub/sub failed: %s", type(e).__name__, exc_info=e, extra={"node": self.name})
                self._connected.clear()
                self._pubsub = None
                for futs in self._confirmations.values():
                    for f in futs:
                        if not f.done():
                            f.set_exception(store_error(e))
                            f.exception()  # retrieved: nobody may be waiting on a resubscription's future
                self._confirmations.clear()
                self._resubscribed.clear()
                if self.channels:
                    self.owner.on_reset(list(self.channels))
                with contextlib.suppress(Exception):
                    await ps.aclose()
                # A node that failed may not own these slots any more (failover, resharding): look again.
                await self.owner.reroute(self)
                if not self.channels and self.owner.retire(self):
                    return
                delay = RECONNECT_BACKOFF.delay(attempt)
                attempt += 1
                log.warning("pub/sub lost redis, reconnecting in %.2fs: %s", delay, e, extra={"node": self.name})
                await asyncio.sleep(delay)

    async def _listen(self, ps: PubSub) -> None:
        """Dispatch the connection's messages while liveness watches it; either one's error ends both."""
        reading = asyncio.ensure_future(
            dispatch(ps, self._msg_type.encode(), self.owner.on_message, self._handle, self._heard))
        watching = asyncio.ensure_future(watch(ps, self._last_heard, self._lock))
        try:
            done, _ = await asyncio.wait({reading, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            reading.cancel()
            watching.cancel()
            await asyncio.gather(reading, watching, return_exceptions=True)
        for task in done:
            task.result()

    def _heard(self, at: float) -> None:
        self.heard_at = at

    def _last_heard(self) -> float:
        return self.heard_at

    async def _handle(self, ps: PubSub, response: Any) -> None:
        """Anything but a data message goes through handle_message, which keeps PubSub's own bookkeeping (its
        channels, pending unsubscribes) right."""
        msg: dict[str, Any] | None = await ps.handle_message(response, ignore_subscribe_messages=False)
        if msg is None:
            return
        kind, ch = msg["type"], msg["channel"]
        if kind == self._msg_type:
            self.owner.on_message(ch, msg["data"])
        elif kind == self._ack_type:
            futs = self._confirmations.get(ch)
            if futs:
                fut = futs.popleft()
                if not futs:
                    del self._confirmations[ch]
                if not fut.done():
                    fut.set_result(None)
            if ch in self._resubscribed:
                self._resubscribed.discard(ch)
                if ch in self.channels:
                    self.owner.on_reset([ch])
        elif kind == self._unack_type:
            pending = self._unsubscribing.get(ch, 0)
            if pending > 1:
                self._unsubscribing[ch] = pending - 1
            elif pending == 1:
                del self._unsubscribing[ch]
            elif ch in self.channels:
                # Not ours: the server dropped the channel because its slot moved to another master.
                self.owner.on_reset([ch])
                self._spawn(self.owner.reroute(self))
