"""The grammar's size, bounded at create (broker.schema.grammar_size): issue 42's 27 KB integer schema is refused at once
naming what is too big, the estimate bounds what the generator really builds for the schemas it admits, the tools
of a forced tool_choice add up to one grammar, and the generator stops a grammar past its byte bound whatever the
estimate said."""

from __future__ import annotations

import time
from typing import Any

import pytest
from helpers import LLAMA_EXTRA

from broker.errors import InvalidRequest
from broker.request.generation import RequestLimits, validate_create_body
from broker.schema.enforceable import check_enforceable
from broker.schema.grammar_size import MAX_DIGIT_STATES, MAX_REPEATS, GrammarSize

W = 2**53 - 1  # zod's z.number().int() bounds


def _object(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _wide(count: int, step: int = 0) -> dict[str, Any]:
    return _object({f"p{i}": {"type": "integer", "minimum": -W + i, "maximum": W - i,
                              "multipleOf": step or 100 - i % 100} for i in range(count)})


def test_issue_42s_integer_schema_is_refused_at_once_naming_what_is_too_big() -> None:
    schema = _wide(260)
    assert 26_000 < len(str(schema).encode()) < 30_000
    started = time.perf_counter()
    with pytest.raises(InvalidRequest) as e:
        check_enforceable(schema, ("response_format", "json_schema", "schema"))
    assert time.perf_counter() - started < 0.5
    assert "multipleOf" in e.value.message and "response_format.json_schema.schema.properties.p" in e.value.message
    assert str(MAX_DIGIT_STATES) in e.value.message


def test_repetitions_add_up_across_a_schema() -> None:
    strings = _object({f"s{i}": {"type": "string", "maxLength": 1000} for i in range(200)})
    with pytest.raises(InvalidRequest) as e:
        check_enforceable(strings, ("s",))
    assert "maxLength" in e.value.message and str(MAX_REPEATS) in e.value.message
    check_enforceable(_object({f"s{i}": {"type": "string", "maxLength": 1000} for i in range(50)}), ("s",))
    with pytest.raises(InvalidRequest, match="pattern"):
        check_enforceable(_object({f"s{i}": {"type": "string", "pattern": "^[a-z]{1,1000}$"} for i in range(150)}),
                          ("s",))


def test_the_tools_of_a_forced_choice_share_one_grammar() -> None:
    limits = RequestLimits(max_tokens=64, default_max_tokens=16, max_messages=8, max_prompt_chars=10_000)
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": _wide(1, 97 - 2 * i)}} for i in range(4)]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    validate_create_body({**body, "tool_choice": {"type": "function", "function": {"name": "f0"}}}, limits)
    validate_create_body(body, limits)  # not forced: no grammar
    with pytest.raises(InvalidRequest) as e:
        validate_create_body({**body, "tool_choice": "required"}, limits)
    assert "tools the forced tool_choice allows" in e.value.message


ADMITTED = {
    "one wide integer, multipleOf 97": _wide(1, 97),
    "three wide integers, multipleOf 97, 89, 83": _object({f"a{s}": {"type": "integer", "minimum": -W, "maximum": W,
                                                                      "multipleOf": s} for s in (97, 89, 83)}),
    "300 distinct wide integers": _object({f"a{i}": {"type": "integer", "minimum": -W + i, "maximum": W - i}
                                           for i in range(300)}),
    "30 distinct wide integers, multipleOf 7": _wide(30, 7),
    "numbers with bounds": _object({f"n{i}": {"type": "number", "minimum": -1e12 + i, "maximum": 1e15}
                                    for i in range(50)}),
}


@pytest.mark.parametrize("name", list(ADMITTED))
def test_the_estimate_bounds_the_grammar_the_generator_builds(name: str) -> None:
    pytest.importorskip("llama_cpp", reason=LLAMA_EXTRA)  # the generator's package imports it
    from generator.engines.schema_grammar import Grammar, SchemaGrammar

    schema = ADMITTED[name]
    check_enforceable(schema, ("s",))
    size = GrammarSize()
    size.add(schema, ("s",))
    grammar = Grammar()
    SchemaGrammar(grammar, schema, "").rule(schema)
    assert len(grammar.rules) <= sum(size.digit_states.values()) + 100, name


def test_the_generator_stops_a_grammar_past_its_byte_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("llama_cpp", reason=LLAMA_EXTRA)
    from broker.request.generation import GenerationRequest, Message, ResponseFormat
    from generator.engines import schema_grammar
    from generator.engines.grammar import SchemaRefused, answer_grammar

    monkeypatch.setattr(schema_grammar, "MAX_GRAMMAR_BYTES", 50_000)
    request = GenerationRequest(messages=(Message("user", "hi"),), prompt=None, model=None, max_tokens=8,
                                temperature=0.0, top_p=1.0, seed=1, stop=(), cancel_on_disconnect=False,
                                response_format=ResponseFormat("json_schema", "x", _wide(1, 97)))
    with pytest.raises(SchemaRefused, match="50000 bytes"):
        answer_grammar(request)
