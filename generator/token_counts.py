"""A worker's answers to the token counts asked of its model (broker.streams.token_counts): while it runs, a worker
whose engine counts (generator.engines.base.TokenCounter: in-process llama.cpp) says so, takes the questions one at
a time and answers each with its prompt's tokens, counted on a thread (tokenizing a long prompt takes
milliseconds; it decodes nothing, so it runs beside the generations)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from broker.errors import StoreFull, StoreUnavailable
from broker.redis.connection import RedisClient
from broker.streams.served_models import ANNOUNCE_INTERVAL_S
from broker.streams.token_counts import TokenCounts
from generator.engines.base import EngineError, TokenCounter, error_code

log = logging.getLogger("rsb.generator")

# A BLPOP well under the pooled client's socket timeout (docs/dependencies.md: it does not extend it).
BLOCK_S = 2.0
RETRY_S = 1.0


async def answer_token_counts(engine: TokenCounter, redis: RedisClient, model: str) -> None:
    """Until cancelled: say this worker counts ``model``'s tokens and answer the questions asked of it."""
    counts = TokenCounts(redis)
    announced = -ANNOUNCE_INTERVAL_S
    while True:
        try:
            if time.monotonic() - announced >= ANNOUNCE_INTERVAL_S:
                await counts.announce(model)
                announced = time.monotonic()
            question = await counts.next_question(model, BLOCK_S)
            if question is None:
                continue
            qid, request = question
            answer: dict[str, Any]
            try:
                answer = {"input_tokens": await asyncio.to_thread(engine.count_tokens, request)}
            except EngineError as e:  # the request's fault (a template that refuses it): said to the asker
                answer = {"error": {"code": error_code(e), "message": str(e)}}
            await counts.answer(qid, answer)
        except (StoreUnavailable, StoreFull) as e:
            log.warning("token counts: redis refused, retrying: %s", type(e).__name__)
            await asyncio.sleep(RETRY_S)
        except Exception as e:  # a bug: said, and the loop goes on
            log.error("token counts failed: %s", type(e).__name__, exc_info=e)
            await asyncio.sleep(RETRY_S)
