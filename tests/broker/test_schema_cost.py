"""The cost bound at create (broker.schema.cost, broker.schema.pattern): schemas and patterns that would make
llama.cpp's grammar engine pay for many readings at once are refused, fast, naming where; what ordinary tools
write (Pydantic's recursive models and unions, zod's integers, discriminated unions) is admitted."""

from __future__ import annotations

import time
from typing import Any

import pytest

from broker.errors import InvalidRequest
from broker.schema import enforceable
from broker.schema.enforceable import check_enforceable
from broker.schema.pattern import parse
from broker.schema.pattern_cost import MAX_STACKS, measure


def deep_anyof(depth: int, *, same: bool = True) -> dict[str, Any]:
    """The issue's schema: anyOf nested through $ref, two alternatives per level that read the same text."""
    defs: dict[str, Any] = {}
    for i in range(depth):
        nxt = {"$ref": f"#/$defs/L{i + 1}"} if i + 1 < depth else {"type": "string"}
        alt = {"type": "object", "properties": {"v": nxt}, "required": ["v"]}
        other = alt if same else {"type": "object", "properties": {"w": nxt}, "required": ["w"]}
        defs[f"L{i}"] = {"anyOf": [alt, dict(other)]}
    return {"$ref": "#/$defs/L0", "$defs": defs}


def deep_object(levels: int) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        out = {"type": "object", "properties": {"a": out}, "required": ["a"]}
    return out


HOSTILE: dict[str, tuple[dict[str, Any], str]] = {
    "ambiguous anyOf through $ref": (deep_anyof(15), "anyOf branches can both match"),
    "ambiguous arrays": ({"anyOf": [{"type": "array", "items": {"type": "object"}},
                                    {"type": "array", "items": {"type": "object", "properties": {"a": {}}}}]},
                         "nested object"),
    "pattern (a?){1024}": ({"type": "string", "pattern": "^(a?){1024}$"}, "too ambiguous"),
    "pattern (a|a)* ... nested": ({"type": "string", "pattern": "^([a-z]{1,10}){1,10}$"}, "too ambiguous"),
    "pattern stars": ({"type": "string", "pattern": "^" + "[a-z]*" * 70 + "$"}, "too ambiguous"),
    "pattern .{n}x.{n}": ({"type": "string", "pattern": "^.{0,1000}x.{0,1000}$"}, "too ambiguous"),
    "nullable star": ({"type": "string", "pattern": "^(a?b?)*$"}, "may be empty"),
    "left recursion": ({"$ref": "#/$defs/A", "$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}]}}},
                       "left recursion"),
    "ref cycle": ({"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}},
                  "left recursion"),
    "100 optional properties": ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(100)}},
                                "ways to read"),
    "wide anyOf": ({"anyOf": [{"type": "object", "properties": {"k": {"type": "string"}, f"x{i}": {}},
                               "required": ["k", f"x{i}"]} for i in range(80)]}, "alive"),
    "1001 enum values": ({"enum": list(range(1001))}, "1000 enum values"),
    "5001 properties": ({"type": "object", "properties": {
        f"g{j}": {"type": "object", "properties": {f"p{i}": {"type": "null"} for i in range(60)},
                  "required": [f"p{i}" for i in range(60)]} for j in range(84)},
        "required": [f"g{j}" for j in range(84)]}, "5000 properties"),
    "15,001 characters": ({"type": "object", "properties": {"x" * 1500 + str(i): {"type": "null"} for i in range(11)},
                           "required": ["x" * 1500 + str(i) for i in range(11)]}, "15000 are accepted"),
}


HOSTILE["11 levels"] = ({"$ref": "#/$defs/A", "$defs": {"A": {"type": "object", "properties": {"a": {"$ref": "#/$defs/B"}}},
                         "B": {"type": "array", "items": deep_object(9)}}}, "nest 11 levels")


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_schemas_are_refused_fast_naming_the_reason(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(enforceable, "MAX_SCHEMA_BYTES", 1 << 20)  # OpenAI's counts lie past 32 KiB of JSON
    schema, reason = HOSTILE[name]
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequest) as e:
        check_enforceable(schema, ("schema",))
    assert time.perf_counter() - t0 < 1.0  # what the issue asks of every route; a busy machine has room
    assert reason in e.value.message and e.value.message.startswith("schema")


ADMITTED: dict[str, dict[str, Any]] = {
    "the issue's schema with distinct branches": deep_anyof(9, same=False),
    "Pydantic recursive model (root $ref)": {"$ref": "#/$defs/Node", "$defs": {"Node": {
        "type": "object", "properties": {"value": {"type": "integer"},
                                         "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
        "required": ["value", "children"]}}},
    "Optional[Model]": {"type": "object", "properties": {"pet": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string"}}}, {"type": "null"}]}}},
    "discriminated union": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "object"}}, "required": ["kind", "x"]},
        {"type": "object", "properties": {"kind": {"const": "b"}, "x": {"type": "array"}}, "required": ["kind", "x"]}]},
    "union decided at a later key": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
         "required": ["name", "age"]},
        {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "object"}},
         "required": ["name", "email"]}]},
    "int | float | str": {"anyOf": [{"type": "integer"}, {"type": "number"}, {"type": "string"}]},
    "identical leaves": {"anyOf": [{"type": "string"}, {"type": "string"}]},
    "1000 short enum values": {"enum": [f"v{i}" for i in range(1000)]},
    "60 optional properties": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(60)}},
    "10 levels": deep_object(10),
    # Any-values ({}) in two branches: the bare type schemas they expand to are shared objects, so the analysis'
    # memo (by id) never reads another's (a fresh dict per use could take a collected one's id).
    "any values in branches": {"type": "object", "properties": {"p0": {"anyOf": [
        {"type": "object", "properties": {"p0": {}, "q1": {"type": "object", "properties": {}}}, "required": ["q1"]},
        {"type": "string", "maxLength": 14},
        {"type": "object", "properties": {"p0": {"type": "object", "properties": {"p3": {}}}, "p1": {"const": None}},
         "required": ["p1"]}]}}, "required": ["p0"]},
}


@pytest.mark.parametrize("name", list(ADMITTED))
def test_ordinary_schemas_are_admitted(name: str) -> None:
    for _ in range(20):  # the same verdict every time
        check_enforceable(ADMITTED[name], ("schema",))


@pytest.mark.parametrize(("pattern", "stacks"), [
    ("^[a-z]+@[a-z]+[.]com$", 2), ("^\\d{3}-\\d{4}$", 1), ("^(US|UK|FR|DE|DK)$", 3), ("abc", 5),
    ("^[a-z]{1,1000}$", 2), ("^(a?){8}$", 9),
])
def test_a_patterns_stacks_are_counted_as_llama_cpp_keeps_them(pattern: str, stacks: int) -> None:
    assert measure(parse(pattern, ("p",)), ("p",)).stacks == stacks


def test_an_alternation_of_words_is_a_trie() -> None:
    words = "|".join(f"w{i:03d}" for i in range(200))  # one stack per word would be far past the bound
    assert measure(parse(f"^({words})$", ("p",)), ("p",)).stacks <= 11 < MAX_STACKS
