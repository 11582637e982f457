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


async def test_recent_lists_announced_models_newest_first_and_drops_silent_ones(models: ServedModels) -> None:
    t = 1_800_000_000.0
    assert await models.recent(now_s=t) == []
    await models.announce("old-model", now_s=t - SEEN_WITHIN_S - 1)
    await models.announce("SmolLM2", now_s=t - 5)
    await models.announce("other", now_s=t - 1)
    assert [m.id for m in await models.recent(now_s=t)] == ["other", "SmolLM2"]
    await models.announce("SmolLM2", now_s=t)  # announced again: the newest
    assert [m.id for m in await models.recent(now_s=t)] == ["SmolLM2", "other"]
    assert [m.id for m in await models.recent(now_s=t + SEEN_WITHIN_S - 0.5)] == ["SmolLM2"]  # "other" fell silent


async def test_names_silent_for_a_long_time_are_deleted_at_the_next_announcement(
        models: ServedModels, redis_client: redis.Redis) -> None:
    t = 1_800_000_000.0
    await models.announce("gone", now_s=t - FORGET_AFTER_S - 1)
    await models.announce("kept", now_s=t - FORGET_AFTER_S + 60)
    await models.announce("live", now_s=t)
    assert redis_client.zrange(models.key, 0, -1) == [b"kept", b"live"]
