"""A JSON Schema ``pattern``: parsed once into a tree that both the admission check (broker.schema.pattern_cost) and the
engine's grammar (generator.engines.schema_grammar) read, so what is measured is what runs.

Semantics. A pattern is matched as JSON Schema says (a search: ``abc`` means "contains abc"; ``^`` and ``$`` at its
very ends anchor it). The grammar generates a subset of what the pattern matches, never anything else: only
characters a JSON string holds unescaped (no quote, backslash or control character, nor U+2028/U+2029), ``\\d`` as
``[0-9]``, ``\\w`` as ``[A-Za-z0-9_]``, ``\\s`` as a space, negated classes and ``.`` within those characters. A
pattern whose subset is empty (``^\\n$``) is refused, as is what cannot be a grammar (lookarounds, backreferences,
word boundaries, ``^``/``$`` inside).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from broker.errors import InvalidRequest, Path

MAX_PATTERN_CHARS = 1024
MAX_REPEAT = 1024  # a {m,n} count; llama.cpp spells each repetition out

Intervals = tuple[tuple[int, int], ...]
#: What a JSON string holds unescaped, less U+2028/U+2029 (which ECMA's "." does not match).
JSON_CHARS: Intervals = ((0x20, 0x21), (0x23, 0x5B), (0x5D, 0x7E), (0x80, 0x2027), (0x202A, 0xD7FF),
                         (0xE000, 0x10FFFF))
DIGITS: Intervals = ((0x30, 0x39),)
WORD: Intervals = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
SPACE: Intervals = ((0x20, 0x20),)


def intersect(a: Intervals, b: Intervals) -> Intervals:
    out: list[tuple[int, int]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def union(parts: list[tuple[int, int]]) -> Intervals:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(parts):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def complement(a: Intervals) -> Intervals:
    """Within JSON_CHARS."""
    out: list[tuple[int, int]] = []
    nxt = 0
    for lo, hi in a:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= 0x10FFFF:
        out.append((nxt, 0x10FFFF))
    return intersect(tuple(out), JSON_CHARS)


@dataclass(frozen=True, slots=True)
class Chars:
    """One character among ``ranges`` (already within JSON_CHARS; empty: no text matches)."""

    ranges: Intervals


@dataclass(frozen=True, slots=True)
class Seq:
    items: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Alt:
    options: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Repeat:
    """``node`` from ``lo`` to ``hi`` times (None: unbounded): ``*`` is (0, None), ``+`` (1, None), ``?`` (0, 1)."""

    node: Node
    lo: int
    hi: int | None


Node = Chars | Seq | Alt | Repeat
_DOT = Chars(JSON_CHARS)
_ANY = Repeat(_DOT, 0, None)
_SHORTHANDS = {"d": DIGITS, "w": WORD, "s": SPACE}
_CONTROLS = {"t": 9, "n": 10, "r": 13, "f": 12, "v": 11, "0": 0}
_SPECIAL = set("^$\\.*+?()[]{}|/-")
_QUANT = re.compile(r"\{([0-9]{1,6})(,([0-9]{0,6}))?\}")


class PatternRefused(InvalidRequest):
    pass


def parse(pattern: str, at: Path) -> Node:
    """The pattern as a tree (the anchors applied), or PatternRefused naming what rsb cannot enforce."""
    if not isinstance(pattern, str) or len(pattern) > MAX_PATTERN_CHARS:
        raise InvalidRequest.at(at, f" must be a string of at most {MAX_PATTERN_CHARS} characters")
    try:
        re.compile(pattern)
    except re.error as e:
        raise InvalidRequest.at(at, f" is not a valid regular expression: {e}") from None
    body = pattern
    head = body.startswith("^")
    tail = body.endswith("$") and not body.endswith("\\$") and len(body) > int(head)
    body = body[int(head): len(body) - int(tail)]
    tree = _Parser(body, at).parse()
    items = ([] if head else [_ANY]) + [tree] + ([] if tail else [_ANY])
    return Seq(tuple(items)) if len(items) > 1 else tree


class _Parser:
    def __init__(self, text: str, at: Path) -> None:
        self.s, self.i, self.at = text, 0, at

    def refuse(self, what: str) -> PatternRefused:
        return PatternRefused.at(self.at, f": {what} in a pattern cannot be enforced by rsb's constrained decoding "
                                 "(docs/protocol.md lists what a pattern may use)")

    def parse(self) -> Node:
        node = self.alternation()
        if self.i < len(self.s):
            raise self.refuse(f"the unbalanced ')' at {self.i}")
        return node

    def alternation(self) -> Node:
        options = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else factor(options)

    def sequence(self) -> Node:
        items: list[Node] = []
        while self.i < len(self.s) and self.s[self.i] not in "|)":
            items.append(self.quantified(self.atom()))
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def quantified(self, node: Node) -> Node:
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.i += 1
                lo, hi = (1 if c == "+" else 0), (1 if c == "?" else None)
            elif c == "{" and (m := _QUANT.match(self.s, self.i)):
                lo = int(m.group(1))
                hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
                if lo > MAX_REPEAT or (hi is not None and hi > MAX_REPEAT):
                    raise InvalidRequest.at(self.at, f": quantifiers {{m,n}} take counts of at most {MAX_REPEAT}")
                if hi is not None and hi < lo:
                    raise InvalidRequest.at(self.at, f": the quantifier {m.group(0)} has its maximum below its minimum")
                self.i = m.end()
            elif self.s.startswith("{,", self.i):
                raise self.refuse("'{,n}' (a literal in ECMA-262, a quantifier in Python: write {0,n})")
            else:
                return node
            if hi is None and nullable(node):
                # llama.cpp spells x* as a rule that calls itself after x: with an x that may be empty, that is
                # left recursion, which it refuses (and the ambiguity is unbounded anyway).
                raise self.refuse("an unbounded repetition of something that may be empty (such as (a*)* or (a?)+)")
            node = Repeat(node, lo, hi)
            nxt = self.peek()
            if nxt == "?":
                self.i += 1  # lazy: the same strings match a whole pattern
            elif nxt == "+":
                raise self.refuse("a possessive quantifier")

    def atom(self) -> Node:
        c = self.s[self.i]
        if c == "(":
            self.i += 1
            if self.s.startswith("?:", self.i):
                self.i += 2
            elif self.s.startswith("?P<", self.i) or (self.s.startswith("?<", self.i)
                                                      and self.s[self.i + 2: self.i + 3] not in ("=", "!")):
                self.i = self.s.index(">", self.i) + 1
            elif self.peek() == "?":
                raise self.refuse("a lookaround or flag group '(?'")
            node = self.alternation()
            if self.peek() != ")":
                raise self.refuse("an unclosed group")
            self.i += 1
            return node
        if c == "[":
            return self.char_class()
        if c == ".":
            self.i += 1
            return _DOT
        if c == "\\":
            raw, _ = self.escape()
            return Chars(intersect(raw, JSON_CHARS))
        if c in "^$":
            raise self.refuse(f"'{c}' anywhere but at the pattern's ends")
        if c in "*+?":
            raise self.refuse(f"the quantifier '{c}' with nothing before it")
        self.i += 1
        return Chars(intersect(((ord(c), ord(c)),), JSON_CHARS))

    def escape(self) -> tuple[Intervals, bool]:
        """The characters of the escape at ``i`` (not yet limited to JSON_CHARS), and whether it is one character."""
        nxt = self.s[self.i + 1: self.i + 2]
        self.i += 2
        if nxt in _SHORTHANDS:
            return _SHORTHANDS[nxt], False
        if nxt.lower() in _SHORTHANDS:
            return complement(_SHORTHANDS[nxt.lower()]), False
        if nxt in ("x", "u"):
            width = 2 if nxt == "x" else 4
            digits = self.s[self.i: self.i + width]
            if len(digits) != width or not all(ch in "0123456789abcdefABCDEF" for ch in digits):
                raise self.refuse(f"the escape '\\{nxt}{digits}'")
            self.i += width
            cp = int(digits, 16)
            return ((cp, cp),), True
        if nxt in _CONTROLS:
            return ((_CONTROLS[nxt], _CONTROLS[nxt]),), True
        if nxt in _SPECIAL:
            return ((ord(nxt), ord(nxt)),), True
        raise self.refuse(f"the escape '\\{nxt}'")

    def char_class(self) -> Node:
        self.i += 1
        negated = self.peek() == "^"
        self.i += int(negated)
        if self.peek() == "]":
            raise self.refuse("a class that starts with ']' (ECMA-262 and Python read it differently)")
        parts: list[tuple[int, int]] = []
        while self.i < len(self.s) and self.s[self.i] != "]":
            lo, single = self.class_atom()
            if single and self.peek() == "-" and self.s[self.i + 1: self.i + 2] not in ("]", ""):
                self.i += 1
                hi, hi_single = self.class_atom()
                if not hi_single:
                    raise self.refuse("a class range to a shorthand")
                if hi[0][0] < lo[0][0]:
                    raise InvalidRequest.at(self.at, ": a class range is out of order")
                parts.append((lo[0][0], hi[0][0]))
            else:
                parts.extend(lo)
        self.i += 1  # the ']' (re.compile checked it is there)
        ranges = union(parts)
        return Chars(complement(ranges) if negated else intersect(ranges, JSON_CHARS))

    def class_atom(self) -> tuple[Intervals, bool]:
        c = self.s[self.i]
        if c != "\\":
            self.i += 1
            return ((ord(c), ord(c)),), True
        if self.s[self.i + 1: self.i + 2] == "b":
            raise self.refuse("'\\b' in a class")
        return self.escape()


def nullable(node: Node) -> bool:
    if isinstance(node, Chars):
        return False
    if isinstance(node, Seq):
        return all(nullable(n) for n in node.items)
    if isinstance(node, Alt):
        return any(nullable(n) for n in node.options)
    return node.lo == 0 or nullable(node.node)


def _literal(node: Node) -> list[int] | None:
    """The code points of a node that is a plain string (each character one code point), else None."""
    items = node.items if isinstance(node, Seq) else (node,)
    out = []
    for n in items:
        if not (isinstance(n, Chars) and len(n.ranges) == 1 and n.ranges[0][0] == n.ranges[0][1]):
            return None
        out.append(n.ranges[0][0])
    return out


def factor(options: list[Node]) -> Node:
    """An alternation, with the common leading characters of its plain-string options merged (a trie): ``US|UK|FR``
    is ``U(S|K)|FR``, so the options alive at once are those that agree so far, not all of them."""
    words = [_literal(o) for o in options]
    if any(w is None for w in words) or len(options) < 2:
        return Alt(tuple(options))
    return _trie([w for w in words if w is not None])


def _trie(words: list[list[int]]) -> Node:
    groups: dict[int, list[list[int]]] = {}
    ends = False
    for w in words:
        if w:
            groups.setdefault(w[0], []).append(w[1:])
        else:
            ends = True
    options: list[Node] = []
    for cp, rests in groups.items():
        head = Chars(((cp, cp),))
        tail = _trie(rests) if any(rests) else None
        if tail is None:
            options.append(head)
        elif isinstance(tail, Seq):
            options.append(Seq((head, *tail.items)))
        else:
            options.append(Seq((head, tail)))
    if ends:
        body: Node = options[0] if len(options) == 1 else Alt(tuple(options))
        return Repeat(body, 0, 1)
    return options[0] if len(options) == 1 else Alt(tuple(options))


