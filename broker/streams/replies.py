"""The replies of a stream's and a job's scripts, read by name: each script answers a list that leads with a tag
(broker.streams.scripts, broker.streams.queue_scripts), and what follows the tag is read here, once, into a small
named value, so that StreamStore and JobStore never index a reply by position."""

from __future__ import annotations

from typing import Any, NamedTuple

from broker.redis.connection import reply_text


class CreateReply(NamedTuple):
    """CREATE's reply. ``detail`` is what its tag is about: ``exists`` the stream's status, ``webhook_backlog`` the
    events pending, ``rate_limited`` the ms until a create fits, ``too_many_generations`` the bound,
    ``queue_full`` the generations waiting, ``budget_exceeded`` which budget (``key`` or ``team``). The model's
    queue load comes with the refusals a wait ends (rate, generations, queue): ``ema_job_s`` its moving average
    of job time (None before a job finished), ``busy`` its running jobs."""

    tag: str
    detail: str = ""
    ema_job_s: float | None = None
    busy: int = 0
    bound: str = ""  # queue_full: which bound it met, ``count`` (--max-queue) or ``wait`` (--max-queue-wait)
    over: str = ""  # budget_exceeded: what the budget cannot hold (broker.streams.budget)

    @classmethod
    def read(cls, raw: Any) -> CreateReply:
        tag = reply_text(raw[0])
        detail = reply_text(raw[1]) if len(raw) > 1 else ""
        if tag == "budget_exceeded":
            return cls(tag, detail, over=reply_text(raw[2]))
        if tag in ("rate_limited", "too_many_generations", "queue_full"):
            ema = reply_text(raw[2])
            return cls(tag, detail, float(ema) if ema else None, int(raw[3] or 0),
                       reply_text(raw[4]) if len(raw) > 4 else "")
        return cls(tag, detail)


class ClaimReply(NamedTuple):
    """A claim's reply (CLAIM's and CLAIM_NEXT's ``claim_reply``), every field as Redis sent it."""

    tag: Any
    stream_id: Any
    fence: Any
    attempts: Any
    request: Any  # the canonical request JSON
    cancel: Any
    model: Any
    seq: Any
    tenant: Any  # meta ``tenant``: the key of the tenant's counters (StreamKeys.tenant_from_counters reads whose)
    tier: Any
    created_at: Any
    claimed_at: Any
    trace: Any


class AppendReply(NamedTuple):
    """APPEND's reply (and each of APPEND_MANY's): ``appended`` with any pending cancel and the last event's id,
    ``seq`` with the stored sequence number (a retry of a batch that landed, or a gap), ``fenced`` with any cancel."""

    tag: str
    cancel_reason: str = ""
    seq: int | None = None
    last_id: str = ""

    @classmethod
    def read(cls, raw: Any) -> AppendReply:
        tag = reply_text(raw[0])
        if tag == "seq":
            return cls(tag, seq=int(raw[1]))
        return cls(tag, reply_text(raw[1]), last_id=reply_text(raw[2]) if len(raw) > 2 else "")


class TaggedReply(NamedTuple):
    """A reply of a tag and at most one value: CLAIM_NEXT's ``empty`` (when a lease or a left job falls due, ms,
    '' for none), RENEW's ``renewed`` (any cancel reason), CANCEL's ``ended``/``requested`` (the status),
    UNHOLD's ``not_held`` (the status)."""

    tag: str
    value: str = ""

    @classmethod
    def read(cls, raw: Any) -> TaggedReply:
        return cls(reply_text(raw[0]), reply_text(raw[1]) if len(raw) > 1 else "")


class TraceLink(NamedTuple):
    """What a read's span links to: the stream's stored traceparent ('': not traced) and its model."""

    traceparent: str
    model: str
