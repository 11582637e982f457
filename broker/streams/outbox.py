"""The webhook outbox: one event per generation that ended with a webhook destination, written by the script that
appends its terminal event (``hook_enqueue``, in FINISH and CANCEL), so the event exists exactly when the terminal
event does; delivered at least once by any live consumer pod (consumer.streaming.webhooks), from Redis, fairly across
destinations: one receiver that never answers holds up only its own events.

Where, per partition (broker.streams.keys.outbox_key and the names below it, all in the partition's slot):
- ``hooks``: a hash of the pending events (field the event id, value its record as JSON: ``sid``, ``hid`` (the id
  the event names: the stream's, or ``resp_...`` for a Responses create), ``url``, ``dest`` (its destination: a
  digest of the URL's scheme, host and port), ``key`` (the API key whose secret signs it, '' for --webhook-secret),
  ``qs`` (its creator's storage quota), ``type``, ``created_at`` (Unix s of the end), ``first_ms`` (when it was first
  due), ``attempts``); every time here is the Redis server's (TIME, read by the scripts), never a pod's;
- ``hooks:d:<dest>``: per destination, a sorted set of its event ids by when each is next due (ms);
- ``hooks:dests``: the destinations with pending events, by when the first may next be taken (its earliest event,
  or later while the destination is held);
- ``hooks:holds``: per failing destination, ``<until ms> <failures in a row>`` (the circuit breaker, shared by
  every pod: see consumer.streaming.webhooks).
A pod takes due events with TAKE, destination by destination, at most as many of each as it may still have in
flight to it (``per_dest`` less its own in-flight count; one while the destination is held: a probe), and makes
them due again a lease later in the same step: two pods never deliver one event at once, and a pod SIGKILLed
mid-delivery leaves its events to whichever pod takes them once the lease is over. Delivered or given up, an event
leaves (DONE); failed, it is due again after its backoff (RETRY), and its destination's failures are counted, held
past BREAKER_FAILURES in a row (FAIL); a delivery clears the destination's hold. The event id is the stream's
(``evt_`` and its hex), the same on every try.

Storage: each pending event counts HOOK_BYTES in its creator's storage quota and 1 in the quota hash's ``hooks``
field, until it leaves; a create that would pass its caller's ``max_pending`` pending events is refused (CREATE,
broker.streams.scripts): a tenant whose receiver never answers cannot grow the outbox without bound.

Events written before destinations were kept apart (``hooks:due``, a sorted set of ids) are moved into their
destination's set by TAKE, a bounded number per call.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import orjson

from broker.redis.connection import RedisClient, register_script, reply_text
from broker.redis.keyspace import lua_builders
from broker.redis.lua import SERVER_MS, Lua
from broker.redis.quota import QUOTA_LUA
from broker.streams.keys import OUTBOX_DEST, outbox_dests_key, outbox_due_key, outbox_holds_key, outbox_key

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
LATE_AFTER_S = 3600.0
GIVE_UP_AFTER_S = 86_400.0
#: The circuit breaker: after this many failed tries in a row a destination is held (none of its events is taken)
#: BREAKER_FIRST_S, doubling with each further failure up to BREAKER_MAX_S; when the hold ends one event is tried
#: (a probe), and a delivery clears the hold.
BREAKER_FAILURES = 3
BREAKER_FIRST_S = 2.0
BREAKER_MAX_S = 30.0
#: What a pending event counts in its creator's storage quota (its record in the hash, its id in a sorted set).
HOOK_BYTES = 512
#: Legacy events moved into their destination's set per TAKE.
MIGRATE_PER_TAKE = 100


def retry_delay_s(attempts: int, age_s: float) -> float:
    """The wait before the next try of an event tried ``attempts`` times, first due ``age_s`` ago (jittered down
    by up to a fifth, so that receivers coming back are not met by every pod's retries at once)."""
    gap = min(HOUR_GAP_S, FIRST_RETRY_S * 2 ** max(0, attempts - 1)) if age_s < LATE_AFTER_S else LATER_GAP_S
    return gap * random.uniform(0.8, 1.0)


def hold_s(failures: int) -> float:
    """How long a destination failing ``failures`` times in a row is held (0: not yet)."""
    if failures < BREAKER_FAILURES:
        return 0.0
    return min(BREAKER_MAX_S, BREAKER_FIRST_S * 2.0 ** (failures - BREAKER_FAILURES))


def event_id(sid: str) -> str:
    return "evt_" + sid.replace("-", "")


#: Shared by the outbox's scripts: a destination's set, and its place in ``dests`` (its earliest event, or its hold's
#: end if later; out of ``dests`` when it has none).
_DEST_LUA = lua_builders(dest_set=OUTBOX_DEST) + """
local function dest_place(outbox, dests, holds, dest)
  local first = redis.call('ZRANGE', dest_set(outbox, dest), 0, 0, 'WITHSCORES')
  if #first == 0 then
    redis.call('ZREM', dests, dest)
    redis.call('HDEL', holds, dest)
    return
  end
  local at = tonumber(first[2])
  local h = redis.call('HGET', holds, dest)
  if h then at = math.max(at, tonumber(string.match(h, '^(%S+)'))) end
  redis.call('ZADD', dests, at, dest)
end
-- A destination's name: its scheme, host and port, as written (a digest: URLs are operators', never clients').
local function dest_of(url)
  local origin = string.match(url, '^[%a][%w+.-]*://[^/?#]*') or url
  return string.sub(redis.sha1hex(string.lower(origin)), 1, 16)
end
"""

#: Lua for the terminal events' scripts (which include broker.redis.quota's Lua first): the stream's webhook event,
#: when its meta names a destination (``hook``, and ``hid``: set by CREATE), counted in its creator's quota.
HOOK_LUA = SERVER_MS + _DEST_LUA + f"""
local HOOK_TYPES = {{{", ".join(f"[{k!r}] = {v!r}" for k, v in EVENT_TYPES.items())}}}
local function hook_enqueue(outbox, dests, holds, meta, sid, status, reason)
  local h = redis.call('HMGET', meta, 'hook', 'hid', 'key_id', 'qs')
  if not h[1] then return end
  local etype = HOOK_TYPES[status]
  if status == 'done' and reason == 'length' then etype = {INCOMPLETE!r} end
  local now_ms = server_ms()
  local id = 'evt_' .. string.gsub(sid, '-', '')
  local dest = dest_of(h[1])
  redis.call('HSET', outbox, id, cjson.encode({{sid = sid, hid = h[2] or sid, url = h[1], dest = dest,
    key = h[3] or '', qs = h[4] or '', type = etype, created_at = math.floor(now_ms / 1000), first_ms = now_ms,
    attempts = 0}}))
  redis.call('ZADD', dest_set(outbox, dest), now_ms, id)
  dest_place(outbox, dests, holds, dest)
  if h[4] then
    quota_charge(h[4], 'hook:' .. id, {HOOK_BYTES})
    redis.call('HINCRBY', h[4], 'hooks', 1)
  end
end
"""

#: The KEYS of the outbox's scripts: one partition's outbox (its destinations' sets are named from ``outbox``).
OUTBOX_KEYS = ("outbox", "dests", "holds", "legacy_due")

# Takes due events, destination by destination (those whose first event is due by now, earliest first), at most
# A.count in all: of each destination at most A.per_dest less what this pod has in flight to it (ARGV past the named
# ones: dest1, n1, dest2, n2, ...), and one while it is held (failures in a row: a probe). Each is due again a lease
# later (A.lease_ms), so no other pod takes it meanwhile. An id without its record (delivered by another pod whose
# reply was lost) is dropped. Reply: {id1, record1, id2, record2, ...}
TAKE = Lua(SERVER_MS + _DEST_LUA + """
-- Events from before destinations were kept apart: into their destination's set, a few per call.
for _, id in ipairs(redis.call('ZRANGE', K.legacy_due, 0, tonumber(A.migrate) - 1)) do
  local record = redis.call('HGET', K.outbox, id)
  if record then
    local r = cjson.decode(record)
    r.dest = dest_of(r.url)
    redis.call('HSET', K.outbox, id, cjson.encode(r))
    redis.call('ZADD', dest_set(K.outbox, r.dest), redis.call('ZSCORE', K.legacy_due, id), id)
    dest_place(K.outbox, K.dests, K.holds, r.dest)
  end
  redis.call('ZREM', K.legacy_due, id)
end
local busy = {}
for i = A_NAMES + 1, #ARGV, 2 do busy[ARGV[i]] = tonumber(ARGV[i + 1]) end
local now, left, per = server_ms(), tonumber(A.count), tonumber(A.per_dest)
local out = {}
local ready = redis.call('ZRANGEBYSCORE', K.dests, '-inf', now, 'LIMIT', 0, left + (#ARGV - A_NAMES) / 2)
for _, dest in ipairs(ready) do
  if left <= 0 then break end
  local room = per - (busy[dest] or 0)
  local h = redis.call('HGET', K.holds, dest)
  if h and tonumber(string.match(h, '%S+$')) >= tonumber(A.breaker) then  -- held, and the hold is over: a probe
    room = math.min(room, 1 - (busy[dest] or 0))
  end
  room = math.min(room, left)
  if room > 0 then
    local set = dest_set(K.outbox, dest)
    for _, id in ipairs(redis.call('ZRANGEBYSCORE', set, '-inf', now, 'LIMIT', 0, room)) do
      local record = redis.call('HGET', K.outbox, id)
      if record then
        redis.call('ZADD', set, now + tonumber(A.lease_ms), id)
        out[#out + 1] = id
        out[#out + 1] = record
        left = left - 1
      else
        redis.call('ZREM', set, id)
      end
    end
    dest_place(K.outbox, K.dests, K.holds, dest)
  end
end
return out
""", key_names=OUTBOX_KEYS, arg_names=("lease_ms", "count", "per_dest", "breaker", "migrate"))

# Delivered, or given up: the event leaves the outbox, and its creator's quota; a delivery (A.delivered = 1) clears
# its destination's hold.
DONE = Lua(QUOTA_LUA + _DEST_LUA + """
local record = redis.call('HGET', K.outbox, A.id)
redis.call('HDEL', K.outbox, A.id)
redis.call('ZREM', K.legacy_due, A.id)
if A.delivered == '1' then redis.call('HDEL', K.holds, A.dest) end
local gone = redis.call('ZREM', dest_set(K.outbox, A.dest), A.id)
dest_place(K.outbox, K.dests, K.holds, A.dest)
if record then
  local qs = cjson.decode(record).qs
  if qs and qs ~= '' and redis.call('HEXISTS', qs, 'hook:' .. A.id) == 1 then
    redis.call('HINCRBY', qs, 'hooks', -1)
    quota_release(qs, 'hook:' .. A.id)
  end
end
return gone
""", key_names=OUTBOX_KEYS, arg_names=("id", "dest", "delivered"))

# Failed: past A.give_up_ms since it was first due (A.first_ms), it is given up (-1: the caller takes it out, as
# DONE); otherwise the event, with its attempts counted (A.record), is due again after A.soon_ms (A.late_ms once it
# is A.late_after_ms old), unless it left meanwhile (0); its destination's failures in a row are counted and, from
# A.breaker on, it is held for its hold (A.holds_ms: the hold of each count of failures from A.breaker on, the last
# repeating). Every time is the server's: pods whose clocks disagree agree on what is due.
RETRY = Lua(SERVER_MS + _DEST_LUA + """
local now = server_ms()
local age = now - tonumber(A.first_ms)
if age >= tonumber(A.give_up_ms) then return -1 end
if redis.call('HEXISTS', K.outbox, A.id) == 0 then return 0 end
redis.call('HSET', K.outbox, A.id, A.record)
local delay = tonumber(A.soon_ms)
if age >= tonumber(A.late_after_ms) then delay = tonumber(A.late_ms) end
redis.call('ZADD', dest_set(K.outbox, A.dest), now + delay, A.id)
local h = redis.call('HGET', K.holds, A.dest)
local failures = (h and tonumber(string.match(h, '%S+$')) or 0) + 1
local until_ms = 0
local breaker = tonumber(A.breaker)
if failures >= breaker then
  local holds = {}
  for v in string.gmatch(A.holds_ms, '%S+') do holds[#holds + 1] = tonumber(v) end
  until_ms = now + holds[math.min(failures - breaker + 1, #holds)]
end
redis.call('HSET', K.holds, A.dest, string.format('%d %d', until_ms, failures))
dest_place(K.outbox, K.dests, K.holds, A.dest)
return 1
""", key_names=OUTBOX_KEYS, arg_names=("id", "record", "dest", "first_ms", "give_up_ms", "soon_ms", "late_ms",
                                          "late_after_ms", "breaker", "holds_ms"))


@dataclass(frozen=True, slots=True)
class HookEvent:
    """One pending webhook event, as taken from the outbox."""

    partition: int
    id: str
    record: dict[str, Any]

    @property
    def url(self) -> str:
        return str(self.record["url"])

    @property
    def dest(self) -> str:
        return str(self.record.get("dest", ""))

    @property
    def key(self) -> str:
        """The API key whose ``webhook_secret`` signs it ('': --webhook-secret)."""
        return str(self.record.get("key") or "")

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
        p = (partition, self.partitions)
        return TAKE.keys({"outbox": outbox_key(*p), "dests": outbox_dests_key(*p), "holds": outbox_holds_key(*p),
                          "legacy_due": outbox_due_key(*p)})

    async def take(self, partition: int, count: int, per_dest: int, busy: dict[str, int],
                   lease_ms: int = LEASE_MS) -> list[HookEvent]:
        """Up to ``count`` events of ``partition`` due by the server's time, at most ``per_dest`` in flight per
        destination with this pod's ``busy`` (destination -> events in flight) counted."""
        tail = [x for dest, n in busy.items() if n > 0 for x in (dest, n)]
        raw = await self._take(keys=self._keys(partition),
                               args=TAKE.args({"lease_ms": lease_ms, "count": count,
                                               "per_dest": per_dest, "breaker": BREAKER_FAILURES,
                                               "migrate": MIGRATE_PER_TAKE}, *tail))
        return [HookEvent(partition, reply_text(raw[i]), orjson.loads(raw[i + 1])) for i in range(0, len(raw), 2)]

    async def done(self, event: HookEvent, *, delivered: bool) -> None:
        await self._done(keys=self._keys(event.partition),
                         args=DONE.args({"id": event.id, "dest": event.dest, "delivered": int(delivered)}))

    async def retry(self, event: HookEvent) -> bool:
        """Count the failed try (and its destination's failure); False when the event is past its day and given up
        (it left the outbox). Its age and next try are the server's time (RETRY): this pod's clock decides neither."""
        attempts = int(event.record.get("attempts", 0)) + 1
        record = orjson.dumps({**event.record, "attempts": attempts})
        holds = " ".join(str(int(hold_s(n) * 1000)) for n in range(BREAKER_FAILURES, BREAKER_FAILURES + 8))
        res = await self._retry(keys=self._keys(event.partition), args=RETRY.args({
            "id": event.id, "record": record, "dest": event.dest, "first_ms": int(event.record["first_ms"]),
            "give_up_ms": int(GIVE_UP_AFTER_S * 1000), "soon_ms": int(retry_delay_s(attempts, 0.0) * 1000),
            "late_ms": int(retry_delay_s(attempts, LATE_AFTER_S) * 1000), "late_after_ms": int(LATE_AFTER_S * 1000),
            "breaker": BREAKER_FAILURES, "holds_ms": holds}))
        if int(res) < 0:
            await self.done(event, delivered=False)
            return False
        return True

    async def pending(self) -> int:
        """Events not delivered yet, over all partitions."""
        total = 0
        for p in range(self.partitions):
            total += int(await self.redis.hlen(outbox_key(p, self.partitions)))
        return total
