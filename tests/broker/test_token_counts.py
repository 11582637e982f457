"""Token counts through Redis (broker.streams.token_counts): a question and its answer, a question nobody answers
(the asker's wait is bounded and the prompt does not stay), a question whose asker gave up (skipped), and the
bounds (questions waiting per model, askers per process)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis
from helpers import until

from broker.errors import Overloaded
from broker.redis.connection import connect
from broker.redis.server import RedisServer
from broker.request.generation import GenerationRequest, Message
from broker.streams.keys import TokenCountKeys
from broker.streams.token_counts import MAX_WAITING, TokenCounts

REQUEST = GenerationRequest(messages=(Message("user", "How many tokens?"),), prompt=None, model="m", max_tokens=8,
                            temperature=0.0, top_p=1.0, seed=None, stop=(), cancel_on_disconnect=False)


@pytest.fixture
async def counts(redis_server: RedisServer, redis_client: redis.Redis) -> AsyncIterator[TokenCounts]:
    r = connect(redis_server.url)
    yield TokenCounts(r)
    await r.aclose()


async def test_a_question_gets_its_answer_and_leaves_nothing(counts: TokenCounts, redis_client: redis.Redis) -> None:
    assert not await counts.counted("m")
    await counts.announce("m")
    assert await counts.counted("m") and 0 < redis_client.ttl(TokenCountKeys("m").counters) <= 35

    async def counter() -> None:
        question = None
        while question is None:
            question = await counts.next_question("m", 1.0)
        qid, request = question
        assert request == REQUEST  # the whole request, as the asker sent it
        await counts.answer(qid, {"input_tokens": 7})

    task = asyncio.create_task(counter())
    assert await counts.ask("m", REQUEST, 5.0) == {"input_tokens": 7}
    await task
    assert redis_client.keys("rsb:tc:ask:*") == [] and redis_client.keys("rsb:tc:ans:*") == []


async def test_nobody_answers_within_the_wait_and_a_late_counter_skips_it(counts: TokenCounts,
                                                                          redis_client: redis.Redis) -> None:
    assert await counts.ask("m", REQUEST, 0.2) is None
    assert redis_client.keys("rsb:tc:ask:*") == []  # the prompt went with its asker
    assert await counts.next_question("m", 0.1) is None  # its id was there; its question is gone: skipped
    assert redis_client.pttl(TokenCountKeys("m").questions) in (-2, *range(1, 60_001))  # the list expires


async def test_the_lists_and_the_askers_are_bounded(counts: TokenCounts, redis_client: redis.Redis) -> None:
    key = TokenCountKeys("m").questions
    redis_client.rpush(key, *(f"{i:032x}" for i in range(MAX_WAITING + 10)))
    assert await counts.ask("m", REQUEST, 0.05) is None
    assert redis_client.llen(key) == MAX_WAITING  # the oldest dropped, the newest (this one) kept
    busy = TokenCounts(counts.redis, max_asking=1)
    waiting = asyncio.create_task(busy.ask("m", REQUEST, 1.0))
    await until(lambda: busy.asking == 1, 5.0, "the first question waiting", interval_s=0.01)
    with pytest.raises(Overloaded):
        await busy.ask("m", REQUEST, 1.0)
    assert await waiting is None and busy.asking == 0
