"""broker.redis's clients under network faults, through the tests' fault proxy (tests/faultproxy.py) in front of
the session's redis-server, on uvloop as the roles run: a reset connection is "Redis away" (StoreUnavailable, never
uvloop's RuntimeError), and a half-open link (no FIN, no RST) is noticed within its stated bound on every kind of
connection: a command's, a blocking BLPOP's, a pub/sub connection's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis
import uvloop
from faultproxy import FaultProxy
from helpers import until

from broker.errors import StoreUnavailable
from broker.redis.connection import BLOCKING_TIMEOUT_S, COMMAND_TIMEOUT_S, connect, connect_blocking
from broker.redis.pubsub.channels import Channels
from broker.redis.pubsub.liveness import DEAD_AFTER_S, WATCH_TICK_S
from broker.redis.server import RedisServer

# Each case waits out a bound of several seconds by design.
pytestmark = pytest.mark.slow

# What a loaded machine may add to a bound before the test calls it broken.
SLACK_S = 4.0


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[FaultProxy]:
    p = FaultProxy(redis_server.port)
    yield p
    p.close()


def test_a_reset_connection_is_redis_away_and_the_next_command_reconnects(proxy: FaultProxy) -> None:
    async def run() -> None:
        client = connect(proxy.url)
        try:
            assert await client.ping()
            proxy.reset()
            await asyncio.sleep(0.1)  # the RST reaches the client's socket
            with pytest.raises(StoreUnavailable):
                await client.ping()  # uvloop: "unable to perform operation on <TCPTransport closed=True>"
            assert await client.ping()
        finally:
            await client.aclose()

    uvloop.run(run())


def test_half_open_links_are_noticed_within_their_bound(proxy: FaultProxy) -> None:
    """A command times out within COMMAND_TIMEOUT_S, a BLPOP within BLOCKING_TIMEOUT_S (its block is shorter); both
    work again once the link heals."""
    async def run() -> None:
        client = connect(proxy.url, retries=0)
        blocking = connect_blocking(proxy.url)
        try:
            assert await client.ping()
            assert await blocking.ping()
            proxy.dark()
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await client.set("k", "v")
            assert time.monotonic() - t0 < COMMAND_TIMEOUT_S + SLACK_S
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await blocking.blpop(["wake"], timeout=1)
            assert time.monotonic() - t0 < BLOCKING_TIMEOUT_S + SLACK_S
            proxy.heal()
            assert await client.ping()
            assert await blocking.blpop(["wake"], timeout=0.1) is None
        finally:
            await client.aclose()
            await blocking.aclose()

    uvloop.run(run())


@pytest.mark.parametrize("new_too", [False, True], ids=["replaced", "healed"])
def test_a_dark_pubsub_link_is_dropped_reset_and_resubscribed(proxy: FaultProxy, redis_client: redis.Redis,
                                                              new_too: bool) -> None:
    """A pub/sub connection carries no command, so it is pinged: dark, it is found dead within DEAD_AFTER_S (plus a
    watch tick), its channels are reset and it is unhealthy; it reconnects on a new link (``replaced``: only the old
    link is dark) or once the partition heals, resubscribes, and delivers again."""
    async def run() -> None:
        blocking = connect_blocking(proxy.url)
        got: list[bytes] = []
        resets: list[bool] = []  # whether the channels were healthy as each reset was reported
        channels = Channels(blocking, on_message=lambda ch, data: got.append(data),
                            on_reset=lambda chs: resets.append(channels.healthy))
        try:
            await channels.start()
            fut = await channels.subscribe(b"live")
            if fut is None:  # not connected yet: the connect subscribes it, and reports it reset once confirmed
                await until(lambda: bool(resets), 10)
                resets.clear()
            else:
                await fut
            redis_client.publish("live", "one")
            await until(lambda: got == [b"one"], 10)
            assert channels.healthy
            proxy.dark(new_too=new_too)
            t0 = time.monotonic()
            await until(lambda: bool(resets), DEAD_AFTER_S + WATCH_TICK_S + SLACK_S, "the dead link was noticed")
            # Unhealthy when the death is reported: read then, since a replaced link may be healthy again by the
            # time this loop polls (its reconnect waits only tens of ms).
            assert resets[0] is False
            if new_too:
                await asyncio.sleep(1.0)  # a partition that lasts: reconnects fail meanwhile
                proxy.heal()
            # Reset again once the new subscription is confirmed; then healthy, and messages flow.
            await until(lambda: len(resets) >= 2 and channels.healthy, 3 * DEAD_AFTER_S, "resubscribed")
            redis_client.publish("live", "two")
            await until(lambda: b"two" in got, 10)
            assert time.monotonic() - t0 < 3 * DEAD_AFTER_S
        finally:
            await channels.stop()
            await blocking.aclose()

    uvloop.run(run())


