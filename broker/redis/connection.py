"""Redis connections. One factory, so every role gets the same timeouts, retries and keepalive.

A URL names a standalone server (``redis://host:port/0``, ``rediss://``), a Redis Cluster
(``redis+cluster://host:port``, ``rediss+cluster://``, or any URL with ``cluster=True``: the
``--redis-cluster`` flag): any one node is enough, the client discovers the others; or a primary that Redis
Sentinel watches (``redis+sentinel://host:port[,host:port...]/service_name[/db]``, ``rediss+sentinel://``
for TLS to the servers): the client asks the sentinels for the current primary at each (re)connect, so it
follows a failover. Every key of one
stream, and of one partition's job queue, shares a hash tag (broker.streams.keys), so each script and each
multi-key command stays in one slot; what must span slots (polling many job queues, tailing many
streams) is grouped per slot by the generator and per node by the consumer's live hub.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import redis as redis_sync
from redis._parsers import AsyncCommandsParser
from redis._parsers.helpers import parse_stream_list
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import AbstractBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    MasterDownError,
    NoScriptError,
    ReadOnlyError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker.backoff import Backoff
from broker.redis.errors import closed_under_the_command, reply, store_errors
from broker.redis.keyspace import NEVER_WRITTEN
from broker.redis.urls import (
    SENTINEL_SCHEMES,
    cluster_url,
    is_cluster_url,
    is_sentinel_url,
    node_url,
    plain_url,
    sentinel_auth,
)

# Ordinary commands: short, so a dead server is noticed in seconds, not minutes.
COMMAND_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 2.0
#: The longest a blocking command (BLPOP) may block: a generator's poll for jobs (2 s), a count_tokens wait (4 s).
#: A blocking client's socket timeout is this plus COMMAND_TIMEOUT_S, so a half-open link (no FIN, no RST: the
#: network just stopped delivering) under a blocked command is noticed within BLOCKING_TIMEOUT_S, as under any other
#: command within COMMAND_TIMEOUT_S. TCP keepalive alone takes the kernel's 2 hours, and never fires when a
#: middlebox (a proxy, a NAT) answers for the dead end.
LONGEST_BLOCK_S = 4.0
BLOCKING_TIMEOUT_S = LONGEST_BLOCK_S + COMMAND_TIMEOUT_S


# Either kind of client: the commands rsb uses have the same signatures on both.
RedisClient = Redis | RedisCluster
#: A registered Lua script (``register_script``): called with ``keys=``, ``args=`` and optionally ``client=`` (a
#: pipeline, which redis-py's AsyncScript types too narrowly to accept).
Script = Any


#: Lua for scripts whose first write Redis would let through when out of memory. Redis refuses a script's write
#: for lack of memory only while the script has written nothing (it cannot stop a script midway), and only for
#: commands that may grow memory (HSET, XADD, SADD...), not for ZREMRANGEBYSCORE, EXPIRE, DEL or XCLAIM: a
#: script that starts with one of those would then write everything else past ``maxmemory``. Such a script calls
#: ``refuse_when_full(key)`` first: a SETRANGE of nothing on a key that never exists (``NEVER_WRITTEN``, in
#: ``key``'s slot) changes nothing, but is refused when Redis is full, so the whole script is, before it wrote.
REFUSE_WHEN_FULL = NEVER_WRITTEN.lua("never_written") + """
local function refuse_when_full(key) redis.call('SETRANGE', never_written(key), 0, '') end
"""

#: The converse, for scripts that must write when Redis is full because what they write takes no new memory (a
#: lease's new deadline: a generation keeps its lease through an out-of-memory episode, so no other worker takes
#: it over when memory returns). ``allow_when_full(key)`` first: a PERSIST of a key that has no expiry changes
#: nothing, but is a write Redis lets through, after which it lets the script's other writes through too.
ALLOW_WHEN_FULL = """
local function allow_when_full(key) redis.call('PERSIST', key) end
"""


#: How long one node may take to answer CLUSTER SLOTS in a slot-map refresh before the next node is asked.
SLOT_MAP_NODE_TIMEOUT_S = 1.0
#: The least time between two slot-map refreshes of one client (BoundedRedisCluster.initialize).
SLOT_MAP_REFRESH_MIN_S = 1.0


def _bounded_slot_map_queries() -> None:
    """Bound each node's CLUSTER SLOTS in redis-py's slot-map refresh (NodesManager.initialize) to
    SLOT_MAP_NODE_TIMEOUT_S. A refresh follows every connection error to a node that died, asks the known nodes in a
    random order, holds a lock every command that needs the map waits on, and gives each node the client's socket
    timeout (5 s; 9 s on a blocking client). A node that takes connections but never answers (a stopped process,
    a host gone behind a proxy or a NAT) then stalled every command of every shard, again and again: on a 3+3
    cluster with one primary killed and its replica stopped, healthy shards' streams waited seconds at a time,
    their leases lapsed, and they ended worker_lost (docs/failures.md, "A shard down"). CLUSTER SLOTS is answered in
    microseconds by a live node, and is sent only by that refresh; a node cut off mid-answer is retried by the next
    refresh. Applied once, to redis-py's ClusterNode (every cluster client in an rsb process is rsb's)."""
    if getattr(ClusterNode.execute_command, "_rsb_bounded", False):
        return
    unbounded = ClusterNode.execute_command

    async def execute_command(self: ClusterNode, *args: Any, **kwargs: Any) -> Any:
        if args and args[0] == "CLUSTER SLOTS":
            async with asyncio.timeout(SLOT_MAP_NODE_TIMEOUT_S):
                return await unbounded(self, *args, **kwargs)
        return await unbounded(self, *args, **kwargs)

    execute_command._rsb_bounded = True  # type: ignore[attr-defined]
    ClusterNode.execute_command = execute_command  # type: ignore[method-assign]


def is_cluster(client: RedisClient) -> bool:
    return isinstance(client, RedisCluster)


def register_script(client: RedisClient, lua: str) -> Script:
    """``client.register_script(lua)``, with every PUBLISH of the script sharded (SPUBLISH) on Redis Cluster: a
    plain PUBLISH is broadcast over the cluster bus to every node, so its cost grows with the cluster and a
    subscriber may sit on any node, where a sharded channel lives on the shard that owns its slot. Each channel
    a script publishes on carries the hash tag of the keys it writes, so SPUBLISH stays inside the script's
    slot. SPUBLISH needs Redis 7; a standalone server keeps PUBLISH, which every server rsb can embed supports."""
    if is_cluster(client):
        return ShardScript(client, lua.replace("redis.call('PUBLISH',", "redis.call('SPUBLISH',"))
    script: Script = client.register_script(lua)
    return script


class ShardScript(AsyncScript):
    """A script of a Redis Cluster client, loaded on the shard that runs it. redis-py loads a script a node lacks
    with SCRIPT LOAD sent to every primary, which fails while any primary is down: a script no call had loaded
    before a shard died (the first lease renewal, a continuation's first read) then failed on every healthy
    shard too, and healthy streams' leases lapsed (tests/broker/test_shard_down.py). EVAL runs it on its keys'
    shard and leaves it cached there."""

    async def __call__(self, keys: Any = None, args: Any = None, client: Any = None) -> Any:
        client = client or self.registered_client
        if not isinstance(client, RedisCluster):  # one node's client or pipeline (broker.redis.replicas): as redis-py
            return await super().__call__(keys, args, client)
        keys = list(keys or ())
        args = tuple(args or ())
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await client.execute_command("EVAL", self.script, len(keys), *keys, *args)


async def evalsha_many(client: RedisClient, script: Script, calls: list[tuple[list[str], list[Any]]]
                       ) -> list[Any]:
    """Run ``script`` once per (keys, args) in one pipeline (one round trip); each reply, or the error of that
    call, in order. EVALSHA directly: a Script object in a pipeline makes redis-py ask SCRIPT EXISTS first, a
    second round trip per batch. When the script is missing (Redis restarted, SCRIPT FLUSH) it is loaded and
    the batch sent again, so the scripts must be safe to run twice (rsb's are)."""
    for attempt in range(2):
        async with client.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            raw: list[Any] = await pipe.execute(raise_on_error=False)
        if attempt == 0 and any(isinstance(r, NoScriptError) for r in raw):
            await client.script_load(script.script)  # standalone or Sentinel only: a cluster pipeline has no EVALSHA
            continue
        return raw
    raise AssertionError("unreachable")


async def xrange_raw(client: RedisClient, key: str, start: str, count: int) -> list[Any]:
    """``XRANGE key start + COUNT count`` as Redis sent it, ``[[id, [field, value, ...]], ...]`` (RAW_ENTRIES:
    no dict per entry), for broker.events.EventPage. A client made elsewhere parses as usual (a dict per
    entry); EventPage reads both."""
    entries: Any = await client.execute_command("XRANGE", key, start, "+", "COUNT", count, keys=[key],
                                                **{RAW_ENTRIES: True})
    return entries if isinstance(entries, list) else list(entries)


def _sentinel(url: str, *, max_connections: int, retries: int, socket_timeout: float | None) -> Redis:
    """A client of the primary that the sentinels of ``url`` name for its service."""
    parts = urlsplit(url)
    hosts = []
    for item in parts.netloc.rpartition("@")[2].split(","):
        host, _, port = item.strip().rpartition(":")
        hosts.append((host or "127.0.0.1", int(port or 26379)))
    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise ValueError("a redis+sentinel:// URL names the service: redis+sentinel://host:26379/mymaster[/db]")
    db = int(path[1]) if len(path) > 1 else 0
    common: dict[str, Any] = {"socket_connect_timeout": CONNECT_TIMEOUT_S, "socket_keepalive": True}
    sentinel = Sentinel(hosts, sentinel_kwargs={**common, "socket_timeout": COMMAND_TIMEOUT_S}, **common)
    client: Redis = sentinel.master_for(
        path[0], redis_class=MappedRedis, db=db, socket_timeout=socket_timeout, max_connections=max_connections,
        retry=_retry(retries), ssl=SENTINEL_SCHEMES[parts.scheme] == "rediss", **sentinel_auth(parts))
    return client


class _RetryBackoff(AbstractBackoff):
    """redis-py's retries wait by rsb's one backoff (broker.backoff)."""

    def __init__(self, backoff: Backoff) -> None:
        self._backoff = backoff

    def reset(self) -> None:
        pass

    def compute(self, failures: int) -> float:
        return self._backoff.delay(max(0, failures - 1))


# Command retries inside redis-py: short, because the callers (the worker's loops, the consumer's 503 +
# Retry-After) have their own, longer patience.
COMMAND_RETRY_BACKOFF = Backoff(base_s=0.05, cap_s=1.0)


def _retry(retries: int) -> Retry:
    # Retrying a script whose reply was lost may run it twice: every script is written to be safe
    # under that (CREATE/CANCEL are idempotent, APPEND carries a sequence number, FINISH a status check).
    return Retry(_RetryBackoff(COMMAND_RETRY_BACKOFF), retries,
                 supported_errors=(RedisConnectionError, RedisTimeoutError))


class _GatedPipeline(ClusterPipeline):
    """A cluster pipeline that waits for the client's gate like a single command does."""

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        client = self.cluster_client
        assert isinstance(client, BoundedRedisCluster)
        async with client.gate:
            with store_errors():
                try:
                    replies = await super().execute(raise_on_error, allow_redirections)
                except AttributeError as e:
                    if not closed_under_the_command(e):
                        raise
                    raise RedisConnectionError(f"connection closed under the pipeline ({e})") from e
        return [reply(r) for r in replies]


class BoundedRedisCluster(RedisCluster):
    """redis-py's async cluster client, made safe for many concurrent callers.

    - redis-py raises MaxConnectionsError once a node's ``max_connections`` are busy, where the standalone
      BlockingConnectionPool waits for one. A burst of requests must queue, not fail: a semaphore of the same size
      gates every command and pipeline, so a node never needs more than ``max_connections`` connections (each
      command uses one connection of one node at a time).
    - A command sent before the client has read the slot map is routed as if it had no key (redis-py decides the
      route before it initializes): to one node, which answers MOVED. Many first commands at once made as many
      MOVEDs, and redis-py's answer to every fifth (``reinitialize_steps``) closes every connection in use
      (broker.redis.errors.closed_under_the_command). So the slot map is read before the first command is routed,
      and MOVED only updates the slot it names (``reinitialize_steps=0``, set in ``_cluster``); a connection error,
      a failover (READONLY) or CLUSTERDOWN still reads the whole map again."""

    gate: asyncio.Semaphore
    source_url: str
    #: When the last slot-map refresh ended (the loop's clock; None: never).
    refreshed_at: float | None

    async def initialize(self, additional_startup_nodes_info: Any = None,
                         last_failed_node_name: str | None = None) -> BoundedRedisCluster:
        """The slot map, refreshed at most every SLOT_MAP_REFRESH_MIN_S. redis-py refreshes it after every
        connection error to a node, under a lock every command that sees the flag waits on: with a node dead, each
        command that met it (parked generations' writes, claims, cancels, announcements) made the next command of
        any shard refresh again, and healthy shards' commands queued behind refresh after refresh (their leases
        lapsed: docs/failures.md, "A shard down"). A refresh a moment ago already knows what the cluster knows; a
        dead node's command fails (StoreUnavailable, waited out by its caller) without another."""
        now = asyncio.get_running_loop().time()
        if self._initialize and self.refreshed_at is not None and now - self.refreshed_at < SLOT_MAP_REFRESH_MIN_S:
            self._initialize = False
            return self
        await super().initialize(additional_startup_nodes_info, last_failed_node_name)
        self.refreshed_at = asyncio.get_running_loop().time()
        return self

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self.gate:
            with store_errors():
                return await self._execute_command_unmapped(*args, **kwargs)

    async def _execute_command_unmapped(self, *args: Any, **kwargs: Any) -> Any:
        try:
            if self._initialize:
                await self.initialize()
            return await super().execute_command(*args, **kwargs)
        except (ReadOnlyError, MasterDownError):
            # A node that was a master is a replica now (a failover redis-py has not seen yet): read the
            # slot map again before the caller's retry, instead of retrying the same node.
            self._initialize = True
            raise
        except AttributeError as e:
            if not closed_under_the_command(e):
                raise
            raise RedisConnectionError(f"connection closed under the command ({e})") from e

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # raises, as upstream does
        return _GatedPipeline(self, transaction)  # type: ignore[abstract]  # as upstream's pipeline()


class _MappedPipeline(Pipeline):
    """A standalone pipeline whose errors are rsb's (``store_errors``), raised or handed back as replies."""

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        with store_errors():
            replies = await super().execute(raise_on_error)
        return [reply(r) for r in replies]


class MappedRedis(Redis):
    """redis-py's standalone client (a server, a sentinel's primary, one cluster node) raising rsb's errors."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        with store_errors():
            return await super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
        return _MappedPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)


def reply_text(v: bytes | str | None) -> str:
    """A Redis reply (bytes; str from a client that decodes) as text; None (a missing field) as ''."""
    if v is None:
        return ""
    return v.decode() if isinstance(v, bytes) else v


#: An option of XRANGE/XREVRANGE (``execute_command(..., raw_entries=True)``): the reply stays as Redis sent it,
#: ``[[id, [field, value, ...]], ...]``, for broker.events.Event.from_raw to read directly. redis-py's own
#: parsing builds a dict per entry (pairs_to_dict): a fifth of the consumer's CPU in a replay.
RAW_ENTRIES = "raw_entries"


def _stream_list(response: Any, **options: Any) -> Any:
    return response if options.get(RAW_ENTRIES) else parse_stream_list(response, **options)


def _raw_entries_on_request(client: RedisClient) -> None:
    # Clients made elsewhere (tests, tools) ignore the option and parse as usual; Event.from_raw reads both.
    for command in ("XRANGE", "XREVRANGE"):
        client.set_response_callback(command, _stream_list)


class _CommandTable(AsyncCommandsParser):
    """redis-py's command table (which keys each command takes), read once. redis-py reads it again (COMMAND) at
    every slot-map refresh, of the map's first primary: when that primary is the one that died, every refresh
    failed, and a failed refresh closes every connection to every node (commands in flight on healthy shards cut,
    their replies lost) and leaves the next command to refresh again: no command of any shard went through while
    that one shard was down (tests/broker/test_shard_down.py, a third of its runs). The table does not change
    under a running client."""

    async def initialize(self, node: ClusterNode | None = None) -> None:
        if not self.commands:
            await super().initialize(node)


def _cluster(url: str, *, max_connections: int, retries: int, socket_timeout: float | None) -> BoundedRedisCluster:
    _bounded_slot_map_queries()
    client = BoundedRedisCluster.from_url(
        plain_url(url),
        max_connections=max_connections,
        socket_timeout=socket_timeout,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_keepalive=True,
        retry=_retry(max(1, retries)),
        reinitialize_steps=0,  # MOVED updates its slot only: see BoundedRedisCluster
    )
    assert isinstance(client, BoundedRedisCluster)
    client.gate = asyncio.Semaphore(max_connections)
    client.source_url = url
    client.refreshed_at = None
    client.commands_parser = _CommandTable()
    _raw_entries_on_request(client)
    return client


def _standalone(url: str, *, max_connections: int, retries: int, socket_timeout: float | None,
                health_check_s: int = 30) -> Redis:
    # A blocking pool: a burst of requests waits for a connection instead of failing, so however many
    # requests a process serves, it never holds more than max_connections.
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=COMMAND_TIMEOUT_S,
        socket_timeout=socket_timeout,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_keepalive=True,
        # A PING before reusing a connection idle this long. Not on blocking clients: their pub/sub connections
        # have a liveness check of their own (broker.redis.pubsub), and their BLPOPs run back to back.
        health_check_interval=health_check_s,
    )
    client = MappedRedis(connection_pool=pool, retry=_retry(retries))
    _raw_entries_on_request(client)
    return client


def connect(url: str, *, max_connections: int = 8, retries: int = 3, cluster: bool = False) -> RedisClient:
    """A client for non-blocking commands. The pool blocks (not fails) when all connections are busy,
    so however many requests a process serves, it never holds more than ``max_connections`` (per node,
    on a cluster)."""
    if cluster or is_cluster_url(url):
        return _cluster(cluster_url(url), max_connections=max_connections, retries=retries,
                        socket_timeout=COMMAND_TIMEOUT_S)
    if is_sentinel_url(url):
        return _sentinel(url, max_connections=max_connections, retries=retries, socket_timeout=COMMAND_TIMEOUT_S)
    return _standalone(url, max_connections=max_connections, retries=retries, socket_timeout=COMMAND_TIMEOUT_S)


def connect_blocking(url: str, *, max_connections: int = 2, cluster: bool = False) -> RedisClient:
    """A client for blocking reads (BLPOP, pub/sub). redis-py does not extend the socket timeout for blocking
    commands, so its timeout is BLOCKING_TIMEOUT_S and no command blocks longer than LONGEST_BLOCK_S. A pub/sub
    connection's reads wait for messages without a timeout: broker.redis.pubsub checks it is alive itself.
    On a cluster, pub/sub does not go through this client's pool: see ``connect_node``."""
    if cluster or is_cluster_url(url):
        return _cluster(cluster_url(url), max_connections=max_connections, retries=0,
                        socket_timeout=BLOCKING_TIMEOUT_S)
    if is_sentinel_url(url):
        return _sentinel(url, max_connections=max_connections, retries=0, socket_timeout=BLOCKING_TIMEOUT_S)
    return _standalone(url, max_connections=max_connections, retries=0, socket_timeout=BLOCKING_TIMEOUT_S,
                       health_check_s=0)


def connect_node(cluster: RedisCluster, host: str, port: int, *, max_connections: int = 1,
                 socket_timeout: float = BLOCKING_TIMEOUT_S, health_check_s: int = 30) -> Redis:
    """A standalone client for one cluster node: for its sharded pub/sub connection (SSUBSCRIBE only
    works on the node that owns the channel's slot; one connection, its liveness checked by broker.redis.pubsub),
    or for a script and the WAIT that must follow it on the same connection (broker.streams.replication)."""
    url = getattr(cluster, "source_url", None) or f"redis://{host}:{port}"
    return _standalone(node_url(url, host, port), max_connections=max_connections, retries=0,
                       socket_timeout=socket_timeout, health_check_s=health_check_s)


def probe(url: str, timeout_s: float) -> tuple[str, str] | None:
    """PING ``url`` once, synchronously (a start-up check, before any event loop runs): None when it answers,
    else ``(kind, detail)``, kind ``auth`` (the credentials were refused) or ``unreachable``."""
    client = redis_sync.Redis.from_url(plain_url(url), socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        client.ping()
    except redis_sync.AuthenticationError as e:
        return "auth", str(e)
    except (redis_sync.RedisError, OSError) as e:
        return "unreachable", str(e)
    finally:
        client.close()
    return None
