"""broker.redis.pubsub on a real redis-server: a subscription is confirmed, then delivered, and an unsubscribe takes
the channel off Redis (channels, shard, dispatch); a connection the server drops resets its channels twice (at the
loss and once subscribed again) and delivers again; a quiet connection is pinged and a silent one declared dead
(liveness). The dark link a network leaves behind is tests/broker/test_connection_faults.py's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import pytest
import redis
from helpers import until
from redis.exceptions import ConnectionError as RedisConnectionError

from broker.redis.connection import connect_blocking
from broker.redis.pubsub import liveness
from broker.redis.pubsub.channels import Channels
from broker.redis.server import RedisServer


class _Heard:
    """What a Channels' owner gets: messages and resets."""

    def __init__(self) -> None:
        self.messages: list[tuple[bytes, bytes]] = []
        self.resets: list[list[bytes]] = []

    def on_message(self, channel: bytes, data: bytes) -> None:
        self.messages.append((channel, data))

    def on_reset(self, channels: Iterable[bytes]) -> None:
        self.resets.append(sorted(channels))


async def _subscribed(channels: Channels, heard: _Heard, ch: bytes) -> None:
    """Subscribe ``ch`` and wait for Redis's confirmation (or, before the connect, for the reset that stands for
    it)."""
    fut = await channels.subscribe(ch)
    if fut is None:
        await until(lambda: [ch] in heard.resets, 10, "subscribed at the connect")
        heard.resets.clear()
    else:
        await fut


async def test_a_channel_is_confirmed_then_delivered_and_an_unsubscribe_takes_it_off_redis(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    blocking = connect_blocking(redis_server.url)
    heard = _Heard()
    channels = Channels(blocking, on_message=heard.on_message, on_reset=heard.on_reset)
    try:
        await channels.start()
        await _subscribed(channels, heard, b"test:pubsub:a")
        assert channels.connections == 1 and channels.healthy
        redis_client.publish("test:pubsub:a", "one")
        redis_client.publish("test:pubsub:other", "not ours")
        await until(lambda: heard.messages == [(b"test:pubsub:a", b"one")], 10)
        channels.unsubscribe(b"test:pubsub:a")
        await until(lambda: redis_client.pubsub_numsub("test:pubsub:a")[0][1] == 0, 10, "unsubscribed on Redis")
        assert heard.resets == [] and channels.reconnects == 0
    finally:
        await channels.stop()
        await blocking.aclose()


async def test_a_connection_the_server_drops_resets_its_channels_twice_and_delivers_again(
        own_redis: RedisServer) -> None:
    admin = redis.Redis(port=own_redis.port)
    blocking = connect_blocking(own_redis.url)
    heard = _Heard()
    channels = Channels(blocking, on_message=heard.on_message, on_reset=heard.on_reset)
    try:
        await channels.start()
        await _subscribed(channels, heard, b"live")
        assert admin.client_kill_filter(_type="pubsub") == 1
        # Reset at the loss, and again once the new subscription is confirmed: a reader that re-reads the stream
        # at the second misses nothing.
        await until(lambda: heard.resets == [[b"live"], [b"live"]], 10, "reset twice")
        await until(lambda: channels.healthy and channels.reconnects == 1, 10, "reconnected")
        admin.publish("live", "again")
        await until(lambda: heard.messages == [(b"live", b"again")], 10)
    finally:
        await channels.stop()
        await blocking.aclose()
        admin.close()


class _QuietLink:
    """A pub/sub connection that answers no PING: only what liveness.watch calls."""

    def __init__(self) -> None:
        self.pings: list[float] = []

    async def ping(self) -> None:
        self.pings.append(time.monotonic())


async def test_a_quiet_connection_is_pinged_once_and_a_silent_one_declared_dead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(liveness, "PING_AFTER_S", 0.1)
    monkeypatch.setattr(liveness, "DEAD_AFTER_S", 0.4)
    monkeypatch.setattr(liveness, "WATCH_TICK_S", 0.02)
    link = _QuietLink()
    t0 = time.monotonic()
    heard_at = asyncio.get_running_loop().time()  # the loop's clock is monotonic's: never before t0
    with pytest.raises(RedisConnectionError, match="silent"):
        await asyncio.wait_for(liveness.watch(link, lambda: heard_at, asyncio.Lock()), 10)  # type: ignore[arg-type]
    assert len(link.pings) == 1 and link.pings[0] - t0 >= 0.1  # one PING per silence, after PING_AFTER_S
    assert time.monotonic() - t0 >= 0.4
