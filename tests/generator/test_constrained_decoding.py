"""Constrained decoding in the llama.cpp engine: every answer to a ``json_schema`` response format, and every
call a forced ``tool_choice`` makes, is JSON valid against its schema (checked with the jsonschema package),
on random weights (which would write anything) and on the real default model; a continuation resumes the
grammar mid-value; a schema rsb cannot enforce is a 400 at create."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from helpers import LLAMA_EXTRA, create
from servers import StackFactory

pytest.importorskip("llama_cpp", reason=LLAMA_EXTRA)

from broker.redis.server import RedisServer
from broker.request.generation import GenerationRequest, RequestLimits, ResponseFormat, validate_create_body
from generator.engines.grammar import SchemaRefused, answer_grammar
from generator.engines.llama import LlamaEngine
from generator.engines.one_sequence import OneSequenceEngine
from generator.engines.pieces import PartialAnswer, PartialCall, Piece, ToolCallStart

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}[.](com|org)$"},
        "born": {"type": "string", "format": "date"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "pet": {"anyOf": [{"$ref": "#/$defs/Pet_Kind"}, {"type": "null"}]},
        "note": {"type": "string", "maxLength": 30},
        "any": {},
    },
    "required": ["name", "age", "email", "born", "tags", "pet", "note", "any"],
    "additionalProperties": False,
    "$defs": {"Pet_Kind": {"type": "object", "properties": {"kind": {"type": "string", "maxLength": 10},
                                                            "friend": {"$ref": "#/$defs/Pet_Kind"}},
                           "required": ["kind"]}},
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]},
                                     "days": {"type": "integer"}},
    "required": ["city", "unit", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "maxLength": 10}}, "required": ["tz"]}}}


def request(**body: Any) -> GenerationRequest:
    body.setdefault("messages", [{"role": "user", "content": "Describe a person as JSON."}])
    return validate_create_body(body, RequestLimits(max_tokens=4096))[1]


def json_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def answer(engine: LlamaEngine, req: GenerationRequest, *, prefix_text: str = "",
           partial: PartialAnswer | None = None, max_tokens: int = 400) -> tuple[list[Piece], str]:
    gen = engine.start(req, prefix_text=prefix_text, max_tokens=max_tokens, stop=threading.Event(), partial=partial)
    pieces = list(gen.pieces)
    return pieces, gen.finish_reason


def calls_of(pieces: list[Piece]) -> list[tuple[str, str]]:
    """(name, arguments) of every call the pieces make."""
    calls: list[tuple[str, str]] = []
    for p in pieces:
        if isinstance(p, ToolCallStart):
            calls.append((p.name, ""))
        elif isinstance(p, str) and calls:
            calls[-1] = (calls[-1][0], calls[-1][1] + p)
    return calls


def text_of(pieces: list[Piece]) -> str:
    return "".join(p for p in pieces if isinstance(p, str))


# -- random weights: the grammar alone makes the JSON valid ----------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_random_weights_under_a_schema_write_valid_json(engine_eos: LlamaEngine, seed: int) -> None:
    req = request(response_format=json_format(PERSON), seed=seed, temperature=1.0)
    pieces, finish = answer(engine_eos, req, max_tokens=2000)
    assert finish == "stop", text_of(pieces)[-200:]  # the grammar ended the answer, not the budget
    jsonschema.validate(json.loads(text_of(pieces)), PERSON)


def test_json_object_is_any_object(engine_eos: LlamaEngine) -> None:
    pieces, finish = answer(engine_eos, request(response_format={"type": "json_object"}, seed=5), max_tokens=3000)
    if finish == "stop":
        assert isinstance(json.loads(text_of(pieces)), dict)


@pytest.mark.parametrize("seed", range(8))
def test_random_weights_forced_to_call_make_a_valid_call(engine_eos: LlamaEngine, seed: int) -> None:
    req = request(tools=[WEATHER, TIME], tool_choice="required", seed=seed, temperature=1.0)
    pieces, finish = answer(engine_eos, req, max_tokens=2000)
    assert finish == "tool_calls"
    [(name, args)] = calls_of(pieces)
    schema = {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"]  # type: ignore[index]
    jsonschema.validate(json.loads(args), schema)
    named = request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
                    seed=seed)
    pieces, _ = answer(engine_eos, named, max_tokens=2000)
    [(name, args)] = calls_of(pieces)
    assert name == "get_time" and isinstance(json.loads(args)["tz"], str)


def test_a_continued_json_answer_resumes_the_grammar_mid_value(engine_eos: LlamaEngine) -> None:
    req = request(response_format=json_format(PERSON), seed=11)
    pieces, _ = answer(engine_eos, req, max_tokens=2000)
    whole = text_of(pieces)
    for cut in (1, len(whole) // 3, len(whole) - 2):
        more, finish = answer(engine_eos, req, prefix_text=whole[:cut], max_tokens=2000)
        assert finish == "stop"
        jsonschema.validate(json.loads(whole[:cut] + text_of(more)), PERSON)


def test_a_continued_call_goes_on_inside_its_arguments(engine_eos: LlamaEngine) -> None:
    req = request(tools=[WEATHER], tool_choice="required", seed=4)
    so_far = '{"city": "Par'
    pieces, finish = answer(engine_eos, req, partial=PartialAnswer(calls=(PartialCall(0, "call_x", "get_weather", so_far),),
                                                                   ends_in=0), max_tokens=2000)
    assert finish == "tool_calls"
    assert not any(isinstance(p, ToolCallStart) for p in pieces)  # nothing announced twice
    args = so_far + text_of(pieces)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])  # type: ignore[index]
    assert json.loads(args)["city"].startswith("Par")


def test_the_engine_refuses_a_schema_the_create_would_have_refused() -> None:
    ok = request(response_format=json_format({"type": "object"}))
    bad = dataclasses.replace(ok, response_format=ResponseFormat("json_schema", "x", {"type": "array",
                                                                                      "uniqueItems": True}))
    with pytest.raises(SchemaRefused, match="uniqueItems") as e:
        answer_grammar(bad)
    assert e.value.code == "invalid_request"


# -- the real default model ---------------------------------------------------------------------------------

TRIALS = 8


@pytest.fixture(scope="module")
def smollm(default_gguf: Path) -> Any:
    eng = OneSequenceEngine(str(default_gguf), n_threads=2, n_ctx=2048)
    yield eng
    eng.close()


RECIPE = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 60}, "servings": {"type": "integer"},
                   "vegetarian": {"type": "boolean"},
                   "ingredients": {"type": "array", "items": {"type": "string", "maxLength": 40},
                                   "minItems": 1, "maxItems": 5}},
    "required": ["title", "servings", "vegetarian", "ingredients"], "additionalProperties": False,
}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_default_model_answers_valid_json_in_every_trial(smollm: LlamaEngine) -> None:
    for seed in range(TRIALS):
        req = request(messages=[{"role": "user", "content": "Give me a simple pancake recipe as JSON."}],
                      response_format=json_format(RECIPE), seed=seed, temperature=0.8)
        pieces, finish = answer(smollm, req, max_tokens=300)
        assert finish == "stop", text_of(pieces)
        jsonschema.validate(json.loads(text_of(pieces)), RECIPE)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_default_model_forced_to_call_makes_a_valid_call_in_every_trial(smollm: LlamaEngine) -> None:
    for seed in range(TRIALS):
        req = request(messages=[{"role": "user", "content": "What's the weather in Paris for the next 3 days?"}],
                      tools=[WEATHER, TIME], tool_choice="required", seed=seed, temperature=0.8)
        pieces, finish = answer(smollm, req, max_tokens=200)
        assert finish == "tool_calls", text_of(pieces)
        [(name, args)] = calls_of(pieces)
        schema = {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"]  # type: ignore[index]
        jsonschema.validate(json.loads(args), schema)


@pytest.mark.slow
def test_a_schema_rsb_cannot_enforce_is_a_400_at_create(
        stack_factory: StackFactory, redis_server: RedisServer) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    with s.client() as c:
        r = create(c, messages=[{"role": "user", "content": "hi"}],
                   response_format=json_format({"type": "object", "properties": {"n": {"type": "array",
                                                                                      "uniqueItems": True}}}))
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "invalid_request"
        assert err["message"].startswith("response_format.json_schema.schema.properties.n.uniqueItems: unique items "
                                         "cannot be enforced")
        r = create(c, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice="required",
                   response_format={"type": "json_object"})
        assert r.status_code == 400 and "exclude each other" in r.json()["error"]["message"]


def test_a_constrained_step_past_its_cpu_budget_ends_the_generation(engine_eos: LlamaEngine,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from generator.engines import sampler

    monkeypatch.setattr(sampler, "STEP_BUDGET_S", -1.0)  # every step is past it
    with pytest.raises(sampler.GrammarTooCostly, match="CPU") as e:
        answer(engine_eos, request(response_format=json_format(PERSON), seed=1))
    assert e.value.code == "schema_too_costly"


def test_a_vocabulary_smaller_than_the_wide_set_still_answers_a_schema(engine_eos: LlamaEngine,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A model with fewer tokens than WIDE (a 289-token GGUF) ended every json_schema request in error `engine`:
    "kth(=-735) out of bounds (289)". The demo model has 1,689 tokens, so WIDE is raised past it here."""
    import numpy as np

    from generator.engines import sampler

    n_vocab = engine_eos._llm.n_vocab()
    monkeypatch.setattr(sampler, "WIDE", n_vocab + 1000)
    kths: list[int] = []
    argpartition = np.argpartition

    def spy(a: Any, kth: Any, *args: Any, **kwargs: Any) -> Any:
        kths.append(int(kth))
        return argpartition(a, kth, *args, **kwargs)

    monkeypatch.setattr(np, "argpartition", spy)
    for seed in range(4):
        pieces, finish = answer(engine_eos, request(response_format=json_format(PERSON), seed=seed, temperature=1.0),
                                max_tokens=2000)
        assert finish == "stop", text_of(pieces)[-200:]
        jsonschema.validate(json.loads(text_of(pieces)), PERSON)
    assert kths and all(-n_vocab <= k < n_vocab for k in kths)  # the wide tier ran, within the vocabulary
