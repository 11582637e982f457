"""Coalescing the appends of many concurrent generations into one pipeline per event-loop turn.

A worker running many generations at once (``--concurrency``, an upstream server or a paced engine)
would otherwise pay one Redis round trip (a syscall each way, a loop wake-up, a reply parse) per token
per stream. Appends that come in while a pipeline is in flight wait for the next one, so the batch
grows with the load and latency stays one round trip; each APPEND script still runs atomically alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from broker.errors import StoreUnavailable
from broker.streams.job_store import JobStore
from broker.streams.records import AppendResult, Claim

_Call = tuple[Claim, int, int, Sequence[tuple[str, bytes]]]


class AppendBatcher:
    def __init__(self, store: JobStore, max_batch: int = 512, interval_s: float = 0.0) -> None:
        self.store = store
        self.max_batch = max_batch
        self.interval_s = interval_s
        self._last_flush = float("-inf")
        self._pending: list[tuple[_Call, asyncio.Future[AppendResult]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def append(self, claim: Claim, seq_before: int, seq_after: int,
                     events: Sequence[tuple[str, bytes]]) -> AppendResult:
        fut: asyncio.Future[AppendResult] = asyncio.get_running_loop().create_future()
        self._pending.append(((claim, seq_before, seq_after, events), fut))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await fut

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            wait_s = self._last_flush + self.interval_s - loop.time()
            if wait_s > 0:
                try:
                    await asyncio.sleep(wait_s)  # the appends of this interval go together
                except asyncio.CancelledError:  # stopped: nobody may wait forever for an append that never left
                    for _, fut in self._pending:
                        if not fut.done():
                            fut.set_exception(StoreUnavailable("the append batcher stopped"))
                    self._pending = []
                    raise
            self._last_flush = loop.time()
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
            try:
                results = await self.store.append_many([call for call, _ in batch])
            except BaseException as e:  # the connection failed: every caller retries as it would alone
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e if isinstance(e, Exception) else StoreUnavailable(str(e)))
                if isinstance(e, asyncio.CancelledError):
                    raise
                continue
            for (_, fut), res in zip(batch, results, strict=True):
                if fut.done():
                    continue
                if isinstance(res, BaseException):
                    fut.set_exception(res)
                else:
                    fut.set_result(res)
