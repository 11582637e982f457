"""Redis's eviction policy, checked when a consumer or a generator starts.

rsb keeps everything in Redis: unfinished streams, the job queues, the callers' counters. A Redis that evicts
keys when it is full (``maxmemory-policy``) may drop any of them without a trace: ``allkeys-*`` may take an
unfinished stream or a job queue, so rsb refuses to start on it, in one line naming the policy and the fix.
``volatile-*`` evicts only keys with an expiry: finished streams before their retention (and their tombstones,
so an expired id answers 404 instead of 410), conversations, Durable Streams with a TTL, the rate limiter of a
caller with nothing unfinished: rsb starts, with a warning saying so. ``noeviction`` (Redis's default) is what
rsb is built for: a full Redis refuses writes, and rsb answers them 507 ``storage_full`` and pauses generations
until memory returns (broker.errors.StoreFull).

CONFIG may be disabled or renamed (managed Redis services often do): then the policy cannot be read, rsb says so
and starts.
"""

from __future__ import annotations

import logging
from typing import Any

import redis as redis_sync

from broker.redis.urls import is_cluster_url, is_sentinel_url, plain_url

log = logging.getLogger("rsb")

POLICY = "maxmemory-policy"
FIX = "set maxmemory-policy noeviction (CONFIG SET maxmemory-policy noeviction, or in redis.conf)"


class EvictionPolicyRefused(Exception):
    """The Redis named evicts keys rsb needs (``allkeys-*``): the message is the one line to print."""


def policies(url: str, *, cluster: bool = False, timeout_s: float = 5.0) -> dict[str, str]:
    """``maxmemory-policy`` of the server ``url`` names (of every primary, on a cluster), by node address. Raises
    redis' errors: a ResponseError when CONFIG is disabled or renamed, a ConnectionError when unreachable."""
    if is_sentinel_url(url):
        raise redis_sync.ResponseError("not read through Sentinel (check the primary's policy yourself)")
    common: dict[str, Any] = {"socket_connect_timeout": timeout_s, "socket_timeout": timeout_s}
    if cluster or is_cluster_url(url):
        nodes = redis_sync.RedisCluster.from_url(plain_url(url), **common)
        try:
            replies = nodes.config_get(POLICY, target_nodes=redis_sync.RedisCluster.PRIMARIES)
            return {str(node): _policy(reply) for node, reply in _per_node(replies).items()}
        finally:
            nodes.close()
    client = redis_sync.Redis.from_url(url, **common)
    try:
        return {url.rpartition("@")[2]: _policy(client.config_get(POLICY))}
    finally:
        client.close()


def _per_node(replies: Any) -> dict[Any, Any]:
    # One primary answers as a plain dict; several as {node: dict}.
    if isinstance(replies, dict) and replies and all(isinstance(v, dict) for v in replies.values()):
        return replies
    return {"cluster": replies}


def _policy(reply: Any) -> str:
    value = reply.get(POLICY) if isinstance(reply, dict) else None
    if value is None and isinstance(reply, dict):
        value = reply.get(POLICY.encode())
    if value is None:
        raise redis_sync.ResponseError(f"CONFIG GET {POLICY} answered nothing")
    return value.decode() if isinstance(value, bytes) else str(value)


def judge(policy: str) -> tuple[bool, str]:
    """Whether rsb may run on ``policy`` (False: refused), and what to say about it ('' for nothing)."""
    if policy.startswith("allkeys-"):
        return False, (f"Redis has maxmemory-policy {policy}: when full it may evict any key, unfinished streams "
                       f"and job queues included, and lose answers; {FIX} (rsb then answers 507 storage_full "
                       "while Redis is full), or volatile-* to let only keys with an expiry go")
    if policy.startswith("volatile-"):
        return True, (f"Redis has maxmemory-policy {policy}: when full it evicts keys with an expiry: finished "
                      "streams before their retention (and the tombstones behind 410), conversations, Durable "
                      "Streams with a TTL, idle callers' rate limiters; noeviction keeps them (writes then get "
                      "507 storage_full until memory is freed)")
    return True, ""


def check_eviction_policy(url: str, *, cluster: bool = False, role: str = "rsb") -> None:
    """Read and judge the policy at start: raise EvictionPolicyRefused for ``allkeys-*``, log a warning for
    ``volatile-*``, and say so (and go on) when CONFIG cannot be read. Unreachable Redis is not this check's to
    report: the role's own start (its retries, its readiness) says that."""
    try:
        found = policies(url, cluster=cluster)
    except (redis_sync.ConnectionError, redis_sync.TimeoutError, OSError):
        return
    except redis_sync.RedisError as e:
        log.warning("%s cannot read Redis's maxmemory-policy (%s): make sure it is noeviction (or volatile-*); "
                    "allkeys-* may evict unfinished streams", role, e, extra={"eviction_check": "unread"})
        return
    for node, policy in found.items():
        ok, message = judge(policy)
        if not ok:
            raise EvictionPolicyRefused(f"{message} [{node}]")
        if message:
            log.warning("%s [%s]", message, node, extra={"eviction_check": "warn", "policy": policy})
