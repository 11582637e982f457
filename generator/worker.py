"""The generator worker: one poll loop that claims jobs and runs each to its terminal event.

The pieces, each in its module: where the next job comes from (generator.jobs: this worker's model's queue,
takeovers and left jobs first), running one job (generator.generation: claim, token pump, terminal event, ack), keeping
its lease and hearing its cancel (generator.lease). This module only decides how many run at once and
how the worker stops: ``request_stop`` (finish what is in flight) and ``hand_over`` (give it back now).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Coroutine
from typing import Any

from broker.backoff import Attempts
from broker.errors import StoreFull, StoreTransient, StoreUnavailable
from broker.redis.connection import RedisClient
from broker.streams.job_store import JobStore
from broker.streams.records import Claim
from broker.streams.served_models import ANNOUNCE_INTERVAL_S, ServedModels
from generator.appends import AppendBatcher
from generator.engines import Engine
from generator.engines.base import TokenCounter
from generator.generation import Appender, JobRunner
from generator.jobs import JobPoller
from generator.lease import check_cancel, listen_for_cancels
from generator.metrics import GeneratorMetrics
from generator.retry import OUT_OF_MEMORY
from generator.settings import GeneratorSettings
from generator.slots import Seat, Slots
from generator.token_counts import answer_token_counts

log = logging.getLogger("rsb.generator")


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Worker:
    def __init__(self, settings: GeneratorSettings, engine: Engine, store: JobStore, blocking: RedisClient) -> None:
        self.settings = settings
        self.engine = engine
        self.store = store
        self.blocking = blocking  # BLPOP and pub/sub: no socket timeout
        self.worker_id = settings.worker_id or default_worker_id()
        self.metrics = GeneratorMetrics()
        OUT_OF_MEMORY.on_refused = self.metrics.storage_full.inc
        # Many generations at once: their appends share pipelines. (Cluster pipelines would split by
        # node anyway; there each append goes on its own. At ``replicated`` each append waits for its replica.)
        #: Generations run at once: the engine's sequences (in-process llama.cpp), else --concurrency.
        self.concurrency = engine.sequences or settings.concurrency
        batch = self.concurrency > 1 and not store.cluster and store.gate is None
        appender: Appender = AppendBatcher(store, interval_s=settings.append_batch_ms / 1000) if batch else store
        self.runner = JobRunner(settings, engine, store, appender, self.metrics, self.worker_id)
        engine.observe_steps(self.metrics.batch_step)
        self._background: set[asyncio.Task[Any]] = set()
        affinity_wait_s = settings.affinity_wait_s if engine.caches_prompts else 0.0
        self.poller = JobPoller(store, blocking, self.worker_id, (engine.name, *settings.engine.model_aliases),
                                settings.lease_s,
                                aging_s=settings.tier_aging_s, affinity_wait_s=affinity_wait_s)
        self._stopping = asyncio.Event()
        self.slots: Slots | None = None  # while running

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def request_stop(self) -> None:
        """Stop claiming; the job in flight is finished (or handed over: see ``hand_over``)."""
        self._stopping.set()

    def hand_over(self) -> None:
        """Stop the job in flight without ending its stream: it goes back to the queue at once and another
        worker continues it from the text already appended (a worker past its shutdown grace)."""
        self._stopping.set()
        for run in self.runner.running.values():
            run.hand_over()

    async def announce_now(self) -> None:
        """Tell the consumers which model (and aliases) this worker serves, once; raises what Redis raises."""
        await ServedModels(self.store.redis).announce(self.engine.name, self.settings.engine.model_aliases,
                                                      worker_id=self.worker_id)

    async def _withdraw(self) -> None:
        """This worker stops: it is not counted as serving its model any more (its announcements lapse anyway)."""
        try:
            await ServedModels(self.store.redis).withdraw(self.engine.name, self.worker_id)
        except StoreTransient as e:
            log.info("could not withdraw the model's announcement: %s", type(e).__name__)

    async def _announce_model(self) -> None:
        """Tell the consumers which model this worker serves (GET /v1/models), now and every few seconds."""
        while True:
            try:
                await self.announce_now()
            except StoreUnavailable as e:
                log.warning("could not announce the model, retrying: %s", e)
            except StoreFull:  # counted in the process's episode, tried again
                OUT_OF_MEMORY.refused("model announcement")
            except Exception as e:  # a bug (the key holds another type): said, and tried again, never in silence
                log.error("could not announce the model: %s", type(e).__name__, exc_info=e)
            await asyncio.sleep(ANNOUNCE_INTERVAL_S)

    def _on_cancel_notice(self, stream_id: uuid.UUID) -> None:
        run = self.runner.running.get(stream_id)
        if run is not None:
            self._spawn(check_cancel(run, self.store, self.settings.disconnect_grace_s, self.settings.lease_s))

    async def run(self) -> None:
        """The poll loop: while fewer than ``concurrency`` jobs run (parked ones aside: generator.slots), claim the
        next one."""
        attempts = Attempts()
        control = asyncio.create_task(listen_for_cancels(self.blocking, self.store.partitions, self._on_cancel_notice),
                                      name="cancel-listener")
        announcer = asyncio.create_task(self._announce_model(), name="announce-model")
        helpers = [control, announcer]
        if isinstance(self.engine, TokenCounter):  # POST /v1/messages/count_tokens for this model
            helpers.append(asyncio.create_task(answer_token_counts(self.engine, self.store.redis, self.engine.name),
                                               name="token-counts"))
        # In-process llama.cpp: claimed ahead, jobs wait inside the engine for the step a sequence frees.
        ahead = self.settings.claim_ahead if self.engine.sequences else 0
        slots = Slots(self.concurrency + max(0, ahead), self.settings.max_parked)
        self.slots = slots
        self.metrics.parked.set_function(lambda: slots.parked)
        jobs: set[asyncio.Task[None]] = set()
        by_stream: dict[uuid.UUID, asyncio.Task[None]] = {}  # the task of each stream's run, by stream
        try:
            while not self._stopping.is_set():
                await slots.take()
                try:
                    claim = await self._claim_unless_stopping()
                    attempts.reset()
                except StoreUnavailable as e:
                    slots.release()
                    log.warning("redis unavailable, retrying: %s", e)
                    await attempts.sleep()
                    continue
                except StoreFull:  # a claim writes: wait, as for an outage
                    slots.release()
                    OUT_OF_MEMORY.refused("claim a job")
                    await attempts.sleep()
                    continue
                if claim is not None and slots.resume_wanted:
                    # A parked generation's write landed while this claim ran: the slot is its, and the job goes back
                    # to the front of its line.
                    self._spawn(self._give_back(claim))
                    claim = None
                if claim is None:
                    slots.release()
                    await self._wait_unless_stopping()
                    continue
                seat = slots.seat()
                own = by_stream.get(claim.stream_id)
                task = asyncio.create_task(self._continue_own(own, claim, seat) if own is not None
                                           else self.runner.run(claim, seat))
                by_stream[claim.stream_id] = task
                jobs.add(task)

                def done(t: asyncio.Task[None], seat: Seat = seat, sid: uuid.UUID = claim.stream_id) -> None:
                    jobs.discard(t)
                    if by_stream.get(sid) is t:
                        del by_stream[sid]
                    seat.close()
                    if not t.cancelled() and t.exception() is not None:  # a bug the run could not even report
                        log.error("a job failed: %s", type(t.exception()).__name__, exc_info=t.exception())

                task.add_done_callback(done)
        finally:
            if jobs:  # finished within the grace period, or handed over by hand_over()
                await asyncio.gather(*jobs, return_exceptions=True)
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, *self._background, return_exceptions=True)
            await self._withdraw()

    async def _continue_own(self, own: asyncio.Task[None], claim: Claim, seat: Seat) -> None:
        """This worker's own run of the stream stalled past its lease (a partition, a stopped process) and this claim
        fenced it out: the claim runs once that run has stopped (its next write or renewal meets the fence). Given
        back instead, the job came straight back to this worker's next claim, and again, each claim an attempt:
        hundreds in a few seconds, then worker_lost (found by tests/fault_schedule.py)."""
        await asyncio.wait({own})
        if self._stopping.is_set():  # handed over meanwhile: the next worker continues it
            await self._give_back(claim)
            return
        await self.runner.run(claim, seat)

    async def _claim_unless_stopping(self) -> Claim | None:
        if self._stopping.is_set():  # never claim (take over) a job just handed over by this very worker
            return None
        return await self.poller.claim()

    async def _wait_unless_stopping(self) -> None:
        """Wait for work, but let a stop request end the wait at once; a failed wait is retried by the next claim."""
        if self._stopping.is_set():
            return
        wait = asyncio.ensure_future(self.poller.wait())
        stop = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({wait, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not wait.done():
            wait.cancel()
        results = await asyncio.gather(wait, return_exceptions=True)
        if isinstance(results[0], StoreUnavailable):
            await asyncio.sleep(0.1)  # Redis away: the claim that follows says so, and backs off

    async def _give_back(self, claim: Claim) -> None:
        try:
            await self.store.give_back(claim)
        except StoreTransient as e:  # its lease lapses instead: taken over after lease_s
            log.warning("could not give a job back: %s", type(e).__name__)
