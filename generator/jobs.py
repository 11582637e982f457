"""Where a worker finds its next job: jobs whose owner stopped renewing its lease first (XAUTOCLAIM), then
new ones from the partitions' job streams (XREADGROUP through the ``generators`` consumer group).

Polling: one blocking XREADGROUP per group of job streams that share a hash slot: all of them in one
call on a standalone server, one call per partition on Redis Cluster (a multi-key command must stay in
one slot). The polls of a cluster run side by side and outlive one ``next_job`` call; an entry that a
poll brings when this worker cannot start it is handed back at once (made look idle for longer than any
lease), so the next XAUTOCLAIM, by any worker, takes it: a worker keeps no job it has not started.

Chat-affine claiming: a job whose chat another worker ran last is left for that worker for at most
``affinity_wait_s`` after its creation (broker.streams.scripts.DEFER: it goes to that worker's inbox, which
that worker's polls read with the job streams), and the jobs a worker finds in its own inbox are its to take
if nobody claimed them meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from broker.errors import StoreUnavailable
from broker.redis.connection import RedisClient
from broker.redis.keyspace import partition_slot
from broker.streams.records import Job
from broker.streams.store import Store

log = logging.getLogger("rsb.generator")

# XREADGROUP BLOCK stays well under any socket timeout and bounds how long shutdown waits for the poll.
POLL_BLOCK_MS = 2000

Spawn = Callable[[Coroutine[Any, Any, None]], None]


@dataclass(slots=True)
class _PollGroup:
    """Job streams read by one XREADGROUP: all partitions on a standalone server; on a cluster, those
    whose keys share one hash slot (usually one partition)."""

    keys: dict[str, int]  # jobs key -> partition
    task: asyncio.Task[list[Job]] | None = None


class JobPoller:
    def __init__(self, store: Store, blocking: RedisClient, worker_id: str, lease_s: float, spawn: Spawn,
                 affinity_wait_s: float = 0.0) -> None:
        self.store = store
        self.blocking = blocking  # XREADGROUP BLOCK: no socket timeout
        self.worker_id = worker_id
        self.lease_ms = int(lease_s * 1000)
        # Never past the lease: a left job is made look idle for (lease - what is left of the wait).
        self.affinity_wait_ms = min(int(affinity_wait_s * 1000), self.lease_ms)
        self._spawn = spawn
        self._groups = self._poll_groups()
        self._polling = False  # a next_job call is waiting for the polls

    def _poll_groups(self) -> list[_PollGroup]:
        n = self.store.partitions
        by_slot: dict[int, dict[str, int]] = {}
        for p in range(n):
            keys = by_slot.setdefault(partition_slot(p, n) if self.store.cluster else 0, {})
            keys[self.store.jobs_key(p)] = p
            if self.affinity_wait_ms > 0:
                keys[self.store.affinity.inbox_key(p, self.worker_id)] = p
        return [_PollGroup(keys) for keys in by_slot.values()]

    async def _accept(self, job: Job) -> Job | None:
        """The job to run, or None: left for the worker that holds its chat, or (from the inbox) already
        claimed by another."""
        if job.inbox_entry:
            return await self.store.affinity.take(job, self.worker_id)
        if await self.store.affinity.defer(job, self.worker_id, self.affinity_wait_ms, self.lease_ms):
            return None
        return job

    async def next_job(self) -> Job | None:
        """A job to run: first any whose owner stopped renewing its lease, then a new one (None: the polls
        timed out with nothing)."""
        for p in range(self.store.partitions):
            if self.affinity_wait_ms > 0:
                # Its group: the inbox expires when unused.
                await self.store.affinity.ensure_inbox(p, self.worker_id)
            job = await self.store.reclaim_stale_job(p, self.worker_id, self.lease_ms)
            if job is not None and (job := await self._accept(job)) is not None:
                return job
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
        for i, job in enumerate(jobs):
            # A multi-key XREADGROUP COUNT 1 may bring one entry per stream, and polls of several slots
            # may end together: run one, hand the rest back.
            accepted = await self._accept(job)
            if accepted is not None:
                if jobs[i + 1:]:
                    self._spawn(self.hand_back(jobs[i + 1:]))
                return accepted
        if error is not None:
            raise error
        return None

    async def _read_group(self, group: _PollGroup) -> list[Job]:
        return await self.store.read_new_jobs(self.blocking, group.keys, self.worker_id, POLL_BLOCK_MS)

    def _on_poll_done(self, group: _PollGroup, task: asyncio.Task[list[Job]]) -> None:
        """A poll ended while no ``next_job`` waits for it (the worker is busy): hand back what it got."""
        if self._polling or group.task is not task:
            return  # next_job collects it (or already did)
        group.task = None
        if task.cancelled() or task.exception() is not None:
            return  # the next poll retries; an entry a failed poll got is taken over after lease_s
        jobs = task.result()
        if jobs:
            self._spawn(self.hand_back(jobs))

    async def hand_back(self, jobs: Iterable[Job]) -> None:
        """Make delivered, unstarted entries look long idle: the next XAUTOCLAIM (any worker's, this
        one's included) takes them at once, instead of after a lease."""
        for job in jobs:
            try:
                if job.inbox_entry:  # its job goes to any worker once its wait is over
                    await self.store.affinity.drop_inbox_entry(job, self.worker_id)
                else:
                    await self.store.hand_back(job, self.worker_id)
            except StoreUnavailable as e:  # it is still pending: taken over after lease_s
                log.warning("could not hand a job back: %s", e)

    async def cancel_polls(self) -> None:
        tasks = [g.task for g in self._groups if g.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
