"""What a partial JSON parser must show for each prefix of a document, computed from the document's own
structure (not by parsing): the oracle of the property tests of rsb/_partial_json.py and
consumer/static/partial-json.js.

``write(value, rng)`` serializes a value the way an engine might (random whitespace, characters escaped or
not, surrogate pairs as two ``\\u`` escapes, numbers in several spellings) and records where each value
starts and ends. ``Doc.expected(n)`` is then the partial value after the first ``n`` characters:

- a value whose first character is not in yet is absent, and so is every member after it;
- an array or object is present from its opening bracket, holding its present members in order;
- a string is present from its opening quote, holding the characters decoded so far: an escape counts once
  complete, a high surrogate once its low half is in; complete at its closing quote;
- ``true`` / ``false`` / ``null`` are present once their last letter is in;
- a number is present once a character after it is in (it could still grow), or at the end of the text;
- an object member is present when its value is.

So a partial value *agrees* with the final one: every member but the last of each open container equals the
final document's, the last one agrees with its final value (recursively), and an open string is a prefix of
its final text. At the end it is the document, ``json.loads``'s value.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

ABSENT: Any = object()  # no value yet (null is a value)

# Values whose JSON both Python and JavaScript read the same: integers JavaScript holds exactly, finite floats.
_SAFE_INT = 2**53 - 1
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-_SAFE_INT, _SAFE_INT)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=25,
)


@dataclass
class Node:
    kind: str  # "scalar", "number", "string", "array", "object"
    start: int  # offset of the first character
    end: int = 0  # offset after the last character
    value: Any = None  # scalars and numbers: their value (numbers: json.loads of their spelling)
    # strings: (offset after a decoded unit, the text decoded up to there), in order
    marks: list[tuple[int, str]] = field(default_factory=list)
    children: list[Node] = field(default_factory=list)  # arrays: elements; objects: their values
    keys: list[str] = field(default_factory=list)  # objects


@dataclass
class Doc:
    text: str
    root: Node

    def expected(self, n: int, *, final: bool = False) -> Any:
        """The partial value after the first ``n`` characters (``final``: and the text ends there)."""
        return _expected(self.root, n, final and n == len(self.text))


def _expected(node: Node, n: int, final: bool) -> Any:
    if n <= node.start:
        return ABSENT
    if node.kind == "scalar":
        return node.value if n >= node.end else ABSENT
    if node.kind == "number":
        return node.value if n > node.end or (final and n == node.end) else ABSENT
    if node.kind == "string":
        text = ""
        for offset, decoded in node.marks:
            if offset > n:
                break
            text = decoded
        return text
    out: Any = [] if node.kind == "array" else {}
    for i, child in enumerate(node.children):
        v = _expected(child, n, final)
        if v is ABSENT:
            break
        if node.kind == "array":
            out.append(v)
        else:
            out[node.keys[i]] = v
    return out


class _Writer:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.out: list[str] = []
        self.pos = 0

    def put(self, s: str) -> None:
        self.out.append(s)
        self.pos += len(s)

    def ws(self) -> None:
        if self.rng.random() < 0.3:
            self.put(self.rng.choice([" ", "\n", "\t", "\r\n", "  "]))

    def value(self, v: Any) -> Node:
        if isinstance(v, str):
            return self.string(v)
        if v is None or isinstance(v, bool):
            node = Node("scalar", self.pos, value=v)
            self.put(json.dumps(v))
        elif isinstance(v, int | float):
            spelling = json.dumps(v)
            if isinstance(v, int) and self.rng.random() < 0.2 and v != 0:
                spelling = f"{v}e0"  # a float spelling of an integer: json.loads gives a float
            elif isinstance(v, float) and "e" not in spelling and self.rng.random() < 0.2:
                spelling += "E+0"
            node = Node("number", self.pos, value=json.loads(spelling))
            self.put(spelling)
        elif isinstance(v, list):
            node = Node("array", self.pos)
            self.put("[")
            for i, item in enumerate(v):
                if i:
                    self.put(",")
                self.ws()
                node.children.append(self.value(item))
                self.ws()
            if not v:
                self.ws()
            self.put("]")
        else:
            node = Node("object", self.pos)
            self.put("{")
            for i, (k, item) in enumerate(v.items()):
                if i:
                    self.put(",")
                self.ws()
                self.string(k)
                self.ws()
                self.put(":")
                self.ws()
                node.keys.append(k)
                node.children.append(self.value(item))
                self.ws()
            self.put("}")
        node.end = self.pos
        return node

    def string(self, s: str) -> Node:
        node = Node("string", self.pos)
        self.put('"')
        decoded = ""
        node.marks.append((self.pos, decoded))
        for ch in s:
            cp = ord(ch)
            escaped = ch in '"\\' or cp < 0x20 or self.rng.random() < 0.15
            if not escaped:
                self.put(ch)
            elif ch in _SHORT and self.rng.random() < 0.7:
                self.put("\\" + _SHORT[ch])
            elif cp > 0xFFFF:
                hi, lo = 0xD800 + ((cp - 0x10000) >> 10), 0xDC00 + ((cp - 0x10000) & 0x3FF)
                self.put(f"\\u{hi:04x}")  # the high half alone decodes to nothing yet
                self.put(f"\\u{lo:04X}")
            else:
                self.put(f"\\u{cp:04x}")
            decoded += ch
            node.marks.append((self.pos, decoded))
        self.put('"')
        node.end = self.pos
        node.marks.append((self.pos, decoded))
        return node


_SHORT = {'"': '"', "\\": "\\", "/": "/", "\b": "b", "\f": "f", "\n": "n", "\r": "r", "\t": "t"}


def write(value: Any, rng: random.Random) -> Doc:
    w = _Writer(rng)
    w.ws()
    root = w.value(value)
    w.ws()
    text = "".join(w.out)
    assert json.loads(text) == value  # the writer writes the value it was given
    return Doc(text, root)


def same(a: Any, b: Any, *, numbers: bool = False, ordered: bool = True) -> bool:
    """Equal, types included (``1``, ``1.0`` and ``True`` are three different JSON values; with ``numbers``,
    ``1`` and ``1.0`` are the same, as in JavaScript), and object keys in the same order (unless not
    ``ordered``)."""
    if numbers and isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return float(a) == float(b)  # (a double that JavaScript writes without a fraction reads back as an int)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        keys_match = list(a) == list(b) if ordered else set(a) == set(b)
        return keys_match and all(same(a[k], b[k], numbers=numbers, ordered=ordered) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y, numbers=numbers, ordered=ordered)
                                        for x, y in zip(a, b, strict=True))
    return bool(a == b)


def cuts(n: int, rng: random.Random) -> list[int]:
    """Where to split a text of ``n`` characters into pieces of 1 to 12 characters (the ends included)."""
    points = [0]
    while points[-1] < n:
        points.append(min(n, points[-1] + rng.randint(1, 12)))
    return points
