"""rsb's schema-to-grammar converter on llama.cpp: random weights (which would write anything) under each schema
write only JSON the jsonschema package (with its format checker) finds valid, for every keyword rsb admits:
numeric bounds, exclusive bounds and multiples, formats, patterns, lengths, recursion through a root ``$ref``,
additional properties beside declared ones, tries of enum values."""

from __future__ import annotations

import json
import threading
from typing import Any

import jsonschema
import pytest
from helpers import LLAMA_EXTRA

pytest.importorskip("llama_cpp", reason=LLAMA_EXTRA)

from broker.request import RequestLimits, validate_create_body
from generator.engines.llama import LlamaEngine

CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER  # every format rsb writes (test extra)
NODE = {"$ref": "#/$defs/Node", "$defs": {"Node": {"type": "object", "properties": {
    "value": {"type": "integer", "minimum": -3, "maximum": 3},
    "children": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 2}]}},
    "required": ["value", "children"], "additionalProperties": False}}}
SCHEMAS: dict[str, dict[str, Any]] = {
    "integer bounds": {"type": "object", "properties": {
        "zod_int": {"type": "integer", "minimum": -9007199254740991, "maximum": 9007199254740991},
        "ge0": {"type": "integer", "minimum": 0},
        "range": {"type": "integer", "minimum": 17, "maximum": 4321},
        "negative": {"type": "integer", "minimum": -250, "exclusiveMaximum": -7},
        "exclusive": {"type": "integer", "exclusiveMinimum": 99, "exclusiveMaximum": 1000},
        "le": {"type": "integer", "maximum": 12},
        "multiple": {"type": "integer", "multipleOf": 7, "minimum": -100, "maximum": 100},
        "multiple_free": {"type": "integer", "multipleOf": 12},
    }, "required": ["zod_int", "ge0", "range", "negative", "exclusive", "le", "multiple", "multiple_free"],
        "additionalProperties": False},
    "number bounds": {"type": "object", "properties": {
        "unit": {"type": "number", "minimum": 0, "maximum": 1},
        "positive": {"type": "number", "exclusiveMinimum": 0},
        "span": {"type": "number", "minimum": -2.5, "maximum": 10.25},
        "tight": {"type": "number", "exclusiveMinimum": 1.5, "exclusiveMaximum": 1.75},
        "below": {"type": "number", "exclusiveMaximum": -0.001},
        "price": {"type": "number", "minimum": 0, "maximum": 99.99},
        "whole": {"type": "number", "multipleOf": 5, "maximum": 50, "minimum": -50},
    }, "required": ["unit", "positive", "span", "tight", "below", "price", "whole"], "additionalProperties": False},
    "formats": {"type": "object", "properties": {
        f: {"type": "string", "format": f} for f in
        ("date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid")},
        "required": ["date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"]},
    "patterns and lengths": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3,5}$"},
        "contains": {"type": "string", "pattern": "^.{0,8}ab{1,3}c.{0,8}$"},
        "country": {"type": "string", "pattern": "^(US|UK|FR|DE|DK|ES)$"},
        "negated": {"type": "string", "pattern": "^[^a-z]{1,12}$"},
        "long": {"type": "string", "minLength": 3, "maxLength": 1024},
        "word": {"type": "string", "pattern": "^\\w{1,10}(\\s\\w{1,10})?$"},
    }, "required": ["code", "contains", "country", "negated", "long", "word"], "additionalProperties": False},
    "recursive root": NODE,
    "additional beside declared": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9}, "ab": {"type": "boolean"}},
        "additionalProperties": {"type": "string", "maxLength": 5}},
    "enums and unions": {"type": "object", "properties": {
        "color": {"enum": ["red", "reddish", "green", "grey", "greyish-blue", 7, None, {"k": [1, 2]}]},
        "kind": {"anyOf": [
            {"type": "object", "properties": {"t": {"const": "a"}, "x": {"type": "object", "properties": {}}},
             "required": ["t", "x"], "additionalProperties": False},
            {"type": "object", "properties": {"t": {"const": "b"}, "y": {"type": "array", "maxItems": 2}},
             "required": ["t", "y"], "additionalProperties": False},
            {"type": "null"}]},
        "num": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "number", "maximum": 0}, {"type": "string"}]},
    }, "required": ["color", "kind", "num"], "additionalProperties": False},
}


def _request(schema: dict[str, Any], seed: int) -> Any:
    body = {"messages": [{"role": "user", "content": "JSON please."}], "seed": seed, "temperature": 1.0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    return validate_create_body(body, RequestLimits(max_tokens=4096))[1]


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("seed", range(3))
def test_random_weights_write_only_valid_values(engine_eos: LlamaEngine, name: str, seed: int) -> None:
    schema = SCHEMAS[name]
    gen = engine_eos.start(_request(schema, seed), prefix_text="", max_tokens=3000, stop=threading.Event())
    text = "".join(str(p) for p in gen.pieces)
    assert gen.finish_reason == "stop", text[-300:]
    jsonschema.validate(json.loads(text), schema, format_checker=CHECKER)
