"""The JSON Schema subset rsb enforces: what is admitted, what is refused (and that the refusal names the
keyword and where it is)."""

from __future__ import annotations

from typing import Any

import pytest

from broker.errors import InvalidRequest
from broker.schema.enforceable import check_enforceable

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "description": "full name", "maxLength": 40},
        "age": {"type": "integer"},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+[.]com$"},
        "born": {"type": "string", "format": "date"},
        "id": {"type": "string", "format": "uuid"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "pet": {"anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}], "default": None},
        "role": {"enum": ["admin", "user"], "type": "string"},
        "point": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}]},
        "extra": {"type": "object", "additionalProperties": {"type": "boolean"}},
        "any": {},
        "kind": {"const": "person"},
        "either": {"type": ["string", "integer"]},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
    "$defs": {"Pet": {"type": "object", "title": "Pet", "properties": {"name": {"type": "string"},
                                                                      "next": {"$ref": "#/$defs/Pet"}}}},
}


def test_a_schema_of_supported_keywords_is_admitted() -> None:
    check_enforceable(PERSON, ("schema",))
    check_enforceable({"allOf": [{"properties": {"a": {"type": "string"}}}, {"$ref": "#/$defs/B"}],
                       "$defs": {"B": {"type": "object", "properties": {"b": {"type": "integer"}}}}}, ("s",))
    check_enforceable({}, ("s",))
    check_enforceable({"type": "array", "minItems": 2}, ("s",))
    check_enforceable({"type": "object", "properties": {  # what zod and Pydantic write for bounded numbers
        "int": {"type": "integer", "minimum": -9007199254740991, "maximum": 9007199254740991},
        "ge": {"type": "integer", "minimum": 0}, "x": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "m": {"type": "integer", "multipleOf": 5}, "whole": {"type": "number", "multipleOf": 2},
        "s": {"type": "string", "maxLength": 1024}, "d": {"type": "string", "format": "date-time"},
        "e": {"type": "string", "format": "email"}, "p": {"type": "string", "pattern": "\\d{3}-[^x]+"}}}, ("s",))


@pytest.mark.parametrize(("schema", "names"), [
    ({"type": "string", "minimum": 1}, ["schema.minimum", "next to"]),
    ({"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0.01}}}, ["properties.a.multipleOf",
                                                                                     "not an integer"]),
    ({"type": "integer", "multipleOf": 1000}, ["multipleOf above 100"]),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, ["oneOf", "anyOf"]),
    ({"type": "string", "format": "uri"}, ["format", "'uri'"]),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, ["maxLength", "next to 'pattern'"]),
    ({"type": "string", "pattern": "^\\bx$"}, ["escape '\\b'"]),
    ({"type": "string", "pattern": "^(?=a)a$"}, ["(?"]),
    ({"type": "string", "pattern": '^"$'}, ["matches no string"]),
    ({"type": "string", "pattern": "^a\tb$"}, ["matches no string"]),
    ({"type": "string", "pattern": "^(a*)*$"}, ["may be empty"]),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, ["uniqueItems"]),
    ({"type": "object", "properties": {}, "required": ["x"]}, ["required", "'x'"]),
    ({"type": "object", "patternProperties": {"^a": {}}}, ["patternProperties"]),
    ({"$ref": "https://example.com/s.json"}, ["reference"]),
    ({"$ref": "#/$defs/A", "description": "fine", "type": "object"}, ["'type' next to '$ref'"]),
    ({"anyOf": [{"type": "string"}], "type": "string"}, ["'type' next to 'anyOf'"]),
    ({"type": ["string", "null"], "maxLength": 3}, ["maxLength"]),
    ({"type": "integer", "format": "int32"}, ["format", "'integer'"]),
    ({"not": {"type": "string"}}, ["schema.not", "negation"]),
    ({"if": {"type": "string"}, "then": {"minLength": 1}}, ["conditionals"]),
    ({"type": "array", "items": [{"type": "string"}]}, ["prefixItems"]),
    ({"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"}}, ["prefixItems"]),
    ({"type": "object", "properties": {"a": False}}, ["'false' schema"]),
    ({"allOf": [{"type": "string"}]}, ["allOf"]),
    ({"allOf": [{"properties": {"a": {}}}, {"properties": {"a": {}}}]}, ["two 'allOf' parts"]),
])
def test_what_the_converter_would_ignore_is_refused_by_name(schema: dict[str, Any], names: list[str]) -> None:
    with pytest.raises(InvalidRequest) as e:
        check_enforceable(schema, ("schema",))
    for name in names:
        assert name in e.value.message
    assert e.value.message.startswith("schema")


@pytest.mark.parametrize(("schema", "message"), [
    ([], "must be a JSON Schema object"),
    ({"type": "uuid"}, "type must be one of"),
    ({"enum": []}, "enum must be a non-empty list"),
    ({"type": "string", "enum": ["a", 1]}, "is not of type 'string'"),
    ({"type": "string", "maxLength": 100_000}, "maxLength must be an integer between 0 and 1024"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer lies within"),
    ({"type": "integer", "minimum": 1, "maximum": 4, "multipleOf": 5}, "no integer multiple of 5"),
    ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "no number of at most 16 decimals lies within"),
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e-20}, "no number of at most 16 decimals"),
    ({"type": "number", "minimum": True}, "must be a number"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "maxLength is below minLength"),
    ({"$ref": "#/$defs/Nope"}, "names no schema"),
    ({"type": "string", "pattern": "^a{1,2000}$"}, "counts of at most 1024"),
    ({"properties": {"a": {"properties": {"a": {"properties": {}}}}}, "x": "y" * 40_000}, "bytes of JSON"),
])
def test_malformed_schemas_are_refused_with_the_reason(schema: Any, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        check_enforceable(schema, ("schema",))


def test_nesting_is_bounded() -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(70):
        deep = {"type": "array", "items": deep}
    with pytest.raises(InvalidRequest, match="nested deeper"):
        check_enforceable(deep, ("schema",))
    # Annotations nested past what orjson serializes (255) but under what it parses (1,024): a 400, not a 500.
    annotated: dict[str, Any] = {"type": "string", "examples": []}
    inner = annotated["examples"]
    for _ in range(600):
        inner.append([])
        inner = inner[0]
    with pytest.raises(InvalidRequest, match="nested deeper than 64"):
        check_enforceable(annotated, ("schema",))


