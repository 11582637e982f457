"""What the consumer asks of rsb's streams: create a stream (and enqueue its job), start a held turn, read its status,
its stored request and its events (the replay, with the reset rule's reads), mark its readers, cancel it, and count
the queues. The generator's side is broker.streams.job_store; what both share, broker.streams.store_base."""

from __future__ import annotations

import contextlib
import math
import uuid
from collections.abc import Sequence
from typing import Any

import orjson

from broker.errors import (
    BudgetExceeded,
    Conflict,
    Expired,
    OverStorageQuota,
    QueueFull,
    RateLimited,
    StoreFull,
    TooManyGenerations,
    WebhookBacklog,
)
from broker.events import Event, EventPage, encode_data
from broker.redis.connection import RedisClient, reply_text
from broker.redis.keyspace import partition_share
from broker.redis.quota import NO_STORAGE_QUOTA, StorageQuota, storage_key
from broker.redis.server_clock import ServerClock
from broker.request import tiers
from broker.request.generation import GenerationRequest
from broker.streams import replication, scripts
from broker.streams.budget import NO_BUDGET, Budget, price_field, reservation, usd_reservation
from broker.streams.keys import budget_key, queue_stats_key, tenant_of
from broker.streams.records import NO_QUOTA, Created, Quota, ReplayPage, StreamStatus, empty_usage
from broker.streams.replies import CreateReply, TaggedReply, TraceLink
from broker.streams.store_base import POSITION_UPDATES, StoreBase
from broker.streams.usage import RETENTION_S as USAGE_RETENTION_S
from broker.streams.usage import Price

# Streams touched per script call: bounds one call's time inside Redis (a script blocks the server).
TOUCH_BATCH = 500
# A create refused for its caller's pending webhook events: about one try of a failing receiver later.
WEBHOOK_BACKLOG_RETRY_S = 30
# The meta fields a status reads (StreamStatus).
STATUS_FIELDS = ("status", "model", "created_at", "usage", "last_id", "cod", "max_tokens", "key_id", "abandon_s",
                 "tier", "held")


class StreamStore(StoreBase):
    """A stream's life as the consumer (the API pod) sees it, in Redis."""

    def __init__(self, redis: RedisClient, partitions: int = 1, *, durability_level: str = replication.LOCAL,
                 replica_wait_ms: int = 1000, replica_patience_s: float | None = None,
                 gate: replication.ReplicaGate | None = None) -> None:
        super().__init__(redis, partitions, durability_level=durability_level, replica_wait_ms=replica_wait_ms,
                         replica_patience_s=replica_patience_s, gate=gate)
        #: The Redis server's time for what the pod names before a script runs (and the consumer's views state).
        self.clock = ServerClock.of(redis, partitions)
        self._create = self._register(scripts.CREATE)
        self._unhold = self._register(scripts.UNHOLD)
        self._cancel = self._register(scripts.CANCEL)
        self._touch = self._register(scripts.TOUCH)

    async def create(
        self,
        stream_id: uuid.UUID,
        request: GenerationRequest,
        *,
        model: str,
        max_queue: int,
        tier: str = tiers.DEFAULT,
        retention_s: int,
        abandon_after_s: float = 0.0,
        key_id: str = "",
        quota: Quota = NO_QUOTA,
        max_queue_wait_s: float = 0.0,
        storage: StorageQuota = NO_STORAGE_QUOTA,
        budget: Budget = NO_BUDGET,
        team_budget: Budget = NO_BUDGET,
        price: Price | None = None,
        webhook: tuple[str, str] | None = None,
        usage_retention_s: int = USAGE_RETENTION_S,
        max_pending_hooks: int = 0,
        trace: str = "",
        identity: str | None = None,
        held: dict[str, Any] | None = None,
        workers: int | None = None,
    ) -> Created:
        """Create the stream and enqueue its job in ``model``'s queue (a served model's name: the consumer resolved
        the request's) in ``tier`` (broker.request.tiers), or recognise a retry of the same request (which no limit
        refuses). Raises Conflict (same id, other request), Expired, RateLimited, TooManyGenerations (the
        caller's ``quota``) or QueueFull: ``max_queue`` queued generations (0: no bound; like the quota,
        each partition holds ceil(max_queue / P) of them), or an estimated wait over ``max_queue_wait_s``
        (waiting jobs x average job time / running jobs; 0: no bound; no estimate before a job finished), or
        BudgetExceeded: the key's ``budget`` or its team's ``team_budget`` cannot hold this create's worst case
        (broker.streams.budget; in money at ``price``, its model's in its tier), or WebhookBacklog: it has a
        ``webhook`` and its caller ``max_pending_hooks`` webhook events pending (0: no bound; each partition holds its
        share). ``webhook``: (URL, the id its event names) where the end is POSTed (broker.streams.outbox);
        ``usage_retention_s``: how long its usage record is kept (broker.streams.usage). ``trace``: the create span's
        W3C traceparent, stored with the stream for its generation's spans (broker.telemetry). ``held``: the stream is
        a conversation's turn that waits for the one before it (broker.request.on_busy), and this is its ``queued``
        event's data: its job gets into its line at ``unhold``. ``identity``: what a retry of this id must match
        (default: the request's hash). ``workers``: the generators serving ``model`` now
        (broker.streams.served_models), told in the ``queued`` event (None: not)."""
        k = self.keys(stream_id)
        max_active, burst, interval_ms = quota.share(self.partitions)
        queue_share = partition_share(max_queue, self.partitions)
        tenant = quota.tenant or tenant_of(key_id, "")
        # A budget period's name is part of its key, named before the script runs (on Redis Cluster a script is
        # routed by its keys): the server's time as this pod carries it (broker.redis.server_clock), so pods whose
        # clocks disagree count a create near a period's end in the same period.
        now = await self.clock.now()
        period, period_end = budget.window(now)
        team_period, team_period_end = team_budget.window(now)
        canonical = request.canonical_json()
        tokens = reservation(canonical, request.max_tokens)
        usd = usd_reservation(price, canonical, request.max_tokens)
        key_budget = budget_key(k.partition, k.partitions, key_id, period)
        q = k.queue(model)
        script = scripts.CREATE
        res = await self._call(
            k, self._create,
            script.keys({"meta": k.meta, "events": k.events, "totals": k.queue_stats, "stats": q.stats,
                         "backlog": q.backlog, "tombstone": k.tombstone, "tenant": k.tenant_counters(tenant),
                         "storage": storage_key(k.partition, k.partitions, storage.tenant or tenant),
                         "budget": key_budget,
                         "team_budget": budget_key(k.partition, k.partitions, team_budget.holder, team_period)
                         if team_budget.bounded else key_budget}),
            script.args({
                "sid": str(stream_id), "rh": identity or request.request_hash(), "req": canonical,
                "max_queue": queue_share, "model": model, "max_tokens": request.max_tokens, "channel": k.channel,
                "key_id": key_id, "retention_s": retention_s, "abandon_s": abandon_after_s,
                "cod": int(request.cancel_on_disconnect), "max_active": max_active, "burst": burst,
                "interval_ms": interval_ms, "max_wait_s": max_queue_wait_s, "keep": int(request.history is not None),
                "storage_share": storage.share(self.partitions), "affinity": request.affinity(tenant),
                "budget_share": budget.share(self.partitions), "usd_share": budget.usd_share(self.partitions),
                "team_share": team_budget.share(self.partitions),
                "team_usd_share": team_budget.usd_share(self.partitions), "reservation": tokens,
                "usd_reservation": usd, "price": price_field(price), "period_end": f"{period_end:.0f}",
                "team_period_end": f"{team_period_end:.0f}",
                "hook": (webhook or ("", ""))[0], "hid": (webhook or ("", ""))[1], "qp": q.prefix, "tier": tier,
                "who": tenant or "-", "position_updates": POSITION_UPDATES, "usage_retention_s": usage_retention_s,
                "max_hooks": partition_share(max_pending_hooks, self.partitions),
                "trace": trace, "held": encode_data(held) if held is not None else "",
                "workers": "" if workers is None else workers}),
            lambda r: "" if CreateReply.read(r).tag == "created" else None)
        reply = CreateReply.read(res)
        tag = reply.tag
        if tag == "created":
            return Created(True, "queued")
        if tag == "exists":
            return Created(False, reply.detail)
        if tag == "conflict":
            raise Conflict("a stream with this id exists with a different request")
        if tag == "expired":
            raise Expired("a stream with this id existed and expired; use a new id")
        if tag == "storage_quota":
            raise OverStorageQuota(storage.quota_bytes, self.partitions, storage.share(self.partitions))
        if tag == "webhook_backlog":
            raise WebhookBacklog(f"this caller has {reply.detail} webhook events its receiver has not taken yet "
                                 f"(at most {max_pending_hooks}, --webhook-max-pending); creates with a webhook wait "
                                 "until some are delivered", retry_after_s=WEBHOOK_BACKLOG_RETRY_S)
        if tag == "budget_exceeded":
            over = team_budget if reply.detail == "team" else budget
            raise BudgetExceeded(over.refusal(reply.over, self.partitions, tokens, usd),
                                 retry_after_s=over.retry_after_s(now))
        ema, busy = reply.ema_job_s, reply.busy
        if tag == "rate_limited":
            raise RateLimited(f"too many creates from this caller (a burst of {quota.burst}, then "
                              f"{quota.rate_per_s:g} per second)",
                              retry_after_s=max(1, math.ceil(int(reply.detail) / 1000)))
        if tag == "too_many_generations":
            raise TooManyGenerations(f"this caller has as many unfinished generations as it may ({quota.max_active})",
                                     retry_after_s=retry_after_s(1, ema, busy))
        assert tag == "queue_full", tag
        waiting = int(reply.detail)
        if reply.bound == "wait":
            assert ema is not None
            allowed = math.floor(max_queue_wait_s * max(1, busy) / ema) if ema > 0 else waiting
            raise QueueFull(f"the generation queue is full (the estimated wait of {waiting} waiting "
                            f"generations exceeds {max_queue_wait_s:g} s)",
                            retry_after_s=retry_after_s(waiting - allowed + 1, ema, busy))
        raise QueueFull(f"the generation queue is full ({waiting} waiting)",
                        retry_after_s=retry_after_s(waiting - queue_share + 1, ema, busy))

    async def status(self, stream_id: uuid.UUID) -> StreamStatus | None:
        k = self.keys(stream_id)
        # ``cod``, not the stored request: a status (every resume makes one) must not parse a prompt of up to
        # --max-prompt-chars to read one flag that CREATE stores apart.
        raw = dict(zip(STATUS_FIELDS, await self._batch.execute("HMGET", k.meta, *STATUS_FIELDS), strict=True))
        if raw["status"] is None:
            return None
        return StreamStatus(
            status=reply_text(raw["status"]),
            model=reply_text(raw["model"]),
            created_at=float(raw["created_at"] or 0),
            usage=orjson.loads(raw["usage"]) if raw["usage"] else None,
            last_id=reply_text(raw["last_id"]) or None,
            cancel_on_disconnect=reply_text(raw["cod"]) == "1",
            max_tokens=int(raw["max_tokens"] or 0),
            key_id=reply_text(raw["key_id"]),
            abandon_s=float(raw["abandon_s"] or 0),
            tier=reply_text(raw["tier"]),
            held=reply_text(raw["held"]) == "1",
        )

    async def trace_of(self, stream_id: uuid.UUID) -> TraceLink:
        """The stream's stored traceparent ('': not traced) and model: what a read's span links to."""
        tp, model = await self._batch.execute("HMGET", self.keys(stream_id).meta, "tp", "model")
        return TraceLink(reply_text(tp), reply_text(model))

    async def unhold(self, stream_id: uuid.UUID, model: str, request: GenerationRequest) -> bool:
        """Start a held turn (``create``'s ``held``) with ``request`` (its conversation's history in front of its
        messages): its job gets into its line, once. False: it was not held (started already, or cancelled)."""
        k = self.keys(stream_id)
        q = k.queue(model)
        script = scripts.UNHOLD
        res = await self._call(
            k, self._unhold,
            script.keys({"meta": k.meta, "events": k.events, "totals": k.queue_stats, "stats": q.stats,
                         "backlog": q.backlog}),
            script.args({"sid": str(stream_id), "req": request.canonical_json(), "channel": k.channel,
                         "position_updates": POSITION_UPDATES}),
            lambda r: "" if TaggedReply.read(r).tag == "started" else None)
        return TaggedReply.read(res).tag == "started"

    async def request_of(self, stream_id: uuid.UUID) -> GenerationRequest | None:
        """The request as stored at create (None: no such stream, or one that ended and kept only its digest)."""
        raw = await self.redis.hget(self.keys(stream_id).meta, "req")
        if raw is None:
            return None
        return GenerationRequest.from_canonical(raw.encode() if isinstance(raw, str) else raw)

    async def replay(self, stream_id: uuid.UUID, after_id: str | None, count: int, *, check: bool) -> ReplayPage:
        """What a reader reads of its range: up to ``count`` readable events after ``after_id`` (None: from the
        start). ``check``: first make sure ``after_id`` is still in the stream (the reset rule), one round trip
        unless it is gone (then a second finds the newest event at or before it)."""
        if not check or after_id is None:
            return ReplayPage(await self.read(stream_id, after_id, count=count))
        events, found = await self._read_after(stream_id, after_id, count)
        if found:
            return ReplayPage(events)
        return ReplayPage((), reset=True, common=await self._last_common_id(stream_id, after_id))

    async def _read_after(self, stream_id: uuid.UUID, after_id: str, count: int) -> tuple[Sequence[Event], bool]:
        """Up to ``count`` readable events after ``after_id``, and whether ``after_id`` is in the stream (the
        reset rule: consumer.streaming.reader). One round trip: the range starts AT ``after_id`` (inclusive)
        and drops it when it is there; at ``replicated``, the gate's script reads up to the watermark."""
        k = self.keys(stream_id)
        if self.gate is not None:
            return await self.gate.read(k, after_id, count, check=True)
        events = EventPage(await self._xrange(k.events, after_id, count + 1))
        if events and events[0].id == after_id:
            return events[1:], True
        return events[:count], False

    async def _last_common_id(self, stream_id: uuid.UUID, after_id: str) -> str | None:
        """The newest event id of the stream that is not newer than ``after_id`` (None: no such event)."""
        entries: Any = await self.redis.xrevrange(self.keys(stream_id).events, max=after_id, min="-", count=1)
        return reply_text(entries[0][0]) if entries else None

    async def last_event_id(self, stream_id: uuid.UUID) -> str | None:
        """The id of the stream's latest event readers may see (None: no events)."""
        if self.gate is not None:
            return await self.gate.watermark(self.keys(stream_id))
        entries: Any = await self.redis.xrevrange(self.keys(stream_id).events, count=1)
        return reply_text(entries[0][0]) if entries else None

    async def expired(self, stream_id: uuid.UUID) -> bool:
        """Whether this id belonged to a stream that ended and passed its retention (410, not 404)."""
        return bool(await self.redis.exists(self.keys(stream_id).tombstone))

    async def touch(self, stream_ids: Sequence[uuid.UUID]) -> None:
        """Record that these streams have a reader connected now (for abandon / cancel_on_disconnect).
        One script call per partition (its keys share a slot), whatever the number of streams."""
        by_partition: dict[int, list[str]] = {}
        for sid in stream_ids:
            k = self.keys(sid)
            by_partition.setdefault(k.partition, []).append(k.meta)
        for metas in by_partition.values():
            for i in range(0, len(metas), TOUCH_BATCH):
                # Redis full: a mark is advisory (the next round makes it), and readers must go on reading.
                with contextlib.suppress(StoreFull):
                    await self._touch(keys=metas[i:i + TOUCH_BATCH], args=scripts.TOUCH.args({}))

    async def cancel(self, stream_id: uuid.UUID, reason: str) -> str | None:
        """Request a cancel. Returns the status after the request (None: unknown stream)."""
        k = self.keys(stream_id)
        usage = orjson.dumps(empty_usage())
        data = encode_data({"reason": reason, "usage": empty_usage()})
        script = scripts.CANCEL
        res = await self._call(
            k, self._cancel,
            script.keys({"meta": k.meta, "events": k.events, "totals": k.queue_stats, "usage_index": k.usage_index,
                         "tombstone": k.tombstone, "aborted_totals": k.aborted_totals, "outbox": k.outbox,
                         "outbox_dests": k.outbox_dests, "outbox_holds": k.outbox_holds,
                         "usage_rollups_since": k.usage_rollups_since}),
            script.args({"reason": reason, "channel": k.channel, "cancelled_data": data, "usage": usage,
                         "control_channel": k.control, "sid": str(stream_id),
                         "usage_prefix": k.usage_prefix}),
            lambda r: "" if TaggedReply.read(r).tag in ("ended", "cancelled") else None)  # nothing comes after those
        reply = TaggedReply.read(res)
        if reply.tag == "unknown":
            return None
        return "cancelled" if reply.tag == "cancelled" else reply.value

    async def waiting(self) -> int:
        """Streams enqueued and not yet claimed, over all partitions and models."""
        total = 0
        for p in range(self.partitions):
            total += int(await self.redis.hget(queue_stats_key(p, self.partitions), "waiting") or 0)
        return total

    async def backlog(self, model: str) -> dict[str, int]:
        """``model``'s queued jobs per tier, over all partitions."""
        out = dict.fromkeys(tiers.TIERS, 0)
        for p in range(self.partitions):
            raw = await self.redis.hmget(self.queue(p, model).stats, [f"waiting:{t}" for t in tiers.TIERS])
            for tier, n in zip(tiers.TIERS, raw, strict=True):
                out[tier] += int(n or 0)
        return out

    async def running(self, model: str) -> int:
        """``model``'s jobs claimed and not finished, over all partitions."""
        return sum([int(await self.redis.hget(self.queue(p, model).stats, "busy") or 0)
                    for p in range(self.partitions)])


def retry_after_s(behind: int, ema_job_s: float | None, busy: int) -> int:
    """When a rejected create may succeed: the time for ``behind`` jobs to leave the queue at the observed
    rate (a moving average of job time over the running workers), between 1 s and 60 s."""
    if ema_job_s is None:
        return 5
    return max(1, min(60, math.ceil(behind * ema_job_s / max(1, busy))))


