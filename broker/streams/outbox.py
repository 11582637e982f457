"""The webhook outbox: one event per generation that ended with a webhook destination, written by the script that
appends its terminal event (``hook_enqueue``, in FINISH and CANCEL), so the event exists exactly when the terminal
event does; delivered at least once by any live consumer pod (consumer.streaming.webhooks), from Redis.

Where: per partition, a hash of the pending events (broker.streams.keys.outbox_key: field the event id, value its
record as JSON: ``sid``, ``hid`` (the id the event names: the stream's, or ``resp_...`` for a Responses create),
``url``, ``type``, ``created_at`` (Unix s of the end), ``first_ms`` (when it was first due), ``attempts``) and a
sorted set of the same ids by when each is next due (ms). A pod takes due events with TAKE, which makes them due
again a lease later in the same step: two pods never deliver one event at once, and a pod SIGKILLed mid-delivery
leaves its events to whichever pod takes them once the lease is over. Delivered or given up, an event leaves both
keys (DONE); failed, it is due again after its backoff (RETRY). The event id is the stream's (``evt_`` and its
hex), the same on every try.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import orjson

from broker.redis.connection import RedisClient, register_script, reply_text
from broker.redis.lua import SERVER_MS, Lua
from broker.streams.keys import outbox_due_key, outbox_key

#: The webhook event of each end: ``done`` that stopped at ``max_tokens`` (finish reason ``length``) is
#: ``response.incomplete``.
EVENT_TYPES = {"done": "response.completed", "cancelled": "response.cancelled", "error": "response.failed"}
INCOMPLETE = "response.incomplete"
#: How long a taken event is its taker's: longer than one delivery may take (consumer.streaming.webhooks' timeout).
LEASE_MS = 30_000
#: Retries: the first within 5 s, doubling to at most 60 s apart for the first hour, then every 5 minutes, for a day.
FIRST_RETRY_S = 1.0
HOUR_GAP_S = 60.0
LATER_GAP_S = 300.0
GIVE_UP_AFTER_S = 86_400.0


def retry_delay_s(attempts: int, age_s: float) -> float:
    """The wait before the next try of an event tried ``attempts`` times, first due ``age_s`` ago (jittered down
    by up to a fifth, so that receivers coming back are not met by every pod's retries at once)."""
    gap = min(HOUR_GAP_S, FIRST_RETRY_S * 2 ** max(0, attempts - 1)) if age_s < 3600 else LATER_GAP_S
    return gap * random.uniform(0.8, 1.0)


def event_id(sid: str) -> str:
    return "evt_" + sid.replace("-", "")


#: Lua for the terminal events' scripts: the stream's webhook event, when its meta names a destination (``hook``,
#: and ``hid``: set by CREATE).
HOOK_LUA = SERVER_MS + f"""
local HOOK_TYPES = {{{", ".join(f"[{k!r}] = {v!r}" for k, v in EVENT_TYPES.items())}}}
local function hook_enqueue(outbox, due, meta, sid, status, reason, now_s)
  local h = redis.call('HMGET', meta, 'hook', 'hid')
  if not h[1] then return end
  local etype = HOOK_TYPES[status]
  if status == 'done' and reason == 'length' then etype = {INCOMPLETE!r} end
  local now_ms = server_ms()
  local id = 'evt_' .. string.gsub(sid, '-', '')
  redis.call('HSET', outbox, id, cjson.encode({{sid = sid, hid = h[2] or sid, url = h[1], type = etype,
    created_at = math.floor(tonumber(now_s)), first_ms = now_ms, attempts = 0}}))
  redis.call('ZADD', due, now_ms, id)
end
"""

#: The KEYS of the outbox's scripts: one partition's outbox.
OUTBOX_KEYS = ("outbox", "due")

# Takes up to A.count events due by A.now_ms: each is due again a lease later (A.lease_ms), so no other pod
# takes it meanwhile. An id without its record (delivered by another pod whose reply was lost) is dropped.
# Reply: {id1, record1, id2, record2, ...}
TAKE = Lua("""
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', K.due, '-inf', A.now_ms, 'LIMIT', 0, tonumber(A.count))) do
  local record = redis.call('HGET', K.outbox, id)
  if record then
    redis.call('ZADD', K.due, tonumber(A.now_ms) + tonumber(A.lease_ms), id)
    out[#out + 1] = id
    out[#out + 1] = record
  else
    redis.call('ZREM', K.due, id)
  end
end
return out
""", key_names=OUTBOX_KEYS, arg_names=("now_ms", "lease_ms", "count"))

# Delivered, or given up: the event leaves the outbox.
DONE = Lua("""
redis.call('HDEL', K.outbox, A.id)
return redis.call('ZREM', K.due, A.id)
""", key_names=OUTBOX_KEYS, arg_names=("id",))

# Failed: the event, with its attempts counted (A.record), is due again at A.due_ms; unless it left meanwhile.
RETRY = Lua("""
if redis.call('HEXISTS', K.outbox, A.id) == 0 then return 0 end
redis.call('HSET', K.outbox, A.id, A.record)
redis.call('ZADD', K.due, A.due_ms, A.id)
return 1
""", key_names=OUTBOX_KEYS, arg_names=("id", "record", "due_ms"))


@dataclass(frozen=True, slots=True)
class HookEvent:
    """One pending webhook event, as taken from the outbox."""

    partition: int
    id: str
    record: dict[str, Any]

    @property
    def url(self) -> str:
        return str(self.record["url"])

    def body(self) -> bytes:
        """What is POSTed: OpenAI's webhook event shape."""
        return orjson.dumps({"id": self.id, "object": "event", "type": self.record["type"],
                             "created_at": int(self.record["created_at"]), "data": {"id": self.record["hid"]}})


class Outbox:
    def __init__(self, redis: RedisClient, partitions: int) -> None:
        self.redis = redis
        self.partitions = partitions
        self._take = register_script(redis, TAKE.text)
        self._done = register_script(redis, DONE.text)
        self._retry = register_script(redis, RETRY.text)

    def _keys(self, partition: int) -> list[str]:
        return TAKE.keys({"outbox": outbox_key(partition, self.partitions),
                          "due": outbox_due_key(partition, self.partitions)})

    async def take(self, partition: int, now_ms: int, count: int, lease_ms: int = LEASE_MS) -> list[HookEvent]:
        raw = await self._take(keys=self._keys(partition),
                               args=TAKE.args({"now_ms": now_ms, "lease_ms": lease_ms, "count": count}))
        return [HookEvent(partition, reply_text(raw[i]), orjson.loads(raw[i + 1])) for i in range(0, len(raw), 2)]

    async def done(self, event: HookEvent) -> None:
        await self._done(keys=self._keys(event.partition), args=DONE.args({"id": event.id}))

    async def retry(self, event: HookEvent, now_ms: int) -> bool:
        """Count the failed try; False when the event is past its day and given up (it left the outbox)."""
        attempts = int(event.record.get("attempts", 0)) + 1
        age_s = (now_ms - int(event.record["first_ms"])) / 1000
        if age_s >= GIVE_UP_AFTER_S:
            await self.done(event)
            return False
        due = now_ms + int(retry_delay_s(attempts, age_s) * 1000)
        record = orjson.dumps({**event.record, "attempts": attempts})
        await self._retry(keys=self._keys(event.partition),
                          args=RETRY.args({"id": event.id, "record": record, "due_ms": due}))
        return True

    async def pending(self) -> int:
        """Events not delivered yet, over all partitions."""
        total = 0
        for p in range(self.partitions):
            total += int(await self.redis.zcard(outbox_due_key(p, self.partitions)))
        return total
