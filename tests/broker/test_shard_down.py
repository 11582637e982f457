"""A shard down on a Redis Cluster with no failover (issue 47): 3 primaries + 3 replicas, 12 streams over them, one
primary SIGKILLed while its replica is cut off (SIGSTOP: it can take no failover), batched generators (--parallel 4).

With ``cluster-require-full-coverage yes`` (Redis's default) every node refuses every command while a slot is
uncovered: nothing can go on, rsb or not (docs/failures.md says to set it ``no``). With ``no``, the healthy shards'
streams must not wait for the dead one: they end while it is down, on their first attempt (a lease that lapsed
behind the dead shard, as before the fix, shows as a second attempt, and as worker_lost after three). Then the
node comes back (AOF, fsync always: nothing lost) and its streams end too; every reader's history is its stream's.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from helpers import create, eventually, stored_events
from history import HistoryReader, check_history
from servers import RedisClusterServers, StackFactory

from broker.events import Event
from broker.redis import connection
from broker.redis.connection import BoundedRedisCluster, connect, register_script
from broker.streams.keys import StreamKeys

pytestmark = pytest.mark.slow

PARTITIONS = 6
TOKENS = 400
# The healthy shards' 8 streams run on 2 generators of 4 sequences: ~4 s on a quiet machine. A stream stuck behind
# the dead shard never ends before it returns: the bound only keeps a broken run from taking for ever.
DOWN_MAX_S = 60.0


@pytest.fixture
def cluster() -> Iterator[RedisClusterServers]:
    # Healthy shards serve while one is down; a killed node restarts with everything it acknowledged.
    c = RedisClusterServers(3, replicas=1, node_timeout_ms=1500, appendonly=True,
                            extra_args=("--cluster-require-full-coverage", "no", "--appendfsync", "always"))
    try:
        c.start()
        yield c
    finally:
        for n in c.nodes:
            if n.proc is not None and n.proc.poll() is None:
                os.kill(n.proc.pid, signal.SIGCONT)
        c.cleanup()


def _events(cluster: RedisClusterServers, sid: str) -> list[Event]:
    client = redis.Redis(port=cluster.primary_of(StreamKeys.of(uuid.UUID(sid), PARTITIONS).events).port)
    try:
        events: list[Event] = stored_events(client, sid, PARTITIONS)
        return events
    finally:
        client.close()


@pytest.mark.timeout(420)
def test_healthy_shards_streams_go_on_at_full_speed_while_a_shard_is_down(
        cluster: RedisClusterServers, stack_factory: StackFactory, slow_model: Path) -> None:
    stack = stack_factory(cluster.url)
    flags = ("--partitions", str(PARTITIONS))
    for _ in range(2):
        stack.generator(*flags, "--parallel", "4", model=slow_model)
    url = stack.consumer(*flags, "--heartbeat-s", "0.5")[1]
    by_master: dict[int, list[str]] = {}
    while len(by_master) < 3 or any(len(v) < 4 for v in by_master.values()):
        sid = str(uuid.uuid4())
        port = cluster.primary_of(StreamKeys.of(uuid.UUID(sid), PARTITIONS).events).port
        if len(by_master.setdefault(port, [])) < 4:
            by_master[port].append(sid)
    victim_port = next(iter(by_master))
    victim = next(n for n in cluster.nodes if n.port == victim_port)
    client = redis.Redis(port=victim_port, decode_responses=True)
    me = client.execute_command("CLUSTER", "MYID")
    nodes = str(client.execute_command("CLUSTER", "NODES")).splitlines()
    client.close()
    replica_port = next(int(line.split()[1].split("@")[0].rsplit(":", 1)[1]) for line in nodes
                        if line.split()[3] == me)
    replica = next(n for n in cluster.nodes if n.port == replica_port)
    assert replica.proc is not None
    healthy = [sid for port, sids in by_master.items() if port != victim_port for sid in sids]
    readers: dict[str, HistoryReader] = {}
    with httpx.Client(base_url=url, timeout=30) as c:
        for sids in by_master.values():
            for sid in sids:
                assert create(c, id=sid, max_tokens=TOKENS).status_code == 201
                readers[sid] = HistoryReader([url], sid, timeout_s=DOWN_MAX_S + 120).start()
    eventually(lambda: sum(any(e.event == "delta" for e in readers[s].events) for s in by_master[victim_port]) >= 1,
               30, "the victim's streams under way")
    os.kill(replica.proc.pid, signal.SIGSTOP)  # cut off: no failover
    victim.kill()
    killed_at = time.monotonic()
    try:
        while not all(readers[s].done for s in healthy) and time.monotonic() - killed_at < DOWN_MAX_S:
            time.sleep(0.05)
        healthy_ended = [s for s in healthy if readers[s].done]
        took = time.monotonic() - killed_at
    finally:
        victim.start()
        os.kill(replica.proc.pid, signal.SIGCONT)
    print(f"\nshard down (no failover): {len(healthy_ended)} of {len(healthy)} healthy-shard streams ended while it was, "
          f"the last {took:.1f} s after the kill")
    assert len(healthy_ended) == len(healthy), f"only {len(healthy_ended)} of {len(healthy)} healthy streams ended"
    cluster.wait_ok()
    for sid, reader in readers.items():
        def ended(sid: str = sid) -> list[Event] | None:
            events = _events(cluster, sid)
            return events if events and events[-1].is_terminal else None

        final: list[Event] = eventually(ended, 120, f"stream {sid} to end")
        reader.join()
        check_history(reader, final)
        assert final[-1].type == "done" and final[-1].json()["usage"]["completion_tokens"] == TOKENS
    for sid in healthy:  # no lease lapsed behind the dead shard: each ran on its first claim
        key = StreamKeys.of(uuid.UUID(sid), PARTITIONS).meta
        owner = redis.Redis(port=cluster.primary_of(key).port, decode_responses=True)
        assert owner.hget(key, "attempts") == "1", sid
        owner.close()


async def test_with_the_clients_default_node_down_every_healthy_shard_answers_scripts_included(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # redis-py reads its command table again at every slot-map refresh, of the map's first primary; and loads a
    # missing script on every primary. With that primary down, both failed on every shard: a failed refresh
    # closes every connection, and each next command refreshed again (a third of the shard-down runs above lost
    # a healthy stream's lease so).
    monkeypatch.setattr(connection, "SLOT_MAP_REFRESH_MIN_S", 0.0)  # every error refreshes the map
    c = RedisClusterServers(3, extra_args=("--cluster-require-full-coverage", "no"))
    try:
        c.start()
        r = connect(c.url)
        try:
            assert isinstance(r, BoundedRedisCluster)
            await r.initialize()
            dead = int(r.get_default_node().port)
            keys: dict[int, str] = {}
            while len(keys) < 3:
                key = f"k{{{uuid.uuid4().hex}}}"
                keys.setdefault(c.primary_of(key).port, key)
            next(n for n in c.nodes if n.port == dead).kill()
            script = register_script(r, f"-- {uuid.uuid4().hex}: a script no node has\n"
                                        "return redis.call('INCR', KEYS[1])")
            for n in range(1, 4):
                # A refresh is due (any connection error, MOVED or CLUSTERDOWN asks for one): the dead node is
                # still the map's first primary, the node redis-py reads its command table from.
                r._initialize = True
                for port, key in keys.items():
                    if port != dead:
                        assert await script(keys=[key]) == n
        finally:
            await r.aclose()
    finally:
        c.cleanup()
