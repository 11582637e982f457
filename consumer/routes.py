"""The HTTP routes of the contract. Handlers raise broker.errors; consumer.errors turns them into JSON."""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from broker.errors import Conflict, Expired, InvalidRequest, NotFound, PayloadTooLarge, QueueFull, TooManyGenerations
from broker.events import parse_event_id
from broker.report import COUNTERS, aborted_report, aborted_totals, parse_time
from broker.request import parse_create_body
from broker.settings import ConsumerSettings
from broker.store import TERMINAL_STATUSES, Store, StreamStatus
from consumer.auth import ensure_owner, principal
from consumer.hub import LiveHub
from consumer.limits import ConnectionLimiter, Counted
from consumer.metrics import Metrics
from consumer.openapi import build_openapi
from consumer.reader import read_batches
from consumer.sse import SSEResponse

log = logging.getLogger("rsb.consumer")


def app_state(request: Request) -> tuple[ConsumerSettings, Store, LiveHub, Metrics]:
    st = request.app.state
    return st.settings, st.store, st.hub, st.metrics


def _path_id(request: Request) -> uuid.UUID:
    raw = request.path_params["stream_id"]
    try:
        if len(raw) != 36:
            raise ValueError
        return uuid.UUID(raw)
    except ValueError:
        raise NotFound("no stream with this id") from None  # could never have existed


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    return bytes(body)


def _status_body(stream_id: uuid.UUID, st: StreamStatus) -> dict[str, object]:
    body: dict[str, object] = {
        "id": str(stream_id),
        "status": st.status,
        "model": st.model,
        "created_at": datetime.fromtimestamp(st.created_at, UTC).isoformat().replace("+00:00", "Z"),
    }
    if st.usage is not None:
        body["usage"] = st.usage
    return body


async def known_status(store: Store, stream_id: uuid.UUID, caller: str) -> StreamStatus:
    """The stream's status, if it exists and belongs to the caller (else 404, or 410 once expired)."""
    st = await store.status(stream_id)
    if st is None:
        if await store.expired(stream_id):
            raise Expired("this stream ended and passed its retention period")
        raise NotFound("no stream with this id")
    ensure_owner(st.key_id, caller)
    return st


async def create_stream(request: Request) -> Response:
    settings, store, _, metrics = app_state(request)
    raw = await read_body(request, settings.max_body_bytes)
    key_max_tokens = int(key_limit(request, principal(request), "max_tokens"))
    max_tokens = min(settings.max_tokens_limit, key_max_tokens) if key_max_tokens else settings.max_tokens_limit
    sid, gen_request = parse_create_body(
        raw, max_tokens_limit=max_tokens, default_max_tokens=min(settings.default_max_tokens, max_tokens),
        max_messages=settings.max_messages, max_prompt_chars=settings.max_prompt_chars,
    )
    stream_id = sid or uuid.uuid4()
    res = await store.create(stream_id, gen_request, default_model=request.app.state.default_model,
                             max_queue=settings.max_queue, retention_s=settings.retention_s,
                             abandon_after_s=settings.abandon_after_s, key_id=principal(request),
                             max_active=int(key_limit(request, principal(request), "max_active")))
    if res.outcome == "conflict":
        raise Conflict("a stream with this id exists with a different request")
    if res.outcome == "expired":
        raise Expired("a stream with this id existed and expired; use a new id")
    if res.outcome == "key_busy":
        metrics.inc("rsb_creates_rejected_total")
        raise TooManyGenerations("this API key has as many unfinished generations as it may (max_active)",
                                 retry_after_s=res.retry_after_s)
    if res.outcome == "queue_full":
        metrics.inc("rsb_creates_rejected_total")
        raise QueueFull(f"the generation queue is full ({res.waiting} waiting)", retry_after_s=res.retry_after_s)
    created = res.outcome == "created"
    extra: dict[str, object] = {"stream_id": str(stream_id), "key_id": principal(request), "new_stream": created}
    if settings.log_content:
        extra["prompt"] = gen_request.prompt if gen_request.prompt is not None else [
            {"role": m.role, "content": m.content} for m in gen_request.messages or ()]
    log.info("create", extra=extra)
    metrics.inc("rsb_streams_created_total" if created else "rsb_creates_replayed_total")
    body: dict[str, object] = {"id": str(stream_id), "status": res.status,
                               "events_url": f"/v1/streams/{stream_id}/events", "created": created}
    keys = request.app.state.api_keys
    if keys.enabled:  # for EventSource, which cannot send an Authorization header
        token = keys.issue_read_token(stream_id, principal(request), settings.read_token_ttl_s)
        body["read_token"] = token
        body["events_url"] = f"/v1/streams/{stream_id}/events?token={token}"
    return JSONResponse(body, status_code=201 if created else 200)


async def stream_events(request: Request) -> Response:
    settings, store, hub, metrics = app_state(request)
    stream_id = _path_id(request)
    header, query = request.headers.get("last-event-id"), request.query_params.get("last_event_id")
    for raw in (header, query):  # both are checked, though the header wins: bad input is never ignored
        if raw and parse_event_id(raw) is None:
            raise InvalidRequest("malformed resume id (Last-Event-ID / last_event_id): use an event's id as sent")
    resume = (header if header is not None else query) or None
    resume_key = parse_event_id(resume) if resume else None
    caller = principal(request)
    ip = request.client.host if request.client else ""
    limiter: ConnectionLimiter = request.app.state.limiter
    # Counted before any Redis round trip: a flood past the limit is refused at the lowest cost.
    limiter.acquire(ip, caller, int(key_limit(request, caller, "max_sse")))
    try:
        st = await known_status(store, stream_id, caller)
    except BaseException:
        limiter.release(ip, caller)
        raise
    if st.status in TERMINAL_STATUSES and st.last_id is not None and resume_key is not None:
        last_key = parse_event_id(st.last_id)
        if last_key is not None and resume_key >= last_key:
            limiter.release(ip, caller)
            return Response(status_code=204)
    if resume is not None:
        metrics.inc("rsb_resumes_total")
    metrics.inc("rsb_reads_total")
    response = SSEResponse(
        read_batches(store, hub, stream_id, resume, settings.heartbeat_s, watched=st.watched),
        shutdown=request.app.state.draining,
        send_timeout_s=settings.send_timeout_s,
        on_sent=lambda n: metrics.inc("rsb_events_sent_total", n),
    )
    return Counted(response, limiter, ip, caller)  # type: ignore[return-value]


def key_limit(request: Request, key_id: str, name: str) -> float:
    """A per-key limit from the API keys file (0: none)."""
    key = request.app.state.api_keys.get(key_id)
    return float(key.limits.get(name, 0)) if key is not None else 0.0


async def stream_status(request: Request) -> Response:
    _, store, _, _ = app_state(request)
    stream_id = _path_id(request)
    return JSONResponse(_status_body(stream_id, await known_status(store, stream_id, principal(request))))


async def cancel_stream(request: Request) -> Response:
    _, store, _, metrics = app_state(request)
    stream_id = _path_id(request)
    await known_status(store, stream_id, principal(request))
    status = await store.cancel(stream_id, "client")
    if status is None:
        raise NotFound("no stream with this id")
    metrics.inc("rsb_cancels_total")
    return JSONResponse({"id": str(stream_id), "status": status}, status_code=202)


async def aborted_report_route(request: Request) -> Response:
    settings, store, _, _ = app_state(request)
    q = request.query_params
    report = await aborted_report(store.redis, settings.broker.partitions, since=parse_time(q.get("since"), "since"),
                                  until=parse_time(q.get("until"), "until"), group_by=q.get("group_by", "reason"),
                                  key_id=principal(request) if request.app.state.api_keys.enabled else None)
    return JSONResponse(report)


async def openapi_route(request: Request) -> Response:
    settings = request.app.state.settings
    return JSONResponse(build_openapi(request.app.state.api_keys.enabled, max_tokens=settings.max_tokens_limit,
                                      max_messages=settings.max_messages,
                                      max_prompt_chars=settings.max_prompt_chars))


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    _, store, _, _ = app_state(request)
    await store.redis.ping()
    return JSONResponse({"status": "ready"})


async def metrics_route(request: Request) -> Response:
    settings, store, _, metrics = app_state(request)
    lines = [metrics.render()]
    totals = await aborted_totals(store.redis, settings.broker.partitions)
    for counter in COUNTERS:
        name = f"rsb_aborted_{counter}_total"
        lines.append(f"# HELP {name} aborted generations (cancelled, abandoned, failed): {counter}, by reason")
        lines.append(f"# TYPE {name} counter")
        for (reason, c), value in sorted(totals.items()):
            if c == counter:
                lines.append(f'{name}{{reason="{reason}"}} {value:g}')
    waiting = await store.waiting()
    lines.append("# HELP rsb_queue_waiting streams enqueued and not yet claimed by a worker")
    lines.append("# TYPE rsb_queue_waiting gauge")
    lines.append(f"rsb_queue_waiting {waiting}")
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


ROUTES = [
    Route("/v1/streams", create_stream, methods=["POST"]),
    Route("/v1/streams/{stream_id}/events", stream_events, methods=["GET"]),
    Route("/v1/streams/{stream_id}", stream_status, methods=["GET"]),
    Route("/v1/streams/{stream_id}/cancel", cancel_stream, methods=["POST"]),
    Route("/v1/reports/aborted", aborted_report_route, methods=["GET"]),
    Route("/openapi.json", openapi_route, methods=["GET"]),
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
    Route("/metrics", metrics_route, methods=["GET"]),
]
