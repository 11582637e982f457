"""The routes of the AI SDK view: send a turn, resume the chat's active turn, stop it."""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from broker.errors import Expired, NotFound
from broker.events import TERMINAL_TYPES
from broker.request import parse_json_object, validate_create_body
from broker.streams.chats import POINTER_MARGIN_S, Turn, turn_stream_id
from broker.streams.records import StreamStatus
from consumer.edge.http import read_body
from consumer.state import State, caller_of, state_of
from consumer.streaming.service import Caller, Slot
from consumer.streaming.sse import STREAM_ID_HEADER, SSEResponse
from consumer.views.aisdk.request import ChatRequest, chat_id_of, continued_message, parse_chat_body
from consumer.views.aisdk.stream import HEADERS, SHUTDOWN_FRAME, earlier_steps, turn_frames


def _respond(state: State, slot: Slot, stream_id: uuid.UUID, st: StreamStatus, message_id: str | None = None,
             earlier: bytes = b"") -> Response:
    state.metrics.reads.inc()
    batches = state.service.batches(stream_id, None, watched=st.watched, resets=False)
    frames = turn_frames(batches, stream_id, state.metrics, message_id, earlier)
    return SSEResponse(frames, shutdown=state.draining, send_timeout_s=state.settings.send_timeout_s,
                       headers={**HEADERS, STREAM_ID_HEADER: str(stream_id)}, shutdown_frame=SHUTDOWN_FRAME,
                       on_close=slot.release)


async def _status_or_none(state: State, caller: Caller, stream_id: uuid.UUID) -> StreamStatus | None:
    try:
        return await state.service.status(caller, stream_id)
    except (NotFound, Expired):  # past its retention: the chat has no turn any more
        return None


async def _start_turn(state: State, caller: Caller, chat: ChatRequest) -> tuple[uuid.UUID, StreamStatus]:
    """The turn this request names: the chat's latest one when this is a repeat of it, else a new one."""
    service = state.service
    _, request = validate_create_body(chat.create_body, service.limits_for(caller))
    turn_key = chat.turn_key(request)
    latest = await state.chats.latest(caller.key_id, chat.chat_id)
    if latest is not None and latest.turn_key == turn_key:
        st = await _status_or_none(state, caller, latest.stream_id)
        if st is not None and (chat.plain_send or st.status not in TERMINAL_TYPES):
            return latest.stream_id, st  # a retry, a second tab: the same turn, no second generation
    previous = latest.stream_id if latest is not None else None
    stream_id = turn_stream_id(caller.key_id, chat.chat_id, turn_key, previous)
    await service.create(caller, request, stream_id)
    # If another new turn of this chat won the race, it is the chat's active turn (what a resume reads);
    # this one still runs, and this request still gets its answer.
    await state.chats.advance(caller.key_id, chat.chat_id, previous, Turn(stream_id, turn_key),
                              state.settings.retention_s + POINTER_MARGIN_S)
    return stream_id, await service.status(caller, stream_id)


async def send_turn(request: Request) -> Response:
    """``POST /api/chat``: start the turn (or find the one this request repeats) and read it from its start."""
    state = state_of(request)
    caller = caller_of(request)
    chat = parse_chat_body(parse_json_object(await read_body(request, state.settings.max_body_bytes)))
    with state.service.connection(caller) as slot:
        stream_id, st = await _start_turn(state, caller, chat)
        # A continued message's earlier steps are on the page that sent them: only a resume sends them.
        return _respond(state, slot, stream_id, st, chat.continues)


async def _active_turn(state: State, caller: Caller, chat_id: str) -> tuple[Turn, StreamStatus] | None:
    latest = await state.chats.latest(caller.key_id, chat_id)
    if latest is None:
        return None
    st = await _status_or_none(state, caller, latest.stream_id)
    return None if st is None else (latest, st)


async def resume_turn(request: Request) -> Response:
    """``GET /api/chat/{chat_id}/stream``: the chat's active turn from its start; 204 when it has none (never
    had one, it ended, or the chat id is another API key's: the same answer, so nothing leaks)."""
    state = state_of(request)
    caller = caller_of(request)
    chat_id = chat_id_of(request.path_params["chat_id"])
    with state.service.connection(caller) as slot:
        active = await _active_turn(state, caller, chat_id)
        if active is None or active[1].status in TERMINAL_TYPES:
            slot.release()
            return Response(status_code=204)
        state.metrics.resumes.inc()
        turn, st = active
        message_id = continued_message(turn.turn_key)
        earlier = b"" if message_id is None else earlier_steps(await state.service.request_of(turn.stream_id))
        return _respond(state, slot, turn.stream_id, st, message_id, earlier)


async def stop_turn(request: Request) -> Response:
    """``POST /api/chat/{chat_id}/stop``: stop the chat's latest turn (the native cancel: no more tokens are
    computed). 202 with the turn's status, also when it had already ended; 404 when the chat has no turn."""
    state = state_of(request)
    caller = caller_of(request)
    chat_id = chat_id_of(request.path_params["chat_id"])
    active = await _active_turn(state, caller, chat_id)
    if active is None:
        raise NotFound("this chat has no turn")
    stream_id = active[0].stream_id
    status = await state.service.cancel(caller, stream_id)
    return JSONResponse({"id": chat_id, "messageId": str(stream_id), "status": status}, status_code=202)
