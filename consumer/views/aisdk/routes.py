"""The routes of the AI SDK view: send a turn, resume the chat's active turn, stop it."""

from __future__ import annotations

import dataclasses
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from broker.errors import Conflict, Expired, InvalidRequest, NotFound
from broker.events import TERMINAL_TYPES
from broker.request.generation import parse_json_object, validate_create_body
from broker.request.on_busy import REJECT
from broker.streams.conversations import Begin, absent
from broker.streams.records import StreamStatus
from consumer.edge.http import read_body
from consumer.state import State, caller_of, state_of
from consumer.streaming.conversations import ROUNDS
from consumer.streaming.service import Caller, Slot
from consumer.streaming.snapshots import from_latest
from consumer.streaming.sse import STREAM_ID_HEADER, SSEResponse
from consumer.views.aisdk.history import plan_turn, ui_messages
from consumer.views.aisdk.request import REGENERATE, ChatRequest, chat_id_of, parse_chat_body
from consumer.views.aisdk.stream import HEADERS, SHUTDOWN_FRAME, earlier_steps, turn_frames

# Turn stream ids live in their own uuid5 namespace (see turn_stream_id).
_TURN_NAMESPACE = uuid.UUID("0d5b6f3e-8c1a-4f6e-a2b9-3c7d9e4f1a20")


def reset_step_of(request: Request) -> bool:
    """``?reset_step=1`` (on ``api``, which ai@7's transport keeps on the resume URL too): after a failover took
    back text, send ``reset-step`` (ai >= 7.0.70) and the turn as it now is, instead of ending the response."""
    raw = request.query_params.get("reset_step")
    if raw is None or raw in ("0", "false"):
        return False
    if raw in ("1", "true"):
        return True
    raise InvalidRequest("'reset_step' must be 1 or 0 (true or false)")


def _respond(state: State, slot: Slot, request: Request, stream_id: uuid.UUID, st: StreamStatus,
             message_id: str | None = None, earlier: bytes = b"", *, latest: bool = False) -> Response:
    state.metrics.reads.inc()
    reset_step = reset_step_of(request)
    service = state.service
    batches = (service.latest(stream_id, None, watched=st.watched, snapshot=latest) if latest or reset_step
               else service.batches(stream_id, None, watched=st.watched, resets=False))
    frames = turn_frames(batches, stream_id, state.metrics, message_id, earlier, latest=latest,
                         reset_step=reset_step)
    return SSEResponse(frames, shutdown=state.draining, send_timeout_s=state.settings.send_timeout_s,
                       headers={**HEADERS, STREAM_ID_HEADER: str(stream_id)}, shutdown_frame=SHUTDOWN_FRAME,
                       on_close=slot.release)


async def _status_or_none(state: State, caller: Caller, stream_id: uuid.UUID) -> StreamStatus | None:
    try:
        return await state.service.status(caller, stream_id)
    except (NotFound, Expired):  # past its retention: the chat has no turn any more
        return None


def turn_stream_id(key_id: str, chat_id: str, version: int, turn: int, turn_key: str) -> uuid.UUID:
    """The stream id of a chat's turn: the same for the same request made on the same history (the
    conversation's version and turn count), so identical POSTs (a retry storm, two tabs) name one stream, and
    its CREATE, idempotent per id, makes one generation. A regenerate's identical bodies get new ids once the
    turn they redo has ended: its branch bumps the version."""
    return uuid.uuid5(_TURN_NAMESPACE, f"{key_id}\n{chat_id}\n{version}\n{turn}\n{turn_key}")


async def _start_turn(state: State, caller: Caller, chat: ChatRequest
                      ) -> tuple[uuid.UUID, StreamStatus, str | None]:
    """The turn this request names: a turn it repeats (a retry, a second tab), else a new one on the
    conversation's history; with the id of the message its answer shows in when that is not its stream id (a
    continuation). While another turn of the chat runs: 409, or (``on_busy``) a turn in line behind it."""
    convs = state.conversations
    _, request = validate_create_body(chat.create_body, state.service.limits_for(caller))
    messages = request.messages or ()
    turn_key = chat.turn_key(request)
    on_busy = state.service.on_busy(caller, chat.on_busy)
    for _ in range(ROUNDS):
        snap = await convs.snapshot(caller, chat.chat_id)
        conv = snap.conversation if snap is not None else absent(caller.key_id, chat.chat_id)
        pending = snap.pending_id if snap is not None else None
        turns = conv.turns
        if snap is not None and pending is not None and on_busy != REJECT:
            # The body may hold the turns that run and wait (their messages; their answers are to come).
            unfinished = [await convs.running_turn(snap), *await convs.waiting_turns(snap)]
            turns = (*turns, *[t for t in unfinished if t is not None])
        plan = plan_turn(turns, chat.message_ids, messages, plain_send=chat.plain_send,
                         regenerate=chat.trigger == REGENERATE)
        repeat = plan.repeat
        if repeat is not None and (st := await _status_or_none(state, caller, repeat.id)) is not None:
            # A retry of the chat's last turn: the same answer, no second generation.
            return repeat.id, st, repeat.answer_id
        stream_id = turn_stream_id(caller.key_id, chat.chat_id, conv.version, plan.keep, turn_key)
        if pending is not None and on_busy != REJECT:
            if stream_id == pending or stream_id in conv.waiting:
                if (st := await _status_or_none(state, caller, stream_id)) is not None:
                    return stream_id, st, chat.continues  # the same POST again: its turn, running or in line
            elif plan.keep < len(turns):
                raise Conflict("this request edits or regenerates a turn while the chat runs one: stop it "
                               "(POST /api/chat/{id}/stop) or wait for its end")
            new = dataclasses.replace(request, messages=messages[plan.start:])
            marked = convs.turn_request(conv, new, 0, chat.message_ids[plan.start:], chat.continues)
            if await convs.queue(caller, conv, marked, stream_id, on_busy) is not None:
                return stream_id, await state.service.status(caller, stream_id), chat.continues
            continue  # nothing runs any more, or the history changed: plan again on what it is now
        if pending is not None:
            if pending != stream_id:
                raise Conflict(f"a turn of this chat is running (message {pending}); stop it "
                               f"(POST /api/chat/{{id}}/stop), wait for its end, or send with on_busy 'interrupt' "
                               f"or 'enqueue'")
        elif plan.keep < conv.count:
            outcome, version = await convs.conversations.branch(conv, plan.keep)
            if outcome is not Begin.RESERVED:
                continue  # a turn began, or the history changed: plan again on what it is now
            conv = dataclasses.replace(conv, version=version, count=plan.keep, turns=conv.turns[:plan.keep],
                                       bytes=sum(len(t.to_json()) for t in conv.turns[:plan.keep]))
            stream_id = turn_stream_id(caller.key_id, chat.chat_id, conv.version, plan.keep, turn_key)
        new = dataclasses.replace(request, messages=messages[plan.start:])
        assembled = convs.assemble(caller, conv, new, 0, chat.message_ids[plan.start:], chat.continues)
        if await convs.begin(caller, conv, assembled, stream_id, busy=on_busy) is not None:
            return stream_id, await state.service.status(caller, stream_id), chat.continues
    raise Conflict("this chat kept changing under this request; retry")


async def send_turn(request: Request) -> Response:
    """``POST /api/chat``: start the turn (or find the one this request repeats) and read it from its start."""
    state = state_of(request)
    caller = caller_of(request)
    reset_step_of(request)  # checked before the turn starts
    chat = parse_chat_body(parse_json_object(await read_body(request, state.settings.max_body_bytes)))
    with state.service.connection(caller) as slot:
        stream_id, st, message_id = await _start_turn(state, caller, chat)
        # A continued message's earlier steps are on the page that sent them: only a resume sends them.
        return _respond(state, slot, request, stream_id, st, message_id)


async def _latest_turn(state: State, caller: Caller, chat_id: str) -> tuple[uuid.UUID, StreamStatus] | None:
    """The chat's running turn, else its last answered one (None: it has none, or its stream expired)."""
    snap = await state.conversations.snapshot(caller, chat_id)
    if snap is None:
        return None
    if snap.pending is not None and snap.pending_id is not None:
        return snap.pending_id, snap.pending
    last = next((t for t in reversed(snap.conversation.turns) if t.has_stream), None)
    st = None if last is None else await _status_or_none(state, caller, last.id)
    return None if last is None or st is None else (last.id, st)


async def resume_turn(request: Request) -> Response:
    """``GET /api/chat/{chat_id}/stream``: the chat's active turn from its start (``?from=latest``: its message so
    far, then the tail); 204 when it has none (never had one, it ended, or the chat id is another API key's: the
    same answer, so nothing leaks)."""
    state = state_of(request)
    caller = caller_of(request)
    chat_id = chat_id_of(request.path_params["chat_id"])
    latest = from_latest(request.query_params)
    reset_step_of(request)  # checked before anything is read
    with state.service.connection(caller) as slot:
        active = await _latest_turn(state, caller, chat_id)
        if active is None or active[1].status in TERMINAL_TYPES:
            slot.release()
            return Response(status_code=204)
        state.metrics.resumes.inc()
        stream_id, st = active
        turn_request = await state.service.request_of(stream_id)
        history = turn_request.history if turn_request is not None else None
        message_id = history.answer_id if history is not None else None
        earlier = b"" if message_id is None else earlier_steps(turn_request)
        return _respond(state, slot, request, stream_id, st, message_id, earlier, latest=latest)


async def stop_turn(request: Request) -> Response:
    """``POST /api/chat/{chat_id}/stop``: stop the chat's latest turn (the native cancel: no more tokens are
    computed). 202 with the turn's status, also when it had already ended; 404 when the chat has no turn."""
    state = state_of(request)
    caller = caller_of(request)
    chat_id = chat_id_of(request.path_params["chat_id"])
    active = await _latest_turn(state, caller, chat_id)
    if active is None:
        raise NotFound("this chat has no turn")
    stream_id = active[0]
    status = await state.service.cancel(caller, stream_id)
    return JSONResponse({"id": chat_id, "messageId": str(stream_id), "status": status}, status_code=202)


async def chat_messages(request: Request) -> Response:
    """``GET /api/chat/{chat_id}/messages``: the chat as ``UIMessage`` s, for another device's ``useChat`` to start
    from (``messages``); a running turn's messages come last, and ``resumeStream()`` brings its answer. 404 when
    the caller has no chat of this id (another key's chat included)."""
    state = state_of(request)
    caller = caller_of(request)
    chat_id = chat_id_of(request.path_params["chat_id"])
    snap = await state.conversations.get(caller, chat_id)
    running = await state.conversations.running_turn(snap)
    waiting = await state.conversations.waiting_turns(snap)
    return JSONResponse({"id": chat_id, "messages": ui_messages(snap.conversation.turns, running, waiting),
                         "active": running is not None})
