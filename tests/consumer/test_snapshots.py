"""Late joiners (consumer.streaming.snapshots, StreamService.latest) on a real redis-server: a read from the latest
starts with the answer as it stands (text, reasoning, tool calls mid-arguments) and goes on with the tail after
its last event, so that the snapshot and its tail add up to exactly what a full replay does; a failover that
takes back events the reader had gets a new snapshot instead of a reset; and the answer is read once per pod,
each later joiner reading only what was appended since."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
from helpers import eventually_async
from in_process import stream_service

from broker.answer import AnswerRuns
from broker.events import Event, EventType, encode_data
from broker.redis.server import RedisServer
from broker.request.generation import GenerationRequest
from broker.streams.job_store import JobStore
from broker.streams.records import Claim
from broker.streams.stream_store import StreamStore
from consumer.streaming.service import StreamService
from consumer.streaming.snapshots import AnswerSnapshot

REQ = GenerationRequest(None, "hello", None, 32, 0.8, 0.95, None, (), False)

#: An answer that has everything: reasoning, text, two calls whose arguments interleave, text again.
ANSWER: list[tuple[str, dict[str, Any]]] = [
    ("started", {"model": "m"}),
    ("reasoning", {"text": "Let me "}), ("reasoning", {"text": "think."}),
    ("delta", {"text": "Calling "}), ("delta", {"text": "tools: "}),
    ("tool_call", {"index": 0, "id": "call_a", "name": "weather"}),
    ("tool_args", {"index": 0, "text": '{"city": "Zü'}),
    ("tool_call", {"index": 1, "id": "call_b", "name": "time"}),
    ("tool_args", {"index": 1, "text": "{}"}),
    ("tool_args", {"index": 0, "text": 'rich", '}),
    ("tool_args", {"index": 0, "text": '"days": 3}'}),
    ("reasoning", {"text": " Done."}),
    ("delta", {"text": "There."}),
]


@pytest.fixture
async def service(redis_server: RedisServer, redis_client: redis.Redis) -> AsyncIterator[StreamService]:
    async with stream_service(redis_server.url, heartbeat_s=0.2) as s:
        yield s


class Writer:
    """The generator's side of one stream: claim it, append events one at a time."""

    def __init__(self, store: StreamStore, jobs: JobStore, sid: uuid.UUID, claim: Claim) -> None:
        self.store, self.jobs, self.sid, self.claim, self.seq = store, jobs, sid, claim, 0

    @classmethod
    async def start(cls, store: StreamStore, jobs: JobStore) -> Writer:
        sid = uuid.uuid4()
        await store.create(sid, REQ, model="m", max_queue=0, retention_s=60)
        claim = await jobs.claim(sid, "w")
        assert isinstance(claim, Claim)
        return cls(store, jobs, sid, claim)

    async def append(self, *events: tuple[str, dict[str, Any]]) -> None:
        for etype, data in events:
            assert (await self.jobs.append(self.claim, self.seq, self.seq + 1, [(etype, encode_data(data))])).ok
            self.seq += 1

    async def finish(self) -> None:
        usage = {"prompt_tokens": 1, "completion_tokens": self.seq}
        assert await self.jobs.finish(self.claim, "done", {"finish_reason": "tool_calls", "usage": usage},
                                       status="done", usage=usage) is not None

    async def ids(self) -> list[str]:
        return [e.id for e in await self.store.read(self.sid, None, count=10_000)]

    async def lose_tail(self, n: int) -> None:
        """What an asynchronous failover does: the last ``n`` events are gone, the sequence number goes back."""
        ids = (await self.ids())[-n:]
        await self.store.redis.xdel(self.store.keys(self.sid).events, *ids)
        await self.store.redis.hincrby(self.store.keys(self.sid).meta, "seq", -n)
        self.seq -= n


class Joiner:
    """What a client of a read from the latest keeps: a snapshot replaces everything, events add to it."""

    def __init__(self) -> None:
        self.answer = AnswerRuns()
        self.snapshots: list[AnswerSnapshot] = []
        self.events: list[Event] = []

    def take(self, item: Any) -> None:
        if isinstance(item, AnswerSnapshot):
            self.snapshots.append(item)
            self.answer = AnswerRuns()
            self.answer.add_all(item.events)
            return
        for ev in item:
            assert ev.type != EventType.RESET  # a read from the latest never sends one
            self.events.append(ev)
            if not ev.is_terminal:
                self.answer.add(ev)


async def _read(service: StreamService, sid: uuid.UUID, joiner: Joiner, until: Any, after: str | None = None,
                snapshot: bool = True) -> None:
    """Read from the latest into ``joiner`` until ``until(joiner)``."""
    reader = service.latest(sid, after, snapshot=snapshot)
    try:
        async with asyncio.timeout(10):
            async for item in reader:
                if item is not None:
                    joiner.take(item)
                if until(joiner):
                    return
    finally:
        await reader.aclose()  # type: ignore[attr-defined]


async def _first_snapshot(joiner: Joiner) -> None:
    async def taken() -> bool:
        return bool(joiner.snapshots)

    await eventually_async(taken, 10, "the first snapshot")


def _replay(events: list[Event]) -> AnswerRuns:
    full = AnswerRuns()
    full.add_all(ev for ev in events if not ev.is_terminal)
    return full


def _same(a: AnswerRuns, b: AnswerRuns) -> None:
    assert (a.text, a.reasoning, a.tool_calls) == (b.text, b.reasoning, b.tool_calls)


async def test_a_snapshot_mid_call_then_the_tail_is_the_full_replay(service: StreamService) -> None:
    w = await Writer.start(service.store, JobStore(service.store.redis))
    await w.append(*ANSWER[:10])  # the first call's arguments stop at 'rich", '
    joiner = Joiner()
    reader = asyncio.create_task(_read(service, w.sid, joiner, lambda j: bool(j.events and j.events[-1].is_terminal)))
    await _first_snapshot(joiner)
    await w.append(*ANSWER[10:])
    await w.finish()
    await reader
    first = joiner.snapshots[0]
    ids = await w.ids()
    assert first.last_id == ids[10]  # queued, then the ten events appended before the join
    assert first.data == {
        "text": "Calling tools: ", "reasoning": "Let me think.", "last_event_id": ids[10],
        "tool_calls": [{"index": 0, "id": "call_a", "name": "weather", "arguments": '{"city": "Zürich", '},
                       {"index": 1, "id": "call_b", "name": "time", "arguments": "{}"}]}
    assert first.event().id == ids[10] and first.event().type == EventType.SNAPSHOT
    # The tail is every event after the snapshot's, exactly once, and the two add up to the full replay.
    assert [e.id for e in joiner.events] == ids[11:]
    full = await service.store.read(w.sid, None, count=100)
    _same(joiner.answer, _replay(list(full)))
    assert joiner.answer.tool_calls[0].arguments == '{"city": "Zürich", "days": 3}'
    # The snapshot's events are the runs: one event per run, each holding its run's texts.
    assert [e.type for e in first.events] == ["started", "reasoning", "delta", "tool_call", "tool_args", "tool_call",
                                             "tool_args", "tool_args"]


async def test_a_finished_stream_gives_its_snapshot_then_its_terminal_event(service: StreamService) -> None:
    w = await Writer.start(service.store, JobStore(service.store.redis))
    await w.append(*ANSWER)
    await w.finish()
    joiner = Joiner()
    await _read(service, w.sid, joiner, lambda j: bool(j.events))
    ids = await w.ids()
    assert joiner.snapshots[0].last_id == ids[-2] and [e.id for e in joiner.events] == [ids[-1]]
    assert joiner.events[0].type == "done"
    _same(joiner.answer, _replay(list(await service.store.read(w.sid, None, count=100))))


async def test_a_failover_that_takes_back_what_the_snapshot_held_sends_a_new_snapshot(
        service: StreamService) -> None:
    w = await Writer.start(service.store, JobStore(service.store.redis))
    await w.append(*ANSWER[:10])
    joiner = Joiner()
    reader = asyncio.create_task(_read(service, w.sid, joiner, lambda j: len(j.snapshots) == 2 and bool(
        j.events) and j.events[-1].is_terminal))
    await _first_snapshot(joiner)
    await w.lose_tail(3)  # the second call and the end of the first's arguments: a failover lost them
    service.hub._on_reset([service.store.keys(w.sid).channel.encode()])  # what the hub reports after one
    await w.append(("tool_args", {"index": 0, "text": 'rich"}'}), ("delta", {"text": " Sunny."}))
    await w.finish()
    await reader
    # The new snapshot holds the stream as it was when it was read (the new events may or may not be in it).
    second = joiner.snapshots[1]
    assert [c["name"] for c in second.data["tool_calls"]] == ["weather"]
    assert '{"city": "Zürich"}'.startswith(second.data["tool_calls"][0]["arguments"])
    full = await service.store.read(w.sid, None, count=100)
    _same(joiner.answer, _replay(list(full)))
    assert joiner.answer.text == "Calling tools:  Sunny." and (await w.ids())[-1] == joiner.events[-1].id
    assert [(c.name, c.arguments) for c in joiner.answer.tool_calls] == [("weather", '{"city": "Zürich"}')]


async def test_a_reconnect_from_the_latest_resumes_after_its_id_and_meets_a_reset_with_a_snapshot(
        service: StreamService) -> None:
    w = await Writer.start(service.store, JobStore(service.store.redis))
    await w.append(*ANSWER[:6])
    joiner = Joiner()
    await _read(service, w.sid, joiner, lambda j: bool(j.snapshots))
    last = joiner.snapshots[0].last_id
    await w.append(*ANSWER[6:8])
    # A reconnect with the snapshot's id (Last-Event-ID): the events after it, no snapshot first.
    again = Joiner()
    again.answer = joiner.answer
    await _read(service, w.sid, again, lambda j: len(j.events) == 2, after=last, snapshot=False)
    assert not again.snapshots and [e.type for e in again.events] == ["tool_args", "tool_call"]
    # A failover lost the snapshot's own last event: the reconnect gets a snapshot of the stream as it now is.
    await w.lose_tail(4)
    later = Joiner()
    await _read(service, w.sid, later, lambda j: bool(j.snapshots), after=last, snapshot=False)
    assert later.snapshots[0].data["tool_calls"] == [] and later.snapshots[0].data["text"] == "Calling "


async def test_the_answer_is_read_once_per_pod_and_each_later_joiner_reads_only_the_new_events(
        service: StreamService) -> None:
    w = await Writer.start(service.store, JobStore(service.store.redis))
    await w.append(("started", {"model": "m"}), *[("delta", {"text": f"t{i} "}) for i in range(3000)])
    read: list[int] = []
    replay = service.store.replay

    async def counted(*args: Any, **kwargs: Any) -> Any:
        page = await replay(*args, **kwargs)
        read.append(len(page.events))
        return page

    service.store.replay = counted  # type: ignore[method-assign]
    snaps = await asyncio.gather(*(service.snapshots.latest(w.sid) for _ in range(50)))
    assert sum(read) == 3002  # queued, started, 3,000 deltas: read once for 50 joiners
    assert {s.last_id for s in snaps} == {(await w.ids())[-1]}
    assert snaps[0].data["text"] == "".join(f"t{i} " for i in range(3000))
    await w.append(("delta", {"text": "more"}))
    read.clear()
    snap = await service.snapshots.latest(w.sid)
    assert sum(read) == 1 and snap.data["text"].endswith("t2999 more")
    assert [e.type for e in snap.events] == ["started", "delta"]  # one run of text, however many deltas
