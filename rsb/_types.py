"""What the client returns: events, and the answers of create and status."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from broker.events import TERMINAL_TYPES
from rsb._partial_json import PartialJSON


@dataclass(frozen=True, slots=True)
class Event:
    """One event of a stream: ``id`` (opaque, echo it back to resume), ``type`` and its decoded ``data``."""

    id: str
    type: str
    data: Any

    @property
    def text(self) -> str:
        """The text a ``delta`` appends to the answer ("" for every other type)."""
        if self.type == "delta" and isinstance(self.data, dict):
            return str(self.data.get("text", ""))
        return ""

    @property
    def terminal(self) -> bool:
        return self.type in TERMINAL_TYPES


# The event types an answer is made of; the others (queued, started, progress, the terminal ones) say how it goes.
_ANSWER_TYPES = frozenset({"delta", "reasoning", "tool_call", "tool_args"})


class _GrowingJSON:
    """A JSON text that grows (a tool call's arguments, a structured answer) and its partial value, parsed
    only as far as it was read: each character once, however often ``parsed`` is asked for."""

    __slots__ = ("_fed", "_joined", "_parser", "_text", "pieces")

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self._text = ""
        self._joined = 0  # pieces in _text
        self._parser: PartialJSON | None = None
        self._fed = 0  # pieces fed to the parser

    @property
    def text(self) -> str:
        if self._joined < len(self.pieces):
            self._text += "".join(self.pieces[self._joined:])
            self._joined = len(self.pieces)
        return self._text

    def parsed(self, ended: bool) -> Any:
        if self._parser is None:
            self._parser = PartialJSON()
        parser = self._parser
        while self._fed < len(self.pieces):
            parser.feed(self.pieces[self._fed])
            self._fed += 1
        if ended and not parser.done:
            parser.end()
        return parser.value


class ToolCall:
    """One tool call of an answer: ``index`` (its place among the calls), ``id``, ``name``, ``arguments``
    (the JSON text the model wrote so far) and ``parsed_arguments`` (that text's partial value: strings grow,
    objects and arrays appear as they open; None before it begins)."""

    __slots__ = ("_answer", "_args", "id", "index", "name")

    def __init__(self, answer: Answer, index: int) -> None:
        self._answer = answer
        self.index = index
        self.id = ""
        self.name = ""
        self._args = _GrowingJSON()

    @property
    def arguments(self) -> str:
        return self._args.text

    @property
    def parsed_arguments(self) -> Any:
        """Raises ValueError when the arguments are not JSON."""
        return self._args.parsed(self._answer.end is not None)

    def __repr__(self) -> str:
        return f"ToolCall(index={self.index}, id={self.id!r}, name={self.name!r}, arguments={self.arguments!r})"


class Answer:
    """What a stream's events add up to, as they come: ``text`` (the deltas), ``reasoning``, ``tool_calls``,
    ``parsed`` (the text as JSON, for structured output) and ``end`` (the terminal event). ``reset`` events are
    applied to all of it: a reset (a Redis failover lost events this reader had) drops what was received after
    the event it names, and what follows continues from there. A ``snapshot`` (a read from the latest) replaces
    all of it with the answer it holds.

        answer = Answer()
        for event in client.stream(stream_id):
            answer.feed(event)
            show(answer.text, answer.tool_calls)
    """

    __slots__ = ("_body", "_calls", "_log", "_reasoning", "end")

    def __init__(self) -> None:
        self._log: list[Event] = []  # the events the answer is made of, in order
        self.end: Event | None = None
        self._clear()

    def _clear(self) -> None:
        self._body = _GrowingJSON()
        self._reasoning: list[str] = []
        self._calls: dict[int, ToolCall] = {}

    def feed(self, event: Event) -> bool:
        """Applies one event; True when the answer changed."""
        if event.type == "snapshot":
            self._snapshot(event)
            return True
        if event.type == "reset":
            back = _id_key(event.id)
            keep = len(self._log)
            while keep and _id_key(self._log[keep - 1].id) > back:
                keep -= 1
            if keep == len(self._log):
                return False
            kept = self._log[:keep]
            self._log = []
            self._clear()
            for ev in kept:
                self.feed(ev)
            return True
        if event.terminal:
            self.end = event
            return False
        data = event.data
        if event.type not in _ANSWER_TYPES or not isinstance(data, dict):
            return False
        self._log.append(event)
        text = data.get("text")
        if event.type == "delta":
            self._body.pieces.append(str(text or ""))
        elif event.type == "reasoning":
            self._reasoning.append(str(text or ""))
        else:
            index = int(data.get("index") or 0)
            call = self._calls.get(index)
            if call is None:
                call = self._calls[index] = ToolCall(self, index)
            if event.type == "tool_call":
                call.id = str(data.get("id") or call.id)
                call.name = str(data.get("name") or call.name)
            else:
                call._args.pieces.append(str(text or ""))
        return True

    def _snapshot(self, event: Event) -> None:
        """A read from the latest (``?from=latest``): the answer as it stands replaces everything, kept as the
        events it stands for (each with the snapshot's id), so a reset after it still applies."""
        data = event.data if isinstance(event.data, dict) else {}
        self._log = []
        self._clear()
        parts = [Event(event.id, "reasoning", {"text": data.get("reasoning") or ""}),
                 Event(event.id, "delta", {"text": data.get("text") or ""})]
        for call in data.get("tool_calls") or ():
            parts.append(Event(event.id, "tool_call", {"index": call["index"], "id": call["id"], "name": call["name"]}))
            parts.append(Event(event.id, "tool_args", {"index": call["index"], "text": call["arguments"]}))
        for ev in parts:
            self.feed(ev)

    @property
    def text(self) -> str:
        return self._body.text

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def tool_calls(self) -> list[ToolCall]:
        """By index."""
        return [self._calls[i] for i in sorted(self._calls)]

    @property
    def parsed(self) -> Any:
        """The text parsed as JSON so far (a structured answer): the partial value, in O(new characters) per
        call (rsb._partial_json); None before it begins. Raises ValueError when the text is not JSON."""
        return self._body.parsed(self.end is not None)

    @property
    def finish_reason(self) -> str | None:
        """``stop``, ``length`` or ``tool_calls`` once the stream is ``done``."""
        if self.end is not None and self.end.type == "done" and isinstance(self.end.data, dict):
            return self.end.data.get("finish_reason")
        return None


def _id_key(event_id: str) -> tuple[int, ...]:
    # A reset's id is one this server issued, so ordering ids is safe here (they stay opaque otherwise).
    return tuple(int(p) for p in event_id.split("-"))


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """The answer to ``create``: ``created`` is False when the id already existed with this request."""

    id: str
    status: str
    events_url: str
    created: bool
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StreamInfo:
        return cls(id=d["id"], status=d["status"], events_url=d["events_url"], created=d["created"], raw=d)


@dataclass(frozen=True, slots=True)
class StreamStatus:
    id: str
    status: str
    model: str | None = None
    created_at: str | None = None
    usage: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL_TYPES

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> StreamStatus:
        return cls(id=body["id"], status=body["status"], model=body.get("model"),
                   created_at=body.get("created_at"), usage=body.get("usage"), raw=body)
