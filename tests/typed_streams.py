"""A stand-in for the generator: writes a stream's events into the real Redis through the broker's JobStore, as a
generator does (claim → append → finish), for the tests of clients that read event types no engine emits
in this tree yet (``reasoning``, ``tool_call``, ``tool_args``, ``done.finish_reason: tool_calls``), and for
what a failover at ``--durability local`` does to a stream (its last events lost: ``lose_tail``).

Every broker import of those tests is here, in one place. Each call runs on an event loop of its own, in a
thread of its own, so a sync test (a Playwright one) can use it between two page actions."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from broker.events import encode_data
from broker.redis.connection import connect
from broker.streams.job_store import JobStore
from broker.streams.records import Claim

T = TypeVar("T")


class StandInGenerator:
    """One stream's writer. The stream must exist (created through the API, so it is queued) and no real
    generator may be running on this Redis (it would claim the job first)."""

    def __init__(self, redis_url: str, stream_id: str) -> None:
        self.redis_url = redis_url
        self.stream_id = uuid.UUID(stream_id)
        self.claim: Claim | None = None
        self.seq = 0  # events appended so far (the stream's sequence number)

    def _run(self, op: Callable[[JobStore], Awaitable[T]]) -> T:
        async def go() -> T:
            r = connect(self.redis_url)
            try:
                return await op(JobStore(r))
            finally:
                await r.aclose()

        # In a thread of its own: Playwright's sync API runs an event loop in the test's thread.
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, go()).result()

    def start(self, model: str = "stand-in") -> str:
        """Claims the stream (it is running now) and appends ``started``; its id."""
        async def claim(jobs: JobStore) -> Claim:
            c = await jobs.claim(self.stream_id, "stand-in")
            assert isinstance(c, Claim), c
            return c

        self.claim = self._run(claim)
        self.seq = self.claim.seq
        return self.append(("started", {"model": model}))[0]

    def append(self, *events: tuple[str, dict[str, Any]]) -> list[str]:
        """Appends events (type, data) one append each, in order; their ids."""
        claim = self.claim
        assert claim is not None, "start() first"

        async def append(jobs: JobStore) -> list[str]:
            for etype, data in events:
                res = await jobs.append(claim, self.seq, self.seq + 1, [(etype, encode_data(data))])
                assert res.ok, res
                self.seq += 1
            stored = await jobs.read(self.stream_id, None, count=100_000)
            return [e.id for e in stored[len(stored) - len(events):]]

        return self._run(append)

    def ids(self) -> list[str]:
        """The ids of every event the stream holds now."""
        async def read(jobs: JobStore) -> list[str]:
            return [e.id for e in await jobs.read(self.stream_id, None, count=10_000)]

        return self._run(read)

    def lose_tail(self, ids: list[str]) -> None:
        """What an asynchronous failover does to a stream: its last events are gone (XDEL leaves the stream's
        last id behind, as a lost tail does) and its sequence number goes back."""
        async def lose(jobs: JobStore) -> None:
            keys = jobs.keys(self.stream_id)
            assert await jobs.redis.xdel(keys.events, *ids) == len(ids)
            await jobs.redis.hincrby(keys.meta, "seq", -len(ids))

        self._run(lose)
        self.seq -= len(ids)

    def finish(self, finish_reason: str = "stop", completion_tokens: int = 0) -> str:
        claim = self.claim
        assert claim is not None, "start() first"
        usage = {"prompt_tokens": 1, "completion_tokens": completion_tokens, "ttft_ms": 1.0, "tpot_ms": 1.0}

        async def finish(jobs: JobStore) -> str:
            eid = await jobs.finish(claim, "done", {"finish_reason": finish_reason, "usage": usage}, status="done",
                                     usage=usage)
            assert eid is not None
            return eid

        return self._run(finish)
