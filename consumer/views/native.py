"""The native view: the HTTP routes of the contract (``/v1/streams...``, the aborted and usage reports). Handlers raise
broker.errors; consumer.edge.errors turns them into JSON. Everything about a stream goes through the stream
service; this module only speaks the native protocol (its JSON bodies and its SSE frames)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from broker.ascii import parse_uuid
from broker.errors import InvalidRequest, NotFound, RateLimited
from broker.events import TERMINAL_TYPES, Event, EventPage, parse_event_id
from broker.request.generation import parse_json_object, validate_create_body
from broker.request.on_busy import parse_on_busy
from broker.streams import usage_report as usage
from broker.streams.keys import tenant_of
from broker.streams.records import StreamStatus
from broker.streams.report import aborted_report
from broker.streams.turns import Turn, as_messages
from consumer.edge.http import read_body
from consumer.edge.paths import EVENTS_ROUTE, STREAM_ROUTE
from consumer.metrics import Metrics
from consumer.state import caller_of, state_of
from consumer.streaming.conversations import conversation_name
from consumer.streaming.snapshots import AnswerSnapshot, from_latest
from consumer.streaming.sse import SSEResponse


def path_stream_id(request: Request) -> uuid.UUID:
    parsed = parse_uuid(request.path_params["stream_id"])
    if parsed is None:
        raise NotFound("no stream with this id")  # could never have existed
    return parsed


def status_body(stream_id: uuid.UUID, st: StreamStatus) -> dict[str, object]:
    body: dict[str, object] = {
        "id": str(stream_id),
        "status": st.status,
        "model": st.model,
        "created_at": datetime.fromtimestamp(st.created_at, UTC).isoformat().replace("+00:00", "Z"),
    }
    if st.usage is not None:
        body["usage"] = st.usage
    return body


async def create_stream(request: Request) -> Response:
    state = state_of(request)
    caller = caller_of(request)
    body_in = parse_json_object(await read_body(request, state.settings.max_body_bytes))
    raw_conversation = body_in.pop("conversation", None)
    conversation = None if raw_conversation is None else conversation_name(raw_conversation)
    on_busy = parse_on_busy(body_in.pop("on_busy", None))  # a conversation's turn's: changes nothing elsewhere
    sid, gen_request = validate_create_body(body_in, state.service.limits_for(caller))
    if conversation is not None:
        started = await state.conversations.start(caller, conversation, gen_request, stream_id=sid,
                                                  on_busy=state.service.on_busy(caller, on_busy))
        stream_id, res = started.stream_id, started.created
    else:
        stream_id = sid or uuid.uuid4()
        res = await state.service.create(caller, gen_request, stream_id)
    body: dict[str, object] = {"id": str(stream_id), "status": res.status,
                               "events_url": EVENTS_ROUTE.format(stream_id=stream_id), "created": res.created}
    if conversation is not None:
        body["conversation"] = conversation
    if state.api_keys.enabled:  # for EventSource, which cannot send an Authorization header
        token = await state.api_keys.issue_read_token(stream_id, caller.key_id, state.settings.read_token_ttl_s)
        body["read_token"] = token
        body["events_url"] = f"{EVENTS_ROUTE.format(stream_id=stream_id)}?token={token}"
    return JSONResponse(body, status_code=201 if res.created else 200)


def resume_id(request: Request) -> str | None:
    """The resume point: the Last-Event-ID header, else ``?last_event_id=`` (None: from the start)."""
    header, query = request.headers.get("last-event-id"), request.query_params.get("last_event_id")
    for raw in (header, query):  # both are checked, though the header wins: bad input is never ignored
        if raw and parse_event_id(raw) is None:
            raise InvalidRequest("malformed resume id (Last-Event-ID / last_event_id): use an event's id as sent")
    return (header if header is not None else query) or None


class NativeFrames:
    """rsb's own SSE frames (``id``, ``event``, ``data``) of a batch, for one send: the response's ``encode``
    (no generator of its own between the reader and the response: one frame less per open reader)."""

    __slots__ = ("events_sent",)

    def __init__(self, metrics: Metrics) -> None:
        self.events_sent = metrics.events_sent

    def __call__(self, batch: Sequence[Event] | AnswerSnapshot) -> bytes:
        if isinstance(batch, AnswerSnapshot):
            self.events_sent.inc()
            return batch.event().to_sse()
        # Counted as it is handed to the connection (a client that leaves mid-send was sent it anyway).
        self.events_sent.inc(len(batch))
        # A replay page is framed straight from Redis's reply (broker.events.EventPage).
        return batch.frames() if isinstance(batch, EventPage) else b"".join([ev.to_sse() for ev in batch])


async def stream_events(request: Request) -> Response:
    state = state_of(request)
    stream_id = path_stream_id(request)
    resume = resume_id(request)
    latest = from_latest(request.query_params)
    resume_key = parse_event_id(resume) if resume else None
    caller = caller_of(request)
    service = state.service
    with service.connection(caller) as slot:
        st = await service.status(caller, stream_id)
        if st.status in TERMINAL_TYPES and st.last_id is not None and resume_key is not None:
            last_key = parse_event_id(st.last_id)
            if last_key is not None and resume_key >= last_key:
                slot.release()
                return Response(status_code=204)
        if resume is not None:
            state.metrics.resumes.inc()
        state.metrics.reads.inc()
        # From the latest, a reconnect (a resume point) goes on from it: snapshots only where a reset would come.
        batches = (service.latest(stream_id, resume, watched=st.watched, snapshot=resume is None) if latest
                   else service.batches(stream_id, resume, watched=st.watched))
        return SSEResponse(batches, encode=NativeFrames(state.metrics),
                           shutdown=state.draining, send_timeout_s=state.settings.send_timeout_s,
                           on_close=slot.release)


async def stream_status(request: Request) -> Response:
    state = state_of(request)
    stream_id = path_stream_id(request)
    return JSONResponse(status_body(stream_id, await state.service.status(caller_of(request), stream_id)))


async def cancel_stream(request: Request) -> Response:
    state = state_of(request)
    stream_id = path_stream_id(request)
    status = await state.service.cancel(caller_of(request), stream_id)
    return JSONResponse({"id": str(stream_id), "status": status}, status_code=202)


def _time(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def turn_body(turn: Turn) -> dict[str, object]:
    """A turn in rsb's shape: its messages as a create body has them (so a client can send them again)."""
    out = turn.output
    body: dict[str, object] = {
        "id": str(turn.id), "status": turn.status, "created_at": _time(turn.created_at),
        "messages": [m.as_openai() for m in as_messages(turn.input)],
        "output": None if not turn.has_stream else {
            "text": out.text, "reasoning": out.reasoning,
            "tool_calls": [c.as_openai() for c in out.tool_calls]},
        "finish_reason": turn.finish_reason, "usage": turn.usage, "model": turn.model}
    if turn.error is not None:
        body["error"] = turn.error
    if turn.has_stream:
        body["events_url"] = EVENTS_ROUTE.format(stream_id=turn.id)
    return body


async def conversation_turns(request: Request) -> Response:
    """``GET /v1/conversations/{id}/turns``: the conversation's history for a second device: every finished
    turn, then the running one (its status, its messages and where to follow it; no output yet)."""
    state = state_of(request)
    name = conversation_name(request.path_params["conversation_id"], NotFound("no conversation with this id"))
    snap = await state.conversations.get(caller_of(request), name)
    conv = snap.conversation
    turns = [turn_body(t) for t in conv.turns]
    running = await state.conversations.running_turn(snap)
    if running is not None:
        turns.append({**turn_body(running), "status": snap.pending.status if snap.pending else "queued",
                      "output": None})
    # Then the turns that wait behind it (sent with on_busy "enqueue" or "interrupt"), in the order they run.
    waiting = await state.conversations.waiting_turns(snap)
    turns += [{**turn_body(t), "status": "queued", "output": None} for t in waiting]
    return JSONResponse({"id": name, "created_at": _time(conv.created_at), "turns": turns})


def _count_report(request: Request) -> None:
    """A report costs this pod's CPU (and Redis's): counted per caller (--report-burst, --report-rate-per-min)."""
    state, caller = state_of(request), caller_of(request)
    tenant = tenant_of(caller.key_id, caller.ip)
    if state.reports is None or not state.reports.enabled:
        return
    wait_s = state.reports.retry_after_s(tenant)
    if wait_s is not None:
        s = state.settings
        raise RateLimited(f"too many reports from this caller (a burst of {s.report_burst}, then "
                          f"{s.report_rate_per_min:g} a minute on each pod)", retry_after_s=wait_s)
    state.reports.charge(tenant, 0)


async def aborted_report_route(request: Request) -> Response:
    state = state_of(request)
    _count_report(request)
    q = request.query_params
    report = await aborted_report(state.store.redis, state.settings.broker.partitions,
                                  since=usage.parse_time(q.get("since"), "since"),
                                  until=usage.parse_time(q.get("until"), "until"),
                                  group_by=q.get("group_by", "reason"),
                                  key_id=caller_of(request).key_id if state.api_keys.enabled else None,
                                  retention_s=state.settings.usage_retention_days * 86_400)
    return JSONResponse(report)


async def usage_report_route(request: Request) -> Response:
    """``GET /v1/reports/usage``: the usage ledger grouped (JSON, or CSV with ``format=csv``). With API keys a key sees
    its own records; an admin key every key's (or one key's, with ``key=``)."""
    state = state_of(request)
    _count_report(request)
    q = request.query_params
    group_by = usage.parse_group_by(q.get("group_by"))
    fmt = q.get("format", "json")
    if fmt not in usage.FORMATS:
        raise InvalidRequest(f"'format' must be one of {', '.join(usage.FORMATS)}")
    key_id: str | None = q.get("key")
    caller = state.api_keys.get(caller_of(request).key_id)
    # Only a key of the keys file reaches a key name; another key's, to a key that is no admin, as if it did not exist.
    if key_id is not None and (state.api_keys.get(key_id) is None or (
            caller is not None and not caller.admin and key_id != caller.id)):
        raise NotFound("no usage of this key")
    if state.api_keys.enabled and (caller is None or not caller.admin):
        key_id = caller.id if caller is not None else ""
    since, until = usage.parse_time(q.get("since"), "since"), usage.parse_time(q.get("until"), "until")
    report = await usage.usage_report(state.store.redis, state.settings.broker.partitions, since=since, until=until,
                                      group_by=group_by, key_id=key_id, prices=state.prices,
                                      retention_s=state.settings.usage_retention_days * 86_400)
    if fmt == "csv":
        return Response(usage.render_csv(report), media_type="text/csv; charset=utf-8")
    return JSONResponse(report)


ROUTES = [
    Route("/v1/streams", create_stream, methods=["POST"]),
    Route(EVENTS_ROUTE, stream_events, methods=["GET"]),
    Route(STREAM_ROUTE, stream_status, methods=["GET"]),
    Route("/v1/streams/{stream_id}/cancel", cancel_stream, methods=["POST"]),
    Route("/v1/reports/aborted", aborted_report_route, methods=["GET"]),
    Route("/v1/reports/usage", usage_report_route, methods=["GET"]),
    Route("/v1/conversations/{conversation_id}/turns", conversation_turns, methods=["GET"]),
]
