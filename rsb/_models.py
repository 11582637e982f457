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
