"""The Responses API in background mode: ``POST /v1/responses``, ``GET /v1/responses/{id}`` (with
``stream=true&starting_after=N`` to resume its events) and ``POST /v1/responses/{id}/cancel``.

A response is an rsb stream: ``resp_<hex of the stream UUID>``. Its Responses events are a pure function of
the stream's events, folded from the first one (``ResponseView``), so their ``sequence_number`` s are the
same on every read: resuming after N replays the stream from its start and sends what comes after N.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp

from broker.errors import NotFound
from broker.events import Event, EventType, parse_event_id
from broker.request import GenerationRequest
from broker.streams.records import StreamStatus
from consumer.state import caller_of, state_of
from consumer.streaming.conversations import openai_id
from consumer.streaming.service import Slot, StreamService
from consumer.streaming.sse import SSEResponse
from consumer.views.openai.common import (
    NULL,
    ROLES,
    STREAM_ID_HEADER,
    DeferredResponse,
    Only,
    boolean,
    check_only,
    event_frame,
    invalid,
    no_items,
    null_only,
    read_json,
    text_format,
    text_of,
    usage_tokens,
)
from consumer.views.openai.response_history import HISTORY_RULES, create_response_stream

_ID = re.compile(r"\Aresp_([0-9a-fA-F]{32})\Z")
#: Every event type a response's stream carries (the OpenAPI document lists them).
EVENT_TYPES = ("response.created", "response.queued", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done", "response.completed",
               "response.incomplete", "response.failed")
#: ``starting_after`` has at most 18 digits: a sequence number, never an integer Python must guard.
MAX_SEQUENCE_NUMBER = 10**18 - 1
# How long a cancel waits for the generation to stop, to answer with the final state. The worker stops at
# its next append (milliseconds); past this the answer shows the state as it is.
CANCEL_WAIT_S = 5.0


def response_id(stream_id: uuid.UUID) -> str:
    return f"resp_{stream_id.hex}"


def parse_response_id(raw: str) -> uuid.UUID | None:
    """The stream id of a response id (None: no response could have it)."""
    m = _ID.match(raw)
    return None if m is None else uuid.UUID(hex=m.group(1))


def _path_stream_id(request: Request) -> uuid.UUID:
    sid = parse_response_id(request.path_params["response_id"])
    if sid is None:
        raise NotFound("no response with this id")  # could never have existed
    return sid


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    prompt, completion = usage_tokens(usage)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


class ResponseView:
    """Folds one stream's events, in order from the first, into Responses events and the Response object.

    rsb event     Responses events
    (before all)  response.created
    first queued  response.queued
    started       response.in_progress, response.output_item.added, response.content_part.added
    delta         response.output_text.delta
    terminal      response.output_text.done, response.content_part.done, response.output_item.done (when
                  started), then response.completed (done, stop), response.incomplete (done, length:
                  max_output_tokens; or cancelled: status "cancelled"), response.failed (error)

    OpenAI's stream has no event for a cancelled response; ``response.incomplete`` is the terminal event
    that clients already handle for "ended before its end", and its response says ``cancelled``.
    """

    def __init__(self, stream_id: uuid.UUID, st: StreamStatus, req: GenerationRequest | None,
                 default_model: str) -> None:
        self.id = response_id(stream_id)
        self.item_id = f"msg_{stream_id.hex}"
        # Only what never changes goes into the objects, so every read folds to the same events: the
        # request as stored, not StreamStatus.model (the engine's name replaces it when the stream ends).
        self.created_at = int(st.created_at)
        self.model = (req.model if req is not None else None) or default_model
        self.temperature = req.temperature if req is not None else None
        self.top_p = req.top_p if req is not None else None
        self.max_output_tokens = st.max_tokens
        history = req.history if req is not None else None
        self.conversation = None if history is None or history.conversation is None else {
            "id": openai_id(history.conversation)}
        self.previous = None if history is None or history.previous is None else response_id(
            uuid.UUID(history.previous))
        self.seq = 0
        self.status = "queued"
        self.queued = False
        self.started = False
        self.ended = False
        self.parts: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete: dict[str, Any] | None = None
        self.completed_at: int | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def _event(self, type_: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": type_, **fields, "sequence_number": self.seq}
        self.seq += 1
        return ev

    def _part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def _item(self) -> dict[str, Any]:
        if not self.ended:
            status = "in_progress"
        else:
            status = "completed" if self.status == "completed" else "incomplete"
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status,
                "content": [self._part()] if self.started else []}

    def response(self) -> dict[str, Any]:
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            # Every rsb generation runs detached from its connections: background, whatever was asked.
            "background": True, "completed_at": self.completed_at, "error": self.error,
            "incomplete_details": self.incomplete, "instructions": None,
            "max_output_tokens": self.max_output_tokens, "metadata": {}, "model": self.model,
            "output": [self._item()] if self.started else [], "parallel_tool_calls": False,
            "previous_response_id": self.previous, "conversation": self.conversation, "store": True,
            "temperature": self.temperature, "top_p": self.top_p,
            "text": {"format": {"type": "text"}}, "tool_choice": "none", "tools": [], "truncation": "disabled",
            "usage": _usage(self.usage),
        }

    def opening(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response())]

    def _start(self) -> list[dict[str, Any]]:
        self.status = "in_progress"
        out = [self._event("response.in_progress", response=self.response())]
        self.started = True
        out.append(self._event("response.output_item.added", output_index=0, item=self._item()))
        out.append(self._event("response.content_part.added", item_id=self.item_id, output_index=0,
                               content_index=0, part=self._part()))
        return out

    def feed(self, ev: Event) -> list[dict[str, Any]]:
        if self.ended:
            return []
        if ev.type == EventType.QUEUED:
            if self.queued or self.started:
                return []  # later positions in the queue: the Response object has no field for them
            self.queued = True
            return [self._event("response.queued", response=self.response())]
        if ev.type == EventType.STARTED:
            return [] if self.started else self._start()
        if ev.type == EventType.DELTA:
            out = [] if self.started else self._start()
            text = ev.json()["text"]
            self.parts.append(text)
            out.append(self._event("response.output_text.delta", item_id=self.item_id, output_index=0,
                                   content_index=0, delta=text, logprobs=[]))
            return out
        if not ev.is_terminal:
            return []  # an event type this view does not know: nothing to say about it
        return self._end(ev)

    def _end(self, ev: Event) -> list[dict[str, Any]]:
        data = ev.json()
        self.usage = data.get("usage")
        key = parse_event_id(ev.id)  # the server's clock when the stream ended (ids are Redis times)
        self.completed_at = key[0] // 1000 if key is not None else None
        if ev.type == EventType.DONE and data.get("finish_reason") != "length":
            self.status, final = "completed", "response.completed"
        elif ev.type == EventType.DONE:
            self.status, final = "incomplete", "response.incomplete"
            self.incomplete = {"reason": "max_output_tokens"}
        elif ev.type == EventType.CANCELLED:
            self.status, final = "cancelled", "response.incomplete"
        else:
            self.status, final = "failed", "response.failed"
            # ResponseError.code is a closed list; rsb's code (deadline, worker_lost, engine) goes in the text.
            self.error = {"code": "server_error",
                          "message": f"{data.get('code', 'engine')}: {data.get('message', 'generation failed')}"}
        self.ended = True
        out = []
        if self.started:
            out.append(self._event("response.output_text.done", item_id=self.item_id, output_index=0,
                                   content_index=0, text=self.text, logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=self.item_id, output_index=0,
                                   content_index=0, part=self._part()))
            out.append(self._event("response.output_item.done", output_index=0, item=self._item()))
        out.append(self._event(final, response=self.response()))
        return out


#: The content parts an input message may carry.
INPUT_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
#: What rsb cannot honour, and the one shape in which each parameter is accepted (the OpenAPI document is
#: built from the same rules).
RESTRICTIONS = (
    Only("instructions", {"anyOf": [{"type": "string"}, NULL]}, lambda v: v is None or isinstance(v, str),
         "'instructions' must be a string"),
    no_items("tools"),
    *HISTORY_RULES, null_only("prompt"),
    Only("text", {"anyOf": [{"type": "object", "properties": {"format": text_format("format", "").schema}}, NULL]},
         lambda v: v is None or (isinstance(v, dict) and text_format("format", "").accepts(v.get("format"))),
         "only the text format is supported"),
    Only("top_logprobs", {"anyOf": [{"const": 0}, NULL]},
         lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v == 0),
         "logprobs are not supported"),
    boolean("stream"), boolean("background"), boolean("store"),
)
#: Passed to rsb's own validation as they are (seed and stop are not Responses parameters; accepted, as
#: extra_body, because rsb has them).
PASSED_THROUGH = ("model", "temperature", "top_p", "seed", "stop")


def _input_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    raw = body.get("input")
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
        return messages
    if not isinstance(raw, list) or not raw:
        raise invalid("'input' must be a string or a non-empty list of messages", "input")
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise invalid(f"input[{i}]: only message items are supported, not {kind!r}", "input")
        role = ROLES.get(str(item.get("role")))
        if role is None:
            raise invalid(f"input[{i}].role must be one of system, developer, user, assistant", "input")
        messages.append({"role": role, "content": text_of(item.get("content"), f"input[{i}]", INPUT_TEXT_PARTS)})
    return messages


def _responses_body(body: dict[str, Any]) -> dict[str, Any]:
    """The rsb create body for a Responses request. What rsb cannot honour is refused, not ignored."""
    check_only(body, RESTRICTIONS)
    rsb: dict[str, Any] = {"messages": _input_messages(body), "max_tokens": body.get("max_output_tokens")}
    for name in PASSED_THROUGH:
        rsb[name] = body.get(name)
    return rsb


async def new_view(service: StreamService, stream_id: uuid.UUID, st: StreamStatus) -> ResponseView:
    return ResponseView(stream_id, st, await service.request_of(stream_id), await service.default_model())


async def _frames(service: StreamService, stream_id: uuid.UUID, view: ResponseView,
                  after: int) -> AsyncIterator[bytes | None]:
    for e in view.opening():
        if e["sequence_number"] > after:
            yield event_frame(e)
    async with aclosing(service.tail(stream_id)) as events:
        async for ev in events:
            if ev is None:
                yield None
                continue
            for e in view.feed(ev):
                if e["sequence_number"] > after:
                    yield event_frame(e)


async def _snapshot(service: StreamService, stream_id: uuid.UUID, st: StreamStatus) -> ResponseView:
    """The response as it stands: every event so far, without waiting for more."""
    view = await new_view(service, stream_id, st)
    for ev in await service.events_so_far(stream_id):
        view.feed(ev)
    return view


async def _serve_events(request: Request, slot: Slot, stream_id: uuid.UUID, st: StreamStatus,
                        after: int) -> ASGIApp:
    state = state_of(request)
    view = await new_view(state.service, stream_id, st)
    # On shutdown the stream just ends: a client resumes with starting_after, as after any dropped connection.
    return SSEResponse(_frames(state.service, stream_id, view, after), shutdown=state.draining,
                       send_timeout_s=state.settings.send_timeout_s, headers={STREAM_ID_HEADER: str(stream_id)},
                       shutdown_frame=b"", on_close=slot.release)


async def create_response(request: Request) -> ASGIApp:
    body = await read_json(request)
    rsb_body = _responses_body(body)
    stream, background = bool(body.get("stream")), bool(body.get("background"))
    renames = {"max_tokens": "max_output_tokens", "messages": "input"}
    uncounted = 1 if body.get("instructions") is not None else 0
    service = state_of(request).service
    if not stream and background:
        stream_id, st = await create_response_stream(request, body, rsb_body, renames, uncounted, parse_response_id)
        return JSONResponse((await _snapshot(service, stream_id, st)).response())
    with service.connection(caller_of(request)) as slot:
        stream_id, st = await create_response_stream(request, body, rsb_body, renames, uncounted, parse_response_id)
        if stream:
            return await _serve_events(request, slot, stream_id, st, -1)

        async def to_end() -> Response:
            view = await new_view(service, stream_id, st)
            await service.fold(stream_id, view.feed)
            return JSONResponse(view.response())

        return DeferredResponse(request, stream_id, to_end, slot.release)


async def retrieve_response(request: Request) -> ASGIApp:
    service = state_of(request).service
    stream_id = _path_stream_id(request)
    q = request.query_params
    stream = q.get("stream", "false")
    if stream not in ("true", "false"):
        raise invalid("'stream' must be true or false", "stream")
    raw_after = q.get("starting_after")
    after = -1
    if raw_after is not None:
        if not raw_after.isdigit() or int(raw_after) > MAX_SEQUENCE_NUMBER:
            raise invalid("'starting_after' must be a sequence number (an integer from 0)", "starting_after")
        after = int(raw_after)
    caller = caller_of(request)
    st = await service.status(caller, stream_id)
    if stream == "false":
        return JSONResponse((await _snapshot(service, stream_id, st)).response())
    with service.connection(caller) as slot:
        return await _serve_events(request, slot, stream_id, st, after)


async def cancel_response(request: Request) -> ASGIApp:
    service = state_of(request).service
    stream_id = _path_stream_id(request)
    caller = caller_of(request)
    st = await service.status(caller, stream_id)
    await service.cancel(caller, stream_id)
    # Answer with the state after the generation stopped (OpenAI's cancel answers "cancelled"); a
    # stream that had already ended is answered as it is (cancelling it changes nothing).
    view = await new_view(service, stream_id, st)
    if not await service.fold(stream_id, view.feed, timeout_s=CANCEL_WAIT_S):
        view = await _snapshot(service, stream_id, st)
    return JSONResponse(view.response())
