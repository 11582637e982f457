"""What one schema may cost the grammar engine, bounded at create (broker.schema.enforceable calls ``check_cost``).

llama.cpp's grammar engine keeps one parse stack per way the answer so far can be read, and pays for each of them
on every character (docs/dependencies.md: an ambiguous ``anyOf`` nested through ``$ref`` cost 43.7 s per token at
depth 15). Ambiguity that stays inside one string, number or key costs a bounded amount and ends with it; ambiguity that
enters a nested object or array multiplies with whatever ambiguity lies inside, level after level. So:

- the branches of an ``anyOf`` must differ before either opens a nested object or array: walking two branches'
  top-level tokens together (braces, keys, leaf values; a nested object or array is one "opens" token), no text may
  take both into a nested value. Then at most one ``anyOf`` is undecided at a time, inside leaves;
- the stacks alive at once are bounded (``MAX_STACKS``, shared with broker.schema.pattern): the branches of an
  undecided ``anyOf`` add up, a pattern counts its own (pattern_cost.measure), an enum the values that agree so
  far, an object the optional properties that may come next;
- a ``$ref`` cycle that never passes a brace (``A: {"anyOf": [{"$ref": A}, ...]}``) is left recursion, which
  llama.cpp refuses: refused here first;
- OpenAI's published limits of strict mode, counted through ``$ref``: ``MAX_PROPERTIES`` properties,
  ``MAX_NESTING`` levels of objects and arrays, ``MAX_ENUM_VALUES`` enum values, ``MAX_NAME_CHARS`` characters of
  property and definition names and of enum and const values.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from typing import Any

from broker.errors import InvalidRequest, Path, spelled
from broker.schema.kinds import FORMATS, NUMERIC, kind, pattern_of, resolve_ref
from broker.schema.pattern_cost import MAX_STACKS, measure

MAX_PROPERTIES = 5000
MAX_NESTING = 10
MAX_ENUM_VALUES = 1000
MAX_NAME_CHARS = 15_000
#: An enum of more than LARGE_ENUM values holds at most LARGE_ENUM_CHARS characters (OpenAI's rule).
LARGE_ENUM, LARGE_ENUM_CHARS = 250, 7500
MAX_PAIR_STATES = 50_000  # states of two branches walked together before the check gives up (and refuses)

_LEAVES = frozenset({"string", "integer", "number", "boolean", "null", "const", "enum"})
_ANY_TYPES = ("object", "array", "string", "number", "boolean", "null")
# One schema object per bare type: the analysis memoizes by id(), so a fresh dict per use could take the id of
# one already collected and read its memo.
_BARE = {t: {"type": t} for t in ("object", "array", "string", "number", "integer", "boolean", "null")}
Token = tuple[str, Any]
ACCEPT = -1


def check_cost(schema: dict[str, Any], where: Path) -> None:
    _Analysis(schema, where).run()


def _branches(a: Path, b: Path, what: str, why: str) -> InvalidRequest:
    """Two anyOf branches (at ``a`` and ``b``) that ``what``, said at the schema both are in, then ``why``."""
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    while 0 < n < len(a) and isinstance(a[n], int):  # anyOf[0] and anyOf[1], not [0] and [1]
        n -= 1
    return InvalidRequest.at(a[:n], f": these anyOf branches {what} ({spelled(a[n:])} and {spelled(b[n:])}){why}")


class _Analysis:
    def __init__(self, root: dict[str, Any], where: Path) -> None:
        self.root = root
        self.where = where
        self.seen: set[int] = set()
        self.stacks_memo: dict[int, int] = {}
        self.nfas: dict[int, dict[int, list[tuple[Token, int]]]] = {}
        self.properties = self.enum_values = 0
        self.name_chars = 0
        self.depth_memo: dict[int, int] = {}

    def run(self) -> None:
        for d in ("$defs", "definitions"):
            for name in self.root.get(d, {}) or {}:
                self.name_chars += len(name)
        self.visit(self.root, self.where)
        depth = self.nesting(self.root, frozenset())
        if depth > MAX_NESTING:
            raise InvalidRequest.at(self.where, f": objects and arrays nest {depth} levels deep (through $ref); at "
                                    f"most {MAX_NESTING} are accepted")
        if self.name_chars > MAX_NAME_CHARS:
            raise InvalidRequest.at(self.where, ": property and definition names and enum and const values hold "
                                    f"{self.name_chars} characters; at most {MAX_NAME_CHARS} are accepted")

    # The alternatives a value position holds, refs and anyOf resolved.
    def alts(self, s: Any, at: Path, chain: frozenset[int] = frozenset()) -> list[tuple[Any, Path]]:
        k = kind(s)
        if k in ("ref", "anyOf"):
            if id(s) in chain:
                raise InvalidRequest.at(at, ": a $ref cycle that reaches itself before any brace (left recursion) "
                                        "cannot be enforced by rsb's constrained decoding")
            chain = chain | {id(s)}
            if k == "ref":
                return self.alts(resolve_ref(self.root, s["$ref"]), (*at, "$ref"), chain)
            out: list[tuple[Any, Path]] = []
            for i, alt in enumerate(s["anyOf"]):
                out.extend(self.alts(alt, (*at, "anyOf", i), chain))
            return out
        if k == "types":
            return [(_BARE[t], at) for t in s["type"]]
        if k == "any":
            return [(_BARE[t], at) for t in _ANY_TYPES]
        return [(s, at)]

    def visit(self, s: Any, at: Path) -> None:
        """Check ``s`` and everything it contains, each schema once."""
        if id(s) in self.seen or not isinstance(s, dict):
            return
        self.seen.add(id(s))
        k = kind(s)
        if k in ("ref", "anyOf", "types", "any"):
            alts = self.alts(s, at)
            if len(alts) > 1:
                self.no_ambiguity(alts)
            total = sum(self.stacks(c, a) for c, a in alts)
            if total > MAX_STACKS:
                raise InvalidRequest.at(at, f": its alternatives can be alive {total} at once while the answer is "
                                        f"written; at most {MAX_STACKS} are accepted (fewer branches, or branches "
                                        "that differ sooner)")
            if k == "ref":
                self.visit(resolve_ref(self.root, s["$ref"]), (*at, "$ref"))
            for i, alt in enumerate(s.get("anyOf", ())):
                self.visit(alt, (*at, "anyOf", i))
            return
        self.count(s, at, k)
        stacks = self.stacks(s, at)
        if stacks > MAX_STACKS:
            raise InvalidRequest.at(at, f": up to {stacks} ways to read its text can be alive at once; at most "
                                    f"{MAX_STACKS} are accepted (fewer optional properties or enum values sharing a "
                                    "beginning)")
        for child, where in self.children(s, at, k):
            self.visit(child, where)

    def children(self, s: dict[str, Any], at: Path, k: str) -> list[tuple[Any, Path]]:
        out: list[tuple[Any, Path]] = []
        if k == "object":
            out += [(v, (*at, "properties", n)) for n, v in s.get("properties", {}).items()]
            if isinstance(s.get("additionalProperties"), dict):
                out.append((s["additionalProperties"], (*at, "additionalProperties")))
        elif k == "allOf":
            for i, part in enumerate(s["allOf"]):
                part = resolve_ref(self.root, part["$ref"]) if "$ref" in part else part
                out += [(v, (*at, "allOf", i, "properties", n)) for n, v in part["properties"].items()]
        elif k == "array":
            if "prefixItems" in s:
                out += [(v, (*at, "prefixItems", i)) for i, v in enumerate(s["prefixItems"])]
            else:
                out.append((s.get("items", True), (*at, "items")))
        return out

    def count(self, s: dict[str, Any], at: Path, k: str) -> None:
        if k in ("object", "allOf"):
            names = [n for part in self.parts(s) for n in part.get("properties", {})]
            self.properties += len(names)
            self.name_chars += sum(len(n) for n in names)
            if self.properties > MAX_PROPERTIES:
                raise InvalidRequest.at(self.where, f": more than {MAX_PROPERTIES} properties in all; at most "
                                        f"{MAX_PROPERTIES} are accepted")
        elif k in ("enum", "const"):
            values = s["enum"] if k == "enum" else [s["const"]]
            chars = sum(len(v) for v in values if isinstance(v, str))
            self.name_chars += chars
            self.enum_values += len(values) if k == "enum" else 0
            if self.enum_values > MAX_ENUM_VALUES:
                raise InvalidRequest.at(self.where, f": more than {MAX_ENUM_VALUES} enum values in all; at most "
                                        f"{MAX_ENUM_VALUES} are accepted")
            if len(values) > LARGE_ENUM and chars > LARGE_ENUM_CHARS:
                raise InvalidRequest.at((*at, "enum"), f": an enum of more than {LARGE_ENUM} values may hold at most "
                                        f"{LARGE_ENUM_CHARS} characters")

    def parts(self, s: dict[str, Any]) -> list[dict[str, Any]]:
        if "allOf" not in s:
            return [s]
        return [resolve_ref(self.root, p["$ref"]) if "$ref" in p else p for p in s["allOf"]]

    def nesting(self, s: Any, path: frozenset[int]) -> int:
        """Levels of objects and arrays below ``s``, through $ref (a reference back into the path adds none)."""
        if not isinstance(s, dict) or id(s) in path:
            return 0
        if id(s) in self.depth_memo:
            return self.depth_memo[id(s)]
        path = path | {id(s)}
        k = kind(s)
        if k == "ref":
            depth = self.nesting(resolve_ref(self.root, s["$ref"]), path)
        elif k == "anyOf":
            depth = max(self.nesting(a, path) for a in s["anyOf"])
        else:
            below = [self.nesting(c, path) for c, _ in self.children(s, (), k)]
            depth = (1 if k in ("object", "allOf", "array") else 0) + max(below, default=0)
        self.depth_memo[id(s)] = depth
        return depth

    # Stacks.
    def stacks(self, c: dict[str, Any], at: Path) -> int:
        """The most stacks alive at once while the top level of ``c`` (a concrete schema) is written."""
        key = id(c)
        if key in self.stacks_memo:
            return self.stacks_memo[key]
        k = kind(c)
        if k in ("ref", "anyOf", "types", "any"):
            n = sum(self.stacks(a, w) for a, w in self.alts(c, at))
        elif k == "string":
            node = pattern_of(c, at)
            n = 2 if node is None else measure(node, (*at, "pattern" if "pattern" in c else "format")).stacks
        elif k in ("integer", "number"):
            # A bounded one: up to three lengths of digits (the lower bound's, those between, the upper's) per
            # sign, each deterministic, plus a fraction's digits.
            n = 8 if set(c) & set(NUMERIC) else 3
        elif k == "enum":
            n = _trie_width([json.dumps(v) for v in c["enum"]])
        elif k in ("const", "boolean", "null"):
            n = 2
        elif k in ("object", "allOf"):
            props: dict[str, Any] = {}
            required: set[str] = set()
            for part in self.parts(c):
                props.update(part.get("properties", {}))
                required |= set(part.get("properties", {})) if k == "allOf" else set(part.get("required", []))
            extra = c.get("additionalProperties")
            keys = len([p for p in props if p not in required]) + (extra not in (None, False)) + 1
            n = max([keys, *(self.value_stacks(v, (*at, "properties", p)) for p, v in props.items()),
                     *([self.value_stacks(extra, (*at, "additionalProperties"))] if isinstance(extra, dict) else [])])
        elif k == "array":
            items = c["prefixItems"] if "prefixItems" in c else [c.get("items", True)]
            n = 1 + max(self.value_stacks(v, (*at, "items")) for v in items)
        else:
            n = 2
        self.stacks_memo[key] = n
        return n

    def value_stacks(self, s: Any, at: Path) -> int:
        """Stacks alive at a value's position: its leaves' own, one per object or array it may open."""
        return sum(self.stacks(c, a) if kind(c) in _LEAVES else 1 for c, a in self.alts(s, at))

    # Ambiguity.
    def no_ambiguity(self, alts: list[tuple[Any, Path]]) -> None:
        nfas = [self.nfa(c) for c, _ in alts]
        for i in range(len(alts)):
            for j in range(i + 1, len(alts)):
                self.walk(nfas[i], nfas[j], alts[i][1], alts[j][1])

    def walk(self, a: dict[int, list[tuple[Token, int]]], b: dict[int, list[tuple[Token, int]]], at_a: Path,
             at_b: Path) -> None:
        todo = [(0, 0)]
        seen = {(0, 0)}
        while todo:
            qa, qb = todo.pop()
            for ta, na in a.get(qa, ()):
                for tb, nb in b.get(qb, ()):
                    if ta[0] == "open" and tb[0] == "open" and ta[1] == tb[1]:
                        nested = "object" if ta[1] == "{" else "array"
                        raise _branches(
                            at_a, at_b, f"can both match the answer up to a nested {nested}",
                            ", which makes llama.cpp's grammar engine pay for every reading of it on every token; make "
                            "the branches differ sooner (a first property of its own, or a const) to have this schema "
                            "enforced")
                    if na == ACCEPT or nb == ACCEPT or (na, nb) in seen or not _overlap(ta, tb):
                        continue
                    seen.add((na, nb))
                    if len(seen) > MAX_PAIR_STATES:
                        raise _branches(at_a, at_b, "are too alike to compare at a bounded cost",
                                        "; make them differ sooner")
                    todo.append((na, nb))

    def nfa(self, c: dict[str, Any]) -> dict[int, list[tuple[Token, int]]]:
        """The top-level tokens of concrete schema ``c`` as an automaton from state 0 to ACCEPT."""
        if id(c) in self.nfas:
            return self.nfas[id(c)]
        edges: dict[int, list[tuple[Token, int]]] = defaultdict(list)
        fresh = iter(range(1, 1 << 30))
        k = kind(c)

        def value(frm: int, s: Any, to: int) -> None:
            for alt, _ in self.alts(s, ()):
                for tok in self.value_tokens(alt):
                    edges[frm].append((tok, to))

        if k in _LEAVES:
            for tok in self.value_tokens(c):
                edges[0].append((tok, ACCEPT))
        elif k in ("object", "allOf"):
            self.object_nfa(c, k, edges, fresh, value)
        elif k == "array":
            start, end = next(fresh), next(fresh)
            edges[0].append((("lit", "["), start))
            edges[start].append((("lit", "]"), ACCEPT))
            edges[end].append((("lit", "]"), ACCEPT))
            if "prefixItems" in c:
                q = start
                for i, item in enumerate(c["prefixItems"]):
                    if i:
                        nq = next(fresh)
                        edges[q].append((("lit", ","), nq))
                        q = nq
                    nq = next(fresh) if i < len(c["prefixItems"]) - 1 else end
                    value(q, item, nq)
                    q = nq
                edges[start] = [e for e in edges[start] if e[0] != ("lit", "]")]
            else:
                sep = next(fresh)
                value(start, c.get("items", True), end)
                edges[end].append((("lit", ","), sep))
                value(sep, c.get("items", True), end)
        self.nfas[id(c)] = edges
        return edges

    def object_nfa(self, c: dict[str, Any], k: str, edges: dict[int, list[tuple[Token, int]]], fresh: Any,
                   value: Any) -> None:
        props: dict[str, Any] = {}
        required: list[str] = []
        for part in self.parts(c):
            props.update(part.get("properties", {}))
            required += list(part.get("properties", {})) if k == "allOf" else part.get("required", [])
        extra = c.get("additionalProperties")
        if "properties" not in c and k == "object" and extra is None:
            extra = True  # a bare object: any properties
        optional = [p for p in props if p not in required]
        q = next(fresh)
        edges[0].append((("lit", "{"), q))
        for i, name in enumerate(p for p in props if p in required):
            if i:
                nq = next(fresh)
                edges[q].append((("lit", ","), nq))
                q = nq
            nq = next(fresh)
            kq = next(fresh)
            edges[q].append((("key", name), kq))
            value(kq, props[name], nq)
            q = nq
        close = q
        edges[close].append((("lit", "}"), ACCEPT))
        # After the required ones, each optional one may come (in order), then the additional ones.
        entries: list[tuple[Token, Any]] = [(("key", p), props[p]) for p in optional]
        if extra not in (None, False):
            entries.append((("keyx", frozenset(props)), {} if extra is True else extra))
        after = [next(fresh) for _ in entries]
        for i, (tok, schema) in enumerate(entries):
            for frm in [close, *after[:i]]:
                kq = next(fresh)
                if frm == close and not required:
                    edges[frm].append((tok, kq))
                else:
                    cq = next(fresh)
                    edges[frm].append((("lit", ","), cq))
                    edges[cq].append((tok, kq))
                value(kq, schema, after[i])
            edges[after[i]].append((("lit", "}"), ACCEPT))
        if extra not in (None, False):
            cq = next(fresh)
            edges[after[-1]].append((("lit", ","), cq))
            kq = next(fresh)
            edges[cq].append((entries[-1][0], kq))
            value(kq, entries[-1][1], after[-1])

    def value_tokens(self, c: Any) -> list[Token]:
        k = kind(c)
        if k == "const":
            return [("lit", json.dumps(c["const"]))]
        if k == "enum":
            return [("lit", json.dumps(v)) for v in c["enum"]]
        if k == "string":
            return [("str", c)]
        if k in ("integer", "number"):
            return [("num", c)]
        if k == "boolean":
            return [("lit", "true"), ("lit", "false")]
        if k == "null":
            return [("lit", "null")]
        return [("open", "[" if k == "array" else "{")]


def _first(t: Token) -> str:
    if t[0] == "lit":
        return str(t[1])[0]
    if t[0] == "open":
        return str(t[1])
    return "-0123456789" if t[0] == "num" else '"'


def _overlap(a: Token, b: Token) -> bool:
    """Whether some text could be read as both tokens (False only when surely not)."""
    if not set(_first(a)) & set(_first(b)):
        return False
    kinds = {a[0], b[0]}
    if kinds == {"lit"}:
        return bool(a[1] == b[1])
    if "open" in kinds:
        return False  # a flat literal beside a nested value: it ends or fails on its own, nothing multiplies
    if kinds == {"key"}:
        return bool(a[1] == b[1])
    if kinds == {"key", "keyx"}:
        key, other = (a, b) if a[0] == "key" else (b, a)
        return bool(key[1] not in other[1])
    if kinds == {"str", "lit"}:
        s, lit = (a[1], b[1]) if a[0] == "str" else (b[1], a[1])
        return _string_admits(s, json.loads(lit))
    return True


def _string_admits(s: dict[str, Any], v: Any) -> bool:
    if not isinstance(v, str):
        return False
    if "pattern" in s:
        return re.search(s["pattern"], v) is not None
    if "format" in s:
        return re.fullmatch(FORMATS[s["format"]][1:-1], v) is not None
    return bool(s.get("minLength", 0) <= len(v) <= s.get("maxLength", len(v)))


def _trie_width(words: list[str]) -> int:
    """The most ways an enum's text can go on after a common beginning (its values in a trie), plus one."""
    trie: dict[str, Any] = {}
    widest = 1
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}
    todo = [trie]
    while todo:
        node = todo.pop()
        widest = max(widest, len(node))
        todo.extend(node.values())
    return widest + 1
