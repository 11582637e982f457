"""Token counts through Redis: a consumer asks the generators of a model how many tokens a request's prompt is,
and one of them answers. The tokenizer and the chat template live with the engine, in a generator; a consumer has
neither (``POST /v1/messages/count_tokens``).

A question is its request, stored under a random id for as long as its asker waits (``SET ... PX``: Redis's own
clock expires it), and that id pushed on the model's list. A generator that counts takes the next id (BLPOP) and
the request (GETDEL: a question whose asker gave up is gone, and is skipped), counts, and pushes the answer on the
id's answer list, which the asker waits on (BLPOP) and which expires soon after. One tenant's prompt is never
readable by another (ids are random and listed only on the model's list, which holds ids), nothing outlives its
asker's wait by more than ``ANSWER_TTL_MS``, and the list is bounded (``MAX_WAITING``, oldest dropped: their askers
time out) and expires when nobody asks. Generators that can count say so (``counters``), so a model without one
is answered at once instead of after a wait.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import orjson

from broker.errors import Overloaded
from broker.redis.connection import RedisClient, reply_text
from broker.request.generation import GenerationRequest
from broker.streams.keys import TokenCountKeys, token_count_answer_key, token_count_question_key

#: How long a counting generator's word lasts: it says it again every announcement (broker.streams.served_models).
COUNTERS_TTL_S = 35
#: Questions waiting per model, at most; an idle list expires after LIST_TTL_MS.
MAX_WAITING = 256
LIST_TTL_MS = 60_000
ANSWER_TTL_MS = 10_000
#: Questions one process waits on at once, by default: each holds a Redis connection while it waits (a consumer
#: gives them connections of their own, this many: consumer.app).
MAX_ASKING = 8
_ID = re.compile(r"\A[0-9a-f]{32}\Z")


class TokenCounts:
    """``max_asking``: the questions this process waits on at once; one more is refused (Overloaded) rather than
    take another of the pool's connections."""

    def __init__(self, redis: RedisClient, max_asking: int = MAX_ASKING) -> None:
        self.redis = redis
        self.max_asking = max_asking
        self.asking = 0

    # -- the asker (a consumer) -----------------------------------------------------------------------------

    async def counted(self, model: str) -> bool:
        """Whether a generator that counts ``model``'s tokens is alive."""
        return bool(await self.redis.exists(TokenCountKeys(model).counters))

    async def ask(self, model: str, request: GenerationRequest, wait_s: float) -> dict[str, Any] | None:
        """The answer of a generator of ``model`` about ``request``'s prompt (``{"input_tokens": int}``, or
        ``{"error": {"code", "message"}}`` when its engine refuses the request), or None after ``wait_s``. Raises
        Overloaded when this process already waits on ``max_asking`` questions."""
        if self.asking >= self.max_asking:
            raise Overloaded("this server is counting as many prompts as it may; retry", retry_after_s=1)
        self.asking += 1
        try:
            return await self._ask(model, request, wait_s)
        finally:
            self.asking -= 1

    async def _ask(self, model: str, request: GenerationRequest, wait_s: float) -> dict[str, Any] | None:
        question = uuid.uuid4().hex
        keys = TokenCountKeys(model)
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(token_count_question_key(question), request.canonical_json(), px=max(1, int(wait_s * 1000)))
        pipe.rpush(keys.questions, question)
        pipe.ltrim(keys.questions, -MAX_WAITING, -1)
        pipe.pexpire(keys.questions, LIST_TTL_MS)
        await pipe.execute()
        got = await self.redis.blpop([token_count_answer_key(question)], timeout=wait_s)
        if got is None:
            await self.redis.delete(token_count_question_key(question))
            return None
        answer: dict[str, Any] = orjson.loads(got[1])
        return answer

    # -- the counter (a generator) --------------------------------------------------------------------------

    async def announce(self, model: str) -> None:
        """Say that a generator counting ``model``'s tokens is alive (for COUNTERS_TTL_S)."""
        await self.redis.set(TokenCountKeys(model).counters, b"1", ex=COUNTERS_TTL_S)

    async def next_question(self, model: str, block_s: float) -> tuple[str, GenerationRequest] | None:
        """The next question whose asker still waits (its id and request), or None after ``block_s``."""
        got = await self.redis.blpop([TokenCountKeys(model).questions], timeout=block_s)
        if got is None:
            return None
        question = reply_text(got[1])
        if not _ID.match(question):
            return None  # not an id an asker pushed
        raw = await self.redis.getdel(token_count_question_key(question))
        if raw is None:
            return None  # its asker gave up
        return question, GenerationRequest.from_canonical(raw)  # type: ignore[arg-type]

    async def answer(self, question: str, answer: dict[str, Any]) -> None:
        key = token_count_answer_key(question)
        pipe = self.redis.pipeline(transaction=False)
        pipe.rpush(key, orjson.dumps(answer))
        pipe.pexpire(key, ANSWER_TTL_MS)
        await pipe.execute()
