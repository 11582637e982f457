"""Tool calls in a model's own text, in the Hermes syntax Qwen, Hermes and most open tool-calling models
write (and rsb's prompt asks for when a model's template knows no tools):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``ToolCallSyntax`` reads a model's answer token by token and turns it into pieces (generator.engines.pieces):
text outside the tags stays text; a call whose name comes first is announced as soon as its name is complete
and its arguments stream as they are written (a small JSON scanner says where they end); a call written any
other way (arguments first) is announced whole at its closing tag; what is between tags but is no call
comes out as the text it was. O(1) work per character, nothing re-parsed.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from typing import Any

from generator.engines.pieces import TEXT, Channel, Extra, Piece, ToolCallStart

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_WS = " \t\r\n"


def call_text(name: str, arguments: str) -> str:
    """A call as the model writes it, up to the end of its arguments (what a continuation replays)."""
    return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}'


def closed_call_text(name: str, arguments: str) -> str:
    return call_text(name, arguments) + "}\n" + CLOSE


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class _Head:
    """Matches the start of a call, ``{"name": "<name>", "arguments": `` (any whitespace between), one
    character at a time: ``feed`` says "more", "no" (not this shape) or "yes" (the next character starts the
    arguments, an object)."""

    _STEPS = ("ws", "{", "ws", '"name"', "ws", ":", "ws", "str", "ws", ",", "ws", '"arguments"', "ws", ":", "ws",
              "args")

    def __init__(self) -> None:
        self._step = 0
        self._pos = 0  # within a literal step
        self._name: list[str] = []
        self._escaped = False
        self.name = ""

    def feed(self, c: str) -> str:
        while True:
            step = self._STEPS[self._step]
            if step == "ws":
                if c in _WS:
                    return "more"
                self._step += 1
                continue
            if step == "str":
                if self._pos == 0:
                    if c != '"':
                        return "no"
                    self._pos = 1
                    return "more"
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    try:
                        self.name = json.loads('"' + "".join(self._name) + '"')
                    except ValueError:
                        return "no"
                    self._step += 1
                    self._pos = 0
                    return "more"
                self._name.append(c)
                return "more"
            if step == "args":
                return "yes" if c == "{" else "no"
            if c != step[self._pos]:
                return "no"
            self._pos += 1
            if self._pos == len(step):
                self._step += 1
                self._pos = 0
            return "more"


class _JsonEnd:
    """Finds where one JSON object ends, fed a character at a time (``feed`` is True on its last one)."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, c: str) -> bool:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
            return False
        if c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            return self._depth == 0
        return False


class ToolCallSyntax:
    """See the module doc. ``feed`` takes one token's text and returns its pieces: exactly one plain ``str``
    (the token's text, possibly ""), the rest markers and ``Extra``. ``calls`` counts the calls begun;
    ``first_index`` numbers them on after the calls an earlier attempt made."""

    def __init__(self, first_index: int = 0, kind: Channel | int = TEXT) -> None:
        self.calls = first_index
        self._kind = kind  # what the text we emit now is: TEXT or the index of a call's arguments
        self._state = "text"  # text | head | args | tail | whole
        self._held = ""  # text: a possible start of OPEN; head/whole: the call so far; tail: after the arguments
        self._head = _Head()
        self._end = _JsonEnd()
        self._after_call = False  # whitespace right after a call is dropped, not answer text

    def prime(self, text: str) -> None:
        """Run over text an earlier attempt wrote (a continuation), emitting nothing."""
        self._emit(text)

    def feed(self, text: str) -> list[Piece]:
        out = self._emit(text)
        pieces: list[Piece] = []
        token = False
        for item in out:
            if isinstance(item, str) and not token:
                pieces.append(str(item))
                token = True
            elif isinstance(item, str) and pieces and isinstance(pieces[-1], str):
                pieces[-1] = type(pieces[-1])(pieces[-1] + item)
            elif isinstance(item, str):
                pieces.append(Extra(item))
            else:
                pieces.append(item)
        if not token:
            pieces.append("")
        return pieces

    def end(self) -> list[Piece]:
        """At the end of the answer: text held back, and a call that never got past its start, as text."""
        out: list[Piece] = []
        if self._state == "text" and self._held:
            self._text(self._held, out)
        elif self._state in ("head", "whole"):
            self._text(OPEN + self._held, out)
        self._held = ""
        self._state = "text"
        return [Extra(p) if isinstance(p, str) else p for p in out]

    # -- the state machine -----------------------------------------------------------------------------------

    def _text(self, text: str, out: list[Piece]) -> None:
        if not text:
            return
        if self._kind is not TEXT:
            out.append(TEXT)
            self._kind = TEXT
        out.append(text)

    def _emit(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        i = 0
        n = len(text)
        while i < n:
            state = self._state
            if state == "text":
                i = self._in_text(text, i, out)
            elif state == "head":
                c = text[i]
                i += 1
                self._held += c
                verdict = self._head.feed(c)
                if verdict == "no":
                    self._state = "whole"
                elif verdict == "yes":
                    index = self.calls
                    self.calls += 1
                    out.append(ToolCallStart(index, new_call_id(), self._head.name))
                    self._kind = index
                    self._state = "args"
                    self._held = ""
                    self._end = _JsonEnd()
                    i -= 1  # the "{" is the arguments' first character
            elif state == "args":
                start = i
                while i < n:
                    done = self._end.feed(text[i])
                    i += 1
                    if done:
                        self._state = "tail"
                        self._held = ""
                        break
                out.append(text[start:i])
            elif state == "tail":
                self._held += text[i]
                i += 1
                if self._held.endswith(CLOSE):
                    self._state = "text"
                    self._held = ""
                    self._after_call = True
            else:  # whole: a call not written name first, read at its closing tag
                self._held += text[i]
                i += 1
                if self._held.endswith(CLOSE):
                    self._whole(self._held[: -len(CLOSE)], out)
        return out

    def _in_text(self, text: str, i: int, out: list[Piece]) -> int:
        if self._after_call:
            while i < len(text) and text[i] in _WS:
                i += 1
            if i == len(text):
                return i
            self._after_call = False
        buf = self._held + text[i:]
        at = buf.find(OPEN)
        if at >= 0:
            self._text(buf[:at], out)
            self._held = ""
            self._state = "head"
            self._head = _Head()
            # Continue right after the tag, in the caller's text.
            return len(text) - (len(buf) - at - len(OPEN))
        hold = 0
        for k in range(min(len(OPEN) - 1, len(buf)), 0, -1):
            if buf.endswith(OPEN[:k]):
                hold = k
                break
        self._text(buf[: len(buf) - hold], out)
        self._held = buf[len(buf) - hold:]
        return len(text)

    def _whole(self, body: str, out: list[Piece]) -> None:
        self._state = "text"
        self._held = ""
        call = _parse_call(body)
        if call is None:
            self._text(OPEN + body + CLOSE, out)
            return
        name, arguments = call
        index = self.calls
        self.calls += 1
        out.append(ToolCallStart(index, new_call_id(), name))
        self._kind = index
        out.append(arguments)
        self._after_call = True


def _parse_call(body: str) -> tuple[str, str] | None:
    try:
        obj: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def replay_text(text: str, calls: Iterable[tuple[str, str, bool]]) -> str:
    """The model's own text of an answer so far: its text, then each call (name, arguments, closed)."""
    return text + "".join(closed_call_text(n, a) if closed else call_text(n, a) for n, a, closed in calls)
