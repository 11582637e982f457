"""What the client returns: events, and the answers of create and status."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from broker.events import TERMINAL_TYPES


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


class Answer:
    """The text of a stream as its events come, ``reset`` events included: a reset (a Redis failover lost
    events this reader had) drops the text received after the event it names, and the deltas that follow
    continue from there."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[tuple[str, str]] = []  # (event id, text)

    def feed(self, event: Event) -> None:
        if event.type == "reset":
            back = _id_key(event.id)
            while self._parts and _id_key(self._parts[-1][0]) > back:
                self._parts.pop()
        elif event.type == "delta":
            self._parts.append((event.id, event.text))

    @property
    def text(self) -> str:
        return "".join(t for _, t in self._parts)


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
