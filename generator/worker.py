"""The generator worker: a poll loop that claims one job at a time and runs it to a terminal event.

Jobs live in each partition's job stream, read through the ``generators`` consumer group. A job is
acknowledged only after its terminal event is in Redis, so a worker never holds the only copy of
anything: if it dies, its pending entry goes idle and another worker's XAUTOCLAIM takes it over.

Polling: one blocking XREADGROUP per group of job streams that share a hash slot: all of them in one
call on a standalone server, one call per partition on Redis Cluster (a multi-key command must stay in
one slot). The polls of a cluster run side by side and outlive one ``_next_job`` call; an entry that a
poll brings when this worker cannot start it is handed back at once (made look idle for longer than any
lease), so the next XAUTOCLAIM, by any worker, takes it: a worker keeps no job it has not started.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker.client import RedisClient
from broker.events import EventType, delta, encode_data
from broker.keys import JOBS_GROUP, control_channel, partition_slot
from broker.pubsub import Channels
from broker.settings import GeneratorSettings
from broker.store import Claim, Store, started_event
from generator.appends import AppendBatcher
from generator.engine import Engine, Generation
from generator.handoff import TokenHandoff
from generator.metrics import GeneratorMetrics
from generator.stops import StopFilter

log = logging.getLogger("rsb.generator")

# XREADGROUP BLOCK stays well under any socket timeout and bounds how long shutdown waits for the poll.
POLL_BLOCK_MS = 2000
# How long a finished generation waits for its lease renewer to stop (it is mid-command at worst).
RENEWER_STOP_S = 1.0
TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)
# XCLAIM ... IDLE this: an entry handed back looks idle for longer than any lease, so XAUTOCLAIM takes it.
HAND_BACK_IDLE_MS = 2**31 - 1

Job = tuple[int, str, uuid.UUID]  # partition, job entry id, stream id


@dataclass(slots=True)
class _PollGroup:
    """Job streams read by one XREADGROUP: all partitions on a standalone server; on a cluster, those
    whose keys share one hash slot (usually one partition)."""

    keys: dict[str, int]  # jobs key -> partition
    task: asyncio.Task[list[Job]] | None = None


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(slots=True)
class _Run:
    """What the worker knows about the job in flight."""

    claim: Claim
    stop: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str = ""
    fenced_out: bool = False
    deadline_hit: bool = False
    handing_over: bool = False
    generation_over: bool = False


class Backoff:
    def __init__(self, base_s: float = 0.1, cap_s: float = 5.0) -> None:
        self.base_s, self.cap_s, self.attempt = base_s, cap_s, 0

    async def sleep(self) -> None:
        delay = min(self.cap_s, self.base_s * 2**self.attempt) * random.uniform(0.5, 1.0)
        self.attempt += 1
        await asyncio.sleep(delay)

    def reset(self) -> None:
        self.attempt = 0


class Worker:
    def __init__(self, settings: GeneratorSettings, engine: Engine, store: Store, blocking: RedisClient) -> None:
        self.metrics = GeneratorMetrics()
        # Many generations at once: their appends share pipelines. (Cluster pipelines would split by
        # node anyway; there each append goes on its own.)
        self._appender: Store | AppendBatcher = (
            AppendBatcher(store) if settings.concurrency > 1 and not store.cluster else store)
        self.settings = settings
        self.engine = engine
        self.store = store
        self.blocking = blocking  # XREADGROUP BLOCK and pub/sub: no socket timeout
        self.worker_id = settings.worker_id or default_worker_id()
        self._stopping = asyncio.Event()
        self._running: dict[uuid.UUID, _Run] = {}
        self._groups = self._poll_groups()
        self._polling = False  # a _next_job call is waiting for the polls
        self._background: set[asyncio.Task[Any]] = set()

    def _poll_groups(self) -> list[_PollGroup]:
        n = self.store.partitions
        if not self.store.cluster:
            return [_PollGroup({self.store.jobs_key(p): p for p in range(n)})]
        by_slot: dict[int, dict[str, int]] = {}
        for p in range(n):
            by_slot.setdefault(partition_slot(p, n), {})[self.store.jobs_key(p)] = p
        return [_PollGroup(keys) for keys in by_slot.values()]

    def _spawn(self, coro: Any) -> None:
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
        for run in self._running.values():
            run.handing_over = True
            run.stop.set()

    async def run(self) -> None:
        """The poll loop: while fewer than ``concurrency`` jobs run, claim the next one."""
        backoff = Backoff()
        control = asyncio.create_task(self._listen_for_cancels(), name="cancel-listener")
        slots = asyncio.Semaphore(max(1, self.settings.concurrency))
        jobs: set[asyncio.Task[None]] = set()
        try:
            while not self._stopping.is_set():
                await slots.acquire()
                try:
                    await self.store.ensure_groups()
                    job = await self._poll_unless_stopping()
                    backoff.reset()
                except TRANSIENT as e:
                    slots.release()
                    log.warning("redis unavailable, retrying: %s", e)
                    await backoff.sleep()
                    continue
                if job is None:
                    slots.release()
                    continue
                task = asyncio.create_task(self._run_job(*job))
                jobs.add(task)

                def done(t: asyncio.Task[None]) -> None:
                    jobs.discard(t)
                    slots.release()

                task.add_done_callback(done)
        finally:
            await self._cancel_polls()
            if jobs:  # finished within the grace period, or handed over by hand_over()
                await asyncio.gather(*jobs, return_exceptions=True)
            control.cancel()
            await asyncio.gather(control, *self._background, return_exceptions=True)

    # -- claiming ------------------------------------------------------------------------------

    async def _poll_unless_stopping(self) -> Job | None:
        """Poll for a job, but let a stop request end the wait at once. An entry delivered to a poll
        that is cancelled this way stays pending and is taken over after ``lease_s``: nothing is lost."""
        if self._stopping.is_set():  # never claim (XAUTOCLAIM) a job just handed over by this very worker
            return None
        poll = asyncio.ensure_future(self._next_job())
        stop = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({poll, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not poll.done():
            poll.cancel()
            await asyncio.gather(poll, return_exceptions=True)
            await self._cancel_polls()
            return None
        return poll.result()

    async def _next_job(self) -> Job | None:
        """A job to run: first any whose owner stopped renewing its lease, then a new one."""
        lease_ms = int(self.settings.lease_s * 1000)
        for p in range(self.store.partitions):
            res: Any = await self.store.redis.xautoclaim(
                self.store.jobs_key(p), JOBS_GROUP, self.worker_id, min_idle_time=lease_ms, start_id="0-0", count=1
            )
            for entry_id, fields in res[1]:
                if fields:
                    return p, entry_id.decode(), uuid.UUID(fields[b"sid"].decode())
        for group in self._groups:
            if group.task is None:
                group.task = asyncio.create_task(self._read_group(group))
                group.task.add_done_callback(functools.partial(self._on_poll_done, group))
        self._polling = True
        try:
            await asyncio.wait([g.task for g in self._groups if g.task is not None],
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._polling = False
        jobs: list[Job] = []
        error: BaseException | None = None
        for group in self._groups:
            task = group.task
            if task is None or not task.done():
                continue
            group.task = None
            if task.cancelled():
                continue
            if task.exception() is not None:
                error = error or task.exception()
                continue
            jobs.extend(task.result())
        if jobs:
            # A multi-key XREADGROUP COUNT 1 may bring one entry per stream, and polls of several slots
            # may end together: run one, hand the rest back.
            if len(jobs) > 1:
                self._spawn(self._hand_back(jobs[1:]))
            return jobs[0]
        if error is not None:
            raise error
        return None

    async def _read_group(self, group: _PollGroup) -> list[Job]:
        streams: dict[Any, Any] = dict.fromkeys(group.keys, ">")
        res: Any = await self.blocking.xreadgroup(JOBS_GROUP, self.worker_id, streams, count=1, block=POLL_BLOCK_MS)
        jobs: list[Job] = []
        for key, entries in res or []:
            p = group.keys[key.decode() if isinstance(key, bytes) else key]
            for entry_id, fields in entries:
                jobs.append((p, entry_id.decode(), uuid.UUID(fields[b"sid"].decode())))
        return jobs

    def _on_poll_done(self, group: _PollGroup, task: asyncio.Task[list[Job]]) -> None:
        """A poll ended while no ``_next_job`` waits for it (the worker is busy): hand back what it got."""
        if self._polling or group.task is not task:
            return  # _next_job collects it (or already did)
        group.task = None
        if task.cancelled() or task.exception() is not None:
            return  # the next poll retries; an entry a failed poll got is taken over after lease_s
        jobs = task.result()
        if jobs:
            self._spawn(self._hand_back(jobs))

    async def _hand_back(self, jobs: Iterable[Job]) -> None:
        """Make delivered, unstarted entries look long idle: the next XAUTOCLAIM (any worker's, this
        one's included) takes them at once, instead of after a lease."""
        for p, entry_id, _ in jobs:
            try:
                await self.store.redis.xclaim(self.store.jobs_key(p), JOBS_GROUP, self.worker_id, 0, [entry_id],
                                              idle=HAND_BACK_IDLE_MS, justid=True)
            except (RedisError, OSError) as e:  # it is still pending: taken over after lease_s
                log.warning("could not hand a job back: %s", e)

    async def _cancel_polls(self) -> None:
        tasks = [g.task for g in self._groups if g.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _ack(self, partition: int, entry_id: str) -> None:
        await self._retry(lambda: self.store.ack(partition, entry_id))

    async def _retry(self, op: Any) -> Any:
        """Run a Redis operation until it succeeds: the worker outlives Redis restarts."""
        backoff = Backoff()
        while True:
            try:
                return await op()
            except TRANSIENT as e:
                log.warning("redis unavailable, retrying: %s", e)
                await backoff.sleep()

    # -- running one job -----------------------------------------------------------------------

    async def _run_job(self, partition: int, entry_id: str, stream_id: uuid.UUID) -> None:
        claim = await self._retry(lambda: self.store.claim(stream_id, self.worker_id))
        if isinstance(claim, int):  # gone or already finished: nothing to do but drop the job
            await self._ack(partition, entry_id)
            return
        run = _Run(claim)
        log.info("claimed", extra={"stream_id": str(stream_id), "attempt": claim.attempts})
        if claim.attempts > self.settings.max_attempts:
            await self._finish_error(run, "worker_lost", f"gave up after {claim.attempts - 1} attempts",
                                     self._usage(0, claim.seq, None, None, None))
        elif claim.cancel_reason:
            await self._finish_cancelled(run, claim.cancel_reason, self._usage(0, claim.seq, None, None, None), 0.0)
        else:
            self._running[stream_id] = run
            self.metrics.running += 1
            try:
                await self._generate(run)
            finally:
                del self._running[stream_id]
                self.metrics.running -= 1
        if not run.fenced_out:
            await self._ack(partition, entry_id)

    async def _prefix_text(self, claim: Claim) -> tuple[str, bool]:
        """The answer so far (from an earlier attempt) and whether ``started`` was already sent."""
        text: list[str] = []
        started = False
        after: str | None = None
        while True:
            events = await self.store.read(claim.stream_id, after, count=1024)
            if not events:
                return "".join(text), started
            for ev in events:
                if ev.type == EventType.DELTA:
                    text.append(ev.json()["text"])
                elif ev.type == EventType.STARTED:
                    started = True
            after = events[-1].id

    async def _generate(self, run: _Run) -> None:
        claim = run.claim
        req = claim.request
        prefix, started = await self._retry(lambda: self._prefix_text(claim))
        if not started:
            res = await self._append_retrying(run, claim.seq, claim.seq, [started_event(self.engine.name)])
            if res is None:
                return
        loop = asyncio.get_running_loop()
        handoff = TokenHandoff(loop, self.settings.handoff_tokens)
        remaining = max(0, req.max_tokens - claim.seq)
        t_start = time.monotonic()
        gen_holder: list[Generation] = []

        def infer() -> None:
            try:
                gen = self.engine.start(req, prefix_text=prefix, max_tokens=remaining, stop=run.stop)
                gen.on_progress = handoff.progress
                gen_holder.append(gen)
                for piece in gen.pieces:
                    if not handoff.put(piece):
                        break
                handoff.close()
            except BaseException as e:  # handed to the loop, which ends the stream with `error`
                handoff.close(e)

        thread_done = asyncio.ensure_future(asyncio.to_thread(infer))
        renewer = asyncio.create_task(self._renew_lease(run))
        stops = StopFilter(req.stop)
        seq = claim.seq  # tokens counted in Redis (all attempts)
        tokens = claim.seq  # tokens generated (all attempts)
        first_token_at: float | None = None
        last_token_at: float | None = None
        deadline = self.settings.max_generation_s
        error: BaseException | None = None
        try:
            while True:
                timeout = None
                if deadline > 0:
                    timeout = max(0.0, t_start + deadline - time.monotonic())
                batch = await handoff.get(timeout_s=timeout if timeout is not None else 1.0)
                now = time.monotonic()
                if batch.progress is not None and not batch.pieces and not run.fenced_out:
                    processed, total = batch.progress
                    progress = [(EventType.PROGRESS, encode_data({"processed": processed, "prompt_tokens": total}))]
                    if await self._append_retrying(run, seq, seq, progress) is None:
                        break
                if batch.pieces:
                    if first_token_at is None:
                        first_token_at = now
                    last_token_at = now
                    tokens += len(batch.pieces)
                text = stops.feed("".join(batch.pieces))
                if stops.stopped:
                    run.stop.set()
                if batch.closed:
                    error = batch.error
                    if error is None and not run.stop.is_set():
                        text += stops.flush()
                if text and not run.fenced_out:
                    res = await self._append_retrying(run, seq, tokens, [delta(text)])
                    if res is None:
                        break
                    seq = tokens
                if run.cancel_reason or run.fenced_out:
                    run.stop.set()
                if deadline > 0 and now - t_start >= deadline and not batch.closed:
                    run.deadline_hit = True
                    run.stop.set()
                if batch.closed:
                    break
        finally:
            handoff.abandon()
            run.generation_over = True  # the renewer's own stop flag: cancellation alone can be swallowed
            renewer.cancel()
            await asyncio.gather(thread_done, return_exceptions=True)
            await asyncio.wait({renewer}, timeout=RENEWER_STOP_S)
        if run.fenced_out:
            log.warning("lost the lease; another worker owns the stream",
                        extra={"stream_id": str(claim.stream_id)})
            return
        if run.handing_over:
            released = await self._retry(lambda: self.store.release(claim, self.worker_id))
            log.info("handed the job over", extra={"stream_id": str(claim.stream_id), "released": released})
            run.fenced_out = True  # not ours to acknowledge any more
            return
        compute_s = time.monotonic() - t_start
        gen = gen_holder[0] if gen_holder else None
        usage = self._usage(gen.prompt_tokens if gen else 0, tokens, t_start, first_token_at, last_token_at)
        if run.cancel_reason and not stops.stopped:
            await self._finish_cancelled(run, run.cancel_reason, usage, compute_s)
        elif run.deadline_hit:
            await self._finish_error(run, "deadline", f"generation exceeded {deadline:g} s", usage, compute_s)
        elif error is not None:
            code = getattr(error, "code", "engine")
            log.error("engine failed: %s", type(error).__name__, extra={"stream_id": str(claim.stream_id)})
            await self._finish_error(run, code, str(error) or type(error).__name__, usage, compute_s)
        else:
            reason = "stop" if stops.stopped else (gen.finish_reason if gen else "stop")
            await self._finish(run, EventType.DONE, {"finish_reason": reason, "usage": usage}, "done", usage)

    async def _append_retrying(self, run: _Run, seq_before: int, seq_after: int,
                               events: Sequence[tuple[str, bytes]]) -> bool | None:
        """Append, surviving Redis outages. None when this worker no longer owns the stream."""
        backoff = Backoff()
        while True:
            try:
                res = await self._appender.append(run.claim, seq_before, seq_after, events)
            except TRANSIENT as e:
                log.warning("append failed, retrying: %s", e)
                await backoff.sleep()
                continue
            if res.ok:
                if res.cancel_reason and not run.cancel_reason:
                    run.cancel_reason = res.cancel_reason
                return True
            if res.seq is not None and res.seq == seq_after:
                return True  # an earlier try landed; its reply was lost
            if res.cancel_reason and not run.cancel_reason:
                run.cancel_reason = res.cancel_reason
            run.fenced_out = True
            return None

    async def _renew_lease(self, run: _Run) -> None:
        interval = max(0.05, self.settings.lease_s / 3)
        while not run.generation_over:
            await asyncio.sleep(interval)
            try:
                res = await self.store.renew(run.claim, self.worker_id, self.settings.disconnect_grace_s)
            except (RedisError, OSError):
                # redis-py may turn our own cancellation mid-command into a connection error: a cancelled
                # renewer must stop, or the job waits on it forever (renewed, never finished).
                task = asyncio.current_task()
                if run.generation_over or (task is not None and task.cancelling()):
                    raise asyncio.CancelledError from None
                continue
            if not res.ok:
                run.fenced_out = True
                run.stop.set()
                return
            if res.cancel_reason and not run.cancel_reason:
                run.cancel_reason = res.cancel_reason
                run.stop.set()

    async def _listen_for_cancels(self) -> None:
        """Cancel notices arrive here at once, even while prefill runs and nothing is appended. One pub/sub
        connection (one per master on a cluster) carries the control channels of every partition; it
        reconnects by itself, and a notice lost meanwhile is still seen at the next lease renewal."""

        def on_message(channel: bytes, data: bytes) -> None:
            with contextlib.suppress(ValueError):
                run = self._running.get(uuid.UUID(data.decode()))
                if run is not None:
                    self._spawn(self._check_cancel(run))

        channels = Channels(self.blocking, on_message=on_message, on_reset=lambda _: None)
        backoff = Backoff()
        try:
            await channels.start()
            n = self.store.partitions
            for p in range(n):
                while True:
                    try:
                        await channels.subscribe(control_channel(p, n).encode())
                        break
                    except (RedisError, OSError) as e:  # e.g. no slot map yet: the cluster is unreachable
                        log.warning("cancel listener cannot subscribe yet: %s", e)
                        await backoff.sleep()
            await asyncio.Event().wait()  # until cancelled at shutdown; the shards run on their own
        finally:
            await channels.stop()

    async def _check_cancel(self, run: _Run) -> None:
        try:
            res = await self.store.renew(run.claim, self.worker_id, self.settings.disconnect_grace_s)
        except (RedisError, OSError):
            return  # the renewal loop asks again within lease_s / 3
        if res.cancel_reason and not run.cancel_reason:
            run.cancel_reason = res.cancel_reason
            run.stop.set()

    # -- terminal events -----------------------------------------------------------------------

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int, t_start: float | None,
               first: float | None, last: float | None) -> dict[str, Any]:
        ttft_ms = None if first is None or t_start is None else round((first - t_start) * 1000, 3)
        tpot_ms = None
        if first is not None and last is not None and completion_tokens > 1 and last > first:
            tpot_ms = round((last - first) * 1000 / (completion_tokens - 1), 3)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "ttft_ms": ttft_ms, "tpot_ms": tpot_ms}

    async def _finish(self, run: _Run, etype: str, data: dict[str, Any], status: str, usage: dict[str, Any],
                      reason: str = "", compute_s: float = 0.0) -> None:
        eid = await self._retry(lambda: self.store.finish(
            run.claim, etype, data, status=status, usage=usage, model=self.engine.name, reason=reason,
            compute_s=compute_s))
        if eid is None:
            run.fenced_out = True
        else:
            self.metrics.finished(status, usage, max(0, int(usage.get("completion_tokens") or 0) - run.claim.seq))
        log.info("finished", extra={"stream_id": str(run.claim.stream_id), "status": status,
                                    "completion_tokens": usage.get("completion_tokens")})

    async def _finish_cancelled(self, run: _Run, reason: str, usage: dict[str, Any], compute_s: float) -> None:
        await self._finish(run, EventType.CANCELLED, {"reason": reason, "usage": usage}, "cancelled", usage,
                           reason, compute_s)

    async def _finish_error(self, run: _Run, code: str, message: str, usage: dict[str, Any],
                            compute_s: float = 0.0) -> None:
        await self._finish(run, EventType.ERROR, {"code": code, "message": message, "usage": usage}, "error",
                           usage, code, compute_s)
