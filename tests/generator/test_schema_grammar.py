"""rsb's schema-to-grammar converter on llama.cpp: random weights (which would write anything) under each schema
write only JSON the jsonschema package (with its format checker) finds valid, for every keyword rsb admits:
numeric bounds, exclusive bounds and multiples, formats, patterns, lengths, recursion through a root ``$ref``,
additional properties beside declared ones, tries of enum values."""

from __future__ import annotations

import json
import random
import threading
from typing import Any

import jsonschema
import pytest
from helpers import LLAMA_EXTRA

pytest.importorskip("llama_cpp", reason=LLAMA_EXTRA)

from broker.errors import InvalidRequest
from broker.request.generation import RequestLimits, validate_create_body
from broker.schema.enforceable import check_enforceable
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
        "least": {"type": "number", "exclusiveMinimum": 0, "maximum": 1e-16},  # only 0.0000000000000001
        "huge": {"type": "integer", "minimum": 1e299, "maximum": 1e300},
    }, "required": ["unit", "positive", "span", "tight", "below", "price", "whole", "least", "huge"], "additionalProperties": False},
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


# -- random schemas: whatever the admission check takes, the grammar compiles and writes only valid values ----------

_PATTERNS = ["^[a-z]+$", "abc", "^(US|UK)$", "^\\d{2,4}-x$", "^[^a]*$", "^(a|b)*c$", "x?y", "^.{0,5}$", "^$"]
_FORMATS = ["date", "time", "date-time", "email", "uuid", "ipv4", "ipv6", "hostname", "duration"]


def _leaf(r: random.Random) -> dict[str, Any]:
    c = r.randrange(11)
    bounds = [0, 1, -5, 17, -1000, 10 ** r.randrange(1, 17), 2.5, -0.5, 0.25]
    if c == 0:
        return {"type": "string", "maxLength": r.randrange(0, 30), "minLength": r.randrange(0, 3)}
    if c == 1:
        return {"type": "string", "pattern": r.choice(_PATTERNS)}
    if c == 2:
        return {"type": "string", "format": r.choice(_FORMATS)}
    if c in (3, 4):
        s: dict[str, Any] = {"type": "integer" if c == 3 else "number"}
        for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if r.random() < 0.4:
                s[k] = r.choice(bounds)
        if c == 3 and r.random() < 0.3:
            s["multipleOf"] = r.choice([2, 3, 7, 100])
        return s
    if c == 5:
        return {"enum": r.sample(["a", "ab", "abc", "b", 1, 2.5, None, True, {"k": 1}, [1]], r.randrange(1, 6))}
    if c == 6:
        return {"type": r.sample(["string", "integer", "number", "boolean", "null", "object", "array"],
                                 r.randrange(1, 4))}
    return [{"type": "string"}, {"type": "boolean"}, {"type": "null"}, {}][c - 7]


def _node(r: random.Random, depth: int) -> dict[str, Any]:
    if depth <= 0 or r.random() < 0.35:
        return _leaf(r)
    c = r.randrange(4)
    if c == 0:
        props = {f"p{i}": _node(r, depth - 1) for i in range(r.randrange(0, 5))}
        s: dict[str, Any] = {"type": "object", "properties": props, "required": [k for k in props if r.random() < 0.5]}
        extra = r.random()
        if extra < 0.3:
            s["additionalProperties"] = False
        elif extra < 0.5:
            s["additionalProperties"] = _node(r, depth - 1)
        return s
    if c == 1:
        return {"type": "array", "items": _node(r, depth - 1), "minItems": r.randrange(0, 3), "maxItems": 4}
    if c == 2:
        return {"anyOf": [_node(r, depth - 1) for _ in range(r.randrange(1, 4))]}
    return {"type": "array", "prefixItems": [_node(r, depth - 1) for _ in range(r.randrange(1, 3))]}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_random_schemas_admitted_compile_and_write_only_valid_values(engine_eos: LlamaEngine) -> None:
    r = random.Random(20261130)
    checked = 0
    for i in range(150):
        schema = _node(r, 3)
        try:
            check_enforceable(schema, ("schema",))
        except InvalidRequest:
            continue  # a refusal by name is fine; anything else (a crash) fails the test
        gen = engine_eos.start(_request(schema, i), prefix_text="", max_tokens=1500, stop=threading.Event())
        text = "".join(str(p) for p in gen.pieces)  # a grammar llama.cpp cannot compile raises here
        if gen.finish_reason == "stop":
            jsonschema.validate(json.loads(text), schema, format_checker=CHECKER)
            checked += 1
    assert checked > 90
