"""rsb on a real Redis Cluster: 3 redis-server masters made a cluster by `redis-cli --cluster create`, a real
`rsb consumer` and `rsb generator` pointed at it with a redis+cluster:// URL and 6 partitions."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from typing import Any

import httpx
import orjson
import pytest
import redis
from helpers import create, create_outcome, read_sse, wait_readers, wait_status
from servers import RedisClusterServers, Stack, StackFactory

from broker.redis.connection import connect
from broker.redis.keyspace import partition_slot
from broker.request.generation import GenerationRequest
from broker.streams.job_store import JobStore
from broker.streams.keys import QueueKeys, partition_of
from broker.streams.records import Claim
from broker.streams.stream_store import StreamStore

pytestmark = pytest.mark.slow

PARTITIONS = 6


def _owner(client: redis.RedisCluster, key: str) -> int:
    """The port of the master that owns ``key``'s slot, asked of the server (CLUSTER KEYSLOT, CLUSTER SLOTS)."""
    slot = int(client.execute_command("CLUSTER KEYSLOT", key, target_nodes=client.get_random_node()))
    slots = client.execute_command("CLUSTER SLOTS", target_nodes=client.get_random_node())
    for (start, end), owner in slots.items():  # redis-py parses the reply into {(start, end): {...}}
        if start <= slot <= end:
            return int(owner["primary"][1])
    raise AssertionError(f"slot {slot} is not served")


def test_job_partitions_are_spread_over_every_master(redis_cluster: RedisClusterServers, cluster_client: redis.RedisCluster) -> None:
    for n in (3, PARTITIONS, 12):
        owners = Counter(_owner(cluster_client, QueueKeys(p, n, "m").backlog) for p in range(n))
        assert sorted(owners) == sorted(redis_cluster.ports), (n, owners)
        assert set(owners.values()) == {n // 3}, (n, owners)  # an even share on each master
        assert [partition_slot(p, n) for p in range(n)] == [
            int(cluster_client.execute_command("CLUSTER KEYSLOT", QueueKeys(p, n, "m").backlog,
                                               target_nodes=cluster_client.get_random_node())) for p in range(n)]


async def test_store_operations_run_in_one_slot_each(redis_cluster: RedisClusterServers, cluster_client: redis.RedisCluster) -> None:
    """The Lua scripts (incl. keys built inside Lua and SPUBLISH) and the 50-way create race on a cluster."""
    r = connect(redis_cluster.url)
    try:
        store = StreamStore(r, PARTITIONS)
        jobs = JobStore(r, PARTITIONS)
        assert store.cluster
        req = GenerationRequest(None, "hello", None, 8, 0.8, 0.95, None, (), False)
        sid = uuid.uuid4()
        results = await asyncio.gather(*(store.create(sid, req, model="m", max_queue=0, retention_s=60)
                                         for _ in range(50)))
        assert sorted(create_outcome(r) for r in results) == ["created"] + ["exists"] * 49
        waiting = [uuid.uuid4() for _ in range(3)]
        for w in waiting:  # queued behind sid in their own partitions: the claim script walks its partition only
            await store.create(w, req, model="m", max_queue=0, retention_s=60)
        claim = await jobs.claim(sid, "w1")
        assert isinstance(claim, Claim)
        assert (await jobs.append(claim, 0, 1, [("delta", b'{"text":"a"}')])).ok
        await store.touch([sid, *waiting])
        assert await store.cancel(sid, "client") == "running"
        renewed = await jobs.renew(claim, 5.0, 30.0)
        assert renewed.ok and renewed.cancel_reason == "client"
        eid = await jobs.finish(claim, "cancelled", {"reason": "client", "usage": {}}, status="cancelled", usage={},
                                 reason="client")
        assert eid is not None
        assert [e.type for e in await store.read(sid, None)] == ["queued", "delta", "cancelled"]
        assert await store.waiting() == 3
        assert await store.cancel(waiting[0], "client") == "cancelled"
        q = store.keys(sid).queue("m")
        # Out of its queue with its end (the waiting streams may share its partition: they stay).
        assert await r.zscore(q.leases, str(sid)) is None
        backlog: Any = await r.xrange(q.backlog)
        assert str(sid).encode() not in [fields[b"sid"] for _, fields in backlog]
    finally:
        await r.aclose()


def _cluster_stack(stack_factory: StackFactory, redis_cluster: RedisClusterServers, *consumer_args: str) -> Stack:
    s = stack_factory(redis_cluster.url)
    s.generator("--partitions", str(PARTITIONS))
    s.consumer("--partitions", str(PARTITIONS), "--heartbeat-s", "1", *consumer_args)
    return s


def test_create_read_resume_cancel_and_idempotency_on_a_cluster(stack_factory: StackFactory, redis_cluster: RedisClusterServers,
                                                                 cluster_client: redis.RedisCluster) -> None:
    s = _cluster_stack(stack_factory, redis_cluster)
    with s.client() as c:
        # Streams in every partition, so every master's job queue and live channels are used.
        sids: list[str] = []
        while {partition_of(uuid.UUID(x), PARTITIONS) for x in sids} != set(range(PARTITIONS)):
            sids.append(str(uuid.uuid4()))
        for sid in sids:
            assert create(c, id=sid, max_tokens=24).status_code == 201
        reads = {sid: read_sse(c, f"/v1/streams/{sid}/events") for sid in sids}
        for sid, full in reads.items():
            types = [e.event for e in full.events]
            assert types[0] == "queued" and "started" in types and types[-1] == "done", types
            assert full.events[-1].data["usage"]["completion_tokens"] == 24
            # Resume from a few points: exactly the rest, in order.
            for i in (0, len(full.events) // 2, len(full.events) - 2):
                rest = read_sse(c, f"/v1/streams/{sid}/events", headers={"Last-Event-ID": full.ids[i]})
                assert [(e.id, e.data) for e in rest.events] == [(e.id, e.data) for e in full.events[i + 1:]]
            assert c.get(f"/v1/streams/{sid}/events", headers={"Last-Event-ID": full.ids[-1]}).status_code == 204
        # Every master holds job queues that were used.
        used = Counter(_owner(cluster_client, QueueKeys(partition_of(uuid.UUID(x), PARTITIONS), PARTITIONS, "m").backlog)
                       for x in sids)
        assert set(used) == set(redis_cluster.ports)

        # 32 concurrent identical creates: one 201, one generation.
        body: dict[str, Any] = {"id": str(uuid.uuid4()), "prompt": "Once upon a time", "max_tokens": 24}

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=s.base_url, timeout=30) as ac:
                return list(await asyncio.gather(*(ac.post("/v1/streams", json=body) for _ in range(32))))

        codes = sorted(r.status_code for r in asyncio.run(burst()))
        assert codes == [200] * 31 + [201]
        events = read_sse(c, f"/v1/streams/{body['id']}/events").events
        assert [e.event for e in events].count("started") == 1 and events[-1].event == "done"
        assert cluster_client.hget(_meta(body["id"]), "attempts") == b"1"
        assert c.post("/v1/streams", json={**body, "prompt": "other"}).status_code == 409

        # Cancel mid-generation: the cancel notice reaches the worker over the partition's sharded
        # control channel; the stream ends with `cancelled` well before max_tokens.
        sid = create(c, max_tokens=3800).json()["id"]
        head = read_sse(c, f"/v1/streams/{sid}/events", stop_after=4)
        assert c.post(f"/v1/streams/{sid}/cancel").status_code == 202
        rest = read_sse(c, f"/v1/streams/{sid}/events", headers={"Last-Event-ID": head.ids[-1]})
        assert rest.events[-1].event == "cancelled" and rest.events[-1].data["reason"] == "client"
        assert rest.events[-1].data["usage"]["completion_tokens"] < 3800
        # The worker is free again at once.
        t0 = time.monotonic()
        nxt = create(c, max_tokens=8).json()["id"]
        assert read_sse(c, f"/v1/streams/{nxt}/events").events[-1].event == "done" and time.monotonic() - t0 < 5
        assert wait_status(c, sid, {"cancelled"})["status"] == "cancelled"


def _meta(sid: str) -> str:
    from broker.streams.keys import StreamKeys

    return StreamKeys.of(uuid.UUID(sid), PARTITIONS).meta


def test_live_tail_on_a_cluster_uses_one_pubsub_connection_per_master(stack_factory: StackFactory, redis_cluster: RedisClusterServers,
                                                                      cluster_client: redis.RedisCluster) -> None:
    s = stack_factory(redis_cluster.url)
    # No create rate limit: the cluster is the module's, and the earlier tests' creates spent the anonymous caller's burst.
    # No bound on unfinished generations either: a partition's share of it (ceil(100 / 6) = 17) is met by chance when
    # the 60 random ids crowd one partition beside the earlier tests' streams (met once, in a run beside 13 other modules).
    s.consumer("--partitions", str(PARTITIONS), "--heartbeat-s", "5", "--create-burst", "0", "--max-active", "0")
    with s.client() as c:
        created = [create(c, max_tokens=16) for _ in range(60)]  # queued: no generator yet
        assert all(r.status_code == 201 for r in created), [r.text for r in created if r.status_code != 201][:3]
        sids = [r.json()["id"] for r in created]
    baseline = {p: {cl["id"] for cl in redis.Redis(port=p).client_list()} for p in redis_cluster.ports}

    async def readers() -> list[str]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=s.base_url, limits=limits, timeout=120) as ac:
            async def one(sid: str) -> str:
                async with ac.stream("GET", f"/v1/streams/{sid}/events") as r:
                    buf = b"".join([chunk async for chunk in r.aiter_raw()])
                return buf.decode()

            tasks = [asyncio.create_task(one(sids[i % len(sids)])) for i in range(300)]
            await wait_readers(ac, 300, 30)
            metrics = (await ac.get("/metrics")).text
            assert _metric(metrics, "rsb_live_hub_connections") == 3  # one per master, whatever the readers
            per_node = {p: [cl for cl in redis.Redis(port=p).client_list() if cl["id"] not in baseline[p]]
                        for p in redis_cluster.ports}
            subscribers = {p: [cl for cl in conns if int(cl.get("ssub", 0)) > 0] for p, conns in per_node.items()}
            print("new connections per node:", {p: len(v) for p, v in per_node.items()},
                  "sharded subscribers:", {p: len(v) for p, v in subscribers.items()})
            assert all(len(v) == 1 for v in subscribers.values()), subscribers
            assert all(len(v) <= 8 + 2 for v in per_node.values())
            s.generator("--partitions", str(PARTITIONS))  # now every stream goes live
            return list(await asyncio.gather(*tasks))

    bodies = asyncio.run(readers())
    assert all("event: done" in b for b in bodies)
    with s.client() as c:
        whole = {sid: read_sse(c, f"/v1/streams/{sid}/events").text for sid in sids}
    for i, b in enumerate(bodies):
        text = "".join(orjson.loads(block.split("data: ", 1)[1])["text"]
                       for block in b.split("\n\n") if "event: delta" in block)
        assert text == whole[sids[i % len(sids)]]


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_the_redis_cluster_flag_accepts_a_plain_url(stack_factory: StackFactory, redis_cluster: RedisClusterServers, cluster_client: redis.RedisCluster) -> None:
    s = stack_factory(f"redis://127.0.0.1:{redis_cluster.ports[1]}")
    s.generator("--partitions", "3", "--redis-cluster")
    s.consumer("--partitions", "3", "--redis-cluster")
    with s.client() as c:
        sid = create(c, max_tokens=8).json()["id"]
        assert read_sse(c, f"/v1/streams/{sid}/events").events[-1].event == "done"


def test_each_job_runs_on_a_worker_of_its_model_on_a_cluster(stack_factory: StackFactory,
                                                             redis_cluster: RedisClusterServers,
                                                             cluster_client: redis.RedisCluster) -> None:
    """Routing by model over every partition of a cluster: each model's queues live in every partition's slot,
    each worker claims only its model's jobs, in every partition, and wakes on its own wake lists."""
    s = stack_factory(redis_cluster.url)
    s.generator("--partitions", str(PARTITIONS), "--model-name", "alpha")
    s.generator("--partitions", str(PARTITIONS), "--model-name", "beta")
    s.consumer("--partitions", str(PARTITIONS), test_default=False)
    with s.client() as c:
        sids: dict[str, str] = {}
        while {partition_of(uuid.UUID(x), PARTITIONS) for x in sids} != set(range(PARTITIONS)) or len(sids) < 12:
            sid = str(uuid.uuid4())
            model = ("alpha", "beta")[len(sids) % 2]
            assert create(c, id=sid, model=model, max_tokens=8).status_code == 201
            sids[sid] = model
        for sid, model in sids.items():
            full = read_sse(c, f"/v1/streams/{sid}/events")
            assert full.events[-1].event == "done"
            assert [e.data["model"] for e in full.events if e.event == "started"] == [model]
        assert create(c, model="gamma").json()["error"]["code"] == "model_not_found"
