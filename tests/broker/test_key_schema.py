"""Every key is declared in one place (broker.streams.keys, broker.durable.keys for Durable Streams, and
broker.redis.quota for the storage quota), the keys the scripts name inside Lua included: the queue's scripts, the
terminal events' and the outbox's, and Durable Streams' scripts, run against a real redis-server, and every key Redis
then holds matches a declared template, the Lua-built ones exactly what Python builds from the same template; and no
Lua text in broker/ spells a key's text itself (each script gets its key builders generated from the templates)."""

from __future__ import annotations

import hashlib
import re
import uuid
from pathlib import Path

import redis

from broker.durable import keys as durable_keys
from broker.durable.keys import DurableKeys
from broker.durable.store import DurableStore, ForkSpec, Producer, StreamSpec
from broker.redis.connection import connect
from broker.redis.keyspace import NEVER_WRITTEN, KeyTemplate, partition_tag
from broker.redis.quota import STORAGE, STORAGE_EXPIRY, StorageQuota
from broker.redis.server import RedisServer
from broker.request.generation import GenerationRequest
from broker.request.tiers import TIERS
from broker.streams import keys
from broker.streams.budget import Budget
from broker.streams.job_store import JobStore
from broker.streams.records import Claim, Quota
from broker.streams.stream_store import StreamStore

BROKER = Path(__file__).resolve().parents[2] / "broker"
REQ = GenerationRequest(None, "hello", None, 8, 0.8, 0.95, None, (), False)
CHAT = GenerationRequest(None, "hello", None, 8, 0.8, 0.95, None, (), False, prompt_cache_key="chat-1")
#: Every declared kind of key: broker.streams.keys's, broker.durable.keys's, and the storage quota's
#: (broker.redis.quota: both count in it, below them).
DECLARED: dict[str, KeyTemplate] = {**keys.SCHEMA, **durable_keys.SCHEMA, "STORAGE": STORAGE,
                                    "STORAGE_EXPIRY": STORAGE_EXPIRY}
#: The kinds of key only a script names (inside Lua), each of which the scenario below leaves in Redis.
LUA_BUILT = ("QUEUE_RING", "QUEUE_WAITING", "QUEUE_INBOX", "QUEUE_WAKE_FOR", "QUEUE_DEFERRED", "QUEUE_STATS",
             "QUEUE_LEASES", "QUEUE_WAKE", "USAGE_LOG", "USAGE_FREE", "USAGE_DAY", "OUTBOX_DEST", "STORAGE_EXPIRY")


async def _create(store: StreamStore, tenant: str, tier: str = "default", request: GenerationRequest = REQ) -> uuid.UUID:
    sid = uuid.uuid4()
    await store.create(sid, request, model="alpha", tier=tier, max_queue=0, retention_s=60, key_id="alice",
                       quota=Quota(tenant=tenant), storage=StorageQuota("alice", 10**9),
                       budget=Budget(tokens=10**6, holder="alice"), webhook=("http://a.example/hooks", str(sid)))
    return sid


async def _claim(jobs: JobStore, worker: str, affinity_wait_s: float = 0.0) -> Claim | None:
    got = await jobs.claim_next("alpha", 0, worker, lease_s=30.0, affinity_wait_s=affinity_wait_s)
    return got if isinstance(got, Claim) else None


async def test_every_key_the_scripts_write_is_declared(store: StreamStore, jobs: JobStore) -> None:
    # Jobs of two tenants in every tier; one claimed and finished (usage, outbox), one cancelled while queued (a free
    # record), one claimed and renewed, one given back, one released; a chat turn left for its worker (its inbox).
    for tier in TIERS:
        for tenant in ("a", "b"):
            await _create(store, tenant, tier)
    done = await _claim(jobs, "w1")
    assert done is not None
    await jobs.renew(done, 5.0, 30.0)
    await jobs.finish(done, "done", {"usage": {}}, status="done", model="alpha",
                       usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5})
    assert await store.cancel(await _create(store, "c"), "client") == "cancelled"
    given = await _claim(jobs, "w2")
    assert given is not None
    await jobs.give_back(given)
    released = await _claim(jobs, "w3")
    assert released is not None
    await jobs.release(released)
    # The rest waits: tenant lines and rings in each tier. A chat turn (of tenant d: first in no line) whose worker is
    # "owner" is met by "other" first: left in owner's inbox, owner woken.
    chat = await _create(store, "d", "priority", CHAT)
    await jobs.affinity.note(CHAT.affinity("d"), "owner", 60)
    for _ in range(8):
        if await store.redis.exists(store.queue(0, "alpha").inbox("owner")):
            break
        assert await _claim(jobs, "other", affinity_wait_s=30) is not None
    assert await store.redis.zscore(store.queue(0, "alpha").deferred, str(chat)) is not None

    held = [k.decode() async for k in store.redis.scan_iter(count=1000)]
    patterns = {name: re.compile(t.pattern) for name, t in DECLARED.items()}
    undeclared = [k for k in held if not any(p.fullmatch(k) for p in patterns.values())]
    assert not undeclared, f"keys no template declares: {undeclared}"
    for name in LUA_BUILT:
        assert any(patterns[name].fullmatch(k) for k in held), f"the scenario leaves no {name} key"

    # The keys Lua named are exactly those Python builds from the same templates.
    q = store.queue(0, "alpha")
    waiting = {(tier, who) for tier in TIERS for who in ("a", "b", "c", "d")
               if await store.redis.exists(keys.QUEUE_WAITING.build(qp=q.prefix, tier=tier, who=who))}
    assert {k for k in held if k.startswith(q.prefix + "w:")} == {
        keys.QUEUE_WAITING.build(qp=q.prefix, tier=t, who=w) for t, w in waiting}
    assert {k for k in held if k.startswith(q.prefix + "ring:")} == {
        keys.QUEUE_RING.build(qp=q.prefix, tier=t) for t, _ in waiting}
    assert {k for k in held if k.startswith(q.prefix + "inbox:")} == {q.inbox("owner")}
    assert {k for k in held if k.startswith(q.prefix + "wake:")} == {q.wake_for("owner")}
    assert {q.stats, q.leases, q.deferred, q.wake, q.backlog} <= set(held)
    assert {keys.usage_log_key(0, 1, "alice"), keys.usage_free_key(0, 1, "alice")} <= set(held)
    assert any(k.startswith(keys.usage_log_prefix(0, 1) + "day:alice:") for k in held)
    assert any(k.startswith(keys.outbox_key(0, 1) + ":d:") for k in held)
    assert STORAGE_EXPIRY.build(storage=STORAGE.build(tag="rsb:{p0}", tenant="alice")) in held


async def test_every_key_durable_streams_write_is_declared(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    # A stream written by a producer, a fork of it (its source's forks set), and a stream of the anonymous key.
    r = connect(redis_server.url)
    ds = DurableStore(r)
    quota = StorageQuota("alice", 10**9)
    src, fork, anon = ds.keys("alice", "src"), ds.keys("alice", "fork"), ds.keys("", "anon")
    spec = StreamSpec("text/plain")
    assert (await ds.create(src, spec, b"hello", max_streams=10, quota=quota)).created
    await ds.append(src, b" world", "text/plain", producer=Producer("p1", 0, 0), quota=quota)
    assert (await ds.create(fork, StreamSpec(""), b"", fork=ForkSpec(src), quota=quota)).created
    assert (await ds.create(anon, spec, b"x")).created
    held = {k.decode() async for k in r.scan_iter(count=1000)}
    await r.aclose()

    patterns = {name: re.compile(t.pattern) for name, t in DECLARED.items()}
    undeclared = [k for k in held if not any(p.fullmatch(k) for p in patterns.values())]
    assert not undeclared, f"keys no template declares: {undeclared}"
    for name in ("DURABLE_META", "DURABLE_DATA", "DURABLE_PRODUCERS", "DURABLE_FORKS", "DURABLE_TENANT"):
        assert any(patterns[name].fullmatch(k) for k in held), f"the scenario leaves no {name} key"
    built = {k for d in (src, fork, anon) for k in (d.meta, d.data, d.producers, d.forks, d.tenant)}
    assert {k for k in held if ":ds" in k} <= built
    assert {src.meta, src.data, src.producers, src.forks, src.tenant, fork.meta, fork.data, anon.meta, anon.tenant} <= held


def test_durable_keys_are_spelled_as_before() -> None:
    # The templates changed how Python builds the keys, never their text: stored streams stay where they were.
    d = DurableKeys.of("alice", "a/b", 4)
    base = f"rsb:{{{partition_tag(d.partition, 4)}}}:ds:" + hashlib.sha256(b"alice/a/b").hexdigest()[:32]
    assert (d.meta, d.data, d.producers, d.forks, d.channel) == tuple(f"{base}:{s}" for s in ("m", "d", "p", "f", "live"))
    assert d.tenant == f"rsb:{{{partition_tag(d.partition, 4)}}}:ds-tenant:alice"
    assert DurableKeys.of("", "x", 1).tenant == "rsb:{p0}:ds-tenant:-"
    assert DurableKeys.of("", "x", 1).meta == "rsb:{p0}:ds:" + hashlib.sha256(b"-/x").hexdigest()[:32] + ":m"


# Concatenated literals in Lua that are not keys: hash fields (a queue's ``waiting:<tier>`` and ``served:<tier>``) and
# a storage quota's items (``usage:<day>``, ``hook:<event>``).
NOT_KEYS = {"waiting:", "served:", "usage:", "hook:"}
_CONCATENATED = re.compile(r"\.\.\s*'((?:[^'\\\n]|\\.)*)'|'((?:[^'\\\n]|\\.)*)'\s*\.\.")


def test_no_lua_in_broker_spells_a_key_itself() -> None:
    # Python has no ``..``: a string literal joined with it is Lua, wherever it sits in broker/'s sources.
    pieces = {p for t in (*DECLARED.values(), NEVER_WRITTEN) for p in t.literals}
    assert NOT_KEYS.isdisjoint(pieces)
    found: list[str] = []
    for path in sorted(BROKER.rglob("*.py")):
        for m in _CONCATENATED.finditer(path.read_text()):
            literal = m.group(1) if m.group(1) is not None else m.group(2)
            if literal in pieces or (":" in literal and '"' not in literal and literal not in NOT_KEYS):
                found.append(f"{path.relative_to(BROKER.parent)}: {literal!r}")
    assert not found, f"Lua that builds a key's text itself (use broker.streams.keys.lua_builders): {found}"
