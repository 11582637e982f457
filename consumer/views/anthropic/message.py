"""A message's Anthropic stream events and its Message object, folded from its rsb stream's events.

The fold is a pure function of the stream's events read from the first one, so every read of a message makes
the same events; each event's SSE ``id`` is ``<rsb event id>:<n>``, the n-th Anthropic event that rsb event
made. A resume after an id replays the stream from its start and sends what comes after it: the same events,
the same ids, exactly once, in the middle of a tool call's input as anywhere else.

    rsb event         Anthropic events
    (the first one)   message_start (content [], stop_reason null, usage zero), ping
    delta             a text block opens (content_block_start {type: text}), content_block_delta text_delta
    reasoning         with thinking shown: a thinking block opens (content_block_start {type: thinking,
                      signature: ""}), content_block_delta thinking_delta; else nothing
    tool_call         a tool_use block opens: content_block_start {type: tool_use, id, name, input: {}}
    tool_args         content_block_delta input_json_delta {partial_json}
    done              the open block stops (content_block_stop), message_delta {stop_reason, stop_sequence,
                      usage}, message_stop
    cancelled, error  event: error {type: error, error: {type, message}} (Anthropic's stream ends so)
    anything else     nothing (queued, started, progress, logprobs)

A block is open until another opens or the message ends. ``stop_reason``: ``end_turn`` (done, stop),
``stop_sequence`` (done naming the stop sequence that ended it), ``max_tokens`` (done, length), ``tool_use``
(done, tool_calls). Usage says Anthropic's words for rsb's counts: ``input_tokens`` the prompt tokens not served
from the prompt cache, ``cache_read_input_tokens`` those that were, ``output_tokens`` every generated token.

A message id is ``msg_<the stream UUID's hex>``, and ``msg_<hex>_thinking`` when the request asked to see the
model's reasoning: whether thinking blocks are shown is the request's choice and not part of the generation, so
the id that resumes a message says it."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from broker.events import Event, EventType, parse_event_id
from broker.streams.records import StreamStatus
from consumer.edge.errors import anthropic_error_object as error_object
from consumer.views.anthropic.errors import TYPES

TEXT, THINKING, TOOL_USE = "text", "thinking", "tool_use"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_ID = re.compile(r"\Amsg_([0-9a-f]{32})(_thinking)?\Z")
_EVENT_ID = re.compile(r"\A([0-9]{1,20}-[0-9]{1,20})(?::([0-9]{1,9}))?\Z")
#: Where an id that names an rsb event alone (``<ms>-<seq>``, as the native view sends it) resumes: after every
#: Anthropic event that rsb event made.
_WHOLE_EVENT = 10**9
#: The status (and so the Anthropic error type) of a generation that failed: its request's fault (the prompt does not
#: fit the model's context, the model's template refuses the conversation), past --max-generation-s, else rsb's (500).
FAILURES = {"context_length_exceeded": 400, "invalid_request": 400, "deadline": 504}


def message_id(stream_id: uuid.UUID, thinking: bool) -> str:
    return f"msg_{stream_id.hex}{'_thinking' if thinking else ''}"


def parse_message_id(raw: str) -> tuple[uuid.UUID, bool] | None:
    """The stream id and the thinking choice of a message id (None: no message could have it)."""
    m = _ID.match(raw)
    return None if m is None else (uuid.UUID(hex=m.group(1)), m.group(2) is not None)


EventKey = tuple[int, int, int]


def parse_resume_id(raw: str) -> EventKey | None:
    """An Anthropic event id of this view (``<ms>-<seq>:<n>``), or an rsb event id, as a comparable key."""
    m = _EVENT_ID.match(raw)
    if m is None:
        return None
    key = parse_event_id(m.group(1))
    if key is None:
        return None
    return (*key, int(m.group(2)) if m.group(2) is not None else _WHOLE_EVENT)


def terminal_error(ev: Event) -> tuple[int, dict[str, Any]]:
    """The HTTP status and the error object of a stream that ended cancelled or failed."""
    data = ev.json()
    if ev.type == EventType.CANCELLED:
        status, message = 409, f"the generation was cancelled ({data.get('reason', 'client')})"
    else:
        code = str(data.get("code", "engine"))
        status, message = FAILURES.get(code, 500), f"{code}: {data.get('message', 'the generation failed')}"
    return status, error_object(TYPES[status], message)


@dataclass(slots=True)
class _Block:
    kind: str
    index: int
    pieces: list[str] = field(default_factory=list)
    call_id: str = ""  # a tool_use block's
    name: str = ""

    def start(self) -> dict[str, Any]:
        """The block as content_block_start shows it: empty."""
        if self.kind == TEXT:
            return {"type": TEXT, "text": ""}
        if self.kind == THINKING:
            return {"type": THINKING, "thinking": "", "signature": ""}
        return {"type": TOOL_USE, "id": self.call_id, "name": self.name, "input": {}}

    def json(self) -> dict[str, Any]:
        """The block as the Message shows it."""
        text = "".join(self.pieces)
        if self.kind == TEXT:
            return {"type": TEXT, "text": text}
        if self.kind == THINKING:
            return {"type": THINKING, "thinking": text, "signature": ""}
        try:
            value = orjson.loads(text) if text else {}
        except orjson.JSONDecodeError:
            value = {}  # arguments a model (through an upstream) wrote badly: the stream shows them as they are
        return {"type": TOOL_USE, "id": self.call_id, "name": self.name,
                "input": value if isinstance(value, dict) else {}}


class MessageView:
    """Folds one stream's events, in order from the first, into Anthropic's events and the Message (the module's
    docstring has the mapping)."""

    def __init__(self, stream_id: uuid.UUID, st: StreamStatus, *, thinking: bool) -> None:
        self.id = message_id(stream_id, thinking)
        self.thinking = thinking
        # Only what never changes goes into the objects, so every read folds to the same events.
        self.model = st.model
        # Anthropic's tiers are priority and standard: rsb's default and flex are both "standard" there.
        self.service_tier = "priority" if st.tier == "priority" else "standard"
        self.blocks: list[_Block] = []
        self.open: _Block | None = None
        self.calls: dict[int, _Block] = {}  # tool call index -> its block
        self.opened = False
        self.end: Event | None = None
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: dict[str, Any] | None = None

    def _usage(self) -> dict[str, Any]:
        usage = self.usage or {}
        prompt, cached = int(usage.get("prompt_tokens") or 0), int(usage.get("cached_tokens") or 0)
        return {"input_tokens": max(0, prompt - cached), "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": int(usage.get("completion_tokens") or 0),
                "service_tier": self.service_tier}

    def message(self) -> dict[str, Any]:
        """The Message as it stands."""
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [b.json() for b in self.blocks], "stop_reason": self.stop_reason,
                "stop_sequence": self.stop_sequence, "usage": self._usage()}

    def feed(self, ev: Event) -> list[tuple[str, dict[str, Any]]]:
        """The Anthropic events ``ev`` makes, each with its id."""
        if self.end is not None:
            return []
        out: list[dict[str, Any]] = []
        if not self.opened:
            self.opened = True
            out += [{"type": "message_start", "message": self.message()}, {"type": "ping"}]
        if ev.type == EventType.DELTA:
            self._text(TEXT, "text_delta", "text", ev.json()["text"], out)
        elif ev.type == EventType.REASONING:
            if self.thinking:
                self._text(THINKING, "thinking_delta", "thinking", ev.json()["text"], out)
        elif ev.type == EventType.TOOL_CALL:
            data = ev.json()
            self.calls[data["index"]] = self._open(TOOL_USE, out, call_id=data["id"], name=data["name"])
        elif ev.type == EventType.TOOL_ARGS:
            data = ev.json()
            block = self.calls.get(data["index"])
            if block is not None:  # arguments of a call never begun: no engine sends that
                block.pieces.append(data["text"])
                out.append({"type": "content_block_delta", "index": block.index,
                            "delta": {"type": "input_json_delta", "partial_json": data["text"]}})
        elif ev.is_terminal:
            self._end(ev, out)
        return [(f"{ev.id}:{n}", e) for n, e in enumerate(out)]

    def _open(self, kind: str, out: list[dict[str, Any]], call_id: str = "", name: str = "") -> _Block:
        self._close(out)
        block = _Block(kind, len(self.blocks), call_id=call_id, name=name)
        self.blocks.append(block)
        self.open = block
        out.append({"type": "content_block_start", "index": block.index, "content_block": block.start()})
        return block

    def _close(self, out: list[dict[str, Any]]) -> None:
        if self.open is not None:
            out.append({"type": "content_block_stop", "index": self.open.index})
            self.open = None

    def _text(self, kind: str, delta: str, name: str, text: str, out: list[dict[str, Any]]) -> None:
        block = self.open if self.open is not None and self.open.kind == kind else self._open(kind, out)
        block.pieces.append(text)
        out.append({"type": "content_block_delta", "index": block.index, "delta": {"type": delta, name: text}})

    def _end(self, ev: Event, out: list[dict[str, Any]]) -> None:
        self.end = ev
        data = ev.json()
        self.usage = data.get("usage")
        if ev.type != EventType.DONE:
            out.append(terminal_error(ev)[1])
            return
        self._close(out)
        self.stop_sequence = data.get("stop_sequence")
        reason = data.get("finish_reason", "stop")
        self.stop_reason = "stop_sequence" if self.stop_sequence is not None else STOP_REASONS.get(reason, "end_turn")
        out.append({"type": "message_delta", "delta": {"stop_reason": self.stop_reason,
                                                       "stop_sequence": self.stop_sequence},
                    "usage": self._usage()})
        out.append({"type": "message_stop"})
