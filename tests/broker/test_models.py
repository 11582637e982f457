"""The served-models registry: what generators announce is what /v1/models lists, newest first, and a model
no generator has announced for SEEN_WITHIN_S leaves the list (and, much later, the key)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis

from broker.redis.connection import connect
from broker.redis.server import RedisServer
from broker.streams.served_models import FORGET_AFTER_S, SEEN_WITHIN_S, ServedModels


@pytest.fixture
async def models(redis_server: RedisServer, redis_client: redis.Redis) -> AsyncIterator[ServedModels]:
    r = connect(redis_server.url)
    yield ServedModels(r)
    await r.aclose()


def _announced_ago(redis_client: redis.Redis, key: str, name: str, s: float) -> None:
    """As if ``name`` had been announced ``s`` earlier than it was (the scores are the Redis server's time)."""
    redis_client.zincrby(key, -s * 1000, name)


async def test_recent_lists_announced_models_newest_first_and_drops_silent_ones(
        models: ServedModels, redis_client: redis.Redis) -> None:
    redis_client.delete(models.key)
    assert await models.recent() == []
    for name, ago_s in (("old-model", SEEN_WITHIN_S + 1), ("SmolLM2", 5), ("other", 1)):
        await models.announce(name)
        _announced_ago(redis_client, models.key, name, ago_s)
    assert [m.id for m in await models.recent()] == ["other", "SmolLM2"]
    await models.announce("SmolLM2")  # announced again: the newest
    assert [m.id for m in await models.recent()] == ["SmolLM2", "other"]
    _announced_ago(redis_client, models.key, "other", SEEN_WITHIN_S)
    assert [m.id for m in await models.recent()] == ["SmolLM2"]  # "other" fell silent


async def test_names_silent_for_a_long_time_are_deleted_at_the_next_announcement(
        models: ServedModels, redis_client: redis.Redis) -> None:
    redis_client.delete(models.key)
    for name, ago_s in (("gone", FORGET_AFTER_S + 1), ("kept", FORGET_AFTER_S - 60), ("live", 0)):
        await models.announce(name)
        _announced_ago(redis_client, models.key, name, ago_s)
    assert redis_client.zrange(models.key, 0, -1) == [b"kept", b"live"]
