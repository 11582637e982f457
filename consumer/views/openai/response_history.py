"""``conversation`` and ``previous_response_id`` on ``POST /v1/responses``: a response with the history in front
of its input, either a conversation's turn (consumer.streaming.conversations) or the continuation of an earlier
response (its input after its own instructions, and its answer), as OpenAI's Responses API has them."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any

from starlette.requests import Request

from broker.errors import NotFound, Path
from broker.request.history import History
from broker.request.on_busy import ON_BUSY
from broker.streams.records import StreamStatus
from consumer.state import caller_of, state_of
from consumer.streaming.conversations import conversation_name
from consumer.views.openai.common import (
    NULL,
    Only,
    create_stream,
    invalid,
    stream_id_for,
    unanswered_result,
    validated,
)
from consumer.views.openai.response_view import response_id

#: ``conversation`` and ``previous_response_id`` as the Responses view accepts them (its RESTRICTIONS; the OpenAPI
#: document is built from the same rules). An id that names nothing is a 404, whatever its spelling.
HISTORY_RULES = (
    Only("conversation", {"anyOf": [{"type": "string"}, {"type": "object", "required": ["id"],
                                                         "additionalProperties": False,
                                                         "properties": {"id": {"type": "string"}}}, NULL]},
         lambda v: v is None or isinstance(v, str) or (isinstance(v, dict) and set(v) == {"id"}
                                                         and isinstance(v["id"], str)),
         "'conversation' must be a conversation id (conv_...) or {\"id\": ...}"),
    Only("previous_response_id", {"anyOf": [{"type": "string"}, NULL]}, lambda v: v is None or isinstance(v, str),
         "'previous_response_id' must be a response id (resp_...)"),
    # rsb's: what a conversation's turn does while another runs (broker.request.on_busy); without one it changes
    # nothing.
    Only("on_busy", {"anyOf": [{"enum": list(ON_BUSY)}, NULL]}, lambda v: v is None or v in ON_BUSY,
         f"'on_busy' must be one of {', '.join(ON_BUSY)}"),
)


def response_conversation(raw: object) -> str | None:
    """The conversation a Responses create names: ``"conv_..."`` or ``{"id": "conv_..."}`` (None: none)."""
    if raw is None:
        return None
    value = raw.get("id") if isinstance(raw, dict) and set(raw) == {"id"} else raw
    if not isinstance(value, str):
        raise invalid("'conversation' must be a conversation id (conv_...) or {\"id\": ...}", "conversation")
    return conversation_name(value, NotFound("no conversation with this id"))


def previous_response(raw: object, parse: Callable[[str], uuid.UUID | None]) -> uuid.UUID | None:
    """The stream of the response a Responses create continues (``parse``: a response id's stream id)."""
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise invalid("'previous_response_id' must be a response id (resp_...)", "previous_response_id")
    sid = parse(raw)
    if sid is None:
        raise NotFound("no response with this id (previous_response_id)")
    return sid


async def create_response_stream(request: Request, body: dict[str, Any], rsb_body: dict[str, Any],
                                 renames: Mapping[Path, Path], lead: int,
                                 parse: Callable[[str], uuid.UUID | None]) -> tuple[uuid.UUID, StreamStatus]:
    """The stream of a Responses create, with the history ``conversation`` or ``previous_response_id`` names in
    front of its input. ``lead``: its instructions (a leading system message, never carried into a later
    response). A response with neither still records where its instructions end, so that a later one can
    continue it without them, as OpenAI's does."""
    conversation = response_conversation(body.get("conversation"))
    previous = previous_response(body.get("previous_response_id"), parse)
    if conversation is not None and previous is not None:
        raise invalid("'conversation' and 'previous_response_id' cannot be used together", "previous_response_id")
    if conversation is None and previous is None:
        return await create_stream(request, rsb_body, renames, uncounted_messages=lead,
                                   history=History(lead=lead, start=lead), hook_name=response_id)
    state = state_of(request)
    caller = caller_of(request)
    gen_request = validated(request, rsb_body, renames, uncounted_messages=lead)
    stream_id = stream_id_for(request, caller)
    if conversation is not None:
        started = await state.conversations.start(caller, conversation, gen_request, lead=lead, stream_id=stream_id,
                                                  implicit=False, hook_name=response_id,
                                                  on_busy=state.service.on_busy(caller, body.get("on_busy")))
        stream_id = started.stream_id
    else:
        assert previous is not None
        assembled = await state.conversations.continue_response(caller, previous, gen_request, lead)
        messages = [m.as_openai() for m in assembled.messages or ()]
        unanswered = unanswered_result(messages)
        if unanswered is not None:
            call_id = str(messages[unanswered]["tool_call_id"])
            raise invalid(f"input: no function_call with call_id {call_id[:64]!r} comes before this output, in the "
                          "input or in the previous responses", "input")
        await state.service.create(caller, assembled, stream_id, hook_name=response_id)
    return stream_id, await state.service.status(caller, stream_id)
