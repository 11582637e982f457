"""The routes of the Messages view: ``POST /v1/messages`` (streamed or not), ``GET /v1/messages/{id}/events`` (read a
message again, or resume it after an event id) and ``POST /v1/messages/count_tokens``.

A create is the stream service's create (the caller's keys, limits, budget and tier, as every view's) with the
request translated by consumer.views.anthropic.request; every read is the service's reader, folded into Anthropic's
events by consumer.views.anthropic.message and sent by the consumer's one SSE response."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp

from broker.errors import Conflict, Expired, NotFound, RsbError
from broker.events import TERMINAL_TYPES, Event, EventType, parse_event_id
from broker.request.generation import parse_json_object
from broker.sse import frame
from consumer.edge.errors import anthropic_error_object as error_object
from consumer.edge.http import read_body
from consumer.state import caller_of, state_of
from consumer.streaming.service import StreamService
from consumer.streaming.sse import SSE_HEADERS, STREAM_ID_HEADER, SSEResponse
from consumer.views.anthropic.errors import NO_RETRY, AnthropicError, error_json, error_response, invalid
from consumer.views.anthropic.message import (
    EventKey,
    MessageView,
    message_id,
    parse_message_id,
    parse_resume_id,
    terminal_error,
)
from consumer.views.anthropic.request import parse_messages_request
from consumer.views.idempotency import HEADER as IDEMPOTENCY_HEADER
from consumer.views.idempotency import stream_id_for_key
from consumer.views.openai.common import DeferredResponse

#: How long a token count waits for a generator's answer: well under the pooled Redis client's socket timeout, which
#: a blocking command does not extend (docs/dependencies.md: redis-py).
COUNT_WAIT_S = 4.0


async def read_json(request: Request) -> dict[str, Any]:
    """The body, a JSON object (else a 400 invalid_request_error; past --max-body-bytes a 413 request_too_large)."""
    return parse_json_object(await read_body(request, state_of(request).settings.max_body_bytes))


def _error_frame(type_: str, message: str) -> bytes:
    """An ``event: error`` without an id: a notice about this connection, not an event of the message (a resume
    with the last id received reads on from the message's events)."""
    return frame(orjson.dumps(error_object(type_, message)), event=b"error")


def _shutdown_frame(message_id: str) -> bytes:
    return _error_frame("overloaded_error", "this server is shutting down and the message goes on: read it again "
                                            f"at GET /v1/messages/{message_id}/events with the Last-Event-ID received")


def _encode(ev: Event, events: list[tuple[str, dict[str, Any]]], after: EventKey | None) -> bytes:
    """The frames of the Anthropic events one rsb event made, those after ``after`` only."""
    if after is not None and events:
        ms, seq = parse_event_id(ev.id) or (0, 0)
        events = [e for n, e in enumerate(events) if (ms, seq, n) > after]
    return b"".join(frame(orjson.dumps(e), event=str(e["type"]).encode(), event_id=eid.encode()) for eid, e in events)


async def _frames(service: StreamService, stream_id: uuid.UUID, view: MessageView,
                  after: EventKey | None) -> AsyncIterator[bytes | None]:
    async with aclosing(service.tail(stream_id)) as events:
        async for ev in events:
            if ev is None:
                yield None  # a heartbeat comment, which the SDKs skip
            elif chunk := _encode(ev, view.feed(ev), after):
                yield chunk
    if view.end is None:
        # The reader stopped before a reset: a Redis failover lost events this message showed, and Anthropic's
        # events cannot take text back. The client reads the message again, as it now is.
        yield _error_frame("api_error", f"a failover rolled this message back: read it again at GET "
                                        f"/v1/messages/{view.id}/events (from its start)")


class _DeferredMessage(DeferredResponse):
    """A non-streamed Message: the wait for the end of its generation, with its errors in Anthropic's shape."""

    def shutting_down(self) -> Response:
        return error_json(529, "this server is shutting down; retry (with the same Idempotency-Key to join the "
                               "generation)", {"Retry-After": "1"})

    def failed(self, err: RsbError) -> Response:
        return error_response(err)


async def _message(service: StreamService, stream_id: uuid.UUID, view: MessageView) -> Response:
    await service.fold(stream_id, view.feed)  # the reader ends only after the terminal event
    end = view.end
    assert end is not None
    if end.type != EventType.DONE:
        # The SDKs would retry a 409 or a 5xx, each retry a new generation paid in full (or, with an
        # Idempotency-Key, this same failure): x-should-retry: false leaves that choice to the caller.
        status, body = terminal_error(end)
        return JSONResponse(body, status_code=status, headers=NO_RETRY)
    return JSONResponse(view.message())


async def create_message(request: Request) -> ASGIApp:
    state = state_of(request)
    service = state.service
    caller = caller_of(request)
    req = parse_messages_request(await read_json(request), service.limits_for(caller))
    stream_id = stream_id_for_key(request.headers.get(IDEMPOTENCY_HEADER), caller)  # InvalidRequest: a 400
    with service.connection(caller) as slot:
        try:
            # Its webhook event names the message as its client knows it.
            await service.create(caller, req.generation, stream_id,
                                 hook_name=lambda sid: message_id(sid, req.thinking))
        except Conflict:
            raise AnthropicError(409, "this Idempotency-Key was used with a different request", NO_RETRY) from None
        except Expired:
            raise AnthropicError(409, "this Idempotency-Key was used for a generation that has expired; use a new "
                                      "key", NO_RETRY) from None
        view = MessageView(stream_id, await service.status(caller, stream_id), thinking=req.thinking)
        if req.stream:
            return SSEResponse(_frames(service, stream_id, view, None), shutdown=state.draining,
                               send_timeout_s=state.settings.send_timeout_s, headers={STREAM_ID_HEADER: str(stream_id)},
                               shutdown_frame=_shutdown_frame(view.id), on_close=slot.release)
        return _DeferredMessage(request, stream_id, lambda: _message(service, stream_id, view), slot.release)


def _resume_key(request: Request) -> EventKey | None:
    """After which event a read resumes: the Last-Event-ID header, else ``?last_event_id=`` (None: from the start)."""
    header, query = request.headers.get("last-event-id"), request.query_params.get("last_event_id")
    keys = []
    for raw in (header, query):  # both are checked, though the header wins: bad input is never ignored
        key = parse_resume_id(raw) if raw else None
        if raw and key is None:
            raise invalid("Last-Event-ID (or last_event_id) is not an event id of this API: resume with the id of "
                          "an event as it was sent")
        keys.append(key)
    return keys[0] if header is not None else keys[1]


async def message_events(request: Request) -> ASGIApp:
    """``GET /v1/messages/{id}/events``: the message's events, from its start or after ``Last-Event-ID``, then live
    ones until it ends; ``204`` when nothing comes after the resume point of a message that has ended."""
    state = state_of(request)
    service = state.service
    parsed = parse_message_id(request.path_params["message_id"])
    if parsed is None:
        raise NotFound("no message with this id")  # could never have existed
    stream_id, thinking = parsed
    after = _resume_key(request)
    caller = caller_of(request)
    with service.connection(caller) as slot:
        st = await service.status(caller, stream_id)  # another key's message is one that does not exist
        view = MessageView(stream_id, st, thinking=thinking)
        if after is not None:
            state.metrics.resumes.inc()
        state.metrics.reads.inc()
        headers = {STREAM_ID_HEADER: str(stream_id)}
        if st.status in TERMINAL_TYPES:  # the whole message is there: one answer, no reader held open
            body = _replay(view, await service.events_so_far(stream_id), after)
            slot.release()
            if not body:
                return Response(status_code=204)
            return Response(body, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        return SSEResponse(_frames(service, stream_id, view, after), shutdown=state.draining,
                           send_timeout_s=state.settings.send_timeout_s, headers=headers,
                           shutdown_frame=_shutdown_frame(view.id), on_close=slot.release)


def _replay(view: MessageView, events: Sequence[Event], after: EventKey | None) -> bytes:
    return b"".join(_encode(ev, view.feed(ev), after) for ev in events)


async def count_tokens(request: Request) -> ASGIApp:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": n}``, the tokens of the prompt a create with this body
    would evaluate, counted by a generator of its model (its tokenizer and chat template; broker.streams.token_counts).
    ``404`` when no generator of the model can count (an upstream's generators cannot), ``529`` when none answers
    within COUNT_WAIT_S."""
    state = state_of(request)
    service, counts = state.service, state.token_counts
    assert counts is not None
    caller = caller_of(request)
    body = await read_json(request)
    limits = service.limits_for(caller)
    # Anthropic's count takes a create's body without max_tokens: any allowed value makes the same prompt.
    req = parse_messages_request({**body, "max_tokens": body.get("max_tokens") or limits.max_tokens}, limits)
    model = await service.resolve_model(req.generation.model)
    if not await counts.counted(model):
        raise AnthropicError(404, f"no generator of model {model!r} counts tokens (in-process llama.cpp generators "
                                  "do; those of an upstream server do not)")
    with service.connection(caller) as slot:
        try:
            answer = await counts.ask(model, req.generation, COUNT_WAIT_S)
        finally:
            slot.release()
    if answer is None:
        raise AnthropicError(529, f"no generator of model {model!r} answered within {COUNT_WAIT_S:g} s; retry",
                             {"Retry-After": "1"})
    if "error" in answer:
        raise invalid(f"{answer['error'].get('code', 'engine')}: {answer['error'].get('message', '')}")
    return JSONResponse({"input_tokens": int(answer["input_tokens"])})
