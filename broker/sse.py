"""Server-sent events, both ways: the one framer every response of rsb writes with, and the one parser
every reader of rsb (the Python client, the upstream engine reading an OpenAI-compatible server, the
tests and the benchmarks) reads with.

Framing (what rsb sends): ``id:``, ``event:`` and ``data:`` fields, one line each, ending with a blank
line; comments (``: ...``) are heartbeats; ``retry:`` is a reconnect hint. Parsing follows the WHATWG
event-stream rules: lines end with LF, CRLF or CR; ``data`` lines of one event are joined with LF; a
field name without a colon has an empty value; one leading space of a value is dropped; an event is
only complete at its blank line, so a connection cut mid-event drops that event (and a resume asks for
it again). Standard library only: the client imports it without the server's dependencies.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from broker.ascii import is_decimal

HEARTBEAT = b": keep-alive\n\n"


def frame(data: bytes, *, event: bytes | None = None, event_id: bytes | None = None) -> bytes:
    """One event. ``data`` must be a single line (rsb's is one line of JSON) and ``event``/``event_id`` must
    not contain CR, LF or NUL: callers pass values they built, never client input."""
    out = b""
    if event_id is not None:
        out += b"id: " + event_id + b"\n"
    if event is not None:
        out += b"event: " + event + b"\n"
    return out + b"data: " + data + b"\n\n"


#: The last event of an OpenAI stream and of an AI SDK UI message stream: ``data: [DONE]``.
DONE_FRAME = frame(b"[DONE]")


def event_frame(event_id: bytes, event: bytes, data: bytes) -> bytes:
    """``frame`` with all three fields, as every stored event is sent: one formatting operation (a replay
    frames hundreds of thousands of events a second)."""
    return b"id: %b\nevent: %b\ndata: %b\n\n" % (event_id, event, data)


def frame_lines(event: bytes, lines: Iterable[bytes]) -> bytes:
    """One event whose data spans ``lines`` (none may contain CR or LF: split the payload on them first), each
    written ``data:<line>``, with no space after the colon: a parser drops one leading space if there is one,
    so without it every line arrives verbatim, leading spaces included. The Durable Streams protocol frames
    its events this way (consumer/views/durable)."""
    return b"event: " + event + b"\n" + b"".join(b"data:" + line + b"\n" for line in lines) + b"\n"


def retry_hint(ms: int) -> bytes:
    return b"retry: %d\n\n" % ms


@dataclass(slots=True)
class Block:
    """One parsed block (up to a blank line). ``fields`` keeps every field line in order, for strict
    checks; ``is_event`` says whether it dispatches an event (it has data)."""

    id: str | None = None
    event: str | None = None
    data_lines: list[str] = field(default_factory=list)
    retry: int | None = None
    comments: list[str] = field(default_factory=list)
    fields: list[tuple[str, str]] = field(default_factory=list)

    @property
    def data(self) -> str:
        return "\n".join(self.data_lines)

    @property
    def is_event(self) -> bool:
        return bool(self.data_lines)

    @property
    def type(self) -> str:
        """The event type as EventSource reports it (``message`` when the block names none)."""
        return self.event or "message"

    def add_line(self, line: str) -> None:
        if line.startswith(":"):
            self.comments.append(line[1:])
            return
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        self.fields.append((name, value))
        if name == "data":
            self.data_lines.append(value)
        elif name == "event":
            self.event = value
        elif name == "id":
            if "\0" not in value:
                self.id = value
        elif name == "retry" and is_decimal(value):
            self.retry = int(value)


def parse_block(block: bytes | str) -> Block:
    """A whole block (without its terminating blank line)."""
    text = block.decode("utf-8", "replace") if isinstance(block, bytes) else block
    out = Block()
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        out.add_line(line)
    return out


class LineDecoder:
    """Blocks from lines already split (``httpx.Response.iter_lines``): ``feed`` returns a block at each
    blank line that ends one, else None."""

    def __init__(self) -> None:
        self._block: Block | None = None

    def feed(self, line: str) -> Block | None:
        if line == "":
            block, self._block = self._block, None
            return block
        if self._block is None:
            self._block = Block()
        self._block.add_line(line)
        return None


class ByteDecoder:
    """Blocks from raw chunks of a response body, split anywhere (mid-line, mid-character)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """The complete blocks (raw bytes, without their blank line) that this chunk finished."""
        buf = self._buf + chunk
        if b"\r" in buf:
            # A CR at the very end may be the first half of a CRLF: keep it for the next chunk.
            keep = buf.endswith(b"\r")
            body = buf[:-1] if keep else buf
            buf = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + (b"\r" if keep else b"")
        *blocks, self._buf = buf.split(b"\n\n")
        return blocks

    @property
    def pending(self) -> bytes:
        """Bytes of a block not finished yet (a clean end of the body leaves none)."""
        return self._buf.rstrip(b"\r")
