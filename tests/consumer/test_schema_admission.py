"""No schema can stall a worker, end to end: the hostile schemas (an ambiguous anyOf nested through $ref, a
pattern of nested quantifiers, left recursion) are a 400 within 1 s on every route that takes a schema, and
nothing is queued; the costliest schema rsb admits (bench/scenarios/constrained.py's WORST) runs on the default
model at about the pace of free decoding, and a cancel ends it within 2 s."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import create, eventually
from servers import Stack

from bench.scenarios.constrained import WORST
from broker.redis.server import RedisServer


def _deep_anyof(depth: int) -> dict[str, Any]:
    defs: dict[str, Any] = {}
    for i in range(depth):
        nxt = {"$ref": f"#/$defs/L{i + 1}"} if i + 1 < depth else {"type": "string"}
        alt = {"type": "object", "properties": {"v": nxt}, "required": ["v"]}
        defs[f"L{i}"] = {"anyOf": [alt, dict(alt)]}
    return {"$ref": "#/$defs/L0", "$defs": defs}


def _wide_integers(count: int) -> dict[str, Any]:
    """Issue 42's schema: integers with wide bounds and a multipleOf each (27 KB at 260: 16 s of a generator's
    Python and an 11 MB grammar before admission bounded its size, broker.schema.grammar_size)."""
    w = 2**53 - 1
    props = {f"p{i}": {"type": "integer", "minimum": -w + i, "maximum": w - i, "multipleOf": 100 - i % 100}
             for i in range(count)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


HOSTILE_SCHEMAS: dict[str, dict[str, Any]] = {
    "27 KB of wide integers with multipleOf": _wide_integers(260),
    "200 strings of up to 1,000 characters": {"type": "object", "properties": {
        f"s{i}": {"type": "string", "maxLength": 1000 - i} for i in range(200)}},
    "ambiguous anyOf through $ref, depth 15": _deep_anyof(15),
    "pattern ^(a?){1024}$": {"type": "string", "pattern": "^(a?){1024}$"},
    "left recursion": {"$ref": "#/$defs/A", "$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}]}}},
    "stars": {"type": "string", "pattern": "^" + "[a-z]*" * 100 + "$"},
}


@pytest.fixture(scope="module")
def model_stack(tmp_path_factory: pytest.TempPathFactory, default_gguf: Path) -> Iterator[Stack]:
    server = RedisServer().start()
    s = Stack(server.url, default_gguf, tmp_path_factory.mktemp("stack"))
    try:
        s.generator(ignore_eos=False)
        s.consumer()
        yield s
    finally:
        s.close()
        server.cleanup()


def _routes(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    ask = [{"role": "user", "content": "hi"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"v": schema}, "required": ["v"]}}}
    return [
        ("/v1/streams", {"id": str(uuid.uuid4()), "messages": ask, "response_format": fmt}),
        ("/v1/streams", {"id": str(uuid.uuid4()), "messages": ask, "tools": [tool], "tool_choice": "required"}),
        ("/v1/chat/completions", {"model": "m", "messages": ask, "response_format": fmt}),
        ("/v1/responses", {"model": "m", "input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                            "schema": schema}}}),
        ("/api/chat", {"id": str(uuid.uuid4()), "trigger": "submit-message", "response_format": fmt,
                       "messages": [{"id": "m1", "role": "user", "parts": [{"type": "text", "text": "hi"}]}]}),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HOSTILE_SCHEMAS))
def test_hostile_schemas_are_a_400_within_a_second_on_every_route(model_stack: Stack, name: str) -> None:
    with model_stack.client() as c:
        for path, body in _routes(HOSTILE_SCHEMAS[name]):
            t0 = time.monotonic()
            r = c.post(path, json=body)
            took = time.monotonic() - t0
            assert r.status_code == 400, (path, r.text[:300])
            assert took < 1.0, (path, took)
            error = r.json()["error"]
            assert error["code"] in ("invalid_request", "invalid_value"), (path, error)
        assert c.get("/metrics").status_code == 200


def _events_until(c: httpx.Client, sid: str, kinds: set[str]) -> tuple[str, float]:
    with c.stream("GET", f"/v1/streams/{sid}/events", timeout=httpx.Timeout(300.0)) as r:
        for line in r.iter_lines():
            if line.startswith("event: ") and line[7:] in kinds:
                return line[7:], time.monotonic()
    raise AssertionError("the stream ended without the event")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_worst_admitted_schema_runs_at_a_free_pace_and_a_cancel_ends_it_within_2_s(model_stack: Stack) -> None:
    ask = [{"role": "user", "content": "Give me some data as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "worst", "schema": WORST}}
    with model_stack.client() as c:
        timed: dict[str, float] = {}
        for kind, extra in (("free", {}), ("worst", {"response_format": fmt})):
            sid = str(uuid.uuid4())
            assert create(c, {"messages": ask, "max_tokens": 120, "temperature": 0.8, "seed": 3, **extra},
                          id=sid).status_code == 201
            _, started = _events_until(c, sid, {"delta"})
            end, ended = _events_until(c, sid, {"done", "error", "cancelled"})
            assert end == "done"
            usage = c.get(f"/v1/streams/{sid}").json()["usage"]
            timed[kind] = (ended - started) / max(1, usage["completion_tokens"] - 1)
        # Per token, the grammar's work stays a small part of a decode (the benchmark measures 1.04x; a shared
        # machine's noise between two runs a few seconds apart is allowed for).
        assert timed["worst"] < 3 * timed["free"], timed

        sid = str(uuid.uuid4())
        assert create(c, {"messages": ask, "max_tokens": 2000, "response_format": fmt}, id=sid).status_code == 201
        _events_until(c, sid, {"delta"})
        t0 = time.monotonic()
        assert c.post(f"/v1/streams/{sid}/cancel").status_code == 202
        end, at = _events_until(c, sid, {"done", "error", "cancelled"})
        assert end == "cancelled" and at - t0 < 2.0, at - t0
        eventually(lambda: c.get(f"/v1/streams/{sid}").json()["status"] == "cancelled")
