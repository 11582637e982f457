"""How rsb reads a JSON Schema that broker.schema.enforceable checked: which branch each schema takes (``kind``), its
``$ref`` targets, the parsed pattern of its text, its numeric bounds; and the formats rsb writes. One reading,
shared by the admission check (broker.schema.enforceable, broker.schema.cost) and the engine's grammar
(generator.engines.schema_grammar)."""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Any

from broker.errors import Path
from broker.schema.pattern import Node, parse

TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# Generated strings of each format: a subset of what the format allows (ASCII, no leap day, ...), valid for every
# validator.
_LABEL = "[a-z0-9](?:[a-z0-9-]{0,20}[a-z0-9])?"
_DATE = ("[1-9][0-9]{3}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         "|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_UUID = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
FORMATS: dict[str, str] = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "duration": "^P(?:[0-9]{1,4}D(?:T[0-9]{1,2}H(?:[0-9]{1,2}M)?)?|T[0-9]{1,2}H(?:[0-9]{1,2}M)?)$",
    "email": f"^[a-z0-9_+-]{{1,32}}(?:\\.[a-z0-9_+-]{{1,32}}){{0,3}}@(?:{_LABEL}\\.){{1,3}}[a-z]{{2,10}}$",
    "hostname": f"^{_LABEL}(?:\\.{_LABEL}){{0,4}}$",
    "ipv4": f"^{_OCTET}(?:\\.{_OCTET}){{3}}$",
    "ipv6": "^[0-9a-f]{1,4}(?::[0-9a-f]{1,4}){7}$",
    "uuid": f"^{_UUID}$",
    **{f"uuid{n}": f"^{_UUID}$" for n in range(1, 6)},  # aliases llama.cpp's converter took
}

NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# The keywords that constrain; everything else is an annotation or a keyword no validator asserts.
STRUCTURAL = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "allOf", "anyOf", "items",
    "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "$ref", "$defs",
    "definitions", *NUMERIC,
})
DEFS = ("$defs", "definitions")
REF = re.compile(r"\A#/(\$defs|definitions)/([A-Za-z0-9_.-]{1,64})\Z")
OBJECT_KEYS = frozenset({"properties", "required", "additionalProperties"})
ARRAY_KEYS = frozenset({"items", "prefixItems", "minItems", "maxItems"})
STRING_KEYS = frozenset({"minLength", "maxLength", "pattern", "format"})


def keys_of(s: dict[str, Any]) -> set[str]:
    return {k for k in s if k in STRUCTURAL and k not in DEFS}


def kind(s: Any) -> str:
    """The branch a (checked) schema takes: any, ref, anyOf, types, const, enum, allOf, object, array, string,
    integer, number, boolean or null."""
    if s is True or not isinstance(s, dict):
        return "any"
    keys = keys_of(s)
    t = s.get("type")
    if not keys:
        return "any"
    for k in ("$ref", "anyOf"):
        if k in keys:
            return "ref" if k == "$ref" else k
    if isinstance(t, list):
        return "types"
    if "const" in keys or "enum" in keys:
        return "const" if "const" in keys else "enum"
    if "allOf" in keys:
        return "allOf"
    if t in (None, "object") and keys & OBJECT_KEYS:
        return "object"
    if t in (None, "array") and keys & ARRAY_KEYS:
        return "array"
    if t in (None, "string") and keys & STRING_KEYS:
        return "string"
    if t is None and keys & set(NUMERIC):
        return "number"
    return str(t)


def resolve_ref(root: dict[str, Any], ref: str) -> Any:
    m = REF.match(ref)
    assert m is not None, "a checked schema"
    return root[m.group(1)][m.group(2)]


def pattern_of(s: dict[str, Any], at: Path) -> Node | None:
    """The parsed pattern a string schema's text must match (its ``pattern`` or its ``format``'s), or None."""
    if "pattern" in s:
        return parse(s["pattern"], (*at, "pattern"))
    if "format" in s:
        return parse(FORMATS[s["format"]], (*at, "format"))
    return None


def integer_bounds(s: dict[str, Any]) -> tuple[int | None, int | None]:
    """The least and greatest integer a checked integer schema admits (None: unbounded)."""
    lo = hi = None
    if "minimum" in s:
        lo = math.ceil(Decimal(str(s["minimum"])))
    if "exclusiveMinimum" in s:
        x = math.floor(Decimal(str(s["exclusiveMinimum"]))) + 1
        lo = x if lo is None else max(lo, x)
    if "maximum" in s:
        hi = math.floor(Decimal(str(s["maximum"])))
    if "exclusiveMaximum" in s:
        x = math.ceil(Decimal(str(s["exclusiveMaximum"]))) - 1
        hi = x if hi is None else min(hi, x)
    return lo, hi


def number_bounds(s: dict[str, Any]) -> tuple[Decimal | None, bool, Decimal | None, bool]:
    """(low, low is exclusive, high, high is exclusive) of a checked number schema."""
    lo: Decimal | None = None
    hi: Decimal | None = None
    lo_x = hi_x = False
    if "minimum" in s:
        lo = Decimal(str(s["minimum"]))
    if "exclusiveMinimum" in s:
        x = Decimal(str(s["exclusiveMinimum"]))
        if lo is None or x >= lo:
            lo, lo_x = x, True
    if "maximum" in s:
        hi = Decimal(str(s["maximum"]))
    if "exclusiveMaximum" in s:
        x = Decimal(str(s["exclusiveMaximum"]))
        if hi is None or x <= hi:
            hi, hi_x = x, True
    return lo, lo_x, hi, hi_x


def multiple_of(s: dict[str, Any]) -> Decimal | None:
    return None if "multipleOf" not in s else Decimal(str(s["multipleOf"]))
