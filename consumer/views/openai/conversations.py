"""OpenAI's Conversations API, and ``conversation`` / ``previous_response_id`` on ``POST /v1/responses``: views
of rsb's conversations (consumer.streaming.conversations), whose turns are rsb streams.

- ``POST /v1/conversations`` (``items``, ``metadata``), ``GET|POST|DELETE /v1/conversations/{id}``;
- ``GET|POST /v1/conversations/{id}/items`` (``after``, ``limit``, ``order``: OpenAI's cursor pages),
  ``GET /v1/conversations/{id}/items/{item_id}``.

A conversation's id is ``conv_`` and the 32 hex digits of its UUID; the UUID names it on rsb's own routes
(``/v1/conversations/{uuid}/turns``, ``"conversation"`` on ``POST /v1/streams``). Its items are its turns'
messages, then each turn's answer (its reasoning, its ``message`` and its ``function_call`` s, with the ids the
response's output gives them), in order; as in OpenAI, a response's items join the conversation once it has ended
(a response that ended without any output adds only its input). Item ids: consumer.views.openai.item_ids (an id rsb
wrote before input and output ids were apart still names its item where it names one).
"""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from broker.ascii import decimal
from broker.errors import Conflict, NotFound
from broker.request.generation import Message, ToolCall
from broker.streams.conversations import Begin, Conversation
from broker.streams.turns import Turn, as_messages, items_turn
from consumer.state import caller_of, state_of
from consumer.streaming.conversations import ROUNDS, conversation_name, openai_id
from consumer.views.openai.common import invalid, read_json, validated
from consumer.views.openai.input_items import input_messages
from consumer.views.openai.item_ids import FUNCTION_CALL, FUNCTION_CALL_OUTPUT, MESSAGE, REASONING, ItemId

MAX_ITEMS = 20  # per create (OpenAI's bound)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX = 20, 100
#: What the Conversations routes take, besides what the Responses input items are.
CREATE_FIELDS = frozenset({"items", "metadata"})
_NOT_FOUND = NotFound("no conversation with this id")


def path_name(request: Request) -> str:
    return conversation_name(request.path_params["conversation_id"], _NOT_FOUND)


def metadata_of(raw: object) -> dict[str, str]:
    if raw is None:
        return {}
    if (not isinstance(raw, dict) or len(raw) > MAX_METADATA_PAIRS
            or not all(isinstance(k, str) and 0 < len(k) <= MAX_METADATA_KEY and isinstance(v, str)
                       and len(v) <= MAX_METADATA_VALUE for k, v in raw.items())):
        raise invalid(f"'metadata' must be an object of at most {MAX_METADATA_PAIRS} pairs of strings (keys of at "
                      f"most {MAX_METADATA_KEY} characters, values of at most {MAX_METADATA_VALUE})", "metadata")
    return dict(raw)


def conversation_object(conv: Conversation) -> dict[str, Any]:
    return {"id": openai_id(conv.name), "object": "conversation", "created_at": int(conv.created_at),
            "metadata": conv.metadata}


# -- items ---------------------------------------------------------------------------------------------


def _content(role: str, text: str) -> list[dict[str, Any]]:
    if role == "assistant":
        return [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return [{"type": "input_text", "text": text}]


def turn_items(turn: Turn) -> list[dict[str, Any]]:
    """One turn as conversation items: its input, then its answer, with their ids (consumer.views.openai.item_ids):
    input items by the input message they come from, the answer's by their index in the response's output."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(as_messages(turn.input)):
        if m.role == "tool":
            out.append({"type": FUNCTION_CALL_OUTPUT, "id": str(ItemId.of_input(FUNCTION_CALL_OUTPUT, turn.id, i)),
                        "call_id": m.tool_call_id, "output": m.content, "status": "completed"})
            continue
        if m.content or not m.tool_calls:
            out.append({"type": MESSAGE, "id": str(ItemId.of_input(MESSAGE, turn.id, i)), "role": m.role,
                        "status": "completed", "content": _content(m.role, m.content)})
        out.extend(_call_item(ItemId.of_input(FUNCTION_CALL, turn.id, i, j), c) for j, c in enumerate(m.tool_calls))
    if not turn.has_stream or (turn.output.empty and not turn.output.reasoning):
        return out
    # The response's output items, with the ids its Response object gives them (reasoning, then the message, then
    # the calls: the order a model answers in, and the order the Response lists them when it answered so).
    status = "completed" if turn.status == "done" and turn.finish_reason != "length" else "incomplete"
    answer: list[dict[str, Any]] = []
    if turn.output.reasoning:
        answer.append({"type": REASONING, "id": str(ItemId.of_output(REASONING, turn.id, len(answer))),
                       "summary": [], "status": "completed",
                       "content": [{"type": "reasoning_text", "text": turn.output.reasoning}]})
    if turn.output.text:
        answer.append({"type": MESSAGE, "id": str(ItemId.of_output(MESSAGE, turn.id, len(answer))),
                       "role": "assistant", "status": status, "content": _content("assistant", turn.output.text)})
    for c in turn.output.tool_calls:
        answer.append(_call_item(ItemId.of_output(FUNCTION_CALL, turn.id, len(answer)), c))
    return out + answer


def _call_item(item_id: ItemId, call: ToolCall) -> dict[str, Any]:
    return {"type": FUNCTION_CALL, "id": str(item_id), "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed"}


def _canonical(raw: str) -> str | None:
    """The id rsb gives today to the item ``raw`` names (None: no item could have it)."""
    parsed = ItemId.parse(raw)
    return None if parsed is None else str(parsed)


def all_items(conv: Conversation) -> list[dict[str, Any]]:
    return [item for turn in conv.turns for item in turn_items(turn)]


def input_items(request: Request, raw: object, param: str) -> tuple[Message, ...]:
    """Items to add, as rsb messages: the Responses view's rules for input items, and the bounds of a create's
    messages (their number and characters)."""
    if not isinstance(raw, list) or not raw or len(raw) > MAX_ITEMS:
        raise invalid(f"'{param}' must be a list of 1 to {MAX_ITEMS} items", param)
    return validated(request, {"messages": input_messages(raw, param=param)}, {("messages",): (param,)}).messages or ()


# -- routes --------------------------------------------------------------------------------------------


async def create_conversation(request: Request) -> ASGIApp:
    body = await read_json(request)
    unknown = sorted(set(body) - CREATE_FIELDS)
    if unknown:
        raise invalid(f"unknown parameter(s): {', '.join(unknown)}", unknown[0], code="unknown_parameter")
    metadata = metadata_of(body.get("metadata"))
    state = state_of(request)
    caller = caller_of(request)
    convs = state.conversations
    items = () if body.get("items") is None else input_items(request, body["items"], "items")
    # Shown by every pod: the Redis server's time, not this pod's (as the conversation's own created_at is).
    turns = [items_turn(items, await state.store.clock.now())] if items else []
    name = str(uuid.uuid4())
    with convs.service.quota_counted():
        await convs.conversations.create(caller.key_id, name, convs.owner(caller), convs.limits(caller),
                                         metadata=metadata, turns=turns)
    snap = await convs.get(caller, name)
    return JSONResponse(conversation_object(snap.conversation))


async def retrieve_conversation(request: Request) -> ASGIApp:
    snap = await state_of(request).conversations.get(caller_of(request), path_name(request))
    return JSONResponse(conversation_object(snap.conversation))


async def update_conversation(request: Request) -> ASGIApp:
    body = await read_json(request)
    if "metadata" not in body or set(body) - {"metadata"}:
        raise invalid("the body must be {\"metadata\": {...}}", "metadata")
    convs = state_of(request).conversations
    caller = caller_of(request)
    name = path_name(request)
    if not await convs.conversations.update(caller.key_id, name, metadata_of(body["metadata"])):
        raise _NOT_FOUND
    return JSONResponse(conversation_object((await convs.get(caller, name)).conversation))


async def delete_conversation(request: Request) -> ASGIApp:
    convs = state_of(request).conversations
    name = path_name(request)
    if not await convs.conversations.delete(caller_of(request).key_id, name):
        raise _NOT_FOUND
    return JSONResponse({"id": openai_id(name), "object": "conversation.deleted", "deleted": True})


async def list_items(request: Request) -> ASGIApp:
    q = request.query_params
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("'order' must be asc or desc", "order")
    limit = decimal(q.get("limit", str(LIST_LIMIT_DEFAULT)), max_digits=6)
    if limit is None or not 1 <= limit <= LIST_LIMIT_MAX:
        raise invalid(f"'limit' must be an integer from 1 to {LIST_LIMIT_MAX}", "limit")
    snap = await state_of(request).conversations.get(caller_of(request), path_name(request))
    items = all_items(snap.conversation)
    if order == "desc":
        items.reverse()
    after = q.get("after")
    if after is not None:
        wanted = _canonical(after)
        at = next((i for i, item in enumerate(items) if item["id"] == wanted), None)
        if at is None:
            raise NotFound("no item of this conversation has the id 'after' names")
        items = items[at + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


async def retrieve_item(request: Request) -> ASGIApp:
    snap = await state_of(request).conversations.get(caller_of(request), path_name(request))
    wanted = _canonical(request.path_params["item_id"])
    item = next((i for i in all_items(snap.conversation) if i["id"] == wanted), None)
    if item is None:
        raise NotFound("no item with this id in this conversation")
    return JSONResponse(item)


async def add_items(request: Request) -> ASGIApp:
    """Items appended to the history (not while a response of the conversation runs: 409)."""
    body = await read_json(request)
    if set(body) - {"items"}:
        raise invalid(f"unknown parameter(s): {', '.join(sorted(set(body) - {'items'}))}", code="unknown_parameter")
    items = input_items(request, body.get("items"), "items")
    state = state_of(request)
    convs = state.conversations
    caller = caller_of(request)
    name = path_name(request)
    turn = items_turn(items, await state.store.clock.now())  # the server's time, as every pod shows it
    for _ in range(ROUNDS):
        snap = await convs.get(caller, name)
        if snap.pending_id is not None:
            raise Conflict(f"a response of this conversation is running (stream {snap.pending_id}); add items once "
                           "it has ended")
        with convs.service.quota_counted():
            outcome = await convs.conversations.append(snap.conversation, [turn],
                                                       convs.limits(caller).storage_quota_bytes)
        if outcome is Begin.GONE:
            raise _NOT_FOUND
        if outcome is Begin.RESERVED:
            added = turn_items(turn)
            return JSONResponse({"object": "list", "data": added, "first_id": added[0]["id"],
                                 "last_id": added[-1]["id"], "has_more": False})
    raise Conflict("this conversation kept changing under this request; retry")


async def conversation_resource(request: Request) -> ASGIApp:
    """``/v1/conversations/{id}``: one route for its methods, so a 405 lists them all (``Allow``)."""
    handler = {"GET": retrieve_conversation, "POST": update_conversation, "DELETE": delete_conversation}
    return await handler[request.method](request)


async def items_resource(request: Request) -> ASGIApp:
    """``/v1/conversations/{id}/items``: list (GET) and add (POST)."""
    return await (list_items if request.method == "GET" else add_items)(request)
