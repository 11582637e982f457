"""consumer.streaming.hub and the reader's subscription, on a real redis-server: a reader that leaves while its
subscription is still being set up (a page reload: the SUBSCRIBE not confirmed yet, or the reader's first
touch still in flight) takes its subscription with it. Otherwise the pod keeps the channel subscribed for
nobody and goes on touching the stream as if it had a reader, so ``cancel_on_disconnect`` never fires."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
from helpers import eventually_async, until

from broker.redis.connection import connect, connect_blocking
from broker.redis.server import RedisServer
from broker.request.generation import GenerationRequest
from broker.streams.job_store import JobStore
from broker.streams.records import Claim
from broker.streams.stream_store import StreamStore
from consumer.app import _touch_readers
from consumer.streaming.hub import LiveHub
from consumer.streaming.reader import read_batches

pytestmark = pytest.mark.slow

COD = GenerationRequest(None, "hello", None, 32, 0.8, 0.95, None, (), True)  # cancel_on_disconnect
GRACE_S = 0.5


@pytest.fixture
async def parts(own_redis: RedisServer) -> AsyncIterator[tuple[StreamStore, LiveHub, redis.Redis]]:
    r = connect(own_redis.url)
    blocking = connect_blocking(own_redis.url)
    hub = LiveHub(blocking)
    await hub.start()
    admin = redis.Redis(port=own_redis.port)
    yield StreamStore(r), hub, admin
    admin.client_unpause()
    admin.close()
    await hub.stop()
    await r.aclose()
    await blocking.aclose()


@pytest.fixture
def jobs(parts: tuple[StreamStore, LiveHub, redis.Redis]) -> JobStore:
    """The generator's side, on the store's Redis."""
    return JobStore(parts[0].redis)


async def _connected(hub: LiveHub) -> None:
    """Until the hub's pub/sub connection is up (a subscription made before is confirmed only at the connect)."""

    async def confirmed() -> bool:
        sub = await hub.subscribe("warm-up")
        hub.unsubscribe(sub)
        return not sub.resync

    await eventually_async(confirmed, 5, "the hub connected")


@contextlib.contextmanager
def _stopped(server: RedisServer) -> Iterator[None]:
    """Redis SIGSTOPped for the block: a command goes out (the kernel takes it), no reply comes back."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


async def test_a_reader_that_leaves_before_redis_confirms_its_subscription_leaves_no_channel(
        own_redis: RedisServer, parts: tuple[StreamStore, LiveHub, redis.Redis]) -> None:
    _, hub, admin = parts
    await _connected(hub)
    channel = f"test:{uuid.uuid4()}:live"
    with _stopped(own_redis):  # the SUBSCRIBE goes out; its confirmation does not come back
        reader = asyncio.ensure_future(hub.subscribe(channel))
        # Deliberate: a moment for the SUBSCRIBE to go out (nothing shows it with Redis stopped), in which the
        # reader must not end.
        await asyncio.sleep(0.3)
        assert not reader.done() and hub.channels == 1
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        assert (hub.channels, hub.readers) == (0, 0)
    # Redis did get the SUBSCRIBE: the hub takes it back once it is confirmed, so nothing stays subscribed there.
    await until(lambda: admin.pubsub_numsub(channel)[0][1] == 0 and hub.channels == 0)
    await asyncio.sleep(0.3)  # deliberate: a moment in which nothing may subscribe it again
    assert admin.pubsub_numsub(channel)[0][1] == 0 and hub.channels == 0


async def test_readers_that_join_a_subscription_being_confirmed_stay_when_its_first_reader_leaves(
        own_redis: RedisServer, parts: tuple[StreamStore, LiveHub, redis.Redis]) -> None:
    _, hub, admin = parts
    await _connected(hub)
    channel = f"test:{uuid.uuid4()}:live"
    with _stopped(own_redis):
        first = asyncio.ensure_future(hub.subscribe(channel))
        await until(lambda: hub.readers == 1, 5, "the first reader waiting", interval_s=0.01)
        second = asyncio.ensure_future(hub.subscribe(channel))
        await until(lambda: hub.readers == 2, 5, "the second reader waiting", interval_s=0.01)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert not second.done() and (hub.channels, hub.readers) == (1, 1)
    sub = await second  # confirmed by the subscription the first reader started
    assert not sub.resync
    admin.publish(channel, b"1-1\ndelta\n{}")
    assert await sub.wait(5.0)
    events, _ = sub.take()
    assert [e.id for e in events] == ["1-1"]
    hub.unsubscribe(sub)
    await until(lambda: admin.pubsub_numsub(channel)[0][1] == 0)


async def test_a_page_reload_during_the_first_touch_still_lets_cancel_on_disconnect_fire(jobs: JobStore,
        parts: tuple[StreamStore, LiveHub, redis.Redis]) -> None:
    """The stream was read once (so a disconnect counts), then a reader comes back and leaves while its first
    touch is in flight (Redis pauses writes: the subscription is confirmed, the touch script waits). With no
    reader left, the pod stops touching the stream and RENEW (what the generator runs every lease/3) says
    ``disconnect`` once the grace has passed."""
    store, hub, admin = parts
    sid = uuid.uuid4()
    await store.create(sid, COD, model="m", max_queue=0, retention_s=60)
    claim = await jobs.claim(sid, "w")
    assert isinstance(claim, Claim)

    first = read_batches(store, hub, sid, None, 0.2, watched=True)
    assert await anext(first)  # the replay: the stream has been read
    await first.aclose()  # type: ignore[attr-defined]
    assert hub.channels == 0

    admin.client_pause(3000, all=False)  # WRITE: scripts wait, SUBSCRIBE does not
    reload = read_batches(store, hub, sid, None, 0.2, watched=True)
    reader = asyncio.ensure_future(anext(reload))
    await until(lambda: hub.channels == 1)
    await asyncio.sleep(0.3)  # deliberate: a moment in which the reader must stay held
    assert not reader.done()  # held in its first touch
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    assert (hub.channels, hub.readers, hub.stream_ids()) == (0, 0, [])
    admin.client_unpause()

    toucher = asyncio.ensure_future(_touch_readers(store, hub, 0.1))  # the pod's own touch loop
    try:
        await asyncio.sleep(GRACE_S + 0.7)  # deliberate: the grace lapses in real time (Redis's clock)
        res = await jobs.renew(claim, GRACE_S, 30.0)
    finally:
        toucher.cancel()
        await asyncio.gather(toucher, return_exceptions=True)
    assert res.ok and res.cancel_reason == "disconnect"
