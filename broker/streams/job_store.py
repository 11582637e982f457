"""What the generator asks of rsb's streams: claim a job (the next of a model's queue, or one stream's), wait for
jobs, append a generation's events (one stream's, or many streams' in one round trip), renew its lease and hear its
cancel, count what a lost attempt wasted, finish it, give it back or release it. The consumer's side is
broker.streams.stream_store; what both share, broker.streams.store_base."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import orjson

from broker.errors import StoreUnavailable
from broker.events import EventType, encode_data
from broker.redis.connection import RedisClient, evalsha_many, reply_text
from broker.redis.lua import record
from broker.request import tiers
from broker.request.generation import GenerationRequest
from broker.streams import queue_scripts, replication, scripts
from broker.streams.affinity import ChatAffinity
from broker.streams.keys import affinity_key, queue_stats_key, stream_key_prefix
from broker.streams.records import AppendResult, Claim, Unclaimable
from broker.streams.replies import AppendReply, ClaimReply, TaggedReply
from broker.streams.store_base import POSITION_UPDATES, StoreBase

# Streams per APPEND_MANY call: bounds one call's time inside Redis (a few ms at most).
APPEND_MANY_STREAMS = 256
# Claims whose APPEND_MANY arguments are kept encoded (a worker's generations in flight, with room to spare).
APPEND_HEADS = 4096


class JobStore(StoreBase):
    """A job's life as the generator (a worker) sees it, in Redis: from its claim to its terminal event."""

    def __init__(self, redis: RedisClient, partitions: int = 1, *, durability_level: str = replication.LOCAL,
                 replica_wait_ms: int = 1000, replica_patience_s: float | None = None,
                 gate: replication.ReplicaGate | None = None) -> None:
        super().__init__(redis, partitions, durability_level=durability_level, replica_wait_ms=replica_wait_ms,
                         replica_patience_s=replica_patience_s, gate=gate)
        self._claim = self._register(queue_scripts.CLAIM)
        self._claim_next = self._register(queue_scripts.CLAIM_NEXT)
        self._give_back = self._register(queue_scripts.GIVE_BACK)
        self._append = self._register(scripts.APPEND)
        self._append_many = self._register(scripts.APPEND_MANY)
        self._append_heads: dict[int, tuple[Claim, tuple[bytes, bytes, bytes, bytes]]] = {}
        self._finish = self._register(scripts.FINISH)
        self._renew = self._register(queue_scripts.RENEW)
        self._release = self._register(queue_scripts.RELEASE)
        self._wasted = self._register(scripts.WASTED)
        self.affinity = ChatAffinity(redis, partitions)

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
        due = TaggedReply.read(res).value
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
        r = ClaimReply(*res)
        k = self.keys(uuid.UUID(reply_text(r.stream_id)))
        return Claim(k.stream_id, k, int(r.fence), int(r.attempts), GenerationRequest.from_canonical(r.request),
                     reply_text(r.cancel), reply_text(r.model), int(r.seq), reply_text(r.tier),
                     tenant=k.tenant_from_counters(reply_text(r.tenant)),
                     waited_s=float(reply_text(r.claimed_at)) - float(reply_text(r.created_at)),
                     trace=reply_text(r.trace))

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
        return self._append_result(await self._call(claim.keys, self._append, keys, args,
                                                    lambda r: self._visible_after(AppendReply.read(r), seq_after)))

    @staticmethod
    def _visible_after(reply: AppendReply, seq_after: int) -> str | None:
        """What an append makes visible at ``replicated``: up to its last event; a retry that finds the batch
        landed, up to the stream's last one; a refused append, nothing."""
        if reply.tag == "appended":
            return reply.last_id
        return "" if reply.tag == "seq" and reply.seq == seq_after else None

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
        reply = AppendReply.read(raw)
        if reply.tag == "appended":
            return AppendResult(True, reply.cancel_reason)
        if reply.tag == "seq":
            return AppendResult(False, "", seq=reply.seq)
        return AppendResult(False, reply.cancel_reason)  # fenced

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
        reply = TaggedReply.read(res)
        renewed = reply.tag == "renewed"
        return AppendResult(renewed, reply.value if renewed else "")

    async def release(self, claim: Claim) -> bool:
        """Hand the job over to the next worker that claims, without waiting for the lease to lapse."""
        script = queue_scripts.RELEASE
        q = claim.queue
        return bool(await self._release(
            keys=script.keys({"meta": claim.keys.meta, "leases": q.leases, "wake": q.wake}),
            args=script.args({"fence": claim.fence, "sid": str(claim.stream_id)})))



def started_event(model: str, tier: str = tiers.DEFAULT) -> tuple[str, bytes]:
    """The ``started`` event: the model that runs the generation and the service tier it waited in."""
    return EventType.STARTED, encode_data({"model": model, "service_tier": tier or tiers.DEFAULT})
