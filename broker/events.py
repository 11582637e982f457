"""The event model and its encodings: Redis stream fields, pub/sub payloads and SSE frames.

An event is stored as a Redis Stream entry with two fields, ``TYPE_FIELD`` (``t``, its type) and
``DATA_FIELD`` (``d``, its data: one line of JSON), in that order. The entry id is the event id clients see
and echo back; it is strictly increasing because Redis assigns it, and opaque to clients. Live, an event is
published as ``<id>\n<type>\n<data>`` (``PAYLOAD_SEPARATOR``). These are defined here only: the Lua scripts
that write them get them from here (broker.streams.lua.PRELUDE).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, overload

import orjson

from broker.sse import event_frame


class EventType(StrEnum):
    QUEUED = "queued"
    STARTED = "started"
    PROGRESS = "progress"  # prefill of a long prompt: {"processed": int, "prompt_tokens": int}
    DELTA = "delta"
    # Typed output, apart from the answer's text (clients that do not know them ignore them):
    REASONING = "reasoning"  # {"text": str}: a piece of the model's reasoning
    TOOL_CALL = "tool_call"  # {"index": int, "id": str, "name": str}: a call begins
    TOOL_ARGS = "tool_args"  # {"index": int, "text": str}: a piece of call `index`'s arguments (JSON text)
    # {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}: the
    # log-probabilities of the answer's text tokens since the last one (a create's ``logprobs``)
    LOGPROBS = "logprobs"
    DONE = "done"
    CANCELLED = "cancelled"
    ERROR = "error"
    # Not stored: sent by a reader whose resume point is no longer in the stream (a Redis failover lost the
    # events after it, see consumer.streaming.reader). {"last_event_id": str | null}: the newest event the reader
    # and the stream still share (null: none); its id is that event's id (or ``RESET_FROM_START``), and the events
    # that follow are the stream's from there.
    RESET = "reset"
    # Not stored: the first event of a read "from the latest" (``?from=latest``), and what such a read sends where
    # a ``reset`` would come: the answer as it stands, {"text", "reasoning", "tool_calls": [{"index", "id",
    # "name", "arguments"}], "last_event_id"}, which replaces whatever the reader had; its id is that last event's
    # id (``RESET_FROM_START`` with null: none yet), and the events that follow are the stream's after it.
    SNAPSHOT = "snapshot"


class FinishReason(StrEnum):
    """``done.finish_reason``."""

    STOP = "stop"  # the model ended its answer (or a stop sequence did)
    LENGTH = "length"  # max_tokens (or the context) ran out
    TOOL_CALLS = "tool_calls"  # the answer is one or more tool calls, to be run by the client


#: A stored event's fields, in the order every script writes them.
TYPE_FIELD = b"t"
DATA_FIELD = b"d"
#: Between the id, the type and the data of a live (pub/sub) payload; the data is one line, so it splits in three.
PAYLOAD_SEPARATOR = b"\n"

#: The types that end a stream; also the statuses of a stream that ended (a stream's final status is the type
#: of its terminal event).
TERMINAL_TYPES: frozenset[str] = frozenset({EventType.DONE, EventType.CANCELLED, EventType.ERROR})

# Redis Stream ids: "<ms>-<seq>", both unsigned 64-bit. Anything else is not an id we issued.
_EVENT_ID = re.compile(r"\A([0-9]{1,20})-([0-9]{1,20})\Z")  # ASCII digits only (broker.ascii)
_U64_MAX = 2**64 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_event_id(raw: str) -> tuple[int, int] | None:
    """Return the id as a comparable tuple, or None when it is not a well-formed event id. The largest id
    (``<u64 max>-<u64 max>``) is none either: every id given is a point to resume after, and nothing can come
    after that one (Redis refuses the range, ``(`` it: a 500 where a client deserves its 400)."""
    m = _EVENT_ID.match(raw)
    if m is None:
        return None
    ms, seq = int(m.group(1)), int(m.group(2))
    if ms > _U64_MAX or seq > _U64_MAX or ms == seq == _U64_MAX:
        return None
    return ms, seq


def encode_data(data: dict[str, Any]) -> bytes:
    """One line of JSON: orjson never emits a raw newline (it escapes them inside strings). Text that is
    not valid Unicode (lone surrogates, which no UTF-8 decoder produces) becomes U+FFFD, never an error."""
    try:
        return orjson.dumps(data)
    except TypeError:
        return orjson.dumps(_scrub(data))


def _scrub(value: Any) -> Any:
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {k: _scrub(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub(v) for v in value]
    return value


# Not frozen: a frozen dataclass sets each field through object.__setattr__, three times slower to build, and
# a replay builds one Event per entry (treat them as immutable all the same).
@dataclass(slots=True)
class Event:
    id: str
    type: str
    data: bytes  # one line of JSON, as stored

    @property
    def is_terminal(self) -> bool:
        return self.type in TERMINAL_TYPES

    def json(self) -> Any:
        return orjson.loads(self.data)

    @classmethod
    def from_entry(cls, entry_id: bytes | str, fields: dict[bytes, bytes]) -> Event:
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        return cls(eid, fields[TYPE_FIELD].decode(), fields[DATA_FIELD])

    @classmethod
    def from_raw(cls, entry: list[Any]) -> Event:
        """One entry of a raw XRANGE reply, ``[id, [TYPE_FIELD, type, DATA_FIELD, data]]`` (every append script
        writes the fields in that order; any other shape is read by name)."""
        eid, fields = entry
        if isinstance(fields, list) and len(fields) == 4 and fields[0] == TYPE_FIELD and fields[2] == DATA_FIELD:
            return cls(eid.decode(), fields[1].decode(), fields[3])
        if isinstance(fields, list):
            fields = dict(zip(fields[::2], fields[1::2], strict=True))
        return cls.from_entry(eid, fields)

    @classmethod
    def from_payload(cls, payload: bytes) -> Event:
        """Decode a live pub/sub payload: ``<id>\\n<type>\\n<data>`` (built by the scripts' ``payload``)."""
        eid, etype, data = payload.split(PAYLOAD_SEPARATOR, 2)
        return cls(eid.decode(), etype.decode(), data)

    def to_sse(self) -> bytes:
        # The id comes from Redis and the type from EventType, so neither can carry CR, LF or NUL;
        # the data is single-line JSON. Framing cannot break.
        return event_frame(self.id.encode(), self.type.encode(), self.data)


#: The id of a ``reset`` that restarts a reader from the stream's start (no event in common).
RESET_FROM_START = "0-0"


def reset_event(last_common_id: str | None) -> Event:
    """Tell a reader to roll back to ``last_common_id`` (None: to the start): drop what it received after it."""
    return Event(last_common_id or RESET_FROM_START, EventType.RESET, encode_data({"last_event_id": last_common_id}))


class EventPage(Sequence[Event]):
    """Stored events as one XRANGE reply: a sequence of Events, built only when asked for (one at a time by
    index, all on iteration), and ``frames()``, rsb's SSE frames of the whole page in one pass straight from
    the reply. A replay serves pages to the native view, which never needs the Events: a frame per entry
    from the raw fields costs about a third of building the Event and framing it."""

    __slots__ = ("_entries", "_events")

    def __init__(self, entries: list[Any]) -> None:
        self._entries = entries
        self._events: list[Event] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    @overload
    def __getitem__(self, i: int) -> Event: ...

    @overload
    def __getitem__(self, i: slice) -> EventPage: ...

    def __getitem__(self, i: int | slice) -> Event | EventPage:
        if isinstance(i, slice):
            return EventPage(self._entries[i])
        if self._events is not None:
            return self._events[i]
        return Event.from_raw(self._entries[i])

    def __iter__(self) -> Iterator[Event]:
        if self._events is None:
            self._events = [Event.from_raw(entry) for entry in self._entries]
        return iter(self._events)

    def frames(self) -> bytes:
        entries = self._entries
        # Every append script writes the fields t, d in that order; a reply parsed by another client (a dict
        # per entry) or any other shape goes through the Events.
        t, d = TYPE_FIELD, DATA_FIELD
        if all(type(f) is list and len(f) == 4 and f[0] == t and f[2] == d for _, f in entries):
            return b"".join([event_frame(eid, f[1], f[3]) for eid, f in entries])
        return b"".join([ev.to_sse() for ev in self])


def delta(text: str) -> tuple[str, bytes]:
    return EventType.DELTA, encode_data({"text": text})


def reasoning(text: str) -> tuple[str, bytes]:
    return EventType.REASONING, encode_data({"text": text})


def tool_call(index: int, call_id: str, name: str) -> tuple[str, bytes]:
    return EventType.TOOL_CALL, encode_data({"index": index, "id": call_id, "name": name})


def tool_args(index: int, text: str) -> tuple[str, bytes]:
    return EventType.TOOL_ARGS, encode_data({"index": index, "text": text})


def logprobs(content: list[dict[str, Any]]) -> tuple[str, bytes]:
    return EventType.LOGPROBS, encode_data({"content": content})
