"""The JSON Schemas rsb can enforce, checked in pure Python (the API pod never imports llama.cpp).

rsb enforces a schema by constrained decoding: llama-cpp-python's JSON-schema-to-grammar converter
(``llama_cpp.llama_grammar.SchemaConverter``, a port of llama.cpp's ``json_schema_to_grammar``) turns it into a
grammar, and the sampler only picks tokens the grammar admits. That converter reads a few keywords and
silently ignores the rest: ``{"type": "integer", "minimum": 1}`` becomes "any integer", so a grammar built
from it admits answers the schema rejects. ``check_enforceable`` admits exactly the schemas whose grammar
only admits valid documents (sometimes fewer: see below) and refuses every other one with a message naming
the keyword and where it is, at create (a 400) and again in the engine before it builds the grammar.

Supported (mirroring the converter's dispatch, which picks ONE branch per schema, so a keyword of another
branch next to it would be ignored and is refused):
- ``type``: a name (object, array, string, number, integer, boolean, null) or a list of names (nothing else
  beside it);
- ``enum`` / ``const`` (with a ``type`` their values match);
- objects: ``properties``, ``required`` (names among the properties), ``additionalProperties`` (false, true or
  a schema). Stricter than JSON Schema: without ``additionalProperties`` no other property is generated, and
  properties come in the schema's order;
- ``allOf`` of object schemas with ``properties`` (merged: every property becomes required);
- ``anyOf`` (not ``oneOf``: exclusivity cannot be enforced);
- arrays: ``items`` with ``minItems`` / ``maxItems``, or ``prefixItems`` (a fixed tuple);
- strings: ``minLength`` / ``maxLength``, or ``pattern`` (anchored ``^...$``, literals, ``.``, classes
  ``[...]`` without quotes, backslashes or control characters, groups, ``|``, quantifiers ``* + ? {m,n}``; no
  ``\\d``-style shorthands: write ``[0-9]``), or
  ``format`` date, time, date-time, uuid;
- ``$ref`` to ``#/$defs/NAME`` or ``#/definitions/NAME`` (recursion included);
- annotations (title, description, examples, default, ...) and keywords JSON Schema does not define are not
  constraints and are dropped before conversion (``for_grammar``), as is a ``{}`` (any value) which becomes
  the union of every type.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from broker.errors import InvalidRequest

#: Bounds on one schema (a tool's parameters or a response format's schema).
MAX_SCHEMA_BYTES = 32 * 1024
MAX_SCHEMA_DEPTH = 32
#: minItems / maxItems / minLength / maxLength / {m,n}: each repetition is spelled out in the grammar.
MAX_REPEAT = 1024
MAX_ENUM_VALUES = 1024

TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
#: The union of every type: what ``{}`` (any value) becomes for the converter, which turns a bare ``{}`` into
#: "any object".
ANY_VALUE: dict[str, Any] = {"type": ["object", "array", "string", "number", "boolean", "null"]}
FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"})

# Keywords JSON Schema defines as constraints that the converter ignores (or, for oneOf, weakens).
_UNSUPPORTED = {
    "minimum": "numeric bounds", "maximum": "numeric bounds", "exclusiveMinimum": "numeric bounds",
    "exclusiveMaximum": "numeric bounds", "multipleOf": "multiples", "uniqueItems": "unique items",
    "contains": "'contains'", "minContains": "'contains'", "maxContains": "'contains'",
    "unevaluatedItems": "unevaluated items", "unevaluatedProperties": "unevaluated properties",
    "additionalItems": "additional items", "minProperties": "property counts", "maxProperties": "property counts",
    "patternProperties": "pattern properties", "propertyNames": "property names",
    "dependentRequired": "dependencies", "dependentSchemas": "dependencies", "dependencies": "dependencies",
    "not": "negation", "if": "conditionals", "then": "conditionals", "else": "conditionals",
    "oneOf": "exclusive alternatives (use anyOf)", "$dynamicRef": "dynamic references",
    "$recursiveRef": "dynamic references", "$anchor": "anchors", "$dynamicAnchor": "anchors",
    "$recursiveAnchor": "anchors",
}
# The keywords the converter reads; for_grammar keeps only these (everything else is an annotation or a
# keyword no validator asserts).
_STRUCTURAL = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "allOf", "anyOf", "items",
    "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "$ref", "$defs",
    "definitions",
})
_DEFS = ("$defs", "definitions")
_REF = re.compile(r"\A#/(\$defs|definitions)/([A-Za-z0-9_.-]{1,64})\Z")
_DIGITS = re.compile(r"\A[0-9]{1,6}\Z")  # ASCII only: str.isdigit and \d accept other scripts' digits
_JSON_UNSAFE = ('"', "\\", "\x7f")


def _json_safe(c: str) -> bool:
    return c >= " " and c not in _JSON_UNSAFE


_PY_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "number": (int, float), "integer": (int,),
    "boolean": (bool,), "null": (type(None),),
}


def check_enforceable(schema: Any, where: str) -> None:
    """Raise InvalidRequest (naming ``where``, the schema's place in the request, and the keyword) unless
    rsb's constrained decoding can enforce ``schema`` exactly as JSON Schema means it."""
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{where} must be a JSON Schema object")
    size = len(orjson.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise InvalidRequest(f"{where} is {size} bytes of JSON; at most {MAX_SCHEMA_BYTES} are accepted")
    _Checker(schema, where).node(schema, where, 0)


def for_grammar(schema: Any) -> Any:
    """The schema as the converter must be given it: only the keywords it reads, ``{}`` and ``true`` as the
    union of every type (a schema that passed ``check_enforceable``)."""
    if schema is True:
        return dict(ANY_VALUE)
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k not in _STRUCTURAL:
            continue
        if k in ("properties", *_DEFS):
            out[k] = {name: for_grammar(s) for name, s in v.items()}
        elif k in ("allOf", "anyOf", "prefixItems"):
            out[k] = [for_grammar(s) for s in v]
        elif k == "items" and isinstance(v, dict | bool):
            out[k] = v if v is False else for_grammar(v)
        elif k == "additionalProperties" and isinstance(v, dict):
            out[k] = for_grammar(v)
        else:
            out[k] = v
    if not out:
        return dict(ANY_VALUE)
    if out.get("type") == "array" and "items" not in out and "prefixItems" not in out and (
            "minItems" in out or "maxItems" in out):
        out["items"] = dict(ANY_VALUE)  # the converter reads the bounds only next to items
    return out


class _Checker:
    def __init__(self, root: dict[str, Any], where: str) -> None:
        self.root = root
        self.where = where

    def fail(self, at: str, what: str) -> InvalidRequest:
        return InvalidRequest(f"{at}: {what} cannot be enforced by rsb's constrained decoding "
                              "(docs/protocol.md lists the JSON Schema keywords it supports)")

    def node(self, s: Any, at: str, depth: int) -> None:
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidRequest(f"{at}: schemas nested deeper than {MAX_SCHEMA_DEPTH} levels are not accepted")
        if s is True:
            return
        if s is False:
            raise self.fail(at, "a 'false' schema (no value is valid)")
        if not isinstance(s, dict):
            raise InvalidRequest(f"{at} must be a JSON Schema (an object)")
        for k in s:
            if k in _UNSUPPORTED:
                raise self.fail(f"{at}.{k}", _UNSUPPORTED[k])
        for d in _DEFS:
            if d in s:
                defs = s[d]
                if not isinstance(defs, dict):
                    raise InvalidRequest(f"{at}.{d} must be an object of schemas")
                for name, sub in defs.items():
                    self.node(sub, f"{at}.{d}.{name}", depth + 1)
        keys = {k for k in s if k in _STRUCTURAL and k not in _DEFS}
        if not keys:
            return  # any value
        if "$ref" in keys:
            self.only(s, at, keys, {"$ref"})
            self.ref(s["$ref"], f"{at}.$ref")
        elif "anyOf" in keys:
            self.only(s, at, keys, {"anyOf"})
            alts = s["anyOf"]
            if not isinstance(alts, list) or not alts:
                raise InvalidRequest(f"{at}.anyOf must be a non-empty list of schemas")
            for i, alt in enumerate(alts):
                self.node(alt, f"{at}.anyOf[{i}]", depth + 1)
        elif isinstance(s.get("type"), list):
            self.only(s, at, keys, {"type"})
            names = s["type"]
            if not names or len(set(map(str, names))) != len(names) or not all(n in TYPES for n in names):
                raise InvalidRequest(f"{at}.type must name distinct types among {', '.join(TYPES)}")
        elif "const" in keys or "enum" in keys:
            self.values(s, at, keys)
        else:
            self.typed(s, at, keys, depth)

    def only(self, s: dict[str, Any], at: str, keys: set[str], allowed: set[str]) -> None:
        extra = sorted(keys - allowed)
        if extra:
            first = next(iter(sorted(allowed)))
            raise self.fail(f"{at}.{extra[0]}", f"'{extra[0]}' next to '{first}'")

    def ref(self, ref: Any, at: str) -> dict[str, Any] | bool:
        m = _REF.match(ref) if isinstance(ref, str) else None
        if m is None:
            raise self.fail(at, f"the reference {ref!r} (only '#/$defs/NAME' and '#/definitions/NAME')")
        defs = self.root.get(m.group(1))
        if not isinstance(defs, dict) or m.group(2) not in defs:
            raise InvalidRequest(f"{at}: {ref!r} names no schema of the root's {m.group(1)}")
        target: dict[str, Any] | bool = defs[m.group(2)]
        return target

    def values(self, s: dict[str, Any], at: str, keys: set[str]) -> None:
        kw = "const" if "const" in keys else "enum"
        self.only(s, at, keys, {kw, "type"})
        if kw == "enum":
            vals = s["enum"]
            if not isinstance(vals, list) or not vals or len(vals) > MAX_ENUM_VALUES:
                raise InvalidRequest(f"{at}.enum must be a list of 1 to {MAX_ENUM_VALUES} values")
        else:
            vals = [s["const"]]
        t = s.get("type")
        if t is None:
            return
        if t not in TYPES:
            raise InvalidRequest(f"{at}.type must be one of {', '.join(TYPES)}")
        for v in vals:
            if not self.is_type(v, t):
                raise InvalidRequest(f"{at}.{kw}: {orjson.dumps(v).decode()[:80]} is not of type {t!r}")

    @staticmethod
    def is_type(v: Any, t: str) -> bool:
        if isinstance(v, bool) and t not in ("boolean",):
            return False
        if t == "integer" and isinstance(v, float):
            return v.is_integer()
        return isinstance(v, _PY_TYPES[t])

    def typed(self, s: dict[str, Any], at: str, keys: set[str], depth: int) -> None:
        t = s.get("type")
        if t is not None and t not in TYPES:
            raise InvalidRequest(f"{at}.type must be one of {', '.join(TYPES)} (or a list of them)")
        object_keys = {"properties", "required", "additionalProperties"}
        array_keys = {"items", "prefixItems", "minItems", "maxItems"}
        string_keys = {"minLength", "maxLength", "pattern", "format"}
        if t in (None, "object") and (keys & object_keys or "allOf" in keys):
            if "allOf" in keys:
                self.only(s, at, keys, {"allOf", "type"})
                self.all_of(s["allOf"], f"{at}.allOf", depth)
            else:
                self.only(s, at, keys, object_keys | {"type"})
                self.object(s, at, depth)
        elif t in (None, "array") and keys & array_keys:
            self.only(s, at, keys, array_keys | {"type"})
            self.array(s, at, depth)
        elif t in (None, "string") and keys & string_keys:
            self.only(s, at, keys, string_keys | {"type"})
            self.string(s, at, keys)
        else:
            extra = sorted(keys - {"type"})
            if extra:
                raise self.fail(f"{at}.{extra[0]}", f"'{extra[0]}' on a schema of type {t!r}")

    def object(self, s: dict[str, Any], at: str, depth: int) -> None:
        props = s.get("properties", {})
        if not isinstance(props, dict):
            raise InvalidRequest(f"{at}.properties must be an object of schemas")
        for name, sub in props.items():
            self.node(sub, f"{at}.properties.{name}", depth + 1)
        required = s.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required) or (
                len(set(required)) != len(required)):
            raise InvalidRequest(f"{at}.required must be a list of distinct property names")
        missing = [r for r in required if r not in props]
        if missing:
            raise self.fail(f"{at}.required", f"a required property without a schema in 'properties' ({missing[0]!r})")
        extra = s.get("additionalProperties")
        if isinstance(extra, dict):
            self.node(extra, f"{at}.additionalProperties", depth + 1)
        elif extra is not None and not isinstance(extra, bool):
            raise InvalidRequest(f"{at}.additionalProperties must be a boolean or a schema")

    def all_of(self, parts: Any, at: str, depth: int) -> None:
        if not isinstance(parts, list) or not parts:
            raise InvalidRequest(f"{at} must be a non-empty list of schemas")
        seen: set[str] = set()
        for i, part in enumerate(parts):
            where = f"{at}[{i}]"
            if isinstance(part, dict) and "$ref" in part:
                self.node(part, where, depth + 1)
                part = self.ref(part["$ref"], f"{where}.$ref")
            if not isinstance(part, dict) or not isinstance(part.get("properties"), dict):
                raise self.fail(where, "an 'allOf' part that is not an object schema with 'properties'")
            keys = {k for k in part if k in _STRUCTURAL and k not in _DEFS}
            if part.get("type", "object") != "object" or keys - {"type", "properties", "required"}:
                raise self.fail(where, "an 'allOf' part with more than 'properties' and 'required'")
            self.node(part, where, depth + 1)
            dup = seen & set(part["properties"])
            if dup:
                raise self.fail(where, f"a property ({sorted(dup)[0]!r}) defined by two 'allOf' parts")
            seen |= set(part["properties"])

    def array(self, s: dict[str, Any], at: str, depth: int) -> None:
        if "prefixItems" in s:
            items = s["prefixItems"]
            if not isinstance(items, list) or not items:
                raise InvalidRequest(f"{at}.prefixItems must be a non-empty list of schemas")
            if s.get("items", False) is not False or "minItems" in s or "maxItems" in s:
                raise self.fail(at, "'prefixItems' with more items after them, or with minItems/maxItems,")
            for i, sub in enumerate(items):
                self.node(sub, f"{at}.prefixItems[{i}]", depth + 1)
            return
        items = s.get("items", True)
        if isinstance(items, list):
            raise self.fail(f"{at}.items", "a list of item schemas (use prefixItems)")
        self.node(items, f"{at}.items", depth + 1)
        lo = self.count(s, "minItems", at) or 0
        hi = self.count(s, "maxItems", at)
        if hi is not None and hi < lo:
            raise InvalidRequest(f"{at}: maxItems is below minItems")

    def count(self, s: dict[str, Any], name: str, at: str) -> int | None:
        v = s.get(name)
        if v is None:
            return None
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_REPEAT:
            raise InvalidRequest(f"{at}.{name} must be an integer between 0 and {MAX_REPEAT}")
        return v

    def string(self, s: dict[str, Any], at: str, keys: set[str]) -> None:
        if "pattern" in keys:
            self.only(s, at, keys, {"pattern", "type"})
            self.pattern(s["pattern"], f"{at}.pattern")
        elif "format" in keys:
            self.only(s, at, keys, {"format", "type"})
            if s["format"] not in FORMATS:
                raise self.fail(f"{at}.format", f"the format {s['format']!r} (only {', '.join(sorted(FORMATS))})")
        else:
            if s.get("type") != "string":
                raise self.fail(at, "minLength/maxLength without \"type\": \"string\"")
            lo = self.count(s, "minLength", at) or 0
            hi = self.count(s, "maxLength", at)
            if hi is not None and hi < lo:
                raise InvalidRequest(f"{at}: maxLength is below minLength")

    def pattern(self, p: Any, at: str) -> None:
        if not isinstance(p, str) or len(p) > 1024:
            raise InvalidRequest(f"{at} must be a string of at most 1024 characters")
        try:
            re.compile(p)
        except re.error as e:
            raise InvalidRequest(f"{at} is not a valid regular expression: {e}") from None
        if not (p.startswith("^") and p.endswith("$")) or len(p) < 2:
            raise self.fail(at, "a pattern not anchored at both ends (write ^...$)")
        body = p[1:-1]
        i = 0
        while i < len(body):
            c = body[i]
            if c == "\\":
                nxt = body[i + 1: i + 2]
                if nxt == "" or nxt not in "[]()|{}*+?":
                    raise self.fail(at, f"the escape '\\{nxt}' in a pattern (write a class such as [0-9] or [.])")
                i += 2
                continue
            if c == "[":
                i = self.pattern_class(body, i + 1, at)
                continue
            if c == "(" and body[i + 1: i + 2] == "?":
                raise self.fail(at, "'(?' groups (lookarounds, named or non-capturing groups) in a pattern")
            if c in "^$":
                raise self.fail(at, f"'{c}' inside a pattern")
            if c in "*+?}" and body[i + 1: i + 2] in ("?", "+"):
                raise self.fail(at, "lazy or possessive quantifiers in a pattern")
            if c == "{":
                close = body.find("}", i)
                bounds = body[i + 1: close].split(",") if close > i else []
                nums = [b.strip() for b in bounds if b.strip()]
                if not bounds or not all(_DIGITS.match(b) and int(b) <= MAX_REPEAT for b in nums):
                    raise InvalidRequest(f"{at}: quantifiers {{m,n}} take integers of at most {MAX_REPEAT}")
            elif c == '"' or not _json_safe(c):
                # The grammar writes pattern characters into the JSON string as they are: a quote or a
                # control character there would end or break it.
                raise self.fail(at, f"the character {c!r} in a pattern")
            i += 1

    def pattern_class(self, body: str, i: int, at: str) -> int:
        """Check the class starting after its '[' at ``i``; return the index after its ']'. A class must
        admit only characters a JSON string holds as they are (no quote, backslash or control character)."""
        if body[i: i + 1] == "^":
            raise self.fail(at, "a negated class [^...] in a pattern (it admits quotes and control characters)")
        chars: list[str] = []
        start = i
        while i < len(body) and (body[i] != "]" or i == start):
            if body[i] == "\\":
                nxt = body[i + 1: i + 2]
                if nxt not in ("]", "["):
                    raise self.fail(at, f"the escape '\\{nxt}' in a pattern's class")
                chars.append(nxt)
                i += 2
            else:
                chars.append(body[i])
                i += 1
        i += 1  # the ']' (re.compile checked that it is there)
        k = 0
        while k < len(chars):
            lo = hi = chars[k]
            if k + 2 < len(chars) and chars[k + 1] == "-":
                hi = chars[k + 2]
                k += 3
            else:
                k += 1
            if any(lo <= bad <= hi for bad in _JSON_UNSAFE) or not (_json_safe(lo) and _json_safe(hi)):
                raise self.fail(at, f"the class range {lo!r}-{hi!r} in a pattern (it admits a quote, a backslash "
                                "or a control character)")
        return i
