"""A conversation's turns as values (no Redis here): what a finished turn holds, how it is read off its
stream's events, and the history the server puts in front of the next turn.

A turn is what one create added to a conversation: the messages it sent new (``input``) and, once its stream
ended, its final output (the answer's text, its tool calls, its reasoning), status, finish reason and usage. A
turn made of items alone (OpenAI's ``POST /v1/conversations`` with initial ``items``) has no stream and
status ``items``. broker.streams.conversations stores one JSON record per turn.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from broker.answer import AnswerRuns
from broker.events import Event, EventType
from broker.request.generation import GenerationRequest, Message, ToolCall

#: The status of a turn that is items only (no generation).
ITEMS = "items"


@dataclass(frozen=True, slots=True)
class Output:
    """What the model answered in one turn."""

    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str = ""

    @property
    def empty(self) -> bool:
        return not self.text and not self.tool_calls

    def message(self) -> dict[str, Any]:
        """The answer as the assistant message of a later turn's prompt, stored form (reasoning stays out)."""
        return Message("assistant", self.text, self.tool_calls).stored()


@dataclass(frozen=True, slots=True)
class Turn:
    """One finished turn. ``id`` is its stream's id (a turn of items alone gets a fresh one); ``input`` the
    messages it sent new, in their stored form (broker.request.generation.Message.stored); ``input_ids`` the client's
    ids for them ("" where it gave none)."""

    id: uuid.UUID
    status: str
    input: tuple[dict[str, Any], ...]
    input_ids: tuple[str, ...] = ()
    output: Output = field(default_factory=Output)
    created_at: float = 0.0
    model: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    #: The client's id of the message its answer shows in, when not the stream id (broker.request.history.History).
    answer_id: str | None = None

    @property
    def answer_message_id(self) -> str:
        return self.answer_id or str(self.id)

    @property
    def has_stream(self) -> bool:
        return self.status != ITEMS

    def message_id(self, i: int) -> str:
        """The id of input message ``i``: the client's, else one derived from the turn (stable on every read)."""
        given = self.input_ids[i] if i < len(self.input_ids) else ""
        return given or f"{self.id.hex}-{i}"

    def prompt(self) -> list[dict[str, Any]]:
        """What this turn puts in front of later turns: its input and its answer. A turn that ended without
        any answer (failed, or cancelled before its first token) puts nothing: its messages went unanswered,
        and a later turn's prompt should not hold them twice when the user sends them again."""
        if not self.has_stream:
            return list(self.input)
        if self.output.empty:
            return []
        return [*self.input, self.output.message()]

    def to_json(self) -> bytes:
        out = self.output
        return orjson.dumps({
            "id": str(self.id), "status": self.status, "input": list(self.input), "input_ids": list(self.input_ids),
            "output": {"text": out.text, "reasoning": out.reasoning,
                       "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in out.tool_calls]},
            "created_at": self.created_at, "model": self.model, "finish_reason": self.finish_reason,
            "usage": self.usage, "error": self.error, "answer_id": self.answer_id,
        })

    @classmethod
    def from_json(cls, raw: bytes | str) -> Turn:
        d = orjson.loads(raw)
        o = d["output"]
        return cls(uuid.UUID(d["id"]), d["status"], tuple(d["input"]), tuple(d["input_ids"]),
                   Output(o["text"], tuple(ToolCall(c["id"], c["name"], c["arguments"]) for c in o["tool_calls"]),
                          o["reasoning"]),
                   d["created_at"], d["model"], d["finish_reason"], d["usage"], d["error"], d.get("answer_id"))


def history_messages(turns: Iterable[Turn]) -> list[dict[str, Any]]:
    """The messages the server puts in front of a conversation's next turn: every turn's, in order."""
    return [m for t in turns for m in t.prompt()]


def with_history(request: GenerationRequest, turns: Sequence[Turn], version: int, count: int) -> GenerationRequest:
    """A conversation's turn as the engine gets it: ``request`` (its ``history`` names the conversation; its own
    instructions, ``messages[:lead]``, then its new messages from ``start``) with the history of ``turns`` (the
    conversation at ``version``, ``count`` turns) in front of its new messages."""
    h = request.history
    assert h is not None and h.conversation is not None and request.messages is not None
    history = as_messages(history_messages(turns))
    messages = (*request.messages[:h.lead], *history, *request.messages[h.start:])
    return dataclasses.replace(request, messages=messages, history=dataclasses.replace(
        h, start=h.lead + len(history), version=version, turn=count))


def turn_identity(request: GenerationRequest) -> str:
    """What tells a retry of a conversation's turn from another request under its stream id (the create rule: 200 or
    409): the turn's own request (its instructions, new messages and options, in its conversation), whatever history
    is in front of it and wherever the conversation stood. A turn that waited (broker.request.on_busy) is created before
    its history is known, so its retries compare without it too."""
    h = request.history
    assert h is not None and request.messages is not None
    bare = dataclasses.replace(request, messages=(*request.messages[:h.lead], *request.messages[h.start:]),
                               history=dataclasses.replace(h, start=h.lead, version=0, turn=0))
    return bare.request_hash()


def as_messages(stored: Sequence[dict[str, Any]]) -> tuple[Message, ...]:
    return tuple(Message.from_stored(m) for m in stored)


def items_turn(messages: Sequence[Message], created_at: float, input_ids: Sequence[str] = ()) -> Turn:
    return Turn(uuid.uuid4(), ITEMS, tuple(m.stored() for m in messages), tuple(input_ids), created_at=created_at)


def output_of(events: Iterable[Event]) -> tuple[Output, Event | None, str]:
    """The answer a stream's events add up to, its terminal event (None: not ended yet), and the model that
    ``started`` named. A pure function of the events: every reader (and every fold) gets the same answer."""
    answer = AnswerRuns()
    terminal: Event | None = None
    for ev in events:
        if ev.is_terminal:
            terminal = ev
            break
        answer.add(ev)
    started = answer.started
    model = str(started.json().get("model") or "") if started is not None else ""
    tool_calls = tuple(ToolCall(c.id, c.name, c.arguments) for c in answer.tool_calls)
    return Output(answer.text, tool_calls, answer.reasoning), terminal, model


def finished_turn(stream_id: uuid.UUID, request: GenerationRequest, created_at: float,
                  events: Iterable[Event]) -> Turn | None:
    """The turn a finished stream adds to its conversation (None: the stream has not ended). Its input is
    what the request sent new (``history.start`` on); its output is read off the events."""
    output, terminal, model = output_of(events)
    if terminal is None:
        return None
    history = request.history
    start = history.start if history is not None else 0
    ids = history.message_ids if history is not None else ()
    data = terminal.json()
    error = None
    if terminal.type == EventType.ERROR:
        error = {"code": str(data.get("code") or "engine"), "message": str(data.get("message") or "")}
    return Turn(stream_id, terminal.type, tuple(m.stored() for m in (request.messages or ())[start:]), tuple(ids),
                output, created_at, model, data.get("finish_reason"), data.get("usage"), error,
                history.answer_id if history is not None else None)
