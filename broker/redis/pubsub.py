"""Subscribing to many channels over few connections, on a standalone server or a Redis Cluster.

Standalone: one pub/sub connection (SUBSCRIBE) carries every channel. Redis Cluster: channels are
sharded (the scripts SPUBLISH them, see broker.streams.scripts) and SSUBSCRIBE only works on the master that
owns the channel's slot, so there is one connection per master that owns at least one subscribed
channel: never more connections than masters, however many channels.

The owner of a ``Channels`` gets three things: messages (``on_message``), confirmations (the future
``subscribe`` returns resolves once Redis acknowledged the subscription, so anything published after
that is delivered), and resets (``on_reset``): channels whose messages may have been lost (the connection
dropped, or the slot moved to another master) and which are subscribed again; a reset is reported twice,
when the loss is seen and once the new subscription is confirmed, so whoever re-reads the source of truth
at the second report misses nothing. A connection that stays silent is pinged, and one that stays silent past
DEAD_AFTER_S is dropped and made again, as one that failed.

Long because a connection's whole life is one loop here (connect, resubscribe, dispatch raw or through redis-py,
liveness, the server dropping a channel, reroutes on a cluster): each step depends on the state the others leave.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import hiredis
from redis._parsers.hiredis import NOT_ENOUGH_DATA
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import SlotNotCoveredError

from broker.backoff import Backoff
from broker.redis.connection import RedisClient, connect_node
from broker.redis.errors import UNAVAILABLE_ERRORS, is_unavailable, store_error, store_errors

log = logging.getLogger("rsb.pubsub")

OnMessage = Callable[[bytes, bytes], None]
OnReset = Callable[[Iterable[bytes]], None]

RECONNECT_BACKOFF = Backoff(base_s=0.05, cap_s=5.0)
# A dispatch loop wakes at least this often even when no message comes (cheap; lets cancellation in).
_IDLE_WAKE_S = 30.0
#: A pub/sub connection waits for messages with no command in flight, so no socket timeout can tell a quiet link
#: from a half-open one (no FIN, no RST: the network stopped delivering). Silent for PING_AFTER_S, it is sent a
#: PING; silent for DEAD_AFTER_S (the pong never came), it is dropped and made again, and its channels are reset
#: (their readers re-read the stream). So a dead link is noticed within DEAD_AFTER_S + WATCH_TICK_S.
PING_AFTER_S = 3.0
DEAD_AFTER_S = 8.0
WATCH_TICK_S = 1.0
# One socket read of the raw dispatch loop: at most this many bytes of messages are handed on per loop turn.
_READ_BYTES = 1 << 18


class _Shard:
    """One pub/sub connection and the channels it should hold; reconnects (and resubscribes) by itself."""

    def __init__(self, owner: Channels, name: str, connect: Callable[[], PubSub], sharded: bool) -> None:
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
        """Dispatch the connection's messages while ``_watch`` checks it is alive; either one's error ends both."""
        dispatch = asyncio.ensure_future(self._dispatch(ps))
        watch = asyncio.ensure_future(self._watch(ps))
        try:
            done, _ = await asyncio.wait({dispatch, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            dispatch.cancel()
            watch.cancel()
            await asyncio.gather(dispatch, watch, return_exceptions=True)
        for task in done:
            task.result()

    async def _watch(self, ps: PubSub) -> None:
        """Ping a quiet connection; raise once it stayed silent past DEAD_AFTER_S (see PING_AFTER_S)."""
        loop = asyncio.get_running_loop()
        pinged_at = 0.0
        while True:
            await asyncio.sleep(WATCH_TICK_S)
            now = loop.time()
            silent = now - self.heard_at
            if silent >= DEAD_AFTER_S:
                raise RedisConnectionError(f"the pub/sub connection was silent for {silent:.1f}s: a dead link")
            if silent >= PING_AFTER_S and pinged_at <= self.heard_at:
                pinged_at = now
                async with self._lock:  # never between the parts of another command
                    await ps.ping()

    async def _dispatch(self, ps: PubSub) -> None:
        parser = getattr(ps.connection, "_parser", None)
        reader, stream = getattr(parser, "_reader", None), getattr(parser, "_stream", None)
        if isinstance(reader, hiredis.Reader) and isinstance(stream, asyncio.StreamReader):
            await self._dispatch_raw(ps, reader, stream)
            return
        msg_kind = self._msg_type.encode()
        clock = asyncio.get_running_loop().time
        while True:
            # get_message is parse_response + handle_message; a data message (every token of every tailed
            # stream) is handed on from the raw reply, without the dict and the handler lookups redis-py
            # builds for it.
            response: Any = await ps.parse_response(block=False, timeout=_IDLE_WAKE_S)
            if not response:
                continue
            self.heard_at = clock()
            if response[0] == msg_kind and len(response) == 3:
                self.owner.on_message(response[1], response[2])
                continue
            await self._handle(ps, response)

    async def _dispatch_raw(self, ps: PubSub, reader: hiredis.Reader, stream: asyncio.StreamReader) -> None:
        """The dispatch loop on the connection's own hiredis reader: one socket read, then every reply it
        completed, handed on in one go. Through ``parse_response`` each message cost a timeout context, the
        retry wrapper and the push-handler chain (half of a consumer pod's CPU with a thousand live streams,
        docs/benchmarks.md); here a message costs one ``gets()`` and the hub's callback. The readers woken by
        one read's messages run after all of them are handed on, so each writes them in one send."""
        msg_kind = self._msg_type.encode()
        on_message = self.owner.on_message
        gets, feed = reader.gets, reader.feed
        clock = asyncio.get_running_loop().time
        while True:
            reply: Any = gets()
            if reply is NOT_ENOUGH_DATA:
                data = await stream.read(_READ_BYTES)
                if not data:
                    raise RedisConnectionError("the pub/sub connection was closed by the server")
                self.heard_at = clock()
                feed(data)
                continue
            if isinstance(reply, list) and len(reply) == 3 and reply[0] == msg_kind:  # hiredis: a PushNotification
                on_message(reply[1], reply[2])
                continue
            if isinstance(reply, Exception):
                raise reply
            await self._handle(ps, reply)

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


class Channels:
    """Channels of one process over one pub/sub connection per server (standalone) or per master (cluster)."""

    def __init__(self, redis: RedisClient, *, on_message: OnMessage, on_reset: OnReset) -> None:
        self._redis = redis
        self._cluster = redis if isinstance(redis, RedisCluster) else None
        self.on_message = on_message
        self.on_reset = on_reset
        self._shards: dict[str, _Shard] = {}
        self._where: dict[bytes, _Shard] = {}
        self._retired_reconnects = 0
        self._reroute_lock = asyncio.Lock()

    @property
    def connections(self) -> int:
        """Pub/sub connections held (or being re-established) now."""
        return len(self._shards)

    @property
    def reconnects(self) -> int:
        return self._retired_reconnects + sum(s.reconnects for s in self._shards.values())

    @property
    def healthy(self) -> bool:
        """Every pub/sub connection is up and alive (see PING_AFTER_S): what this process hears is live."""
        return all(s.healthy for s in self._shards.values())

    async def start(self) -> None:
        if self._cluster is None:
            # Connect now, so the first readers find a live connection and need no resync.
            self._shard("", lambda: self._redis.pubsub(), sharded=False)
            return
        with contextlib.suppress(*UNAVAILABLE_ERRORS):
            await self._cluster.initialize()  # the slot map; retried at the first subscribe otherwise

    async def stop(self) -> None:
        shards = list(self._shards.values())
        self._shards.clear()
        self._where.clear()
        await asyncio.gather(*(s.stop() for s in shards), return_exceptions=True)

    async def subscribe(self, ch: bytes, *, moved: bool = False) -> asyncio.Future[None] | None:
        """See ``_Shard.subscribe``. Raises StoreUnavailable when the command could not be sent; the future fails
        with rsb's error (broker.errors.StoreError) of a lost connection."""
        with store_errors():
            return await self._subscribe(ch, moved)

    async def _subscribe(self, ch: bytes, moved: bool) -> asyncio.Future[None] | None:
        shard = self._where.get(ch)
        if shard is None:
            shard = await self._shard_for(ch)
            self._where[ch] = shard
        if moved:
            shard.resubscribe(ch)
        try:
            return await shard.subscribe(ch)
        except asyncio.CancelledError:
            if ch not in shard.channels and self._where.get(ch) is shard:
                del self._where[ch]  # the shard took it back (see _Shard.subscribe)
            raise

    def unsubscribe(self, ch: bytes) -> None:
        shard = self._where.pop(ch, None)
        if shard is not None:
            shard.unsubscribe(ch)

    async def _shard_for(self, ch: bytes) -> _Shard:
        if self._cluster is None:
            return self._shard("", lambda: self._redis.pubsub(), sharded=False)
        cluster = self._cluster
        await cluster.initialize()
        node = cluster.get_node_from_key(ch.decode())
        if node is None:
            raise SlotNotCoveredError(f"no master owns the slot of {ch!r}")
        host, port = node.host, int(node.port)
        return self._shard(node.name, lambda: _node_pubsub(cluster, host, port), sharded=True)

    def _shard(self, name: str, connect: Callable[[], PubSub], *, sharded: bool) -> _Shard:
        shard = self._shards.get(name)
        if shard is None:
            shard = self._shards[name] = _Shard(self, name, connect, sharded)
            shard.start()
        return shard

    def retire(self, shard: _Shard) -> bool:
        """Drop a shard left with no channels (its node failed and its slots moved): connections stay
        bounded by the masters in use. False when it got channels meanwhile."""
        if shard.channels or self._shards.get(shard.name) is not shard:
            return False
        del self._shards[shard.name]
        self._retired_reconnects += shard.reconnects
        return True

    async def reroute(self, shard: _Shard) -> None:
        """Cluster: refresh the slot map and move the channels this master no longer owns to their owner.
        Their readers are reset (messages published while the slot moved may be lost)."""
        cluster = self._cluster
        if cluster is None:
            return
        async with self._reroute_lock:
            try:
                await cluster.nodes_manager.initialize()
            except Exception as e:  # it runs in a shard's reconnect loop, which must go on whatever this raised
                if not is_unavailable(e):
                    log.error("could not refresh the cluster's slot map", exc_info=e)
                else:
                    log.warning("could not refresh the cluster's slot map: %s", e)
                return
            moved: list[bytes] = []
            for ch in list(shard.channels):
                try:
                    node = cluster.get_node_from_key(ch.decode())
                except UNAVAILABLE_ERRORS:  # no master owns it in this map: the next reroute looks again
                    continue
                if node is None or node.name == shard.name:
                    continue
                shard.channels.discard(ch)
                self._where.pop(ch, None)
                moved.append(ch)
            for ch in moved:
                with contextlib.suppress(*UNAVAILABLE_ERRORS):  # the shard's reconnect subscribes it
                    await self._subscribe(ch, moved=True)
            if moved:
                log.info("channels moved to another master", extra={"node": shard.name, "channels": len(moved)})
                self.on_reset(moved)


def _node_pubsub(cluster: RedisCluster, host: str, port: int) -> PubSub:
    client: Redis = connect_node(cluster, host, port, health_check_s=0)
    return client.pubsub()
