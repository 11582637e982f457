"""Where a worker finds its next job: its model's queue in every partition (broker.streams.queue_scripts), and how
it waits when there is none. Also its aliases' queues: a create that named an alias (or fell to a
``--default-model`` that is one) while no generator announced it could not be resolved to the model, and waits
under the name it gave.

A claim is one script call per partition, tried from a partition that turns with each claim (so no partition's
jobs wait behind another's), and the first that claims wins: the script itself takes what is due first (a job
left for this worker, a lapsed lease, a left job whose wait is over) and then the next job in line, tiers in
order and tenants in turn. A worker never holds a job it has not claimed, and a claimed job it cannot start after
all goes back to the front of its line (``JobStore.give_back``). A claim whose reply was lost (its script ran, the
link failed) is asked again with its token, which gets the same job back (QueueKeys.receipt): never a job held
by no one until its lease lapses.

Idle, a worker blocks on wake tokens (BLPOP): each enqueue pushes one on its queue, so one new job wakes one idle
worker, and a job left for this worker pushes one on its own list. All partitions' lists in one call on a
standalone server; one call per hash slot on Redis Cluster (a multi-key command stays in one slot), raced. A
wait never outlasts the next lease or left job falling due (the claim script says when) nor POLL_BLOCK_S, so a
crashed worker's job is taken over within about a lease, and a lost token costs at most one block.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from broker.errors import StoreTransient
from broker.redis.connection import LONGEST_BLOCK_S, RedisClient
from broker.redis.keyspace import partition_slot
from broker.streams.job_store import JobStore
from broker.streams.records import Claim

log = logging.getLogger("rsb.generator")

# A wait stays within LONGEST_BLOCK_S (the blocking client's socket timeout, which notices a dead link under it, is
# that plus a command's) and bounds how long shutdown waits for it.
POLL_BLOCK_S = 2.0
assert POLL_BLOCK_S <= LONGEST_BLOCK_S
# How long a partition whose shard failed a claim is passed over (its jobs wait for the shard in any case).
AWAY_S = 1.0


class JobPoller:
    def __init__(self, store: JobStore, blocking: RedisClient, worker_id: str, models: tuple[str, ...],
                 lease_s: float, *, aging_s: float = 0.0, affinity_wait_s: float = 0.0) -> None:
        self.store = store
        self.blocking = blocking  # BLPOP: no socket timeout
        self.worker_id = worker_id
        self.models = tuple(dict.fromkeys(models))  # the model's name first, then its aliases
        self.lease_s = lease_s
        self.aging_s = aging_s
        # Never past the lease: a left job must fall due before its owner's silence would.
        self.affinity_wait_s = min(affinity_wait_s, lease_s)
        self._start = 0  # the partition the next claim tries first
        self._due_s: float | None = None  # when, after the last empty claim, something falls due
        self._away_until: dict[int, float] = {}  # partitions whose shard failed a claim: passed over until then
        self._tokens: dict[tuple[int, str], str] = {}  # the token of each queue's claim that failed (its reply lost?)
        by_slot: dict[int, list[str]] = {}
        self._partition_of: dict[str, int] = {}
        for model in self.models:
            for p, keys in store.wake_keys(model, worker_id).items():
                by_slot.setdefault(partition_slot(p, store.partitions) if store.cluster else 0, []).extend(keys)
                for key in keys:
                    self._partition_of[key] = p
        self._wake_groups = list(by_slot.values())

    async def claim(self) -> Claim | None:
        """The next job of this worker's model, claimed (None: nothing to claim now). A partition whose shard is
        away (Redis Cluster: a primary down, a failover) is passed over for AWAY_S, so the others' jobs go on; with
        every partition away the error is raised, for the worker to wait it out."""
        n = self.store.partitions
        due: float | None = None
        now = time.monotonic()
        ready = [p for p in ((self._start + i) % n for i in range(n)) if self._away_until.get(p, 0.0) <= now]
        error: StoreTransient | None = None
        for p in ready or [(self._start + i) % n for i in range(n)]:
            try:
                for model in self.models:
                    # A try that failed keeps its token for the queue's next one: its script may have run and
                    # claimed a stream whose reply was lost, which the same token gets back (QueueKeys.receipt).
                    token = self._tokens.setdefault((p, model), uuid.uuid4().hex)
                    got = await self.store.claim_next(model, p, self.worker_id, lease_s=self.lease_s,
                                                      aging_s=self.aging_s, affinity_wait_s=self.affinity_wait_s,
                                                      token=token)
                    del self._tokens[(p, model)]
                    if isinstance(got, Claim):
                        self._start = (p + 1) % n
                        return got
                    if got is not None:
                        due = got if due is None else min(due, got)
            except StoreTransient as e:
                self._away_until[p] = time.monotonic() + AWAY_S
                error = error or e
                continue
            self._away_until.pop(p, None)
        if error is not None and len(self._away_until) >= n:
            raise error
        self._due_s = due if error is None else min(due or AWAY_S, AWAY_S)
        return None

    async def wait(self) -> None:
        """Until a job may be there: a wake token, something falling due, or POLL_BLOCK_S. The next claim starts
        at the partition that woke."""
        timeout = POLL_BLOCK_S if self._due_s is None else min(POLL_BLOCK_S, self._due_s + 0.005)
        if timeout <= 0.005:
            return
        if len(self._wake_groups) == 1:
            woke = await self.store.wait_for_jobs(self.blocking, self._wake_groups[0], timeout)
        else:
            woke = await self._wait_any(block_s=timeout)
        if woke is not None:
            self._start = self._partition_of.get(woke, self._start)

    async def _wait_any(self, block_s: float) -> str | None:
        """One wait per hash slot, raced: the first token or timeout ends them all. A slot whose shard is away
        fails its wait at once; the others go on waiting (raised only when every one failed)."""
        pending = {asyncio.ensure_future(self.store.wait_for_jobs(self.blocking, keys, block_s))
                   for keys in self._wake_groups}
        error: BaseException | None = None
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if t.exception() is None:
                        return t.result()  # a key that woke, or None: the timeout
                    error = error or t.exception()
        finally:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        assert error is not None
        raise error
