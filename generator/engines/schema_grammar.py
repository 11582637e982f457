"""A JSON Schema (one broker.schema.enforceable admits) as llama.cpp grammar rules (GBNF).

rsb's own converter, so that the grammar is what the admission check measured (broker.schema.cost,
broker.schema.pattern) and nothing the schema excludes can be written:
- objects: required properties in order, then each optional one (in order), then the additional ones, whose keys
  never spell a declared property's name (a trie of the names: llama.cpp's converter let ``additionalProperties``
  write any key, a declared one included, which both broke the schema and made the two readings alive at once);
- strings hold only what JSON writes unescaped (no quote, backslash or control character, whole Unicode scalar
  values) or an escape; ``pattern`` and ``format`` from their parsed tree (broker.schema.pattern), repetitions in
  llama.cpp's own ``{m,n}`` (which it spells out as rules: nested groups past 1,000 levels fail to parse);
- bounded integers and numbers digit by digit (generator.engines.number_grammar);
- ``enum``/``const`` values and alternations of plain strings as tries, so the values alive at once are the
  ones that agree so far;
- ``$ref`` as a rule per definition (recursion included; a ``$ref`` at the root too).
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

from broker.schema.grammar_size import MAX_GRAMMAR_BYTES
from broker.schema.kinds import integer_bounds, kind, multiple_of, number_bounds, pattern_of, resolve_ref
from broker.schema.pattern import JSON_CHARS, Alt, Chars, Intervals, Node, Seq, intersect
from generator.engines.number_grammar import integer_rule, number_rule

# What a JSON string holds unescaped (whole Unicode scalar values: no surrogate, nothing past U+10FFFF), or an escape.
_UNESCAPED = r"[\x20-\x21\x23-\x5B\x5D-\x7E\u0080-\uD7FF\uE000-\U0010FFFF]"
PRIMITIVES: dict[str, str] = {
    "space": '" "?',
    "char": _UNESCAPED + r' | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])',
    "string": r'"\"" char* "\"" space',
    "boolean": '("true" | "false") space',
    "null": '"null" space',
    "integral-part": '"0" | [1-9] [0-9]{0,15}',
    "number": '"-"? integral-part ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,3})? space',
    "integer": '"-"? integral-part space',
    "value": "object | array | string | number | boolean | null",
    "object": '"{" space ( string ":" space value ( "," space string ":" space value )* )? "}" space',
    "array": '"[" space ( value ( "," space value )* )? "]" space',
}
_DEPENDS = {"string": ("space", "char"), "boolean": ("space",), "null": ("space",), "number": ("integral-part",
            "space"), "integer": ("integral-part", "space"), "value": ("object", "array", "string", "number",
            "boolean", "null"), "object": ("string", "value", "space"), "array": ("value", "space")}


def _cp(c: int) -> str:
    ch = chr(c)
    if ch.isascii() and ch.isalnum():
        return ch
    return f"\\u{c:04X}" if c <= 0xFFFF else f"\\U{c:08X}"


def literal(text: str) -> str:
    return '"' + "".join(_cp(ord(c)) for c in text) + '"'


def char_class(ranges: Intervals) -> str:
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return literal(chr(ranges[0][0]))
    return "[" + "".join(_cp(a) if a == b else f"{_cp(a)}-{_cp(b)}" for a, b in ranges) + "]"


class GrammarTooBig(Exception):
    """The grammar passed MAX_GRAMMAR_BYTES while it was built (the admission estimate, broker.schema.grammar_size,
    missed it): the build stops there, so a schema never holds a worker for long."""


class Grammar:
    """The rules of one grammar; ``add`` names a rule (``prefix`` keeps two tools' rules apart)."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}
        self._bodies: dict[str, str] = {}
        self._n = 0
        self._bytes = 0

    def primitive(self, name: str) -> str:
        if name not in self.rules:
            self.rules[name] = PRIMITIVES[name]
            for dep in _DEPENDS.get(name, ()):
                self.primitive(dep)
        return name

    def add(self, hint: str, body: str) -> str:
        if body in self._bodies:
            return self._bodies[body]
        self._n += 1
        name = f"{hint}-{self._n}"
        self._bytes += len(body) + len(name)
        if self._bytes > MAX_GRAMMAR_BYTES:
            raise GrammarTooBig(f"its grammar passed {MAX_GRAMMAR_BYTES} bytes")
        self.rules[name] = body
        self._bodies[body] = name
        return name

    def reserve(self, hint: str) -> str:
        self._n += 1
        return f"{hint}-{self._n}"

    def text(self, root: str) -> str:
        lines = [f"root ::= {root}"] + [f"{n} ::= {b}" for n, b in self.rules.items()]
        return "\n".join(lines)


class SchemaGrammar:
    """Rules for one schema (``root`` resolves its ``$ref``s) inside ``grammar``."""

    def __init__(self, grammar: Grammar, root: dict[str, Any], prefix: str) -> None:
        self.g = grammar
        self.root = root
        self.prefix = prefix
        self.defs: dict[int, str] = {}  # a definition's rule, named before it is built (recursion)

    def rule(self, s: Any) -> str:
        """The name of a rule for values valid against ``s``."""
        k = kind(s)
        if k == "ref":
            target = resolve_ref(self.root, s["$ref"])
            if id(target) not in self.defs:
                name = self.g.reserve(f"{self.prefix}def")
                self.defs[id(target)] = name
                self.g.rules[name] = self.body(target)
            return self.defs[id(target)]
        if k == "any":
            return self.g.primitive("value")
        if k in ("boolean", "null") or (k in ("string", "integer", "number") and set(s) & _CONSTRAINED[k] == set()):
            return self.g.primitive(k)
        if k == "object" and "properties" not in s and s.get("additionalProperties") in (None, True):
            return self.g.primitive("object")
        if k == "array" and "prefixItems" not in s and s.get("items", True) in (True, {}) and not (
                {"minItems", "maxItems"} & set(s)):
            return self.g.primitive("array")
        return self.g.add(f"{self.prefix}{k}", self.body(s))

    def body(self, s: Any) -> str:
        k = kind(s)
        if k in ("ref", "any", "boolean", "null"):
            return self.rule(s)
        if k == "anyOf":
            return " | ".join(self.rule(a) for a in s["anyOf"])
        if k == "types":
            return " | ".join(self.rule({"type": t}) for t in s["type"])
        if k == "const":
            return f"{self.trie([json.dumps(s['const'])])} {self.g.primitive('space')}"
        if k == "enum":
            return f"{self.trie([json.dumps(v) for v in s['enum']])} {self.g.primitive('space')}"
        if k in ("object", "allOf"):
            return self.object(s, k)
        if k == "array":
            return self.array(s)
        if k == "string":
            return self.string(s)
        if k == "integer" or (k == "number" and _integral_step(s)):
            lo, hi = integer_bounds(s)
            step = multiple_of(s)
            self.g.primitive("space")
            return integer_rule(self.g.add, lo, hi, 1 if step is None else int(step))
        if k == "number":
            nlo, lo_x, nhi, hi_x = number_bounds(s)
            self.g.primitive("space")
            return number_rule(self.g.add, nlo, lo_x, nhi, hi_x)
        raise AssertionError(f"unchecked schema kind {k}")

    def object(self, s: dict[str, Any], k: str) -> str:
        props: dict[str, Any] = {}
        required: list[str] = []
        parts = [s] if k == "object" else [resolve_ref(self.root, p["$ref"]) if "$ref" in p else p for p in s["allOf"]]
        for part in parts:
            props.update(part.get("properties", {}))
            required += list(part.get("properties", {})) if k == "allOf" else part.get("required", [])
        space = self.g.primitive("space")
        kv = {name: f'{literal(json.dumps(name))} {space} ":" {space} {self.rule(v)}' for name, v in props.items()}
        entries = [self.g.add(f"{self.prefix}kv", kv[p]) for p in props if p not in required]
        extra = s.get("additionalProperties")
        if extra not in (None, False):
            key = self.not_names(list(props))
            value = self.rule({} if extra is True else extra)
            one = self.g.add(f"{self.prefix}addkv", f'{key} ":" {space} {value}')
            entries.append(self.g.add(f"{self.prefix}addkvs", f'{one} ( "," {space} {one} )*'))
        out = f'"{{" {space} ' + f' "," {space} '.join(kv[p] for p in props if p in required)
        if entries:
            rests = [""] * len(entries)
            for i in range(len(entries) - 2, -1, -1):  # after entry i, each later one may come, in order
                rests[i] = self.g.add(f"{self.prefix}rest", f'( "," {space} {entries[i + 1]} )? {rests[i + 1]}'.strip())
            chain = " | ".join(f"{e} {r}".strip() for e, r in zip(entries, rests, strict=True))
            out += f' ( "," {space} ( {chain} ) )?' if required else f"( {chain} )?"
        return f'{out} "}}" {space}'

    def not_names(self, names: list[str]) -> str:
        """A JSON string that is none of ``names`` (their characters as written; an escape only past the point
        where it already differs from all of them)."""
        char = self.g.primitive("char")
        space = self.g.primitive("space")
        trie: dict[str, Any] = {}
        for n in names:
            node = trie
            for c in n:
                node = node.setdefault(c, {})
            node[""] = {}

        def visit(node: dict[str, Any]) -> str:
            kids = sorted(c for c in node if c and intersect(((ord(c), ord(c)),), JSON_CHARS))
            alts = [f"{literal(c)} {visit(node[c])}" for c in kids]
            others = JSON_CHARS
            for c in kids:
                others = intersect(others, _without(ord(c)))
            alts.append(f"{char_class(others)} {char}*")
            body = " | ".join(alts)
            return self.g.add(f"{self.prefix}key", f"( {body} )" if "" in node else f"( {body} )?")

        return f'"\\"" {visit(trie)} "\\"" {space}'

    def array(self, s: dict[str, Any]) -> str:
        space = self.g.primitive("space")
        if "prefixItems" in s:
            items = f' "," {space} '.join(self.rule(i) for i in s["prefixItems"])
            return f'"[" {space} {items} "]" {space}'
        item = self.rule(s.get("items", True))
        lo, hi = s.get("minItems", 0), s.get("maxItems")
        lo, hi = int(lo), None if hi is None else int(hi)
        if hi == 0:
            return f'"[" {space} "]" {space}'
        more = _repeat(f'( "," {space} {item} )', max(lo - 1, 0), None if hi is None else hi - 1)
        inner = f"{item} {more}".strip()
        return f'"[" {space} {inner if lo else f"( {inner} )?"} "]" {space}'

    def string(self, s: dict[str, Any]) -> str:
        space = self.g.primitive("space")
        node = pattern_of(s, ("schema",))
        if node is not None:
            body = self.pattern(node)
        else:
            char = self.g.primitive("char")
            body = _repeat(char, int(s.get("minLength", 0)), None if "maxLength" not in s else int(s["maxLength"]))
        return f'"\\"" {body} "\\"" {space}'

    def pattern(self, node: Node) -> str:
        """GBNF for a parsed pattern (its dead parts, characters JSON cannot hold unescaped, left out)."""
        out = _pattern(node)
        assert out is not None, "the admission check refuses a pattern that matches nothing"
        return out

    def trie(self, words: list[str]) -> str:
        tree: dict[str, Any] = {}
        for w in words:
            node = tree
            for c in w:
                node = node.setdefault(c, {})
            node[""] = {}

        def visit(node: dict[str, Any]) -> str:
            alts = []
            for c in sorted(k for k in node if k):
                run, child = c, node[c]
                while "" not in child and len(child) == 1:  # a chain: one literal
                    ((c2, child),) = child.items()
                    run += c2
                alts.append(f"{literal(run)} {visit(child)}".strip())
            if not alts:
                return ""
            body = alts[0] if len(alts) == 1 else "( " + " | ".join(alts) + " )"
            return f"( {body} )?" if "" in node else body

        return visit(tree)


_CONSTRAINED = {"string": {"pattern", "format", "minLength", "maxLength"},
                "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
                "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}}


def _integral_step(s: dict[str, Any]) -> bool:
    step = multiple_of(s)
    return step is not None and step == step.to_integral_value() and step != Decimal(0)


def _without(c: int) -> Intervals:
    return tuple(r for r in ((0, c - 1), (c + 1, 0x10FFFF)) if r[0] <= r[1])


def _repeat(item: str, lo: int, hi: int | None) -> str:
    if hi == 0:
        return ""
    if (lo, hi) == (0, None):
        return f"{item}*"
    if (lo, hi) == (1, None):
        return f"{item}+"
    if (lo, hi) == (0, 1):
        return f"{item}?"
    if hi is None:
        return f"{item}{{{lo},}}"
    return f"{item}{{{lo}}}" if lo == hi else f"{item}{{{lo},{hi}}}"


def _pattern(node: Node) -> str | None:
    """None: matches nothing; "": matches only the empty string."""
    if isinstance(node, Chars):
        ranges = intersect(node.ranges, JSON_CHARS)
        return char_class(ranges) if ranges else None
    if isinstance(node, Seq):
        parts = []
        for item in node.items:
            p = _pattern(item)
            if p is None:
                return None
            if p:
                parts.append(p)
        return " ".join(parts)
    if isinstance(node, Alt):
        opts = [_pattern(o) for o in node.options]
        live = [o for o in opts if o]
        if not live:
            return "" if "" in opts else None
        body = f"( {' | '.join(live)} )"
        return f"{body}?" if "" in opts else body
    inner = _pattern(node.node)
    if not inner:
        return "" if node.lo == 0 or inner == "" else None
    return _repeat(f"( {inner} )", node.lo, node.hi)
