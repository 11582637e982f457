"""A chat is a conversation: how the messages ``useChat`` sends line up with the conversation's turns, and the
conversation's turns as the ``UIMessage`` s another device's ``useChat`` starts from.

``DefaultChatTransport`` sends the whole chat with every request. The conversation holds what the server
answered, so only what the body adds to it is new: the body is matched against the turns, message by message
(a user or system message by its id and text, an answer by its id, which is the turn's stream id), and the
turn starts after the last turn the body holds whole. A body that leaves a turn out (a regenerate drops the
last answer; an edit changes a message) branches: the conversation keeps the turns before it, and the new
turn takes the rest of the body. Pure functions: no Redis here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from broker.streams.turns import Turn
from consumer.views.aisdk.request import UIMessageRef


@dataclass(frozen=True, slots=True)
class Plan:
    """What a POST does: answer with ``repeat`` (a turn it repeats), or keep the first ``keep`` turns and start
    a turn with the body's messages from ``start`` on."""

    keep: int
    start: int
    repeat: Turn | None = None


def _input_matches(turn: Turn, body: Sequence[UIMessageRef], at: int) -> int | None:
    """Where the turn's input ends in ``body`` if the body holds it from ``at`` (None: it does not)."""
    for i, m in enumerate(turn.input):
        j = at + i
        if j >= len(body):
            return None
        b = body[j]
        if b.id != turn.message_id(i) or b.role != m.get("role") or b.text != (m.get("content") or ""):
            return None
    return at + len(turn.input)


def plan_turn(turns: Sequence[Turn], body: Sequence[UIMessageRef], *, plain_send: bool, regenerate: bool) -> Plan:
    starts: list[int] = []  # where each turn the body holds whole begins in it
    at = 0
    for k, turn in enumerate(turns):
        end = _input_matches(turn, body, at)
        if end is None:
            break  # an edit (or another history): branch before this turn
        if turn.has_stream and end < len(body) and body[end].role == "assistant" and body[end].id == str(turn.id):
            end += 1
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


def ui_messages(turns: Sequence[Turn], running: Turn | None = None) -> list[dict[str, Any]]:
    """The chat as ``UIMessage`` s: each turn's messages, then its answer (id: the turn's stream id, as the
    chunks of its stream name it). A running turn's messages come last, without an answer: ``resumeStream()``
    (the resume route) brings it, into a message of that id."""
    out: list[dict[str, Any]] = []
    for turn in [*turns, *([running] if running is not None else [])]:
        for i, m in enumerate(turn.input):
            out.append({"id": turn.message_id(i), "role": m.get("role"),
                        "parts": [{"type": "text", "text": m.get("content") or ""}]})
        if turn is running or not turn.has_stream or turn.output.empty:
            continue
        parts: list[dict[str, Any]] = [{"type": "step-start"}]
        if turn.output.reasoning:
            parts.append({"type": "reasoning", "text": turn.output.reasoning, "state": "done"})
        if turn.output.text:
            parts.append({"type": "text", "text": turn.output.text, "state": "done"})
        meta: dict[str, Any] = {"model": turn.model, "status": turn.status, "usage": _usage(turn.usage)}
        if turn.finish_reason is not None:
            meta["finishReason"] = turn.finish_reason
        out.append({"id": str(turn.id), "role": "assistant", "parts": parts, "metadata": meta})
    return out
