"""What a parsed pattern (broker.schema.pattern) costs llama.cpp's grammar engine.

llama.cpp's grammar engine keeps one parse stack per position the text so far may have reached, and on every
character advances each of them and deduplicates the new ones linearly (docs/dependencies.md: ``^(a?){1024}$``
took 593 s for 12 tokens). The stacks after a character are exactly the positions of the pattern's Glushkov
automaton, with the repetitions spelled out as llama.cpp spells them (``x{2,4}`` is ``x x`` then a chain of two
optional copies). ``measure`` walks the deterministic automaton of those position sets and refuses a pattern if,
after any text, more than ``MAX_STACKS`` stacks are alive or one character costs more than ``MAX_STEP_WORK`` stack
pushes times the stacks they are compared with.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from broker.errors import InvalidRequest, Path
from broker.schema.pattern import Alt, Chars, Intervals, Node, Seq

#: Positions of the pattern with its repetitions spelled out (the grammar's size, roughly).
MAX_POSITIONS = 4096
#: Parse stacks alive at once, and the work of one character (pushes x stacks compared), anywhere in an answer.
MAX_STACKS = 64
MAX_STEP_WORK = 4096
MAX_STATES = 20_000  # position sets the admission check explores before it gives up (and refuses)


def positions(node: Node) -> int:
    """How many character positions the node has with its repetitions spelled out."""
    if isinstance(node, Chars):
        return 1
    if isinstance(node, Seq):
        return sum(positions(n) for n in node.items)
    if isinstance(node, Alt):
        return sum(positions(n) for n in node.options)
    copies = node.lo + 1 if node.hi is None else node.hi
    return copies * positions(node.node)


@dataclass(frozen=True, slots=True)
class Cost:
    """The most parse stacks alive at once and the most work of one character, over every text."""

    stacks: int
    work: int


END = -1


class _Glushkov:
    """Positions and their follow sets, repetitions spelled out; aborts as soon as a set passes MAX_STACKS."""

    def __init__(self, at: Path) -> None:
        self.labels: list[Intervals] = []
        self.follow: list[set[int]] = []
        self.at = at

    def too_costly(self) -> InvalidRequest:
        return InvalidRequest.at(self.at, ": the pattern is too ambiguous to enforce at a bounded cost (more than "
                                 f"{MAX_STACKS} ways to match its text at once); make its repetitions unambiguous")

    def link(self, lasts: set[int], firsts: set[int]) -> None:
        for p in lasts:
            f = self.follow[p]
            f |= firsts
            if len(f) > MAX_STACKS:
                raise self.too_costly()

    def build(self, node: Node) -> tuple[set[int], set[int], bool]:
        """(first, last, nullable) of a fresh copy of ``node``."""
        if isinstance(node, Chars):
            if not node.ranges:
                return set(), set(), False  # matches nothing: a dead end
            self.labels.append(node.ranges)
            self.follow.append(set())
            p = len(self.labels) - 1
            return {p}, {p}, False
        if isinstance(node, Alt):
            first: set[int] = set()
            last: set[int] = set()
            nullable = False
            for opt in node.options:
                f, la, n = self.build(opt)
                first |= f
                last |= la
                nullable = nullable or n
            self.check(first)
            return first, last, nullable
        if isinstance(node, Seq):
            return self.sequence(list(node.items))
        items: list[Node | _Star | _Chain] = [node.node] * node.lo
        if node.hi is None:
            items.append(_Star(node.node))
        elif node.hi > node.lo:
            items.append(_Chain(node.node, node.hi - node.lo))
        return self.sequence(items)

    def sequence(self, items: list[Node | _Star | _Chain] | list[Node]) -> tuple[set[int], set[int], bool]:
        first: set[int] = set()
        last: set[int] = set()
        nullable = True
        for item in items:
            if isinstance(item, _Chain):
                f, la, n = self.chain(item)
            elif isinstance(item, _Star):
                f, la, _ = self.build(item.node)
                self.link(la, f)
                n = True
            else:
                f, la, n = self.build(item)
            self.link(last, f)
            if nullable:
                first |= f
                self.check(first)
            last = la | last if n else la
            nullable = nullable and n
        return first, last, nullable

    def chain(self, chain: _Chain) -> tuple[set[int], set[int], bool]:
        """``(x (x (x)?)?)?``, built from the innermost copy out."""
        first: set[int] = set()
        last: set[int] = set()
        for _ in range(chain.count):
            f, la, n = self.build(chain.node)
            self.link(la, first)
            first = f | first if n else f
            self.check(first)
            last = last | la
        return first, last, True

    def check(self, s: set[int]) -> None:
        if len(s) > MAX_STACKS:
            raise self.too_costly()


@dataclass(frozen=True, slots=True)
class _Chain:
    """``(x (x (x)?)?)?`` (``count`` copies): how llama.cpp spells the optional part of ``x{m,n}``."""

    node: Node
    count: int


@dataclass(frozen=True, slots=True)
class _Star:
    node: Node


def measure(node: Node, at: Path) -> Cost:
    """The pattern's cost (a string's content; the closing quote counts as one more stack), or InvalidRequest if it
    is too costly, too large, or matches no string rsb can write."""
    if positions(node) > MAX_POSITIONS:
        raise InvalidRequest.at(at, f": the pattern spells out more than {MAX_POSITIONS} characters with its "
                                "repetitions")
    g = _Glushkov(at)
    first, last, nullable = g.build(node)
    for p in last:
        g.follow[p].add(END)
    if nullable:
        first = first | {END}
    labels, follow = g.labels, g.follow
    seen: set[frozenset[int]] = set()
    todo: list[frozenset[int]] = [frozenset(first)]
    stacks = work = 0
    accepts = False
    while todo:
        closure = todo.pop()
        if closure in seen:
            continue
        seen.add(closure)
        if len(seen) > MAX_STATES:
            raise InvalidRequest.at(at, ": the pattern is too complex to bound its cost; simplify it")
        stacks = max(stacks, len(closure))
        accepts = accepts or END in closure
        for matched in _moves(closure, labels):
            nxt: set[int] = set()
            pushes = 0
            for p in matched:
                nxt |= follow[p]
                pushes += len(follow[p])
            step = len(closure) + pushes * len(nxt)
            if len(nxt) > MAX_STACKS or step > MAX_STEP_WORK:
                raise g.too_costly()
            work = max(work, step)
            todo.append(frozenset(nxt))
    if not accepts:
        raise InvalidRequest.at(at, ": the pattern matches no string rsb can write (only characters a JSON string "
                                "holds unescaped are generated: no quote, backslash or control character)")
    return Cost(stacks, work)


def _moves(closure: frozenset[int], labels: list[Intervals]) -> list[frozenset[int]]:
    """For each class of characters the positions in ``closure`` tell apart, the positions that match it."""
    live = [p for p in closure if p != END]
    if not live:
        return []
    cuts: set[int] = set()
    for p in live:
        for lo, hi in labels[p]:
            cuts.add(lo)
            cuts.add(hi + 1)
    points = sorted(cuts)
    out: set[frozenset[int]] = set()
    for a, b in itertools.pairwise(points):
        matched = frozenset(p for p in live if _covers(labels[p], a, b - 1))
        if matched:
            out.add(matched)
    return list(out)


def _covers(ranges: Intervals, lo: int, hi: int) -> bool:
    return any(r_lo <= lo and hi <= r_hi for r_lo, r_hi in ranges)
