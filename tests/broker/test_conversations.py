"""broker.streams.conversations on a real redis-server and a real Redis Cluster: the races its scripts close (two
devices reserving the next turn at once, a turn folded in twice, a reservation whose create never came, a
rewrite under a running turn), its bounds and its expiry. Through the HTTP views: tests/consumer/test_native_conversations.py."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

import pytest
from servers import RedisClusterServers

from broker.errors import Expired, TooManyConversations
from broker.events import EventType, encode_data
from broker.redis.connection import RedisClient, connect, is_cluster
from broker.redis.keyspace import partition_slot
from broker.redis.server import RedisServer
from broker.request.generation import GenerationRequest, Message
from broker.request.history import History
from broker.streams import conversations as conversations_module
from broker.streams.conversations import Begin, ConversationStore, Limits, Settled, absent
from broker.streams.job_store import JobStore
from broker.streams.keys import ConversationKeys
from broker.streams.records import Claim
from broker.streams.stream_store import StreamStore
from broker.streams.turns import items_turn

pytestmark = pytest.mark.slow

LIMITS = Limits(ttl_s=600, max_conversations=0)
OWNER = "owner-a"


@pytest.fixture(params=["standalone", "cluster"])
async def redis_async(request: pytest.FixtureRequest) -> AsyncIterator[RedisClient]:
    if request.param == "standalone":
        server: RedisServer = request.getfixturevalue("redis_server")
        request.getfixturevalue("redis_client")  # flushed
        url, cluster = server.url, False
    else:
        servers: RedisClusterServers = request.getfixturevalue("redis_cluster")
        request.getfixturevalue("cluster_client")  # flushed
        url, cluster = servers.url, True
    r = connect(url, cluster=cluster)
    yield r
    await r.aclose()


@pytest.fixture
def convs(redis_async: RedisClient) -> ConversationStore:
    # Six partitions on the cluster: a conversation and its turns' streams land on different masters.
    return ConversationStore(StreamStore(redis_async, 6 if is_cluster(redis_async) else 1))


def _request(text: str, history: History | None = None, *prior: Message) -> GenerationRequest:
    messages = (*prior, Message("user", text))
    return GenerationRequest(messages, None, None, 32, 0.8, 0.95, None, (), False, history=history)


async def _turn(convs: ConversationStore, key_id: str, name: str, text: str, answer: str | None = None) -> uuid.UUID:
    """Reserve, create and (with ``answer``) finish one turn, as the consumer and a worker do."""
    conv = await convs.read(key_id, name) or absent(key_id, name)
    sid = uuid.uuid4()
    outcome, _ = await convs.begin(conv, sid, OWNER, LIMITS, create=True)
    assert outcome is Begin.RESERVED
    history = History(start=0, conversation=name, tenant=key_id, version=conv.version, turn=conv.count)
    await convs.store.create(sid, _request(text, history), model="m", max_queue=0, retention_s=60,
                             key_id=key_id)
    if answer is not None:
        await _finish(convs.store, sid, answer)
    return sid


async def _finish(store: StreamStore, sid: uuid.UUID, answer: str) -> None:
    """Claim, answer and finish the turn's stream, as a worker does (on the conversations' Redis)."""
    jobs = JobStore(store.redis, store.partitions)
    claim = await jobs.claim(sid, "w1")
    assert isinstance(claim, Claim)
    events = [(EventType.DELTA, encode_data({"text": piece})) for piece in answer.split("|")]
    assert (await jobs.append(claim, 0, len(events), events)).ok
    usage = {"prompt_tokens": 3, "completion_tokens": len(events), "ttft_ms": None, "tpot_ms": None}
    await jobs.finish(claim, EventType.DONE, {"finish_reason": "stop", "usage": usage}, status="done", usage=usage)


async def test_two_devices_reserving_the_next_turn_at_once_make_one_turn(convs: ConversationStore) -> None:
    seen = absent("alice", "c1")
    ids = [uuid.uuid4() for _ in range(20)]
    results = await asyncio.gather(*(convs.begin(seen, sid, OWNER, LIMITS, create=True)
                                     for sid in ids))
    outcomes = [r[0] for r in results]
    assert outcomes.count(Begin.RESERVED) == 1 and outcomes.count(Begin.BUSY) == 19
    winner = ids[outcomes.index(Begin.RESERVED)]
    assert {r[1] for r in results if r[0] is Begin.BUSY} == {winner}  # each loser is told which turn runs
    # The winner's retry (its reply lost) finds its own reservation.
    assert (await convs.begin(seen, winner, OWNER, LIMITS, create=True))[0] is Begin.ALREADY
    conv = await convs.read("alice", "c1")
    assert conv is not None and conv.pending is not None and conv.pending.stream_id == winner


async def test_a_finished_turn_is_folded_in_exactly_once(convs: ConversationStore) -> None:
    sid = await _turn(convs, "alice", "c1", "hello", "Hi| there|!")
    # The worker, pods reading the conversation, retries: all fold the same stream at once.
    assert all(await asyncio.gather(*(convs.fold(sid) for _ in range(10))))
    assert await convs.fold(sid)
    conv = await convs.read("alice", "c1")
    assert conv is not None and conv.count == 1 and conv.pending is None
    (turn,) = conv.turns
    assert turn.id == sid and turn.status == "done" and turn.input == ({"role": "user", "content": "hello"},)
    assert turn.output.text == "Hi there!" and turn.finish_reason == "stop" and turn.usage is not None
    assert conv.bytes == len(turn.to_json())
    # The next turn is built on it, and folds after it.
    second = await _turn(convs, "alice", "c1", "more", "sure")
    await convs.fold(second)
    conv = await convs.read("alice", "c1")
    assert conv is not None and [t.id for t in conv.turns] == [sid, second]


async def test_a_turn_that_has_not_ended_is_not_folded(convs: ConversationStore) -> None:
    sid = await _turn(convs, "alice", "c1", "hello")
    assert not await convs.fold(sid)
    conv = await convs.read("alice", "c1")
    assert conv is not None and conv.count == 0 and conv.pending is not None
    settled, st = await convs.settle(conv)
    assert settled is Settled.RUNNING and st is not None and st.status == "queued"


async def test_a_deleted_conversation_is_never_brought_back_by_its_running_turn(convs: ConversationStore,
                                                                               redis_async: RedisClient) -> None:
    sid = await _turn(convs, "alice", "c1", "hello")
    assert await convs.delete("alice", "c1")
    assert not await convs.delete("alice", "c1")
    await _finish(convs.store, sid, "late")
    await convs.fold(sid)
    k = convs.keys("alice", "c1")
    assert await convs.read("alice", "c1") is None
    assert not await redis_async.exists(k.meta) and not await redis_async.exists(k.turns)


async def test_a_reservation_whose_create_never_came_is_taken_back(convs: ConversationStore,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    dead = uuid.uuid4()
    assert (await convs.begin(absent("alice", "c1"), dead, OWNER, LIMITS, create=True))[0] is Begin.RESERVED
    conv = await convs.read("alice", "c1")
    assert conv is not None
    # Moments after the reservation its create is presumed in flight.
    assert (await convs.settle(conv))[0] is Settled.STARTING
    monkeypatch.setattr(conversations_module, "PENDING_GRACE_S", 0.0)
    again = await convs.read("alice", "c1")
    assert again is not None
    assert (await convs.settle(again))[0] is Settled.DROPPED
    after = await convs.read("alice", "c1")
    assert after is not None and after.pending is None
    # The process that reserved it wakes up and creates its stream after all: refused, so no second turn runs.
    with pytest.raises(Expired):
        await convs.store.create(dead, _request("late"), model="m", max_queue=0, retention_s=60,
                                 key_id="alice")


async def test_a_reservation_whose_stream_was_created_in_time_is_never_taken(convs: ConversationStore,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conversations_module, "PENDING_GRACE_S", 0.0)
    sid = await _turn(convs, "alice", "c1", "hello")
    assert not await convs.take(sid)
    conv = await convs.read("alice", "c1")
    assert conv is not None and (await convs.settle(conv))[0] is Settled.RUNNING


async def test_a_reservation_naming_another_stream_is_released(convs: ConversationStore) -> None:
    """A create whose id was another stream's (a native client's id reused), whose process died before it
    released its reservation: the conversation is not blocked by a stream that is not its turn."""
    other = uuid.uuid4()
    await convs.store.create(other, _request("not a turn"), model="m", max_queue=0, retention_s=60,
                             key_id="alice")
    assert (await convs.begin(absent("alice", "c1"), other, OWNER, LIMITS, create=True))[0] is Begin.RESERVED
    conv = await convs.read("alice", "c1")
    assert conv is not None and (await convs.settle(conv))[0] is Settled.DROPPED
    conv = await convs.read("alice", "c1")
    assert conv is not None and conv.pending is None


async def test_a_branch_keeps_a_prefix_bumps_the_version_and_waits_for_the_running_turn(
        convs: ConversationStore) -> None:
    first = await _turn(convs, "alice", "c1", "one", "1")
    await convs.fold(first)
    second = await _turn(convs, "alice", "c1", "two", "2")
    conv = await convs.read("alice", "c1")
    assert conv is not None
    assert (await convs.branch(conv, 1))[0] is Begin.BUSY  # the second turn runs
    await convs.fold(second)
    stale = conv
    conv = await convs.read("alice", "c1")
    assert conv is not None and conv.count == 2
    assert (await convs.branch(stale, 1))[0] is Begin.CHANGED  # built on a history that has changed
    outcome, version = await convs.branch(conv, 1)
    assert outcome is Begin.RESERVED and version == conv.version + 1
    after = await convs.read("alice", "c1")
    assert after is not None and [t.id for t in after.turns] == [first] and after.version == version
    assert after.bytes == len(after.turns[0].to_json())
    # A turn reserved on the history before the branch is refused.
    assert (await convs.begin(conv, uuid.uuid4(), OWNER, LIMITS, create=True))[0] is Begin.CHANGED


async def test_items_join_only_between_turns(convs: ConversationStore) -> None:
    now = time.time()
    assert await convs.create("alice", "c1", OWNER, LIMITS, metadata={"k": "v"},
                              turns=[items_turn((Message("system", "be brief"),), now)])
    assert not await convs.create("alice", "c1", OWNER, LIMITS, metadata={})
    conv = await convs.read("alice", "c1")
    assert conv is not None and conv.count == 1 and conv.metadata == {"k": "v"}
    assert abs(conv.created_at - now) < 10  # the server's time (no pod passes its own)
    sid = await _turn(convs, "alice", "c1", "hello")
    conv = await convs.read("alice", "c1")
    assert conv is not None
    assert await convs.append(conv, [items_turn((Message("user", "x"),), now)]) is Begin.BUSY
    await _finish(convs.store, sid, "hi")
    await convs.fold(sid)
    conv = await convs.read("alice", "c1")
    assert conv is not None
    assert await convs.append(conv, [items_turn((Message("user", "x"),), now)]) is Begin.RESERVED
    conv = await convs.read("alice", "c1")
    assert conv is not None and [t.status for t in conv.turns] == ["items", "done", "items"]


async def test_conversations_are_per_api_key(convs: ConversationStore) -> None:
    await _turn(convs, "alice", "shared-id", "mine")
    assert await convs.read("bob", "shared-id") is None
    assert await convs.read("alice", "shared-id") is not None
    assert ConversationKeys.of("alice", "x", 6).digest != ConversationKeys.of("bob", "x", 6).digest


async def test_an_owner_holds_at_most_its_share_of_conversations(convs: ConversationStore) -> None:
    limits = Limits(ttl_s=600, max_conversations=3 * convs.partitions)  # three per partition
    made = 0
    with pytest.raises(TooManyConversations):
        for i in range(1000):
            await convs.create("alice", f"c{i}", OWNER, limits, metadata={})
            made += 1
    assert 3 <= made <= 3 * convs.partitions
    # A deleted one frees its place; another owner is counted apart.
    await convs.create("alice", "other-owner", "owner-b", limits, metadata={})
    victim = next(f"c{i}" for i in range(made) if convs.keys("alice", f"c{i}").partition
                  == convs.keys("alice", f"c{made}").partition)
    assert await convs.delete("alice", victim)
    assert await convs.create("alice", f"c{made}", OWNER, limits, metadata={})


async def test_use_restarts_the_sliding_expiry(convs: ConversationStore, redis_async: RedisClient) -> None:
    limits = dataclasses.replace(LIMITS, ttl_s=100)
    await convs.create("alice", "c1", OWNER, limits, metadata={})
    k = convs.keys("alice", "c1")
    await redis_async.expire(k.meta, 5)
    assert await convs.read("alice", "c1") is not None
    assert 90 < await redis_async.ttl(k.meta) <= 100
    assert 90_000 < await redis_async.pttl(k.owner(OWNER)) <= 100_000


async def test_a_conversation_and_its_turns_live_in_different_slots_on_a_cluster(convs: ConversationStore) -> None:
    if not convs.store.cluster:
        pytest.skip("a standalone server has one slot space")
    def slot(partition: int) -> int:
        return partition_slot(partition, convs.partitions)

    slots = {slot(convs.store.keys(await _turn(convs, "alice", f"c{i}", "hi", "ok")).partition)
             != slot(convs.keys("alice", f"c{i}").partition) for i in range(6)}
    assert True in slots  # at least one turn's stream is in another slot than its conversation
    for i in range(6):
        conv = await convs.read("alice", f"c{i}")
        assert conv is not None and conv.pending is not None
        await convs.fold(conv.pending.stream_id)
        after = await convs.read("alice", f"c{i}")
        assert after is not None and after.count == 1 and after.turns[0].output.text == "ok"
