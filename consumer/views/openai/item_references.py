"""``item_reference`` input items on ``POST /v1/responses``: an item of an earlier response named by its id instead
of repeated (the AI SDK's Responses provider sends its earlier answers so while ``store`` is true, which rsb's
responses always are). Each is replaced by the item it names, read back from that response's stream (the caller's
own: another tenant's is a 404 like any other read), before the input is read: an assistant message
(``msg_...``), a function call (``fc_...``) or a reasoning item (``rs_...``, dropped as the input's reasoning items
are). An id that names no item of a response rsb holds is a 400 naming it.

Only the items named are read: each response's events from its start until the items named of it have closed (the
next item opened, or the stream ended), never its stored request (which a Responses create keeps: a history of up to
``--max-body-bytes``). Bounded before the first read: at most MAX_ITEM_REFERENCES references, to at most
MAX_REFERENCED_RESPONSES responses, reading at most MAX_READ_BYTES of events in all (issue 42: 64 references in a
4.5 KB request made Redis send 51 MB, the stored requests of 64 responses)."""

from __future__ import annotations

import re
import uuid
from typing import Any

from consumer.streaming.reader import REPLAY_PAGE
from consumer.streaming.service import Caller, StreamService
from consumer.views.openai.common import invalid
from consumer.views.openai.response_view import ResponseView

_ITEM_ID = re.compile(r"\A(msg|fc|rs)_([0-9a-f]{32})(?:_([0-9]{1,6}))?\Z")
MAX_ITEM_REFERENCES = 256  # item_reference items one input may hold
MAX_REFERENCED_RESPONSES = 64  # responses they may name items of (each is read back)
MAX_READ_BYTES = 4 * 1024 * 1024  # events read back for them, in all


async def resolve_references(service: StreamService, caller: Caller, raw: Any) -> Any:
    """``raw`` (a Responses ``input``) with every ``item_reference`` replaced by the item it names."""
    if not isinstance(raw, list) or not any(isinstance(i, dict) and i.get("type") == "item_reference" for i in raw):
        return raw
    wanted: dict[uuid.UUID, set[str]] = {}
    count = 0
    for i, item in enumerate(raw):
        if not (isinstance(item, dict) and item.get("type") == "item_reference"):
            continue
        count += 1
        if count > MAX_ITEM_REFERENCES:
            raise invalid(f"input: at most {MAX_ITEM_REFERENCES} item_reference items are accepted", "input")
        ref = item.get("id")
        m = _ITEM_ID.match(ref) if isinstance(ref, str) else None
        if m is None or set(item) - {"type", "id"}:
            raise invalid(f"input[{i}]: an item_reference is {{\"type\": \"item_reference\", \"id\"}} with the id of "
                          "an earlier response's output item (msg_..., fc_..., rs_...)", "input")
        wanted.setdefault(uuid.UUID(hex=m.group(2)), set()).add(m.group(0))
        if len(wanted) > MAX_REFERENCED_RESPONSES:
            raise invalid(f"input: items of at most {MAX_REFERENCED_RESPONSES} responses may be referenced", "input")
    found: dict[str, dict[str, Any]] = {}
    budget = MAX_READ_BYTES
    for sid, ids in wanted.items():
        budget = await _read_items(service, caller, sid, ids, found, budget)
    out: list[Any] = []
    for i, item in enumerate(raw):
        if not (isinstance(item, dict) and item.get("type") == "item_reference"):
            out.append(item)
        elif item["id"] in found:
            out.append(found[item["id"]])
        else:
            raise invalid(f"input[{i}]: item_reference {item['id']!r} names no output item of that response", "input")
    return out


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
    if item["type"] == "message":
        return {"type": "message", "role": "assistant", "content": item["content"]}
    if item["type"] == "function_call":
        return {"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                "arguments": item["arguments"]}
    return {"type": "reasoning", "summary": []}
