"""``item_reference`` input items on ``POST /v1/responses``: an item of an earlier response named by its id instead
of repeated (the AI SDK's Responses provider sends its earlier answers so while ``store`` is true, which rsb's
responses always are). Each is replaced by the item it names, read back from that response's stream (the caller's
own: another tenant's is a 404 like any other read), before the input is read: an assistant message
(``msg_...``), a function call (``fc_...``) or a reasoning item (``rs_...``, dropped as the input's reasoning items
are). An id that names no item of a response rsb holds is a 400 naming it."""

from __future__ import annotations

import re
import uuid
from typing import Any

from consumer.streaming.service import Caller, StreamService
from consumer.views.openai.common import invalid
from consumer.views.openai.response_view import ResponseView

_ITEM_ID = re.compile(r"\A(msg|fc|rs)_([0-9a-f]{32})(?:_([0-9]{1,6}))?\Z")
MAX_REFERENCED_RESPONSES = 64  # responses one input may name items of (each is read back)


async def resolve_references(service: StreamService, caller: Caller, raw: Any) -> Any:
    """``raw`` (a Responses ``input``) with every ``item_reference`` replaced by the item it names."""
    if not isinstance(raw, list) or not any(isinstance(i, dict) and i.get("type") == "item_reference" for i in raw):
        return raw
    views: dict[uuid.UUID, ResponseView] = {}
    out: list[Any] = []
    for i, item in enumerate(raw):
        if not (isinstance(item, dict) and item.get("type") == "item_reference"):
            out.append(item)
            continue
        ref = item.get("id")
        m = _ITEM_ID.match(ref) if isinstance(ref, str) else None
        if m is None or set(item) - {"type", "id"}:
            raise invalid(f"input[{i}]: an item_reference is {{\"type\": \"item_reference\", \"id\"}} with the id of "
                          "an earlier response's output item (msg_..., fc_..., rs_...)", "input")
        sid = uuid.UUID(hex=m.group(2))
        view = views.get(sid)
        if view is None:
            if len(views) >= MAX_REFERENCED_RESPONSES:
                raise invalid(f"input: items of at most {MAX_REFERENCED_RESPONSES} responses may be referenced",
                              "input")
            st = await service.status(caller, sid)  # 404 / 410, the owner checked
            view = ResponseView(sid, st, await service.request_of(sid))
            for ev in await service.events_so_far(sid):
                view.feed(ev)
            views[sid] = view
        found = next((it for it in view.items if it.id == ref), None)
        if found is None:
            raise invalid(f"input[{i}]: item_reference {ref!r} names no output item of that response", "input")
        out.append(_as_input(found.json()))
    return out


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] == "message":
        return {"type": "message", "role": "assistant", "content": item["content"]}
    if item["type"] == "function_call":
        return {"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                "arguments": item["arguments"]}
    return {"type": "reasoning", "summary": []}
