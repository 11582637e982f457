"""Which models the generators serve, as the consumers learn it: every generator announces the name its
engine serves, the aliases it answers to, and itself, every ``ANNOUNCE_INTERVAL_S``; a model is served while
announced within ``SEEN_WITHIN_S``, by as many generators as announced it that recently (a generator that stops
cleanly withdraws at once). Nothing is ever configured twice: the name a consumer shows is the one the generator's
``started`` events carry, and the queue a create goes to is that name's (broker.streams.keys.QueueKeys). Models an
operator declares (the consumer's ``--models``) are known with no generator at all: that is the consumer's.

Scores are the Redis server's time, read by the scripts that write and read them (``SCORE_NOW``, ``SINCE``): a
generator whose clock runs ahead or behind neither keeps its model listed after it stopped nor drops it while it runs.
Each script touches one key (the three keys are outside every partition: on Redis Cluster they may live apart).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from broker.redis.connection import RedisClient, register_script, reply_text
from broker.redis.lua import SERVER_MS, Lua
from broker.streams.keys import served_models_key, served_workers_key

ANNOUNCE_INTERVAL_S = 10.0
# Three missed announcements: a generator that stopped (or lost Redis) leaves the list after this long, and a
# create naming its model is refused from then on (404 model_not_found) instead of waiting for nobody.
SEEN_WITHIN_S = 35.0
# Names not announced for this long are deleted at the next announcement (the key never grows unbounded).
FORGET_AFTER_S = 7 * 24 * 3600.0
# An alias is stored as this prefix and the alias in the same sorted set, its model in a hash beside it.
_ALIAS = "alias:"

#: Members (ARGV past the named ones) scored by the server's time now; then those older than A.forget_ms leave.
SCORE_NOW = Lua(SERVER_MS + """
local now = server_ms()
for i = A_NAMES + 1, #ARGV do redis.call('ZADD', K.set, now, ARGV[i]) end
redis.call('ZREMRANGEBYSCORE', K.set, '-inf', now - tonumber(A.forget_ms))
return now
""", key_names=("set",), arg_names=("forget_ms",))

#: Members scored within A.within_ms of the server's time now, the newest first.
SINCE = Lua(SERVER_MS + """
return redis.call('ZREVRANGEBYSCORE', K.set, '+inf', server_ms() - tonumber(A.within_ms))
""", key_names=("set",), arg_names=("within_ms",))


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A name a create may give: a model (``root`` is itself) or an alias of one (``root``: the model), and the
    generators serving its model now (0: a declared model none runs yet)."""

    id: str
    root: str
    workers: int = 0


class ServedModels:
    def __init__(self, redis: RedisClient) -> None:
        self.redis = redis
        self.key = served_models_key()
        self.aliases_key = self.key + ":aliases"
        self.workers_key = served_workers_key()
        self._score_now = register_script(redis, SCORE_NOW.text)
        self._since = register_script(redis, SINCE.text)

    async def announce(self, name: str, aliases: tuple[str, ...] = (), *, worker_id: str = "") -> None:
        others = [a for a in aliases if a != name]
        if others:
            await self.redis.hset(self.aliases_key, mapping={a: name for a in others})
        await self._score_now(keys=SCORE_NOW.keys({"set": self.key}),
                              args=SCORE_NOW.args({"forget_ms": int(FORGET_AFTER_S * 1000)}, name,
                                                  *(_ALIAS + a for a in others)))
        if worker_id:
            await self._score_now(keys=SCORE_NOW.keys({"set": self.workers_key}),
                                  args=SCORE_NOW.args({"forget_ms": int(SEEN_WITHIN_S * 1000)},
                                                      f"{name}\n{worker_id}"))

    async def withdraw(self, name: str, worker_id: str) -> None:
        """This generator serves ``name`` no more (a clean stop): it is not counted from now on."""
        await self.redis.zrem(self.workers_key, f"{name}\n{worker_id}")

    async def recent(self, within_s: float = SEEN_WITHIN_S) -> list[ServedModel]:
        """Models and aliases announced within ``within_s``, the most recently announced first (models before
        aliases), each with its model's generators announced as recently; an alias whose model has not been
        announced as recently is left out."""
        within = {"within_ms": int(within_s * 1000)}
        raw = await self._since(keys=SINCE.keys({"set": self.key}), args=SINCE.args(within))
        raw_workers = await self._since(keys=SINCE.keys({"set": self.workers_key}), args=SINCE.args(within))
        names = [reply_text(n) for n in raw]
        workers = Counter(reply_text(w).partition("\n")[0] for w in raw_workers)
        models = [n for n in names if not n.startswith(_ALIAS)]
        aliases = [n[len(_ALIAS):] for n in names if n.startswith(_ALIAS)]
        roots = [reply_text(r) if r is not None else "" for r in await self.redis.hmget(self.aliases_key, aliases)] \
            if aliases else []
        return [ServedModel(m, m, workers[m]) for m in models] + [ServedModel(a, r, workers[r]) for a, r in
                                                                  zip(aliases, roots, strict=True)
                                                                  if r in models and a not in models]
