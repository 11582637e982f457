"""The per-tenant storage quota: the bytes one tenant (an API key, or without keys an address group:
broker.streams.keys.tenant_of) holds in Redis, bounded by ``--storage-quota-bytes``.

What is counted: the data of the Durable Streams a caller created (every append, a fork at its full size: a fork
is a copy), the request bodies of its rsb streams while Redis holds them (until the stream ends, or for the
retention when a view reads it back), and its conversations' histories (kept equal to their ``bytes``).
Answers are bounded by ``max_tokens`` and the create rate.

How: one hash per caller and partition (``storage_key``, in the partition's slot, so the script that writes the
data checks and counts it in the same step, on Redis Cluster too: each partition holds its share of the quota),
field ``bytes`` the total and one field per item (a stream's meta key) with what that item holds; and beside it a
sorted set (the same name + ``:exp``) of the items by expiry (ms; ``inf`` for none). Redis expires the items' keys
by itself, without telling anyone: every script that charges first sweeps the caller's items whose expiry passed
(``quota_sweep``) and takes their bytes off, so the count is exact once swept (a write meets at most the items
that expired and were not swept yet, up to SWEEP_MAX a call). A deleted item is released in the deleting step.
The caller's own two keys expire with its longest-lived item (they persist while one has no expiry).
An item is charged to the caller that created it, whoever writes to it later (without API keys, any address may
append to a Durable Stream whose path it knows): an item's charge lives in one place and leaves with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import RedisCluster

from broker.redis.connection import REFUSE_WHEN_FULL, RedisClient, is_cluster
from broker.redis.keyspace import KeyTemplate, partition_share, tagged
from broker.redis.lua import SERVER_MS

#: Expired items swept per charging call: bounds the call's time in Redis.
SWEEP_MAX = 64
#: The default quota of a caller when Redis has no ``maxmemory`` (or it cannot be read).
FIXED_DEFAULT_BYTES = 256 * 1024 * 1024
#: With ``maxmemory`` set, the default quota of a caller is this fraction of it (never more than the fixed default):
#: the bytes counted are the data a caller wrote, and what Redis holds for them (entries, hashes, the streams'
#: events) comes on top, so one caller at its bound holds well under a fifth of Redis (docs/security.md: measured).
MAXMEMORY_FRACTION = 1 / 8


def default_quota_bytes(maxmemory: int) -> int:
    """A caller's quota when no ``--storage-quota-bytes`` is given, for a Redis of ``maxmemory`` bytes (0: none)."""
    if maxmemory <= 0:
        return FIXED_DEFAULT_BYTES
    return max(1, min(FIXED_DEFAULT_BYTES, int(maxmemory * MAXMEMORY_FRACTION)))


async def read_maxmemory(redis: RedisClient) -> int:
    """Redis's ``maxmemory`` in bytes (0: none), from INFO (which managed services answer where CONFIG is disabled);
    on a cluster, the smallest primary's (each holds its partitions' shares). Raises what the command raises."""
    if is_cluster(redis):
        replies: Any = await redis.info("memory", target_nodes=RedisCluster.PRIMARIES)
    else:
        replies = await redis.info("memory")
    if isinstance(replies, dict) and "maxmemory" not in replies:  # {node: info} from several primaries
        values = [int(r.get("maxmemory", 0)) for r in replies.values() if isinstance(r, dict)]
    else:
        values = [int(replies.get("maxmemory", 0))]
    bounded = [v for v in values if v > 0]
    return min(bounded) if bounded else 0


@dataclass(frozen=True, slots=True)
class StorageQuota:
    """Who is charged (``tenant``: broker.streams.keys.tenant_of) and how many bytes it may hold (0 = no bound)."""

    tenant: str = ""
    quota_bytes: int = 0

    def share(self, partitions: int) -> int:
        """The bytes one partition allows (ceil(quota / P): exact with one partition, the default)."""
        return partition_share(self.quota_bytes, partitions)


NO_STORAGE_QUOTA = StorageQuota()


#: A caller's stored bytes in one partition (a hash), and its items by expiry (a sorted set beside it). Here, not in
#: broker.streams.keys: Durable Streams count in it too.
STORAGE = KeyTemplate("{tag}:storage:{tenant}")
STORAGE_EXPIRY = KeyTemplate.under("{storage}:exp", storage=STORAGE)


def storage_key(partition: int, partitions: int, tenant: str) -> str:
    """Hash of one tenant's stored bytes in one partition (and, ``STORAGE_EXPIRY``, its items by expiry)."""
    return STORAGE.build(tag=tagged(partition, partitions), tenant=tenant or "-")


#: The Lua of the quota, for the scripts that write counted data (broker.streams.scripts, broker.durable.scripts).
#: ``s`` is a caller's storage_key; ``item`` the key an item's charge is recorded under (its meta key).
QUOTA_LUA = REFUSE_WHEN_FULL + SERVER_MS + STORAGE_EXPIRY.lua("expiries") + f"""
-- The caller's two keys live as long as its longest-lived item (then they count nothing): the counts of the
-- many callers seen once do not pile up in Redis.
local function quota_keep(s)
  local top = redis.call('ZRANGE', expiries(s), -1, -1, 'WITHSCORES')
  if #top == 0 then return end
  if tonumber(top[2]) == math.huge then
    redis.call('PERSIST', s)
    redis.call('PERSIST', expiries(s))
  else
    local at = string.format('%d', tonumber(top[2]) + 1000)
    redis.call('PEXPIREAT', s, at)
    redis.call('PEXPIREAT', expiries(s), at)
  end
end
local function quota_release(s, item)
  local b = tonumber(redis.call('HGET', s, item) or '0')
  if b ~= 0 then redis.call('HINCRBY', s, 'bytes', -b) end
  redis.call('HDEL', s, item)
  redis.call('ZREM', expiries(s), item)
  if tonumber(redis.call('HGET', s, 'bytes') or '0') <= 0 and redis.call('ZCARD', expiries(s)) == 0 then
    redis.call('DEL', s, expiries(s))
  else
    quota_keep(s)
  end
end
-- The caller's items whose keys expired, taken off its total. A full Redis refuses the whole script here.
local function quota_sweep(s)
  refuse_when_full(s)
  local gone = redis.call('ZRANGEBYSCORE', expiries(s), '-inf', server_ms(), 'LIMIT', 0, {SWEEP_MAX})
  for _, item in ipairs(gone) do quota_release(s, item) end
end
-- Whether ``charge`` more bytes fit the caller's ``quota`` (0: no bound). Sweep first.
local function quota_room(s, charge, quota)
  return quota <= 0 or charge <= 0 or tonumber(redis.call('HGET', s, 'bytes') or '0') + charge <= quota
end
-- Count ``charge`` bytes more for ``item`` (recorded with no expiry until quota_expire says one).
local function quota_charge(s, item, charge)
  if charge == 0 then return end
  redis.call('HINCRBY', s, item, charge)
  redis.call('HINCRBY', s, 'bytes', charge)
  redis.call('ZADD', expiries(s), 'NX', 'inf', item)
  quota_keep(s)
end
-- ``item``'s keys expire at ``at_ms`` ('inf': never): swept then.
local function quota_expire(s, item, at_ms)
  if redis.call('ZADD', expiries(s), 'XX', 'CH', at_ms, item) == 1 then quota_keep(s) end
end
"""
