"""broker.streams.chats on a real redis-server and a real Redis Cluster: a chat's latest-turn pointer and the turn ids.
Racing turns through the view itself (one generation per turn, one active turn, on a cluster too) are in
tests/consumer/test_aisdk.py."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from servers import RedisClusterServers

from broker.redis.connection import RedisClient, connect
from broker.redis.server import RedisServer
from broker.streams.chats import ChatStore, Turn, turn_stream_id
from broker.streams.keys import chat_key


@pytest.fixture(params=["standalone", pytest.param("cluster", marks=pytest.mark.slow)])
async def redis_async(request: pytest.FixtureRequest) -> AsyncIterator[RedisClient]:
    if request.param == "standalone":
        server: RedisServer = request.getfixturevalue("redis_server")
        request.getfixturevalue("redis_client")  # flushed
        url = server.url
    else:
        cluster: RedisClusterServers = request.getfixturevalue("redis_cluster")
        request.getfixturevalue("cluster_client")  # flushed
        url = cluster.url
    r = connect(url)
    yield r
    await r.aclose()


async def test_the_pointer_moves_only_from_what_the_request_read(redis_async: RedisClient) -> None:
    chats = ChatStore(redis_async)
    assert await chats.latest("alice", "c") is None
    first, second, third = (Turn(uuid.uuid4(), tk) for tk in ("t1", "t2", "t3"))
    assert await chats.advance("alice", "c", None, first, 60)
    assert await chats.advance("alice", "c", None, first, 60)  # the same turn again: already in place
    assert await chats.latest("alice", "c") == first
    # Another new turn that read "no turn" lost the race: the first stays the chat's turn.
    assert not await chats.advance("alice", "c", None, second, 60)
    assert await chats.advance("alice", "c", first.stream_id, second, 60)
    # A request that read the older pointer cannot move the chat back.
    assert not await chats.advance("alice", "c", first.stream_id, third, 60)
    assert await chats.latest("alice", "c") == second
    # The key id is part of the chat's name: another tenant's chat of the same id is another chat.
    assert await chats.latest("bob", "c") is None
    assert 0 < await redis_async.ttl(chat_key("alice", "c")) <= 60


def test_turn_ids_are_derived_from_everything_that_names_the_turn() -> None:
    prev = uuid.uuid4()
    base = turn_stream_id("alice", "c", "tk", prev)
    assert base == turn_stream_id("alice", "c", "tk", prev)
    others = {turn_stream_id("bob", "c", "tk", prev), turn_stream_id("alice", "d", "tk", prev),
              turn_stream_id("alice", "c", "tk2", prev), turn_stream_id("alice", "c", "tk", None)}
    assert base not in others and len(others) == 4
