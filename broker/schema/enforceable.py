"""The JSON Schemas rsb can enforce, checked in pure Python (the API pod never imports llama.cpp).

rsb enforces a schema by constrained decoding: generator.engines.schema_grammar turns it into a llama.cpp grammar,
and the sampler only picks tokens the grammar admits. ``check_enforceable`` admits exactly the schemas whose grammar
admits only valid documents (sometimes fewer: see below), never an empty set, and at a bounded cost per token
(broker.schema.cost); every other schema is refused with a message naming the keyword and where it is, at create
(a 400) and again in the engine before it builds the grammar.

Each schema takes one branch (``kind``); a keyword of another branch beside it is refused rather than ignored:
- ``type``: a name (object, array, string, number, integer, boolean, null) or a list of names (nothing beside it);
- ``enum`` / ``const`` (with a ``type`` their values match);
- objects: ``properties``, ``required`` (names among the properties), ``additionalProperties`` (false, true or a
  schema). Stricter than JSON Schema: without ``additionalProperties`` no other property is generated, properties
  come in the schema's order, and an additional property never takes a declared property's name;
- ``allOf`` of object schemas with ``properties`` (merged: every property becomes required);
- ``anyOf`` (not ``oneOf``: exclusivity cannot be enforced), branches that differ before either opens a nested
  object or array (broker.schema.cost);
- arrays: ``items`` with ``minItems`` / ``maxItems``, or ``prefixItems`` (a fixed tuple);
- strings: ``minLength`` / ``maxLength``, or ``pattern`` (broker.schema.pattern), or ``format`` (``FORMATS``);
- integers: ``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``, ``multipleOf`` (an integer up
  to ``MAX_MULTIPLE_OF``); numbers: the bounds (answers are written without an exponent) and an integer
  ``multipleOf`` (the answer is then an integer);
- ``$ref`` to ``#/$defs/NAME`` or ``#/definitions/NAME`` (recursion included);
- annotations (title, description, examples, default, ...) and keywords JSON Schema does not define are not
  constraints and are ignored.
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, Context, Decimal, localcontext
from typing import Any

import orjson

from broker.errors import InvalidRequest, Path
from broker.schema.cost import check_cost
from broker.schema.grammar_size import GrammarSize
from broker.schema.kinds import (
    ARRAY_KEYS,
    DEFS,
    FORMATS,
    NUMERIC,
    OBJECT_KEYS,
    REF,
    STRING_KEYS,
    TYPES,
    integer_bounds,
    keys_of,
    kind,
    multiple_of,
    number_bounds,
    pattern_of,
)

#: Bounds on one schema (a tool's parameters or a response format's schema).
MAX_SCHEMA_BYTES = 32 * 1024
MAX_SCHEMA_DEPTH = 64  # levels of the schema's JSON (annotations included)
#: minItems / maxItems / minLength / maxLength: the grammar spells each repetition out.
MAX_REPEAT = 1024
MAX_MULTIPLE_OF = 100
MAX_BOUND_DIGITS = 20  # significant digits of a numeric bound
#: Numbers with bounds are written without an exponent, with at most this many decimals.
FRACTION_DIGITS = 16
EXACT_DIGITS = 400  # decimal arithmetic on bounds: enough for any float's digits and the decimals

# Keywords JSON Schema defines as constraints that rsb cannot enforce (or, for oneOf, enforces only weakened).
_UNSUPPORTED = {
    "uniqueItems": "unique items", "contains": "'contains'", "minContains": "'contains'", "maxContains": "'contains'",
    "unevaluatedItems": "unevaluated items", "unevaluatedProperties": "unevaluated properties",
    "additionalItems": "additional items", "minProperties": "property counts", "maxProperties": "property counts",
    "patternProperties": "pattern properties", "propertyNames": "property names",
    "dependentRequired": "dependencies", "dependentSchemas": "dependencies", "dependencies": "dependencies",
    "not": "negation", "if": "conditionals", "then": "conditionals", "else": "conditionals",
    "oneOf": "exclusive alternatives (use anyOf)", "$dynamicRef": "dynamic references",
    "$recursiveRef": "dynamic references", "$anchor": "anchors", "$dynamicAnchor": "anchors",
    "$recursiveAnchor": "anchors",
}
_PY_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "number": (int, float), "integer": (int,),
    "boolean": (bool,), "null": (type(None),),
}



def check_enforceable(schema: Any, where: Path, size: GrammarSize | None = None) -> None:
    """Raise InvalidRequest (naming ``where``, the schema's place in the request, and the keyword) unless rsb's
    constrained decoding can enforce ``schema`` exactly as JSON Schema means it, at a bounded cost. ``size``: the
    grammar this schema shares with others (a forced tool_choice's tools), added up across them."""
    if not isinstance(schema, dict):
        raise InvalidRequest.at(where, " must be a JSON Schema object")
    if json_depth(schema) > MAX_SCHEMA_DEPTH:
        raise InvalidRequest.at(where, f": schemas nested deeper than {MAX_SCHEMA_DEPTH} levels are not accepted")
    nbytes = len(orjson.dumps(schema))
    if nbytes > MAX_SCHEMA_BYTES:
        raise InvalidRequest.at(where, f" is {nbytes} bytes of JSON; at most {MAX_SCHEMA_BYTES} are accepted")
    _Checker(schema).node(schema, where)
    check_cost(schema, where)
    size = size or GrammarSize()
    size.add(schema, where)
    size.check()


def json_depth(value: Any) -> int:
    """How deep a parsed JSON value nests (a scalar is 0), without recursion."""
    deepest = 0
    todo: list[tuple[Any, int]] = [(value, 0)]
    while todo:
        v, d = todo.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is not None:
            deepest = max(deepest, d + 1)
            todo.extend((c, d + 1) for c in children)
    return deepest


class _Checker:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root

    def fail(self, at: Path, what: str) -> InvalidRequest:
        return InvalidRequest.at(at, f": {what} cannot be enforced by rsb's constrained decoding "
                                 "(docs/protocol.md lists the JSON Schema keywords it supports)")

    def node(self, s: Any, at: Path) -> None:
        if s is True:
            return
        if s is False:
            raise self.fail(at, "a 'false' schema (no value is valid)")
        if not isinstance(s, dict):
            raise InvalidRequest.at(at, " must be a JSON Schema (an object)")
        for k in s:
            if k in _UNSUPPORTED:
                raise self.fail((*at, k), _UNSUPPORTED[k])
        for d in DEFS:
            if d in s:
                defs = s[d]
                if not isinstance(defs, dict):
                    raise InvalidRequest.at((*at, d), " must be an object of schemas")
                for name, sub in defs.items():
                    self.node(sub, (*at, d, name))
        keys = keys_of(s)
        k = kind(s)
        if k == "any":
            return
        if k == "ref":
            self.only(s, at, keys, {"$ref"})
            self.ref(s["$ref"], (*at, "$ref"))
        elif k == "anyOf":
            self.only(s, at, keys, {"anyOf"})
            alts = s["anyOf"]
            if not isinstance(alts, list) or not alts:
                raise InvalidRequest.at((*at, "anyOf"), " must be a non-empty list of schemas")
            for i, alt in enumerate(alts):
                self.node(alt, (*at, "anyOf", i))
        elif k == "types":
            self.only(s, at, keys, {"type"})
            names = s["type"]
            if not names or len(set(map(str, names))) != len(names) or not all(n in TYPES for n in names):
                raise InvalidRequest.at((*at, "type"), f" must name distinct types among {', '.join(TYPES)}")
        elif k in ("const", "enum"):
            self.values(s, at, keys, k)
        elif k == "allOf":
            self.only(s, at, keys, {"allOf", "type"})
            if s.get("type", "object") != "object":
                raise self.fail((*at, "allOf"), f"'allOf' on a schema of type {s['type']!r}")
            self.all_of(s["allOf"], (*at, "allOf"))
        elif k == "object":
            self.only(s, at, keys, OBJECT_KEYS | {"type"})
            self.object(s, at)
        elif k == "array":
            self.only(s, at, keys, ARRAY_KEYS | {"type"})
            self.array(s, at)
        elif k == "string":
            self.only(s, at, keys, STRING_KEYS | {"type"})
            self.string(s, at, keys)
        elif k in ("integer", "number"):
            extra = sorted(keys - {*NUMERIC, "type"})
            if extra:
                raise self.fail((*at, extra[0]), f"'{extra[0]}' on a schema of type {k!r}")
            self.numeric(s, at, k)
        elif k not in TYPES:
            raise InvalidRequest.at((*at, "type"), f" must be one of {', '.join(TYPES)} (or a list of them)")
        else:
            extra = sorted(keys - {"type"})
            if extra:
                raise self.fail((*at, extra[0]), f"'{extra[0]}' on a schema of type {k!r}")

    def only(self, s: dict[str, Any], at: Path, keys: set[str], allowed: set[str] | frozenset[str]) -> None:
        extra = sorted(keys - allowed)
        if extra:
            first = next(iter(sorted(allowed)))
            raise self.fail((*at, extra[0]), f"'{extra[0]}' next to '{first}'")

    def ref(self, ref: Any, at: Path) -> Any:
        m = REF.match(ref) if isinstance(ref, str) else None
        if m is None:
            raise self.fail(at, f"the reference {ref!r} (only '#/$defs/NAME' and '#/definitions/NAME')")
        defs = self.root.get(m.group(1))
        if not isinstance(defs, dict) or m.group(2) not in defs:
            raise InvalidRequest.at(at, f": {ref!r} names no schema of the root's {m.group(1)}")
        return defs[m.group(2)]

    def values(self, s: dict[str, Any], at: Path, keys: set[str], kw: str) -> None:
        self.only(s, at, keys, {kw, "type"})
        if kw == "enum":
            vals = s["enum"]
            if not isinstance(vals, list) or not vals:
                raise InvalidRequest.at((*at, "enum"), " must be a non-empty list of values")
        else:
            vals = [s["const"]]
        t = s.get("type")
        if t is None:
            return
        if t not in TYPES:
            raise InvalidRequest.at((*at, "type"), f" must be one of {', '.join(TYPES)}")
        for v in vals:
            if not is_type(v, t):
                raise InvalidRequest.at((*at, kw), f": {orjson.dumps(v).decode()[:80]} is not of type {t!r}")

    def object(self, s: dict[str, Any], at: Path) -> None:
        props = s.get("properties", {})
        if not isinstance(props, dict):
            raise InvalidRequest.at((*at, "properties"), " must be an object of schemas")
        for name, sub in props.items():
            self.node(sub, (*at, "properties", name))
        required = s.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required) or (
                len(set(required)) != len(required)):
            raise InvalidRequest.at((*at, "required"), " must be a list of distinct property names")
        missing = [r for r in required if r not in props]
        if missing:
            raise self.fail((*at, "required"), f"a required property without a schema in 'properties' ({missing[0]!r})")
        extra = s.get("additionalProperties")
        if isinstance(extra, dict):
            self.node(extra, (*at, "additionalProperties"))
        elif extra is not None and not isinstance(extra, bool):
            raise InvalidRequest.at((*at, "additionalProperties"), " must be a boolean or a schema")

    def all_of(self, parts: Any, at: Path) -> None:
        if not isinstance(parts, list) or not parts:
            raise InvalidRequest.at(at, " must be a non-empty list of schemas")
        seen: set[str] = set()
        for i, part in enumerate(parts):
            where = (*at, i)
            if isinstance(part, dict) and "$ref" in part:
                self.node(part, where)
                part = self.ref(part["$ref"], (*where, "$ref"))
            if not isinstance(part, dict) or not isinstance(part.get("properties"), dict):
                raise self.fail(where, "an 'allOf' part that is not an object schema with 'properties'")
            if part.get("type", "object") != "object" or keys_of(part) - {"type", "properties", "required"}:
                raise self.fail(where, "an 'allOf' part with more than 'properties' and 'required'")
            self.node(part, where)
            dup = seen & set(part["properties"])
            if dup:
                raise self.fail(where, f"a property ({sorted(dup)[0]!r}) defined by two 'allOf' parts")
            seen |= set(part["properties"])

    def array(self, s: dict[str, Any], at: Path) -> None:
        if "prefixItems" in s:
            items = s["prefixItems"]
            if not isinstance(items, list) or not items:
                raise InvalidRequest.at((*at, "prefixItems"), " must be a non-empty list of schemas")
            if s.get("items", False) is not False or "minItems" in s or "maxItems" in s:
                raise self.fail(at, "'prefixItems' with more items after them, or with minItems/maxItems,")
            for i, sub in enumerate(items):
                self.node(sub, (*at, "prefixItems", i))
            return
        items = s.get("items", True)
        if isinstance(items, list):
            raise self.fail((*at, "items"), "a list of item schemas (use prefixItems)")
        self.node(items, (*at, "items"))
        lo = self.count(s, "minItems", at) or 0
        hi = self.count(s, "maxItems", at)
        if hi is not None and hi < lo:
            raise InvalidRequest.at(at, ": maxItems is below minItems")

    def count(self, s: dict[str, Any], name: str, at: Path) -> int | None:
        v = s.get(name)
        if v is None:
            return None
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_REPEAT:
            raise InvalidRequest.at((*at, name), f" must be an integer between 0 and {MAX_REPEAT}")
        return v

    def string(self, s: dict[str, Any], at: Path, keys: set[str]) -> None:
        if "pattern" in keys:
            self.only(s, at, keys, {"pattern", "type"})
        elif "format" in keys:
            self.only(s, at, keys, {"format", "type"})
            if s["format"] not in FORMATS:
                raise self.fail((*at, "format"), f"the format {s['format']!r} (only {', '.join(sorted(FORMATS))})")
        else:
            if s.get("type") != "string":
                raise self.fail(at, "minLength/maxLength without \"type\": \"string\"")
            lo = self.count(s, "minLength", at) or 0
            hi = self.count(s, "maxLength", at)
            if hi is not None and hi < lo:
                raise InvalidRequest.at(at, ": maxLength is below minLength")
        pattern_of(s, at)  # parsed here so a bad one is refused by name

    def numeric(self, s: dict[str, Any], at: Path, t: str) -> None:
        for k in NUMERIC:
            v = s.get(k)
            if k not in s:
                continue
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise InvalidRequest.at((*at, k), " must be a number")
            if k != "multipleOf" and len(Decimal(str(v)).normalize().as_tuple().digits) > MAX_BOUND_DIGITS:
                raise self.fail((*at, k), f"a bound with more than {MAX_BOUND_DIGITS} significant digits")
        step = multiple_of(s)
        if step is not None:
            if step <= 0:
                raise InvalidRequest.at((*at, "multipleOf"), " must be greater than 0")
            integral = step == step.to_integral_value()
            if integral and step > MAX_MULTIPLE_OF:
                raise self.fail((*at, "multipleOf"), f"a multipleOf above {MAX_MULTIPLE_OF}")
            if not integral:
                # 0.01 is not a binary fraction: validators' floating-point division disagrees on 8.95
                raise self.fail((*at, "multipleOf"), "a multipleOf that is not an integer")
        if t == "integer" or (step is not None and step == step.to_integral_value()):
            lo, hi = integer_bounds(s)
            n = 1 if step is None else int(step)
            first = lo if lo is None or lo % n == 0 else lo + (n - lo % n)
            if first is not None and hi is not None and first > hi:
                which = "integer" if n == 1 else f"integer multiple of {n}"
                raise InvalidRequest.at(at, f": no {which} lies within its bounds")
        else:
            nlo, lo_x, nhi, hi_x = number_bounds(s)
            if nlo is not None and nhi is not None:
                # The least number written with at most FRACTION_DIGITS decimals (and no exponent) within the low
                # bound must be within the high one: the grammar writes no other.
                with localcontext(Context(prec=EXACT_DIGITS)):  # a bound's 309 integer digits, and 16 decimals
                    step = Decimal(1).scaleb(-FRACTION_DIGITS)
                    least = nlo.quantize(step, rounding=ROUND_CEILING)
                    if lo_x and least == nlo:
                        least += step
                    empty = least > nhi or (hi_x and least == nhi)
                if empty:
                    raise InvalidRequest.at(at, f": no number of at most {FRACTION_DIGITS} decimals lies within its "
                                            "bounds")


def is_type(v: Any, t: str) -> bool:
    if isinstance(v, bool) and t not in ("boolean",):
        return False
    if t == "integer" and isinstance(v, float):
        return v.is_integer()
    return isinstance(v, _PY_TYPES[t])
