"""``item_reference`` input items on ``POST /v1/responses``: an item named by its id (consumer.views.openai.item_ids)
instead of repeated (the AI SDK's Responses provider sends its earlier answers so while ``store`` is true, which rsb's
responses always are). Each is replaced by the item it names before the input is read:

- an earlier response's output item (an assistant message, a function call, or a reasoning item, dropped as the
  input's reasoning items are), read back from that response's stream (the caller's own: another tenant's is a 404
  like any other read);
- an input item of a conversation's turn (a message, a function call, a tool result), read from the conversation the
  create names (``conversation``): only a response of that conversation can name its input items.

An id that names no item rsb holds is a 400 naming it.

Only the items named are read: each response's events from its start until the items named of it have closed (the
next item opened, or the stream ended), never its stored request (which a Responses create keeps: a history of up to
``--max-body-bytes``). Bounded before the first read: at most MAX_ITEM_REFERENCES references, to at most
MAX_REFERENCED_RESPONSES responses, reading at most MAX_READ_BYTES of events in all (issue 42: 64 references in a
4.5 KB request made Redis send 51 MB, the stored requests of 64 responses)."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from broker.streams.conversations import Conversation
from consumer.streaming.reader import REPLAY_PAGE
from consumer.streaming.service import Caller, StreamService
from consumer.views.openai.common import invalid
from consumer.views.openai.conversations import all_items
from consumer.views.openai.item_ids import ItemId
from consumer.views.openai.response_view import ResponseView

#: The conversation a create names, read when one of its input items is referenced (None: it names none).
ConversationOf = Callable[[], Awaitable[Conversation | None]]
MAX_ITEM_REFERENCES = 256  # item_reference items one input may hold
MAX_REFERENCED_RESPONSES = 64  # responses they may name items of (each is read back)
MAX_READ_BYTES = 4 * 1024 * 1024  # events read back for them, in all


async def resolve_references(service: StreamService, caller: Caller, raw: Any, conversation: ConversationOf) -> Any:
    """``raw`` (a Responses ``input``) with every ``item_reference`` replaced by the item it names."""
    if not isinstance(raw, list) or not any(isinstance(i, dict) and i.get("type") == "item_reference" for i in raw):
        return raw
    wanted: dict[uuid.UUID, set[str]] = {}  # output items, by the response they are of
    inputs: set[str] = set()  # input items of the conversation's turns
    count = 0
    for i, item in enumerate(raw):
        if not (isinstance(item, dict) and item.get("type") == "item_reference"):
            continue
        count += 1
        if count > MAX_ITEM_REFERENCES:
            raise invalid(f"input: at most {MAX_ITEM_REFERENCES} item_reference items are accepted", "input")
        ref = ItemId.parse(item.get("id"))
        if ref is None or set(item) - {"type", "id"}:
            raise invalid(f"input[{i}]: an item_reference is {{\"type\": \"item_reference\", \"id\"}} with the id of "
                          "an earlier response's output item (msg_..., fc_..., rs_...) or of an input item of the "
                          "conversation", "input")
        if not ref.output:
            inputs.add(item["id"])
            continue
        wanted.setdefault(ref.stream, set()).add(item["id"])
        if len(wanted) > MAX_REFERENCED_RESPONSES:
            raise invalid(f"input: items of at most {MAX_REFERENCED_RESPONSES} responses may be referenced", "input")
    found: dict[str, dict[str, Any]] = {}
    budget = MAX_READ_BYTES
    for sid, ids in wanted.items():
        budget = await _read_items(service, caller, sid, ids, found, budget)
    if inputs:
        await _conversation_items(conversation, inputs, found)
    out: list[Any] = []
    for i, item in enumerate(raw):
        if not (isinstance(item, dict) and item.get("type") == "item_reference"):
            out.append(item)
        elif item["id"] in found:
            out.append(found[item["id"]])
        else:
            raise invalid(f"input[{i}]: item_reference {item['id']!r} names no item of "
                          f"{'that response' if item['id'] not in inputs else 'this conversation'}", "input")
    return out


async def _conversation_items(conversation: ConversationOf, ids: set[str], found: dict[str, dict[str, Any]]) -> None:
    """The conversation's items ``ids`` names (ids as their client spelled them: an old spelling too) into ``found``."""
    conv = await conversation()
    if conv is None:
        raise invalid(f"input: item_reference {sorted(ids)[0]!r} names an input item of a conversation: only a "
                      "response of that conversation ('conversation') can reference it", "input")
    spellings: dict[str, list[str]] = {}
    for i in ids:
        spellings.setdefault(str(ItemId.parse(i)), []).append(i)
    for item in all_items(conv):
        for given in spellings.get(item["id"], ()):
            found[given] = _as_input(item)


async def _read_items(service: StreamService, caller: Caller, sid: uuid.UUID, ids: set[str],
                      found: dict[str, dict[str, Any]], budget: int) -> int:
    """Fold the response's events until the items ``ids`` closed (or its events so far ran out), putting those
    found in ``found``; what is left of ``budget`` (bytes of events) after."""
    st = await service.status(caller, sid)  # 404 / 410, the owner checked
    view = ResponseView(sid, st, None)  # the items need no request
    after: str | None = None
    while True:
        page = await service.page(sid, after)
        for ev in page:
            budget -= len(ev.data)
            view.feed(ev)
        if budget < 0:
            raise invalid(f"input: the items referenced take more than {MAX_READ_BYTES} bytes to read back; send "
                          "them as input items instead", "input")
        closed = view.items if view.ended else view.items[:-1]  # an item closes when the next one opens
        if ids <= {it.id for it in closed} or len(page) < REPLAY_PAGE:
            break
        after = page[-1].id
    for it in view.items:
        if it.id in ids:
            found[it.id] = _as_input(it.json())
    return budget


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An item as an input item (what a client would have sent in its place)."""
    kind = item["type"]
    if kind == "message":
        return {"type": "message", "role": item["role"], "content": item["content"]}
    if kind == "function_call":
        return {"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                "arguments": item["arguments"]}
    if kind == "function_call_output":
        return {"type": "function_call_output", "call_id": item["call_id"], "output": item["output"]}
    return {"type": "reasoning", "summary": []}
