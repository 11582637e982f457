"""Which models the generators serve, as the consumers learn it: every generator announces the name its
engine serves, and the aliases it answers to, every ``ANNOUNCE_INTERVAL_S``; a model is served while announced
within ``SEEN_WITHIN_S``. Nothing is ever configured twice: the name a consumer shows is the one the generator's
``started`` events carry, and the queue a create goes to is that name's (broker.streams.keys.QueueKeys).

Scores are the announcing process's clock: a skew between machines well under ``SEEN_WITHIN_S`` only
shifts when a stopped generator's model leaves the list.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from broker.redis.connection import RedisClient, reply_text
from broker.streams.keys import served_models_key

ANNOUNCE_INTERVAL_S = 10.0
# Three missed announcements: a generator that stopped (or lost Redis) leaves the list after this long, and a
# create naming its model is refused from then on (404 model_not_found) instead of waiting for nobody.
SEEN_WITHIN_S = 35.0
# Names not announced for this long are deleted at the next announcement (the key never grows unbounded).
FORGET_AFTER_S = 7 * 24 * 3600.0
# An alias is stored as this prefix and the alias in the same sorted set, its model in a hash beside it.
_ALIAS = "alias:"


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A name a create may give: a model (``root`` is itself) or an alias of one (``root``: the model)."""

    id: str
    root: str


class ServedModels:
    def __init__(self, redis: RedisClient) -> None:
        self.redis = redis
        self.key = served_models_key()
        self.aliases_key = self.key + ":aliases"

    async def announce(self, name: str, aliases: tuple[str, ...] = (), now_s: float | None = None) -> None:
        now_ms = int((time.time() if now_s is None else now_s) * 1000)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(self.key, {name: now_ms, **{_ALIAS + a: now_ms for a in aliases if a != name}})
        if aliases:
            pipe.hset(self.aliases_key, mapping={a: name for a in aliases if a != name})
        pipe.zremrangebyscore(self.key, "-inf", now_ms - int(FORGET_AFTER_S * 1000))
        await pipe.execute()

    async def recent(self, within_s: float = SEEN_WITHIN_S, now_s: float | None = None) -> list[ServedModel]:
        """Models and aliases announced within ``within_s``, the most recently announced first (models before
        aliases); an alias whose model has not been announced as recently is left out."""
        now_ms = int((time.time() if now_s is None else now_s) * 1000)
        raw = await self.redis.zrevrangebyscore(self.key, "+inf", now_ms - int(within_s * 1000))
        names = [reply_text(n) for n in raw]  # type: ignore[arg-type]  # members only, no scores
        models = [n for n in names if not n.startswith(_ALIAS)]
        aliases = [n[len(_ALIAS):] for n in names if n.startswith(_ALIAS)]
        roots = [reply_text(r) if r is not None else "" for r in await self.redis.hmget(self.aliases_key, aliases)] \
            if aliases else []
        return [ServedModel(m, m) for m in models] + [
            ServedModel(a, r) for a, r in zip(aliases, roots, strict=True) if r in models and a not in models]
