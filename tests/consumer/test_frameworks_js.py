"""JavaScript agent frameworks unchanged against a running rsb (tests/frameworks/harness, pinned by its
package-lock.json, installed by scripts/test.sh with ``npm ci``, run on its own Node 22): the AI SDK 7's
``generateText`` tool loop with ``@ai-sdk/openai-compatible`` (chat completions) and with ``@ai-sdk/openai``'s
Responses provider (whose second step sends ``item_reference`` items), structured output with zod's integers, and
``@openai/agents`` continuing a run by ``previousResponseId`` and by ``conversationId``. A scripted upstream gives
the exact tool loops."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from scripted_upstream import Reply, ScriptedUpstream, text, tool_call_pieces
from servers import Stack, StackFactory

from broker.redis.server import RedisServer

HARNESS = Path(__file__).resolve().parents[1] / "frameworks" / "harness"
NODE22 = HARNESS / "node_modules" / ".bin" / "node"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (HARNESS / "node_modules" / "@openai" / "agents").exists() or not NODE22.exists(),
    reason=f"the frameworks harness is not installed: npm ci --prefix {HARNESS} (scripts/test.sh does)")]


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as up:
        yield up


@pytest.fixture
def scripted(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
             upstream: ScriptedUpstream) -> Stack:
    s = stack_factory(redis_server.url)
    s.generator("--upstream", upstream.url, ignore_eos=False)
    s.consumer()
    return s


def _run(stack: Stack, scenario: str) -> dict[str, Any]:
    r = subprocess.run([str(NODE22), "run.mjs", stack.base_url, scenario], cwd=HARNESS, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"], out
    return out


def _weather(call_id: str) -> Reply:
    return Reply(tool_call_pieces(0, call_id, "get_weather", '{"city": "Paris"}'), finish_reason="tool_calls")


def _last_history(upstream: ScriptedUpstream) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = upstream.bodies()[-1]["messages"]
    return messages


def test_ai_sdk_tool_loop_on_chat_completions(scripted: Stack, upstream: ScriptedUpstream) -> None:
    upstream.script(_weather("call_j1"), Reply([text("It is 18 C.")]))
    out = _run(scripted, "compatibleTools")
    assert (out["text"], out["steps"]) == ("It is 18 C.", 2)
    assert [m["role"] for m in _last_history(upstream)][-2:] == ["assistant", "tool"]


def test_ai_sdk_responses_provider_sends_item_references(scripted: Stack, upstream: ScriptedUpstream) -> None:
    upstream.script(_weather("call_j2"), Reply([text("Sunny, 18 C.")]), Reply([text("Rain.")]))
    out = _run(scripted, "responsesTools")
    assert (out["text"], out["steps"], out["next"]) == ("Sunny, 18 C.", 2, "Rain.")
    assert out["references"] >= 1  # the first turn's answer came back as an item_reference
    assert any(i.get("type") == "item_reference" for i in out["inputs"][-1])
    history = _last_history(upstream)  # ... and reached the model as the answer it names
    assert [(m["role"], m.get("content")) for m in history[-2:]] == [("assistant", "Sunny, 18 C."),
                                                                     ("user", "And tomorrow?")]


def test_ai_sdk_structured_output_with_zod_integers(scripted: Stack, upstream: ScriptedUpstream) -> None:
    answer = '{"city": "Oslo", "population": 709000}'
    upstream.script(Reply([text(answer)]), Reply([text(answer)]))
    out = _run(scripted, "structured")
    assert out["chat"] == out["responses"] == {"city": "Oslo", "population": 709000}
    for body in upstream.bodies():
        population = body["response_format"]["json_schema"]["schema"]["properties"]["population"]
        assert population["maximum"] == 9007199254740991  # zod's integer bound, enforced by rsb


def test_openai_agents_js_continues_by_previous_response_and_conversation(scripted: Stack,
                                                                         upstream: ScriptedUpstream) -> None:
    for i in range(3):
        upstream.script(_weather(f"call_a{i}"), Reply([text(f"Answer {i}.")]))
    out = _run(scripted, "agents")
    assert out["outputs"] == ["Answer 0.", "Answer 1.", "Answer 2."]
    second = upstream.bodies()[3]["messages"]  # the second run's tool turn: the first run's history in front
    assert "Weather in Paris?" in json.dumps(second) and "And in Rome?" in json.dumps(second)
