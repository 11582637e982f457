"""Typed operations on streams and jobs: the only module that talks to Redis about them.

Every change to a stream and its job (create, claim, append, finish, cancel, renew, release, give back, touch) is
one Lua script of broker.streams.scripts or broker.streams.queue_scripts, so each is atomic. Reads (status, events,
the stored request, queue counts) and the idle workers' wait (BLPOP on wake tokens) are plain commands, made here
too, so that no other module names a Redis key or a command.

Long because it is that one place for every operation on a stream and its job, every script's call and the
reading of its reply, and every read (noting which worker holds a chat is apart, in broker.streams.affinity);
splitting it would split the schema it keeps consistent.
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from broker import tiers
from broker.errors import (
    BudgetExceeded,
    Conflict,
    Expired,
    OverStorageQuota,
    QueueFull,
    RateLimited,
    StoreFull,
    StoreUnavailable,
    TooManyGenerations,
    WebhookBacklog,
)
from broker.events import Event, EventPage, EventType, encode_data
from broker.redis.batching import CommandBatcher
from broker.redis.connection import (
    RAW_ENTRIES,
    RedisClient,
    evalsha_many,
    is_cluster,
    register_script,
    reply_text,
    xrange_raw,
)
from broker.redis.keyspace import partition_share
from broker.redis.lua import Lua, record
from broker.redis.quota import NO_STORAGE_QUOTA, StorageQuota, storage_key
from broker.request import GenerationRequest
from broker.streams import queue_scripts, replication, scripts
from broker.streams.affinity import ChatAffinity
from broker.streams.budget import NO_BUDGET, Budget, price_field, reservation, usd_reservation
from broker.streams.keys import (
    QueueKeys,
    StreamKeys,
    affinity_key,
    budget_key,
    principal,
    queue_stats_key,
    stream_key_prefix,
)
from broker.streams.records import (
    NO_QUOTA,
    AppendResult,
    Claim,
    Created,
    Quota,
    ReplayPage,
    StreamStatus,
    Unclaimable,
    empty_usage,
)
from broker.streams.usage import RETENTION_S as USAGE_RETENTION_S
from broker.streams.usage import Price

# Waiting streams whose `queued` position is refreshed on each claim (bounds the claim script's work).
POSITION_UPDATES = 32
# Streams touched per script call: bounds one call's time inside Redis (a script blocks the server).
TOUCH_BATCH = 500
# Streams per APPEND_MANY call: bounds one call's time inside Redis (a few ms at most).
APPEND_MANY_STREAMS = 256
# A create refused for its caller's pending webhook events: about one try of a failing receiver later.
WEBHOOK_BACKLOG_RETRY_S = 30
# Claims whose APPEND_MANY arguments are kept encoded (a worker's generations in flight, with room to spare).
APPEND_HEADS = 4096


class Store:
    """What both roles do to Redis. Holds no state beyond the client and the registered scripts.

    Works unchanged on a standalone server and on Redis Cluster (``redis`` a RedisCluster): every call
    touches the keys of one partition, i.e. one hash slot, except the per-partition loops below."""

    def __init__(self, redis: RedisClient, partitions: int = 1, *, durability_level: str = replication.LOCAL,
                 replica_wait_ms: int = 1000, replica_patience_s: float | None = None) -> None:
        self.redis = redis
        self.partitions = partitions
        self.cluster = is_cluster(redis)
        # The reads every attaching reader makes (status, replay) go out in shared pipelines (a reconnect storm
        # makes thousands at once: broker.redis.batching).
        self._batch = CommandBatcher(redis)
        replicated = durability_level == replication.REPLICATED
        # replicated: events become visible (published, readable) only once a replica has them.
        self.gate = replication.ReplicaGate(redis, wait_ms=replica_wait_ms,
                                           patience_s=replica_patience_s) if replicated else None

        def register(script: Lua) -> Any:
            return register_script(redis, replication.prepare(script.text, replicated=replicated))

        self._create = register(scripts.CREATE)
        self._unhold = register(scripts.UNHOLD)
        self._claim = register(queue_scripts.CLAIM)
        self._claim_next = register(queue_scripts.CLAIM_NEXT)
        self._give_back = register(queue_scripts.GIVE_BACK)
        self._append = register(scripts.APPEND)
        self._append_many = register(scripts.APPEND_MANY)
        self._append_heads: dict[int, tuple[Claim, tuple[bytes, bytes, bytes, bytes]]] = {}
        self._finish = register(scripts.FINISH)
        self._cancel = register(scripts.CANCEL)
        self._renew = register(queue_scripts.RENEW)
        self._release = register(queue_scripts.RELEASE)
        self._touch = register(scripts.TOUCH)
        self._wasted = register(scripts.WASTED)
        self.affinity = ChatAffinity(redis, partitions)

    def queue(self, partition: int, model: str) -> QueueKeys:
        return QueueKeys(partition, self.partitions, model)

    def keys(self, stream_id: uuid.UUID) -> StreamKeys:
        return StreamKeys.of(stream_id, self.partitions)

    # -- consumer side -------------------------------------------------------------------------

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
        the request's) in ``tier`` (broker.tiers), or recognise a retry of the same request (which no limit
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
        a conversation's turn that waits for the one before it (broker.on_busy), and this is its ``queued`` event's
        data: its job gets into its line at ``unhold``. ``identity``: what a retry of this id must match (default:
        the request's hash). ``workers``: the generators serving ``model`` now
        (broker.streams.served_models), told in the ``queued`` event (None: not)."""
        k = self.keys(stream_id)
        max_active, burst, interval_ms = quota.share(self.partitions)
        queue_share = partition_share(max_queue, self.partitions)
        who = quota.principal or principal(key_id, "")
        # The one pod clock a create reads: a budget period's name is part of its key, which is named before the
        # script runs (on Redis Cluster a script is routed by its keys). A pod off by a minute counts a create made
        # within that minute of a period's end in the neighbouring period; every other time is the server's.
        now = time.time()
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
                         "backlog": q.backlog, "tombstone": k.tombstone, "tenant": k.tenant(who),
                         "storage": storage_key(k.partition, k.partitions, storage.principal or who),
                         "budget": key_budget,
                         "team_budget": budget_key(k.partition, k.partitions, team_budget.holder, team_period)
                         if team_budget.bounded else key_budget}),
            script.args({
                "sid": str(stream_id), "rh": identity or request.request_hash(), "req": canonical,
                "max_queue": queue_share, "model": model, "max_tokens": request.max_tokens, "channel": k.channel,
                "key_id": key_id, "retention_s": retention_s, "abandon_s": abandon_after_s,
                "cod": int(request.cancel_on_disconnect), "max_active": max_active, "burst": burst,
                "interval_ms": interval_ms, "max_wait_s": max_queue_wait_s, "keep": int(request.history is not None),
                "storage_share": storage.share(self.partitions), "affinity": request.affinity(who),
                "budget_share": budget.share(self.partitions), "usd_share": budget.usd_share(self.partitions),
                "team_share": team_budget.share(self.partitions),
                "team_usd_share": team_budget.usd_share(self.partitions), "reservation": tokens,
                "usd_reservation": usd, "price": price_field(price), "period_end": f"{period_end:.0f}",
                "team_period_end": f"{team_period_end:.0f}",
                "hook": (webhook or ("", ""))[0], "hid": (webhook or ("", ""))[1], "qp": q.prefix, "tier": tier,
                "who": who or "-", "position_updates": POSITION_UPDATES, "usage_retention_s": usage_retention_s,
                "max_hooks": partition_share(max_pending_hooks, self.partitions),
                "trace": trace, "held": encode_data(held) if held is not None else "",
                "workers": "" if workers is None else workers}),
            lambda r: "" if reply_text(r[0]) == "created" else None)
        tag = reply_text(res[0])
        if tag == "created":
            return Created(True, "queued")
        if tag == "exists":
            return Created(False, reply_text(res[1]))
        if tag == "conflict":
            raise Conflict("a stream with this id exists with a different request")
        if tag == "expired":
            raise Expired("a stream with this id existed and expired; use a new id")
        if tag == "storage_quota":
            raise OverStorageQuota(storage.quota_bytes, self.partitions, storage.share(self.partitions))
        if tag == "webhook_backlog":
            raise WebhookBacklog(f"this caller has {reply_text(res[1])} webhook events its receiver has not taken yet "
                                 f"(at most {max_pending_hooks}, --webhook-max-pending); creates with a webhook wait "
                                 "until some are delivered", retry_after_s=WEBHOOK_BACKLOG_RETRY_S)
        if tag == "budget_exceeded":
            over = team_budget if reply_text(res[1]) == "team" else budget
            raise BudgetExceeded(over.refusal(reply_text(res[2]), self.partitions, tokens, usd),
                                 retry_after_s=over.retry_after_s(now))
        ema_raw, busy = reply_text(res[2]), int(res[3] or 0)
        ema = float(ema_raw) if ema_raw else None
        if tag == "rate_limited":
            raise RateLimited(f"too many creates from this caller (a burst of {quota.burst}, then "
                              f"{quota.rate_per_s:g} per second)", retry_after_s=max(1, math.ceil(int(res[1]) / 1000)))
        if tag == "too_many_generations":
            raise TooManyGenerations(f"this caller has as many unfinished generations as it may ({quota.max_active})",
                                     retry_after_s=retry_after_s(1, ema, busy))
        assert tag == "queue_full", tag
        waiting = int(res[1])
        if reply_text(res[4]) == "wait":
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
        raw = await self._batch.execute(
            "HMGET", k.meta, "status", "model", "created_at", "usage", "last_id", "cod", "max_tokens", "key_id",
            "abandon_s", "tier", "held")
        if raw[0] is None:
            return None
        return StreamStatus(
            status=reply_text(raw[0]),
            model=reply_text(raw[1]),
            created_at=float(raw[2] or 0),
            usage=orjson.loads(raw[3]) if raw[3] else None,
            last_id=reply_text(raw[4]) or None,
            cancel_on_disconnect=reply_text(raw[5]) == "1",
            max_tokens=int(raw[6] or 0),
            key_id=reply_text(raw[7]),
            abandon_s=float(raw[8] or 0),
            tier=reply_text(raw[9]),
            held=reply_text(raw[10]) == "1",
        )

    async def trace_of(self, stream_id: uuid.UUID) -> tuple[str, str]:
        """The stream's stored traceparent ('': not traced) and model: what a read's span links to."""
        raw = await self._batch.execute("HMGET", self.keys(stream_id).meta, "tp", "model")
        return reply_text(raw[0]) if raw[0] else "", reply_text(raw[1]) if raw[1] else ""

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
            lambda r: "" if reply_text(r[0]) == "started" else None)
        return reply_text(res[0]) == "started"

    async def request_of(self, stream_id: uuid.UUID) -> GenerationRequest | None:
        """The request as stored at create (None: no such stream, or one that ended and kept only its digest)."""
        raw = await self.redis.hget(self.keys(stream_id).meta, "req")
        if raw is None:
            return None
        return GenerationRequest.from_canonical(raw.encode() if isinstance(raw, str) else raw)

    async def _call(self, k: StreamKeys, script: Any, keys: list[str], args: list[Any],
                    visible: Callable[[Any], str | None]) -> Any:
        """Run one of a stream's scripts. At ``replicated`` through the gate: its events become visible up to
        ``visible(result)`` ('' = the stream's last; None: nothing new) once a replica has them."""
        if self.gate is None:
            return await script(keys=keys, args=args)
        return await self.gate.call(k, script, keys, args, visible)

    async def read(self, stream_id: uuid.UUID, after_id: str | None, count: int = 512, *,
                   visible_only: bool = True) -> Sequence[Event]:
        """Events strictly after ``after_id`` (None: from the start), at most ``count``. ``visible_only``:
        what readers may see (at ``replicated``, up to the watermark); a worker continuing a stream reads it all."""
        k = self.keys(stream_id)
        if self.gate is not None and visible_only:
            return (await self.gate.read(k, after_id, count, check=False))[0]
        return EventPage(await self._xrange(k.events, "-" if after_id is None else f"({after_id}", count))

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

    async def _xrange(self, key: str, start: str, count: int) -> Any:
        """``xrange_raw`` through the read batcher: a burst of attaching readers' replays go out together."""
        if self._batch.direct:
            return await xrange_raw(self.redis, key, start, count)
        return await self._batch.execute("XRANGE", key, start, "+", "COUNT", count, keys=[key], **{RAW_ENTRIES: True})

    async def _last_common_id(self, stream_id: uuid.UUID, after_id: str) -> str | None:
        """The newest event id of the stream that is not newer than ``after_id`` (None: no such event)."""
        entries: Any = await self.redis.xrevrange(self.keys(stream_id).events, max=after_id, min="-", count=1)
        return reply_text(entries[0][0]) if entries else None

    async def aclose(self) -> None:
        """Close what the store opened itself (the replica gate's per-master clients); the client is the caller's."""
        if self.gate is not None:
            await self.gate.aclose()

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
            lambda r: "" if reply_text(r[0]) in ("ended", "cancelled") else None)  # nothing comes after those
        tag = reply_text(res[0])
        if tag == "unknown":
            return None
        return "cancelled" if tag == "cancelled" else reply_text(res[1])

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

    # -- generator side ------------------------------------------------------------------------

    async def claim_next(self, model: str, partition: int, worker_id: str, *, lease_s: float,
                         aging_s: float = 0.0, affinity_wait_s: float = 0.0, token: str = "") -> Claim | float | None:
        """Claim the next job of ``model``'s queue in ``partition`` for ``worker_id``: one left for it, else a lapsed
        lease's, else the next in line (broker.streams.queue_scripts). With nothing to claim: how long (s) until a
        lease or a left job falls due, or None for nothing due.

        ``token``: this claim's, unique to it; asked again with the same token after an error (its reply lost: the
        script may have run), the claim answers the stream it took then, if still the worker's (QueueKeys.receipt).
        Without one, a fresh token per call."""
        q = self.queue(partition, model)
        script = queue_scripts.CLAIM_NEXT
        res = await self._claim_next(
            keys=script.keys({"totals": queue_stats_key(partition, self.partitions), "stats": q.stats,
                              "leases": q.leases, "deferred": q.deferred, "inbox": q.inbox(worker_id),
                              "receipt": q.receipt(worker_id)}),
            args=script.args({"qp": q.prefix, "worker": worker_id, "token": token or uuid.uuid4().hex,
                              "lease_ms": int(lease_s * 1000),
                              "aging_ms": int(aging_s * 1000), "affinity_wait_ms": int(affinity_wait_s * 1000),
                              "affinity_prefix": affinity_key(partition, self.partitions, ""),
                              "tries": queue_scripts.CLAIM_TRIES,
                              "stream_prefix": stream_key_prefix(partition, self.partitions),
                              "position_updates": POSITION_UPDATES}))
        if reply_text(res[0]) == "claimed":
            return self._claimed(res)
        due = reply_text(res[1])
        return int(due) / 1000 if due else None

    async def claim(self, stream_id: uuid.UUID, worker_id: str, *, lease_s: float = 30.0) -> Claim | Unclaimable:
        """Claim this stream's generation, wherever its job is (in line, or running under anyone's lease): every
        earlier owner is fenced out. What a stand-in writer does; workers take the next job (``claim_next``)."""
        k = self.keys(stream_id)
        script = queue_scripts.CLAIM
        res = await self._claim(
            keys=script.keys({"meta": k.meta, "totals": k.queue_stats}),
            args=script.args({"sid": str(stream_id), "worker": worker_id, "lease_ms": int(lease_s * 1000),
                              "stream_prefix": stream_key_prefix(k.partition, k.partitions),
                              "position_updates": POSITION_UPDATES}))
        tag = reply_text(res[0])
        if tag != "claimed":
            return {"gone": Unclaimable.GONE, "held": Unclaimable.HELD}.get(tag, Unclaimable.FINISHED)
        return self._claimed(res)

    def _claimed(self, res: Any) -> Claim:
        _, sid, fence, attempts, req, cancel, model, seq, tenant, tier, created_at, claimed_at, trace = res
        k = self.keys(uuid.UUID(reply_text(sid)))
        return Claim(k.stream_id, k, int(fence), int(attempts), GenerationRequest.from_canonical(req),
                     reply_text(cancel), reply_text(model), int(seq), reply_text(tier),
                     tenant=k.principal_of(reply_text(tenant)),
                     waited_s=float(reply_text(claimed_at)) - float(reply_text(created_at)), trace=reply_text(trace))

    def wake_keys(self, model: str, worker_id: str) -> dict[int, list[str]]:
        """Per partition, the lists an idle worker of ``model`` blocks on: its queue's wake tokens and its own."""
        return {p: [self.queue(p, model).wake, self.queue(p, model).wake_for(worker_id)]
                for p in range(self.partitions)}

    async def wait_for_jobs(self, blocking: RedisClient, keys: Sequence[str], timeout_s: float) -> str | None:
        """Block until one of these wake lists (one hash slot) has a token, or ``timeout_s``: the key that woke,
        or None. ``blocking``: a client without a socket timeout."""
        res: Any = await blocking.blpop(list(keys), timeout=max(0.01, timeout_s))
        return reply_text(res[0]) if res else None

    async def give_back(self, claim: Claim) -> None:
        """A claimed job this worker will not start after all: back at the front of its tenant's line (one some
        attempt had started: handed over, to be continued)."""
        script = queue_scripts.GIVE_BACK
        await self._give_back(keys=script.keys({"meta": claim.keys.meta, "totals": claim.keys.queue_stats}),
                              args=script.args({"fence": claim.fence, "sid": str(claim.stream_id)}))

    async def append(self, claim: Claim, seq_before: int, seq_after: int,
                     events: Sequence[tuple[str, bytes]]) -> AppendResult:
        keys, args = self._append_call(claim, seq_before, seq_after, events)
        # Visible up to its last event; a retry that finds the batch landed, up to the stream's last one.
        return self._append_result(await self._call(claim.keys, self._append, keys, args, lambda r: (
            reply_text(r[2]) if reply_text(r[0]) == "appended"
            else "" if reply_text(r[0]) == "seq" and int(r[1]) == seq_after else None)))

    async def append_many(self, calls: Sequence[tuple[Claim, int, int, Sequence[tuple[str, bytes]]]]
                          ) -> list[AppendResult | BaseException]:
        """Several streams' appends in one round trip: one APPEND_MANY call per partition (its keys share a
        slot), at most APPEND_MANY_STREAMS streams each, all in one pipeline. Each stream's append is checked
        and made as ``append`` makes it; their results (or the error of their call) come back in order."""
        groups: dict[int, list[int]] = {}
        for i, (claim, _, _, _) in enumerate(calls):
            groups.setdefault(claim.keys.partition, []).append(i)
        packed: list[tuple[list[Any], list[Any]]] = []
        members: list[list[int]] = []
        for indexes in groups.values():
            for start in range(0, len(indexes), APPEND_MANY_STREAMS):
                part = indexes[start:start + APPEND_MANY_STREAMS]
                keys: list[Any] = []  # names as bytes (see _append_head)
                args: list[Any] = []
                for i in part:
                    claim, seq_before, seq_after, events = calls[i]
                    meta, stream, fence, channel = self._append_head(claim)
                    keys += record(scripts.APPEND_MANY_KEYS, {"meta": meta, "events": stream})
                    args += record(scripts.APPEND_MANY_ARGS, {"fence": fence, "channel": channel,
                                                              "seq_before": seq_before, "seq_after": seq_after,
                                                              "events": len(events)})
                    for etype, data in events:
                        args += (etype, data)
                packed.append((keys, args))
                members.append(part)
        # An append that already landed before a reload of the script answers its seq check, not twice.
        raw = await evalsha_many(self.redis, self._append_many, packed)
        out: list[AppendResult | BaseException] = [StoreUnavailable("no reply")] * len(calls)
        for part, reply in zip(members, raw, strict=True):
            for n, i in enumerate(part):
                out[i] = reply if isinstance(reply, BaseException) else self._append_result(reply[n])
        return out

    def _append_head(self, claim: Claim) -> tuple[bytes, bytes, bytes, bytes]:
        """A claim's keys, fence and channel as the bytes APPEND_MANY takes: built once per claim, not per token
        (three key names and the fence encoded again at every append were a tenth of a busy worker's CPU)."""
        # By identity (a claim's hash would hash its whole request): a worker appends with the Claim it got.
        kept = self._append_heads.get(id(claim))
        if kept is not None and kept[0] is claim:
            return kept[1]
        if len(self._append_heads) >= APPEND_HEADS:
            self._append_heads.clear()  # claims of streams long finished; the live ones are rebuilt once
        k = claim.keys
        head = (k.meta.encode(), k.events.encode(), str(claim.fence).encode(), k.channel.encode())
        self._append_heads[id(claim)] = (claim, head)
        return head

    @staticmethod
    def _append_call(claim: Claim, seq_before: int, seq_after: int,
                     events: Sequence[tuple[str, bytes]]) -> tuple[list[str], list[Any]]:
        k = claim.keys
        script = scripts.APPEND
        return (script.keys({"meta": k.meta, "events": k.events}),
                script.args({"fence": claim.fence, "channel": k.channel, "seq_before": seq_before,
                             "seq_after": seq_after}, *(part for event in events for part in event)))

    @staticmethod
    def _append_result(raw: Any) -> AppendResult:
        tag, detail = reply_text(raw[0]), raw[1]
        if tag == "appended":
            return AppendResult(True, reply_text(detail))
        if tag == "seq":
            return AppendResult(False, "", seq=int(detail))
        return AppendResult(False, reply_text(detail))  # fenced

    async def finish(self, claim: Claim, etype: str, data: dict[str, Any], *, status: str,
                     usage: dict[str, Any], model: str = "", reason: str = "", compute_s: float = 0.0,
                     wasted_tokens: int = 0) -> str | None:
        """Append the terminal event and close the stream, with its usage record (broker.streams.usage);
        ``wasted_tokens``: what lost attempts computed and the stream does not hold, as this attempt knows it. None:
        this claim no longer owns it."""
        k = claim.keys
        ttft = usage.get("ttft_ms")
        q = claim.queue
        script = scripts.FINISH
        eid = await self._call(
            k, self._finish,
            script.keys({"meta": k.meta, "events": k.events, "usage_index": k.usage_index, "stats": q.stats,
                         "leases": q.leases, "backlog": q.backlog, "tombstone": k.tombstone,
                         "aborted_totals": k.aborted_totals, "outbox": k.outbox, "outbox_dests": k.outbox_dests,
                         "outbox_holds": k.outbox_holds, "usage_rollups_since": k.usage_rollups_since}),
            script.args({"fence": claim.fence, "channel": k.channel, "type": etype, "data": encode_data(data),
                         "status": status, "usage": orjson.dumps(usage), "model": model,
                         "reason": reason or status, "prompt_tokens": usage.get("prompt_tokens", 0),
                         "completion_tokens": usage.get("completion_tokens", 0), "compute_s": f"{compute_s:.6f}",
                         "sid": str(claim.stream_id), "cached_tokens": usage.get("cached_tokens") or 0,
                         "wasted_tokens": max(0, wasted_tokens), "ttft_ms": "" if ttft is None else f"{ttft:.3f}",
                         "usage_prefix": k.usage_prefix}),
            lambda r: None if r is None else reply_text(r))
        return None if eid is None else reply_text(eid)

    async def add_wasted(self, claim: Claim, tokens: int) -> None:
        """Count ``tokens`` this claim computed and its stream will not hold into the stream's usage record."""
        script = scripts.WASTED
        await self._wasted(keys=script.keys({"meta": claim.keys.meta}), args=script.args({"tokens": tokens}))

    async def renew(self, claim: Claim, disconnect_grace_s: float, lease_s: float) -> AppendResult:
        """Extend the lease by ``lease_s``; the reply carries any cancel reason (incl. abandoned / disconnect)."""
        script = queue_scripts.RENEW
        # Batched: a worker's renewals come in bursts (generations started together renew together), which
        # sent one by one grew the pool to its bound and paid a new connection's handshake each.
        res = await self._batch.script(
            self._renew, script.keys({"meta": claim.keys.meta, "leases": claim.queue.leases}),
            script.args({"fence": claim.fence, "sid": str(claim.stream_id), "lease_ms": int(lease_s * 1000),
                         "disconnect_grace_s": disconnect_grace_s}))
        renewed = reply_text(res[0]) == "renewed"
        return AppendResult(renewed, reply_text(res[1]) if renewed else "")

    async def release(self, claim: Claim) -> bool:
        """Hand the job over to the next worker that claims, without waiting for the lease to lapse."""
        script = queue_scripts.RELEASE
        q = claim.queue
        return bool(await self._release(
            keys=script.keys({"meta": claim.keys.meta, "leases": q.leases, "wake": q.wake}),
            args=script.args({"fence": claim.fence, "sid": str(claim.stream_id)})))


def retry_after_s(behind: int, ema_job_s: float | None, busy: int) -> int:
    """When a rejected create may succeed: the time for ``behind`` jobs to leave the queue at the observed
    rate (a moving average of job time over the running workers), between 1 s and 60 s."""
    if ema_job_s is None:
        return 5
    return max(1, min(60, math.ceil(behind * ema_job_s / max(1, busy))))


def started_event(model: str, tier: str = tiers.DEFAULT) -> tuple[str, bytes]:
    """The ``started`` event: the model that runs the generation and the service tier it waited in."""
    return EventType.STARTED, encode_data({"model": model, "service_tier": tier or tiers.DEFAULT})
