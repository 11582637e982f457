"""Responses input items (``input`` on ``POST /v1/responses``, ``items`` on the Conversations routes) as rsb messages:
the one reader of them.

Messages (``developer`` is ``system``), ``function_call`` items (the calls of an earlier answer: they become the
assistant message's tool calls), ``function_call_output`` items (tool results, each answering a call made before it:
common.unanswered_result) and ``reasoning`` items, which are dropped: models are not given their past reasoning, as
chat templates drop it. ``item_reference`` s are replaced by the items they name before (item_references).
"""

from __future__ import annotations

from typing import Any

from consumer.views.openai.common import ROLES, invalid, text_of, unanswered_result

#: The content parts an input message (or a function call's output) may carry.
INPUT_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
#: The input items rsb reads.
INPUT_ITEMS = ("message", "function_call", "function_call_output", "reasoning")


def _string(item: dict[str, Any], name: str, param: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str) or (name != "arguments" and not value):
        raise invalid(f"{param}[{i}].{name} must be a{'' if name == 'arguments' else ' non-empty'} string", param)
    return value


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], param: str, i: int) -> None:
    """A ``function_call`` item as a tool call of the assistant message it belongs to: the one right before it (the
    text and calls of one answer are one assistant message), or a new one."""
    call = {"id": _string(item, "call_id", param, i), "type": "function",
            "function": {"name": _string(item, "name", param, i), "arguments": _string(item, "arguments", param, i)}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def input_messages(raw: object, *, instructions: object = None, param: str = "input",
                   with_history: bool = False) -> list[dict[str, Any]]:
    """``raw`` (the items of ``param``: a string, or a non-empty list) as rsb messages, after ``instructions`` (a
    leading system message) when given. Their number is bounded by the caller (responses.check_item_count). A tool
    result must answer a call made before it in these items, unless the request has history (``with_history``:
    ``previous_response_id`` or ``conversation``), whose calls it may answer: checked once the history is in front
    (response_history)."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
        return messages
    if not isinstance(raw, list) or not raw:
        raise invalid(f"'{param}' must be a string or a non-empty list of items", param)
    origin: list[int] = []  # the item each message begins with (a message's later calls fold into it)
    for i, item in enumerate(raw):
        at = f"{param}[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
        if kind not in INPUT_ITEMS:
            raise invalid(f"{at}: only {', '.join(INPUT_ITEMS)} items are supported, not {kind!r}", param)
        assert isinstance(item, dict)
        before = len(messages)
        if kind == "function_call":
            _add_call(messages, item, param, i)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param, i),
                             "content": text_of(item.get("output"), (param, i), INPUT_TEXT_PARTS, "output")})
        elif kind == "message":
            role = ROLES.get(str(item.get("role")))
            if role is None:
                raise invalid(f"{at}.role must be one of system, developer, user, assistant", param)
            messages.append({"role": role, "content": text_of(item.get("content"), (param, i), INPUT_TEXT_PARTS)})
        origin.extend([i] * (len(messages) - before))
    if not messages:
        raise invalid(f"'{param}' has no message (reasoning items alone are no conversation)", param)
    lead = len(messages) - len(origin)
    unanswered = None if with_history else unanswered_result(messages[lead:])
    if unanswered is not None:
        call_id = str(messages[lead + unanswered]["tool_call_id"])
        raise invalid(f"{param}[{origin[unanswered]}]: no function_call with call_id {call_id[:64]!r} comes before "
                      "this output", param)
    return messages
