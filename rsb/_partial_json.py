"""The partial value of a JSON text that arrives in pieces (a structured answer, a tool call's arguments), kept
up to date in O(new characters) per piece.

Re-parsing the accumulated text after every delta costs O(n) per delta, O(n²) in all: a 12 KB answer in 1,600
deltas re-reads ~10 MB (docs/benchmarks.md, "partial-json"). ``PartialJSON`` is a state machine that reads
each character once: it keeps the containers it has opened as real dicts and lists, mutated in place, and
holds back only what the next piece may still change (half of an escape, a number without its end, a
literal without its last letter).

What ``value`` shows for a prefix of a valid document (``tests/json_prefixes.py`` states it exactly and the
property tests check it for every prefix):
- a container appears as soon as it opens, with every member it completed;
- an object member appears once its value has begun; a string value grows as its characters arrive (a
  ``\\u`` escape counts once its four digits are in; the high half of a surrogate pair waits for the low
  half); ``true``/``false``/``null`` appear once spelled out; a number only once something follows it (it
  could still grow), at the top level once ``end()`` says the text is over;
- so members before the last one equal the final document's, and the last is a prefix of its final value.

Reading ``value`` joins the one string still open (a copy of that string, not of the document).
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

_WS = re.compile(r"[ \t\n\r]*")
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
# A number's characters, then the number grammar: a run that stops at the end of the text may grow, so it
# is judged once something follows it.
_NUMBER_RUN = re.compile(r"[-+0-9.eE]+")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS: dict[str, tuple[str, Any]] = {"t": ("true", True), "f": ("false", False), "n": ("null", None)}

# What may come next (outside a string, whitespace too).
_VALUE = 0  # a value (the document's, an array element after ",", an object member's after ":")
_VALUE_OR_CLOSE = 1  # just after "["
_KEY = 2  # just after "," in an object
_KEY_OR_CLOSE = 3  # just after "{"
_COLON = 4
_COMMA_OR_CLOSE = 5
_STRING = 6  # inside a string (a key or a value)
_END = 7  # the document is complete: only whitespace may follow


class _Open:
    """An open container, and in an object the key of the member being read."""

    __slots__ = ("container", "key")

    def __init__(self, container: dict[str, Any] | list[Any]) -> None:
        self.container = container
        self.key = ""


class PartialJSON:
    """Feed pieces of one JSON text with ``feed``; ``value`` is the document so far (None before it begins:
    see ``started``), ``done`` whether it is complete. Invalid JSON raises ``ValueError`` (and every later
    call does too)."""

    __slots__ = ("_done_chars", "_error", "_final", "_high", "_is_key", "_open", "_pieces", "_rest", "_root",
                 "_started", "_state")

    def __init__(self) -> None:
        self._state = _VALUE
        self._open: list[_Open] = []
        self._root: Any = None
        self._started = False
        self._rest = ""  # text read but not yet consumed: what the next piece may change
        self._done_chars = 0  # characters consumed before _rest (for error positions)
        self._pieces: list[str] = []  # the open string's decoded text
        self._is_key = False
        self._high = ""  # a high surrogate escape waiting for its low half
        self._final = False
        self._error: str | None = None

    @property
    def started(self) -> bool:
        return self._started

    @property
    def done(self) -> bool:
        """A whole JSON value was read (only whitespace may follow)."""
        return self._state == _END

    @property
    def value(self) -> Any:
        if self._state == _STRING and not self._is_key:
            s = "".join(self._pieces)
            self._pieces = [s]
            self._place(s)
        return self._root

    def end(self) -> None:
        """The text is over: a number at the top level is complete now. (An unfinished document stays
        unfinished: ``done`` says which.)"""
        self._final = True
        self.feed("")

    def feed(self, text: str) -> None:
        if self._error is not None:
            raise ValueError(self._error)
        buf = self._rest + text if self._rest else text
        i = 0
        try:
            i = self._consume(buf)
        except ValueError as e:
            self._error = str(e)
            raise
        self._done_chars += i
        self._rest = buf[i:]

    # -- the state machine -------------------------------------------------------------------------------

    def _consume(self, buf: str) -> int:
        """Consumes what it can of ``buf``; returns where it stopped (the rest waits for more text)."""
        i, n = 0, len(buf)
        while i < n:
            state = self._state
            if state == _STRING:
                m = _STRING_RUN.match(buf, i)
                if m is not None:
                    self._flush_high()
                    self._pieces.append(m.group())
                    i = m.end()
                    continue
                c = buf[i]
                if c == '"':
                    self._close_string()
                    i += 1
                elif c == "\\":
                    if i + 1 >= n:
                        break
                    esc = buf[i + 1]
                    if esc == "u":
                        if i + 6 > n:
                            if not _HEX4.match(buf[i + 2:] + "0000"):
                                self._fail(i, "a \\u escape needs four hex digits")
                            break
                        if not _HEX4.match(buf, i + 2):
                            self._fail(i, "a \\u escape needs four hex digits")
                        self._code_unit(int(buf[i + 2:i + 6], 16))
                        i += 6
                    elif esc in _ESCAPES:
                        self._flush_high()
                        self._pieces.append(_ESCAPES[esc])
                        i += 2
                    else:
                        self._fail(i, f"invalid escape \\{esc}")
                else:
                    self._fail(i, "a control character in a string")
                continue
            ws = _WS.match(buf, i)
            if ws is not None:
                i = ws.end()
            if i >= n:
                break
            c = buf[i]
            if state == _VALUE or state == _VALUE_OR_CLOSE:
                if c == "]" and state == _VALUE_OR_CLOSE:
                    self._close_container()
                    i += 1
                elif c == '"':
                    self._attach("")
                    self._begin_string(is_key=False)
                    i += 1
                elif c == "{":
                    obj: dict[str, Any] = {}
                    self._attach(obj)
                    self._open.append(_Open(obj))
                    self._state = _KEY_OR_CLOSE
                    i += 1
                elif c == "[":
                    arr: list[Any] = []
                    self._attach(arr)
                    self._open.append(_Open(arr))
                    self._state = _VALUE_OR_CLOSE
                    i += 1
                elif c in _LITERALS:
                    word, lit = _LITERALS[c]
                    got = buf[i:i + len(word)]
                    if got != word:
                        if len(got) < len(word) and word.startswith(got):
                            break  # the rest of the word is still to come
                        self._fail(i, "an unknown literal")
                    self._attach(lit)
                    self._after_value()
                    i += len(word)
                elif c == "-" or "0" <= c <= "9":
                    run = _NUMBER_RUN.match(buf, i)
                    assert run is not None
                    if run.end() == n and not self._final:
                        break  # more digits may follow
                    num = _NUMBER.fullmatch(run.group())
                    if num is None:
                        self._fail(i, f"an invalid number {run.group()!r}")
                    self._attach(float(run.group()) if num.group(1) or num.group(2) else int(run.group()))
                    self._after_value()
                    i = run.end()
                else:
                    self._fail(i, f"unexpected {c!r} where a value should be")
            elif state == _KEY or state == _KEY_OR_CLOSE:
                if c == '"':
                    self._begin_string(is_key=True)
                elif c == "}" and state == _KEY_OR_CLOSE:
                    self._close_container()
                else:
                    self._fail(i, f"unexpected {c!r} where a key should be")
                i += 1
            elif state == _COLON:
                if c != ":":
                    self._fail(i, f"unexpected {c!r} where ':' should be")
                self._state = _VALUE
                i += 1
            elif state == _COMMA_OR_CLOSE:
                top = self._open[-1]
                is_obj = isinstance(top.container, dict)
                if c == ",":
                    self._state = _KEY if is_obj else _VALUE
                elif c == ("}" if is_obj else "]"):
                    self._close_container()
                else:
                    self._fail(i, f"unexpected {c!r} after a member")
                i += 1
            else:  # _END
                self._fail(i, f"unexpected {c!r} after the document")
        return i

    def _fail(self, i: int, what: str) -> NoReturn:
        raise ValueError(f"invalid JSON at character {self._done_chars + i}: {what}")

    def _attach(self, value: Any) -> None:
        """A value begins where the state says: the document, the next element, the current member."""
        if not self._open:
            self._root = value
            self._started = True
            return
        top = self._open[-1]
        if isinstance(top.container, dict):
            top.container[top.key] = value
        else:
            top.container.append(value)

    def _place(self, value: Any) -> None:
        """Replaces the value begun last (an open string's current text)."""
        if not self._open:
            self._root = value
            return
        top = self._open[-1]
        if isinstance(top.container, dict):
            top.container[top.key] = value
        else:
            top.container[-1] = value

    def _after_value(self) -> None:
        self._state = _COMMA_OR_CLOSE if self._open else _END

    def _close_container(self) -> None:
        self._open.pop()
        self._after_value()

    def _begin_string(self, *, is_key: bool) -> None:
        self._state = _STRING
        self._is_key = is_key
        self._pieces = []
        self._high = ""

    def _code_unit(self, cp: int) -> None:
        if 0xD800 <= cp < 0xDC00:
            self._flush_high()
            self._high = chr(cp)
        elif 0xDC00 <= cp < 0xE000 and self._high:
            self._pieces.append(chr(0x10000 + ((ord(self._high) - 0xD800) << 10) + (cp - 0xDC00)))
            self._high = ""
        else:
            self._flush_high()
            self._pieces.append(chr(cp))

    def _flush_high(self) -> None:
        # A high surrogate not followed by its low half stays what it is (as json.loads keeps it).
        if self._high:
            self._pieces.append(self._high)
            self._high = ""

    def _close_string(self) -> None:
        self._flush_high()
        s = "".join(self._pieces)
        self._pieces = []
        if self._is_key:
            self._open[-1].key = s
            self._state = _COLON
        else:
            self._place(s)
            self._after_value()
