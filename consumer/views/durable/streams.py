"""Durable Streams that clients name and write: PUT (create, fork), POST (append, close), GET (catch-up; live
modes in consumer.views.durable.live), HEAD and DELETE. Every Redis step is broker.durable.store's; this module
translates headers into its calls and its outcomes into statuses and headers."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from broker.durable.format import offset_of
from broker.durable.keys import DurableKeys
from broker.durable.store import Appended, ForkSpec, Outcome, StreamSpec
from broker.errors import InvalidRequest, PayloadTooLarge
from broker.redis.keyspace import partition_share
from consumer.edge.errors import error_response
from consumer.edge.http import read_body
from consumer.state import State, caller_of, state_of
from consumer.views.durable.live import long_poll, read, sse
from consumer.views.durable.protocol import (
    CLOSED,
    EXPECTED_SEQ,
    EXPIRES_AT,
    NEXT_OFFSET,
    PREFIX,
    PRODUCER_EPOCH,
    PRODUCER_SEQ,
    RECEIVED_SEQ,
    TTL,
    content_type,
    expiry,
    fork_headers,
    is_true,
    offset_param,
    producer,
    respond,
)
from consumer.views.durable.responses import page_response

#: Paths under this first segment are rsb's generations (consumer.views.durable.generations): read-only.
GENERATIONS = "rsb"


# A body refused for its size is still read (and dropped) up to this much before the 413: a client that is
# still sending when the server answers and closes sees its connection reset, not the 413.
DRAIN_MAX_BYTES = 32 * 1024 * 1024


async def body_of(request: Request, limit: int) -> bytes:
    try:
        return await read_body(request, limit)
    except PayloadTooLarge:
        seen = 0
        while seen <= DRAIN_MAX_BYTES:
            message = await request.receive()
            seen += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        raise


def keys_of(request: Request, state: State, path: str) -> DurableKeys:
    """Each API key has its own namespace of paths."""
    return state.durable.keys(caller_of(request).key_id, path)


def max_streams(request: Request, state: State) -> int:
    """The caller's stream allowance in one partition (the count is checked atomically per partition, as
    for max_active: with P partitions each allows ceil(limit / P); exact with the default single one)."""
    limit = state.service.key_limit(caller_of(request), "max_ds_streams") or state.settings.ds_max_streams
    return partition_share(limit, state.durable.partitions)


async def put(request: Request, path: str) -> Response:
    state = state_of(request)
    ttl_s, expires_at, expires_ms = expiry(request)
    source, fork_offset, sub_offset = fork_headers(request)
    if source is not None and source.split("/", 1)[0] == GENERATIONS:
        raise InvalidRequest("forking an rsb generation is not supported; read it from /v1/stream/rsb/<id>")
    spec = StreamSpec(content_type(request, fork=source is not None), ttl_s, expires_at, expires_ms,
                      is_true(request, CLOSED))
    body = await body_of(request, state.settings.ds_max_body_bytes)
    fork = ForkSpec(keys_of(request, state, source), fork_offset, sub_offset) if source is not None else None
    with state.service.quota_counted():
        res = await state.durable.create(keys_of(request, state, path), spec, body, fork=fork,
                                         max_streams=max_streams(request, state),
                                         max_bytes=state.settings.ds_max_stream_bytes,
                                         quota=state.service.storage_quota(caller_of(request)))
    headers = {"content-type": res.content_type, NEXT_OFFSET: offset_of(res.tail)}
    if res.closed:
        headers[CLOSED] = "true"
    if res.created:
        headers["Location"] = f"{request.url.scheme}://{request.url.netloc}{PREFIX}{path}"
    return respond(201 if res.created else 200, headers)


async def post(request: Request, path: str) -> Response:
    state = state_of(request)
    prod = producer(request)
    close = is_true(request, CLOSED)
    body = await body_of(request, state.settings.ds_max_body_bytes)
    if not body and not close:
        raise InvalidRequest("an append needs a body (or Stream-Closed: true to close the stream)")
    ctype = request.headers.get("content-type")
    if body and not ctype:
        raise InvalidRequest("an append needs a Content-Type")
    with state.service.quota_counted():
        res = await state.durable.append(keys_of(request, state, path), body, ctype or "", close=close,
                                         stream_seq=request.headers.get("stream-seq") or "", producer=prod,
                                         max_bytes=state.settings.ds_max_stream_bytes,
                                         quota=state.service.storage_quota(caller_of(request)))
    echo = {PRODUCER_EPOCH: str(prod.epoch), PRODUCER_SEQ: str(prod.seq)} if prod else {}
    return _appended(res, echo, created_data=bool(body), closing=close)


def _appended(res: Appended, echo: dict[str, str], *, created_data: bool, closing: bool) -> Response:
    o = res.outcome
    tail = {NEXT_OFFSET: offset_of(res.tail)}
    if o is Outcome.OK:
        headers = {**tail, **echo}
        if closing:
            headers[CLOSED] = "true"
        # A producer's append answers 200 with its headers; a close-only request, and a plain append, 204.
        return respond(200 if echo and created_data else 204, headers)
    if o is Outcome.DUPLICATE:
        return respond(204, {**tail, **echo, PRODUCER_SEQ: res.seq})
    if o in (Outcome.DUPLICATE_CLOSE, Outcome.ALREADY_CLOSED):
        return respond(204, {**tail, **echo, CLOSED: "true"})
    if o is Outcome.CLOSED:
        return error_response(409, "stream_closed", "the stream is closed", {**tail, CLOSED: "true"})
    if o is Outcome.TYPE_MISMATCH:
        return error_response(409, "content_type_mismatch", "the Content-Type differs from the stream's")
    if o is Outcome.STALE_EPOCH:
        return error_response(403, "stale_producer_epoch", "a newer epoch of this producer has written",
                              {PRODUCER_EPOCH: res.epoch})
    if o is Outcome.BAD_EPOCH:
        return error_response(400, "invalid_request", "a new producer epoch starts at Producer-Seq 0")
    if o is Outcome.SEQUENCE_GAP:
        return error_response(409, "producer_sequence_gap", "Producer-Seq skips ahead",
                              {EXPECTED_SEQ: res.expected_seq, RECEIVED_SEQ: res.received_seq})
    if o is Outcome.SEQ_CONFLICT:
        return error_response(409, "stream_seq_conflict", "Stream-Seq must increase (byte-wise)")
    if o is Outcome.BAD_BODY:
        return error_response(400, "invalid_request", "the body is not valid JSON (or is an empty array)")
    return error_response(413, "payload_too_large", "the stream would exceed its size limit")


async def get(request: Request, path: str) -> Response:
    state = state_of(request)
    offset = offset_param(request)
    mode = request.query_params.get("live")
    keys = keys_of(request, state, path)
    if mode in ("long-poll", "sse"):
        if offset is None:
            raise InvalidRequest(f"live={mode} needs an offset (-1 for the start, now for the tail)")
        if mode == "sse":
            return await sse(request, state, keys, offset)
        return await long_poll(request, state, keys, offset)
    page = await read(state, keys, offset or "-1")
    return page_response(request, page, offset)


async def head(request: Request, path: str) -> Response:
    state = state_of(request)
    meta = await state.durable.head(keys_of(request, state, path))
    headers = {"content-type": meta.content_type, NEXT_OFFSET: offset_of(meta.tail), "Cache-Control": "no-store"}
    if meta.ttl_s:
        headers[TTL] = meta.ttl_s
    if meta.expires_at:
        headers[EXPIRES_AT] = meta.expires_at
    if meta.closed:
        headers[CLOSED] = "true"
    return respond(200, headers)


async def delete(request: Request, path: str) -> Response:
    state = state_of(request)
    await state.durable.delete(keys_of(request, state, path))
    return respond(204)
