"""Sending again while a conversation's turn runs (broker.request.on_busy), through the conversation service on a real
redis-server, with the broker's own calls in the worker's place (claim, append, finish, fold: what
generator/generation.py does): ``enqueue`` waits and starts on the history the turn before it left, ``interrupt``
stops the running turn and starts on its partial answer, ``reject`` is the 409; retries, cancels, a refused create
and a deleted conversation leave no turn behind; and creates racing each other (two pods, many devices) keep one
turn at a time, in line."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
from in_process import stream_service

from broker.errors import Conflict
from broker.events import EventType, encode_data
from broker.redis.server import RedisServer
from broker.request.generation import GenerationRequest, Message
from broker.streams.conversations import MAX_WAITING
from broker.streams.job_store import JobStore
from broker.streams.records import Claim, Unclaimable
from consumer.edge.auth import ApiKey, ApiKeys
from consumer.streaming.conversations import ConversationService, TurnStarted
from consumer.streaming.service import Caller

CALLER = Caller("", "127.0.0.1")


def _request(text: str) -> GenerationRequest:
    return GenerationRequest((Message("user", text),), None, None, 16, 0.8, 0.95, None, (), False)


@pytest.fixture
async def convs(redis_server: RedisServer, redis_client: redis.Redis) -> AsyncIterator[ConversationService]:
    async with stream_service(redis_server.url, default_model="m") as service:
        yield ConversationService(service, service.conversations)


class Worker:
    """The worker's side of one turn: claim it, write an answer, finish it (done or cancelled) and fold it."""

    def __init__(self, convs: ConversationService, sid: uuid.UUID) -> None:
        self.convs, self.sid, self.seq = convs, sid, 0
        self.jobs = JobStore(convs.service.store.redis)
        self.claim: Claim | None = None

    async def start(self) -> Worker:
        claim = await self.jobs.claim(self.sid, "w")
        assert isinstance(claim, Claim), claim
        self.claim = claim
        return self

    async def write(self, text: str) -> str:
        """Appends a delta; the cancel it was told of ('' for none)."""
        assert self.claim is not None
        res = await self.jobs.append(self.claim, self.seq, self.seq + 1, [(EventType.DELTA, encode_data({"text": text}))])
        assert res.ok, res
        self.seq += 1
        return res.cancel_reason

    async def finish(self, status: str = "done") -> None:
        assert self.claim is not None
        usage = {"prompt_tokens": 1, "completion_tokens": self.seq}
        data: dict[str, Any] = ({"finish_reason": "stop", "usage": usage} if status == "done"
                                else {"reason": "client", "usage": usage})
        assert await self.jobs.finish(self.claim, status, data, status=status, usage=usage) is not None
        await self.convs.conversations.fold(self.sid)  # what the worker does once it finished a turn


async def _send(convs: ConversationService, name: str, text: str, on_busy: str = "reject",
                sid: uuid.UUID | None = None) -> TurnStarted:
    return await convs.start(CALLER, name, _request(text), stream_id=sid, on_busy=on_busy)


async def _engine_messages(convs: ConversationService, sid: uuid.UUID) -> list[tuple[str, str]]:
    request = await convs.service.request_of(sid)
    assert request is not None and request.messages is not None
    return [(m.role, m.content) for m in request.messages]


async def _events(convs: ConversationService, sid: uuid.UUID) -> list[tuple[str, Any]]:
    return [(e.type, e.json()) for e in await convs.service.events_so_far(sid)]


async def test_enqueue_waits_held_and_starts_on_the_history_the_turn_before_it_left(
        convs: ConversationService) -> None:
    name = str(uuid.uuid4())
    first = await _send(convs, name, "one")
    w = await Worker(convs, first.stream_id).start()
    await w.write("Answer one.")
    with pytest.raises(Conflict):
        await _send(convs, name, "two")  # reject: the default
    second = await _send(convs, name, "two", "enqueue")
    assert second.created.created and second.created.status == "queued"
    # Held: readable (a `queued` event saying whom it waits for), in no line (no worker can take it).
    assert await _events(convs, second.stream_id) == [
        ("queued", {"position": 1, "eta_s": None, "waiting_for": str(first.stream_id)})]
    assert await JobStore(convs.service.store.redis).claim(second.stream_id, "w") is Unclaimable.HELD
    assert await _engine_messages(convs, second.stream_id) == [("user", "two")]
    assert await convs.service.store.waiting() == 0
    # A retry of the same send is the same turn; a third send waits behind the second.
    again = await _send(convs, name, "two", "enqueue", sid=second.stream_id)
    assert again.stream_id == second.stream_id and not again.created.created
    third = await _send(convs, name, "three", "enqueue")
    await w.write(" More.")
    await w.finish()  # the worker folds the first turn: the second comes up, on the history the first left
    assert await _engine_messages(convs, second.stream_id) == [
        ("user", "one"), ("assistant", "Answer one. More."), ("user", "two")]
    last = (await _events(convs, second.stream_id))[-1]
    assert last[0] == "queued" and last[1]["position"] == 1 and "waiting_for" not in last[1]  # in its line now
    assert await convs.service.store.waiting() == 1
    w2 = await Worker(convs, second.stream_id).start()
    assert await _engine_messages(convs, third.stream_id) == [("user", "three")]  # still held
    await w2.write("Answer two.")
    await w2.finish()
    assert await _engine_messages(convs, third.stream_id) == [
        ("user", "one"), ("assistant", "Answer one. More."), ("user", "two"), ("assistant", "Answer two."),
        ("user", "three")]
    snap = await convs.get(CALLER, name)
    assert [t.output.text for t in snap.conversation.turns] == ["Answer one. More.", "Answer two."]
    assert snap.pending_id == third.stream_id and snap.conversation.waiting == ()


async def test_interrupt_stops_the_running_turn_and_starts_on_its_partial_answer(
        convs: ConversationService) -> None:
    name = str(uuid.uuid4())
    first = await _send(convs, name, "tell me a long story")
    w = await Worker(convs, first.stream_id).start()
    await w.write("Once upon")
    second = await _send(convs, name, "no, a short one", "interrupt")
    # The running turn was told to stop (its worker hears it at its next append) and the new one waits for it.
    assert await w.write(" a time") == "client"
    assert await _engine_messages(convs, second.stream_id) == [("user", "no, a short one")]
    await w.finish("cancelled")
    snap = await convs.get(CALLER, name)
    assert [(t.status, t.output.text) for t in snap.conversation.turns] == [("cancelled", "Once upon a time")]
    assert await _engine_messages(convs, second.stream_id) == [
        ("user", "tell me a long story"), ("assistant", "Once upon a time"), ("user", "no, a short one")]
    assert snap.pending_id == second.stream_id


async def test_an_interrupt_cancels_the_turns_that_waited_before_it_and_the_last_interrupt_wins(
        convs: ConversationService) -> None:
    name = str(uuid.uuid4())
    first = await _send(convs, name, "one")
    w = await Worker(convs, first.stream_id).start()
    waited = await _send(convs, name, "two", "enqueue")
    a = await _send(convs, name, "three", "interrupt")
    b = await _send(convs, name, "four", "interrupt")
    await w.finish("cancelled")
    # The waiting turn and the first interrupt were cancelled as they came up (held: at once, no output), the last
    # interrupt runs next; each cancelled turn's stream says so.
    for sid in (waited.stream_id, a.stream_id):
        assert (await _events(convs, sid))[-1][0] == "cancelled"
    snap = await convs.get(CALLER, name)
    assert [t.id for t in snap.conversation.turns] == [first.stream_id, waited.stream_id, a.stream_id]
    assert snap.pending_id == b.stream_id
    assert await _engine_messages(convs, b.stream_id) == [("user", "four")]  # no answer came before it: none in front


async def test_a_waiting_turn_cancelled_a_refused_create_and_a_deleted_conversation_leave_nothing_behind(
        convs: ConversationService) -> None:
    name = str(uuid.uuid4())
    first = await _send(convs, name, "one")
    w = await Worker(convs, first.stream_id).start()
    two = await _send(convs, name, "two", "enqueue")
    three = await _send(convs, name, "three", "enqueue")
    assert await convs.service.cancel(CALLER, two.stream_id) == "cancelled"  # a held turn ends at once
    # The same id with other messages is another request: 409, and no place in line.
    with pytest.raises(Conflict):
        await _send(convs, name, "not three", "enqueue", sid=three.stream_id)
    await w.write("Answer.")
    await w.finish()
    snap = await convs.get(CALLER, name)
    assert [t.id for t in snap.conversation.turns] == [first.stream_id, two.stream_id]
    assert snap.pending_id == three.stream_id
    # The cancelled turn got no answer: its message stays in the history, out of the prompt (send it again).
    assert await _engine_messages(convs, three.stream_id) == [("user", "one"), ("assistant", "Answer."),
                                                              ("user", "three")]
    # As many may wait as MAX_WAITING; one more is a 409.
    waiting = [await _send(convs, name, f"w{i}", "enqueue") for i in range(MAX_WAITING)]
    with pytest.raises(Conflict):
        await _send(convs, name, "one too many", "enqueue")
    # A deleted conversation's waiting turns will never start: they are cancelled.
    assert await convs.conversations.delete("", name)
    for t in waiting:
        assert (await convs.service.status(CALLER, t.stream_id)).status == "cancelled"


async def test_sends_racing_each_other_keep_one_turn_at_a_time_in_line(redis_server: RedisServer,
                                                                      convs: ConversationService) -> None:
    """Two pods (two services, each its own Redis clients) and many sends at once, some interrupting: every send is
    a turn (none lost, none twice), one runs at a time, and the conversation ends with each in it exactly once."""
    async with stream_service(redis_server.url, default_model="m") as other_service:
        other = ConversationService(other_service, other_service.conversations)
        name = str(uuid.uuid4())
        first = await _send(convs, name, "zero")
        sends = [_send(pod, name, f"m{i}", "interrupt" if i % 3 == 0 else "enqueue")
                 for i, pod in enumerate([convs, other] * 5)]
        started = await asyncio.gather(*sends)
        ids = {t.stream_id for t in started}
        assert len(ids) == 10 and all(t.created.created for t in started)
        # Run each turn as it comes up, to the end: the conversation's turns are every send, once.
        pending = first.stream_id
        for _ in range(12):
            st = await convs.service.status(CALLER, pending)
            if st.status not in ("done", "cancelled"):
                w = await Worker(convs, pending).start()
                await w.write("x")
                await w.finish()
            snap = await convs.get(CALLER, name)
            if snap.pending_id is None:
                break
            pending = snap.pending_id
        snap = await convs.get(CALLER, name)
        assert snap.pending_id is None and snap.conversation.waiting == ()
        assert sorted(map(str, [t.id for t in snap.conversation.turns])) == sorted(map(str, {first.stream_id, *ids}))


async def test_a_keys_on_busy_is_what_its_turns_do_when_they_name_none(convs: ConversationService) -> None:
    # An agent app's key that always interrupts: its clients need not learn the parameter; one that names it wins.
    entry = {"id": "agent", "sha256": "00" * 32, "on_busy": "interrupt"}
    convs.service.api_keys = ApiKeys([ApiKey.from_entry(entry), ApiKey.from_entry({**entry, "id": "plain",
                                                                                     "on_busy": ""})])
    agent, plain = Caller("agent", "127.0.0.1"), Caller("plain", "127.0.0.1")
    service = convs.service
    assert [service.on_busy(agent, None), service.on_busy(agent, "enqueue"), service.on_busy(plain, None),
            service.on_busy(CALLER, None)] == ["interrupt", "enqueue", "reject", "reject"]
    name = str(uuid.uuid4())
    first = await convs.start(agent, name, _request("Tell me a story."), on_busy=service.on_busy(agent, None))
    running = await Worker(convs, first.stream_id).start()
    assert await running.write("Once") == ""
    second = await convs.start(agent, name, _request("Shorter."), on_busy=service.on_busy(agent, None))
    assert await running.write(" upon") == "client"  # interrupted: the running turn hears it is cancelled
    assert second.stream_id != first.stream_id
    with pytest.raises(ValueError, match="'on_busy' must be one of"):
        ApiKey.from_entry({**entry, "on_busy": "later"})
