"""A chat is a conversation: how the messages ``useChat`` sends line up with the conversation's turns, and the
conversation's turns as the ``UIMessage`` s another device's ``useChat`` starts from.

``DefaultChatTransport`` sends the whole chat with every request, which the view reads as rsb messages, each
with the id of the UI message it comes from (consumer.views.aisdk.request: an assistant UI message is its
steps and its calls' results). The conversation holds what the server answered, so only what the body adds is
new: the body is matched against the turns, message by message (an input by its UI message's id and its
content, an answer by the id of the message it shows in: its stream id, or for a turn that continues a message
after a tool result, that message's), and the turn starts after the last turn the body holds whole. A body that
leaves a turn out (a regenerate drops the last answer; an edit changes a message) branches: the conversation
keeps the turns before it, and the new turn takes the rest of the body. Pure functions: no Redis here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from broker.request.generation import Message, ToolCall
from broker.streams.turns import Turn, as_messages


@dataclass(frozen=True, slots=True)
class Plan:
    """What a POST does: answer with ``repeat`` (a turn it repeats), or keep the first ``keep`` turns and start
    a turn with the body's messages from ``start`` on."""

    keep: int
    start: int
    repeat: Turn | None = None


def _input_matches(turn: Turn, ids: Sequence[str], body: Sequence[Message], at: int) -> int | None:
    """Where the turn's input ends in ``body`` if the body holds it from ``at`` (None: it does not)."""
    for i, m in enumerate(as_messages(turn.input)):
        j = at + i
        if j >= len(body) or ids[j] != turn.message_id(i) or body[j] != m:
            return None
    return at + len(turn.input)


def plan_turn(turns: Sequence[Turn], ids: Sequence[str], body: Sequence[Message], *, plain_send: bool,
              regenerate: bool) -> Plan:
    """``ids[i]``: the UI message ``body[i]`` comes from."""
    starts: list[int] = []  # where each turn the body holds whole begins in it
    at = 0
    for k, turn in enumerate(turns):
        end = _input_matches(turn, ids, body, at)
        if end is None:
            break  # an edit (or another history): branch before this turn
        answered = end < len(body) and body[end].role == "assistant" and ids[end] == turn.answer_message_id
        if turn.has_stream and answered:
            end += 1  # the client's copy of an answer may be partial (it stopped reading): its id is what counts
        elif turn.has_stream and not turn.output.empty:
            # Its question without its answer: the SDK's body for this very turn (a repeat), or a regenerate.
            if plain_send and k == len(turns) - 1 and end == len(body):
                return Plan(k, at, repeat=turn)
            return Plan(k, at)
        starts.append(at)
        at = end
    kept = len(starts)
    if at < len(body):
        return Plan(kept, at)
    # The body is history the conversation holds, with nothing new: answer its last turn again, or (a
    # regenerate, or a turn that got no answer) start it over.
    if kept == 0:
        return Plan(0, 0)
    last = turns[kept - 1]
    if regenerate or not last.has_stream or last.output.empty:
        return Plan(kept - 1, starts[kept - 1])
    return Plan(kept, at, repeat=last)


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    u = usage or {}
    prompt, completion = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    return {"inputTokens": prompt, "outputTokens": completion, "totalTokens": prompt + completion}


def _result(content: str) -> Any:
    """A call's result as the SDK had it: JSON text of an object or a list back as its value, any other text
    as it is (the view sends a non-string output to the model as JSON text)."""
    try:
        value = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content
    return value if isinstance(value, dict | list) else content


def _call_part(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = orjson.loads(call.arguments) if call.arguments else {}
    except orjson.JSONDecodeError:
        return {"type": f"tool-{call.name}", "toolCallId": call.id, "state": "input-available", "input": None,
                "rawInput": call.arguments}
    return {"type": f"tool-{call.name}", "toolCallId": call.id, "state": "input-available", "input": arguments}


class _Chat:
    """The UI messages being built: an assistant's steps (one per model call) land in one message while they
    share its id, and a call's result goes into the part of that call."""

    def __init__(self) -> None:
        self.out: list[dict[str, Any]] = []

    def message(self, message_id: str, role: str) -> dict[str, Any]:
        if self.out and self.out[-1]["id"] == message_id and self.out[-1]["role"] == role:
            return self.out[-1]
        msg: dict[str, Any] = {"id": message_id, "role": role, "parts": []}
        self.out.append(msg)
        return msg

    def step(self, message_id: str, text: str, calls: Sequence[ToolCall], reasoning: str = "") -> dict[str, Any]:
        msg = self.message(message_id, "assistant")
        msg["parts"].append({"type": "step-start"})
        if reasoning:
            msg["parts"].append({"type": "reasoning", "text": reasoning, "state": "done"})
        if text:
            msg["parts"].append({"type": "text", "text": text, "state": "done"})
        msg["parts"].extend(_call_part(c) for c in calls)
        return msg

    def result(self, call_id: str | None, content: str) -> None:
        for msg in reversed(self.out):
            for part in msg["parts"]:
                if part.get("toolCallId") == call_id and call_id is not None:
                    part.update(state="output-available", output=_result(content))
                    return


def ui_messages(turns: Sequence[Turn], running: Turn | None = None,
                waiting: Sequence[Turn] = ()) -> list[dict[str, Any]]:
    """The chat as ``UIMessage`` s: each turn's messages, then its answer (in the message of its answer's id,
    as the chunks of its stream name it: a continuation after a tool result adds a step to the message it
    continues). A running turn's messages come last, without its answer: ``resumeStream()`` (the resume route)
    brings it, into a message of that id; then the messages of the turns waiting behind it (broker.request.on_busy)."""
    chat = _Chat()
    unfinished = [*([running] if running is not None else []), *waiting]
    for turn in [*turns, *unfinished]:
        for i, m in enumerate(as_messages(turn.input)):
            mid = turn.message_id(i)
            if m.role == "tool":
                chat.result(m.tool_call_id, m.content)
            elif m.role == "assistant":
                chat.step(mid, m.content, m.tool_calls)
            else:
                chat.message(mid, m.role)["parts"].append({"type": "text", "text": m.content})
        if any(turn is u for u in unfinished) or not turn.has_stream or turn.output.empty:
            continue
        out = turn.output
        msg = chat.step(turn.answer_message_id, out.text, out.tool_calls, out.reasoning)
        meta: dict[str, Any] = {"model": turn.model, "status": turn.status, "usage": _usage(turn.usage)}
        if turn.finish_reason is not None:
            meta["finishReason"] = turn.finish_reason
        msg["metadata"] = meta
    return chat.out
