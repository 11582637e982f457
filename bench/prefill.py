"""Streams written straight through rsb's StreamStore and JobStore (the same Lua scripts a consumer and a worker
use), for scenarios that read: ``prefill(redis_url, streams, events)`` returns each stream's id and event ids."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any

import orjson

from broker.events import EventType, encode_data
from broker.redis.connection import connect
from broker.request.generation import RequestLimits, parse_create_body
from broker.request.history import History
from broker.streams.conversations import Begin, ConversationStore, Limits, absent
from broker.streams.job_store import JobStore, started_event
from broker.streams.records import Claim
from broker.streams.stream_store import StreamStore

BATCH = 256


def delta_text(i: int) -> str:
    """The text of delta ``i``: a word-sized piece, like one token."""
    return f" tok{i}"


async def _one(streams: StreamStore, jobs: JobStore, events: int, finish: bool, prompt: str,
               conversation: str | None = None) -> tuple[str, list[str]]:
    sid = uuid.uuid4()
    body = {"prompt": prompt} if conversation is None else {"messages": [{"role": "user", "content": prompt}]}
    _, req = parse_create_body(orjson.dumps({**body, "max_tokens": events}),
                               RequestLimits(max_tokens=1 << 20, default_max_tokens=events))
    if conversation is not None:  # the stream is the conversation's pending turn (key id "": no API keys)
        outcome, _ = await ConversationStore(streams).begin(absent("", conversation), sid, "", Limits(3600),
                                                          created_at=time.time(), create=True)
        assert outcome is Begin.RESERVED, outcome
        req = dataclasses.replace(req, history=History(conversation=conversation))
    await streams.create(sid, req, model="prefill", max_queue=0, retention_s=3600)
    claim = await jobs.claim(sid, "prefill")
    assert isinstance(claim, Claim), claim
    await jobs.append(claim, 0, 0, [started_event("prefill")])
    # queued + started + deltas (+ done) = ``events`` events in all.
    n_deltas = events - 2 - (1 if finish else 0)
    seq = 0
    for start in range(0, n_deltas, BATCH):
        batch = [(str(EventType.DELTA), encode_data({"text": delta_text(i)}))
                 for i in range(start, min(n_deltas, start + BATCH))]
        res = await jobs.append(claim, seq, seq + len(batch), batch)
        assert res.ok, res
        seq += len(batch)
    if finish:
        usage = {"prompt_tokens": 1, "completion_tokens": seq, "ttft_ms": None, "tpot_ms": None}
        await jobs.finish(claim, EventType.DONE, {"finish_reason": "length", "usage": usage}, status="done",
                           usage=usage)
    ids = [e.id for e in await streams.read(sid, None, count=events + 10)]
    assert len(ids) == events, (len(ids), events)
    return str(sid), ids


async def prefill_async(redis_url: str, streams: int, events: int, *, finish: bool = True,
                        conversation: str | None = None) -> list[dict[str, Any]]:
    redis = connect(redis_url)
    streams, jobs = StreamStore(redis), JobStore(redis)
    try:
        out = []
        for _ in range(streams):
            sid, ids = await _one(streams, jobs, events, finish, "prefill", conversation)
            out.append({"id": sid, "event_ids": ids})
        return out
    finally:
        await redis.aclose()


def prefill(redis_url: str, streams: int, events: int, *, finish: bool = True,
            conversation: str | None = None) -> list[dict[str, Any]]:
    """``streams`` streams of exactly ``events`` events (queued, started, deltas, and done when ``finish``);
    with ``conversation``, each the pending turn of that conversation (of the anonymous key)."""
    return asyncio.run(prefill_async(redis_url, streams, events, finish=finish, conversation=conversation))
