"""The Responses API in background mode: ``POST /v1/responses``, ``GET /v1/responses/{id}`` (with
``stream=true&starting_after=N`` to resume its events) and ``POST /v1/responses/{id}/cancel``.

A response is an rsb stream: ``resp_<hex of the stream UUID>``. Its Responses events are a pure function of
the stream's events, folded from the first one (``ResponseView``, consumer.views.openai.response_view), so
their ``sequence_number`` s are the same on every read: resuming after N replays the stream from its start
and sends what comes after N.

Input items are read by consumer.views.openai.input_items (``item_reference`` s replaced first:
consumer.views.openai.item_references); ``tools`` (function tools), ``tool_choice`` and ``text.format`` become rsb's
tools, tool_choice and response_format (consumer.views.openai.shapes).
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

from broker.ascii import decimal
from broker.errors import ANY, NotFound, Path
from broker.request.sampling import MAX_TOP_LOGPROBS
from broker.streams.conversations import Conversation
from broker.streams.records import StreamStatus
from consumer.state import caller_of, state_of
from consumer.streaming.service import Slot, StreamService
from consumer.streaming.sse import SSEResponse
from consumer.views.openai.common import (
    NULL,
    STREAM_ID_HEADER,
    DeferredResponse,
    Only,
    boolean,
    check_known,
    check_only,
    dropped_header,
    event_frame,
    invalid,
    null_only,
    read_json,
)
from consumer.views.openai.input_items import input_messages
from consumer.views.openai.item_references import resolve_references
from consumer.views.openai.response_history import HISTORY_RULES, create_response_stream, response_conversation
from consumer.views.openai.response_view import ResponseView
from consumer.views.openai.shapes import chat_tool_choice, chat_tools, response_format

_ID = re.compile(r"\Aresp_([0-9a-fA-F]{32})\Z")
#: Every event type a response's stream carries (the OpenAPI document lists them).
EVENT_TYPES = ("response.created", "response.queued", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.reasoning_text.delta", "response.reasoning_text.done",
               "response.function_call_arguments.delta", "response.function_call_arguments.done",
               "response.content_part.done", "response.output_item.done", "response.completed",
               "response.incomplete", "response.failed")
#: ``starting_after`` has at most 18 digits: a sequence number, never an integer Python must guard.
MAX_SEQUENCE_NUMBER = 10**18 - 1
# How long a cancel waits for the generation to stop, to answer with the final state. The worker stops at
# its next append (milliseconds); past this the answer shows the state as it is.
CANCEL_WAIT_S = 5.0


def parse_response_id(raw: str) -> uuid.UUID | None:
    """The stream id of a response id (None: no response could have it)."""
    m = _ID.match(raw)
    return None if m is None else uuid.UUID(hex=m.group(1))


def _path_stream_id(request: Request) -> uuid.UUID:
    sid = parse_response_id(request.path_params["response_id"])
    if sid is None:
        raise NotFound("no response with this id")  # could never have existed
    return sid


#: What rsb cannot honour, and the one shape in which each parameter is accepted (the OpenAPI document is
#: built from the same rules).
RESTRICTIONS = (
    Only("instructions", {"anyOf": [{"type": "string"}, NULL]}, lambda v: v is None or isinstance(v, str),
         "'instructions' must be a string"),
    *HISTORY_RULES, null_only("prompt"), null_only("reasoning", droppable=True),
    null_only("prompt_cache_retention", droppable=True),
    Only("top_logprobs", {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}, NULL]},
         lambda v: v is None or (isinstance(v, int | float) and not isinstance(v, bool) and float(v).is_integer()
                                 and 0 <= v <= MAX_TOP_LOGPROBS),
         f"'top_logprobs' must be an integer between 0 and {MAX_TOP_LOGPROBS}"),
    Only("truncation", {"anyOf": [{"const": "disabled"}, NULL]}, lambda v: v is None or v == "disabled",
         "only 'truncation': 'disabled' is supported (a too long input is a 400 context_length_exceeded)",
         droppable=True),
    # rsb runs no built-in tool, so what include asks of them is nothing to add; message.output_text.logprobs
    # asks for the logprobs of the message's tokens.
    Only("include", {"anyOf": [{"type": "array", "items": {"type": "string"}}, NULL]},
         lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
         "'include' must be a list of strings"),
    Only("stream_options", {"anyOf": [{"type": "object"}, NULL]}, lambda v: v is None or isinstance(v, dict),
         "'stream_options' must be an object"),
    boolean("stream"), boolean("background"),
)
#: What ``include`` names to have each message token's logprobs (and ``top_logprobs`` of them).
LOGPROBS_INCLUDE = "message.output_text.logprobs"
#: Passed to rsb's own validation as they are (seed and stop are not Responses parameters; accepted, as
#: extra_body, because rsb has them).
PASSED_THROUGH = ("model", "temperature", "top_p", "seed", "stop", "prompt_cache_key", "parallel_tool_calls",
                  "max_tool_calls", "metadata", "user", "safety_identifier", "store", "service_tier")
#: Every parameter a Responses create may carry; any other is a 400 naming it.
KNOWN = frozenset({"input", "max_output_tokens", "tools", "tool_choice", "text", *PASSED_THROUGH,
                   *("instructions", "conversation", "previous_response_id")})
#: rsb's fields, as the Responses API names them (InvalidRequest.said): its tools have no ``function`` level, its
#: output format is ``text.format`` (a json_schema's fields beside its type), its messages are ``input``.
RENAMES: dict[Path, Path] = {
    ("response_format",): ("text", "format"), ("response_format", "json_schema"): ("text", "format"),
    ("tools", ANY, "function"): ("tools", ANY), ("max_tokens",): ("max_output_tokens",), ("messages",): ("input",)}


def _responses_body(body: dict[str, Any], *, drop: bool = False) -> tuple[dict[str, Any], list[str]]:
    """The rsb create body for a Responses request, and the parameters it had dropped (``drop``:
    --drop-unsupported-params). What rsb cannot honour is refused, not ignored, unless it is dropped."""
    dropped = check_only(body, RESTRICTIONS, drop=drop)
    text = body.get("text")
    if drop and isinstance(text, dict) and text.get("verbosity") is not None:
        body["text"] = {k: v for k, v in text.items() if k != "verbosity"}
        dropped.append("text.verbosity")
    check_known(body, KNOWN | {r.name for r in RESTRICTIONS})
    with_history = body.get("previous_response_id") is not None or body.get("conversation") is not None
    messages = input_messages(body.get("input"), instructions=body.get("instructions"), with_history=with_history)
    rsb: dict[str, Any] = {"messages": messages, "max_tokens": body.get("max_output_tokens")}
    for name in PASSED_THROUGH:
        rsb[name] = body.get(name)
    top = int(body.get("top_logprobs") or 0)
    if LOGPROBS_INCLUDE in (body.get("include") or ()) or top:
        rsb["logprobs"], rsb["top_logprobs"] = True, top
    typed = {"tools": chat_tools(body.get("tools")), "tool_choice": chat_tool_choice(body.get("tool_choice")),
             "response_format": response_format(body.get("text"))}
    rsb.update({name: value for name, value in typed.items() if value is not None})
    return rsb, dropped


async def new_view(service: StreamService, stream_id: uuid.UUID, st: StreamStatus) -> ResponseView:
    return ResponseView(stream_id, st, await service.request_of(stream_id))


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
                        after: int, headers: dict[str, str] | None = None) -> ASGIApp:
    state = state_of(request)
    view = await new_view(state.service, stream_id, st)
    # On shutdown the stream just ends: a client resumes with starting_after, as after any dropped connection.
    return SSEResponse(_frames(state.service, stream_id, view, after), shutdown=state.draining,
                       send_timeout_s=state.settings.send_timeout_s,
                       headers={STREAM_ID_HEADER: str(stream_id), **(headers or {})}, shutdown_frame=b"",
                       on_close=slot.release)


def check_item_count(raw: list[Any], max_items: int, param: str = "input") -> None:
    """Before any loop over the items: at most ``max_items`` (a request's messages bound; function calls fold into
    the message before them, so an input has at least as many items as messages)."""
    if len(raw) > max_items:
        raise invalid(f"'{param}' takes at most {max_items} items", param)


async def create_response(request: Request) -> ASGIApp:
    body = await read_json(request)
    state, caller = state_of(request), caller_of(request)
    service = state.service
    if isinstance(body.get("input"), list):
        check_item_count(body["input"], service.limits_for(caller).max_messages)

        async def conversation() -> Conversation | None:  # the one named, when an input item of it is referenced
            name = response_conversation(body.get("conversation"))
            return None if name is None else (await state.conversations.get(caller, name)).conversation

        body["input"] = await resolve_references(service, caller, body["input"], conversation)
    rsb_body, dropped = _responses_body(body, drop=service.drops_unsupported(caller_of(request)))
    headers = dropped_header(dropped)
    stream, background = bool(body.get("stream")), bool(body.get("background"))
    uncounted = 1 if body.get("instructions") is not None else 0
    if not stream and background:
        stream_id, st = await create_response_stream(request, body, rsb_body, RENAMES, uncounted, parse_response_id)
        return JSONResponse((await _snapshot(service, stream_id, st)).response(), headers=headers)
    with service.connection(caller_of(request)) as slot:
        stream_id, st = await create_response_stream(request, body, rsb_body, RENAMES, uncounted, parse_response_id)
        if stream:
            return await _serve_events(request, slot, stream_id, st, -1, headers)

        async def to_end() -> Response:
            view = await new_view(service, stream_id, st)
            await service.fold(stream_id, view.feed)
            return JSONResponse(view.response())

        return DeferredResponse(request, stream_id, to_end, slot.release, headers)


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
        given = decimal(raw_after)
        if given is None or given > MAX_SEQUENCE_NUMBER:
            raise invalid("'starting_after' must be a sequence number (an integer from 0)", "starting_after")
        after = given
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
