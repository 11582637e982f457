"""JavaScript Anthropic-protocol clients unchanged against a running rsb (tests/anthropic/harness, pinned by its
package-lock.json, installed by scripts/test.sh with ``npm ci``, run on its own Node 22): ``@anthropic-ai/sdk``'s
``messages.stream`` and ``messages.create`` in a tool loop with ``tool_result``, and the AI SDK 7 with
``@ai-sdk/anthropic`` (a ``generateText`` tool loop, ``streamText``). A scripted upstream gives the exact answers;
the stack runs with API keys, so the key goes as each client sends it (the SDK: bearer; the AI SDK: x-api-key)."""

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
from consumer.edge.auth import new_key

HARNESS = Path(__file__).resolve().parents[1] / "anthropic" / "harness"
NODE22 = HARNESS / "node_modules" / ".bin" / "node"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (HARNESS / "node_modules" / "@anthropic-ai" / "sdk").exists() or not NODE22.exists(),
    reason=f"the Anthropic harness is not installed: npm ci --prefix {HARNESS} (scripts/test.sh does)")]


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as up:
        yield up


@pytest.fixture
def scripted(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
             upstream: ScriptedUpstream, tmp_path: Path) -> tuple[Stack, str]:
    token, entry = new_key("js")
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [entry]}))
    s = stack_factory(redis_server.url)
    s.generator("--upstream", upstream.url, ignore_eos=False)
    s.consumer("--api-keys", str(keys))
    return s, token


def _run(scripted: tuple[Stack, str], scenario: str) -> dict[str, Any]:
    stack, token = scripted
    r = subprocess.run([str(NODE22), "run.mjs", stack.base_url, token, scenario], cwd=HARNESS, capture_output=True,
                       text=True, timeout=300)
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {}
    assert r.returncode == 0 and out.get("ok"), (out.get("error") or r.stderr[-3000:])
    return out


def test_the_typescript_sdk_tool_loop(scripted: tuple[Stack, str], upstream: ScriptedUpstream) -> None:
    upstream.script(Reply(tool_call_pieces(0, "call_js1", "get_weather", '{"city": "Paris"}'),
                          finish_reason="tool_calls", delay_s=0.01),
                    Reply([text("18 C "), text("in Paris.")]))
    out = _run(scripted, "sdkToolLoop")
    assert out["partial"] == '{"city": "Paris"}'
    call = out["call"]
    assert call["stop_reason"] == "tool_use" and call["content"] == [
        {"type": "tool_use", "id": "call_js1", "name": "get_weather", "input": {"city": "Paris"}}]
    assert out["answer"]["content"] == [{"type": "text", "text": "18 C in Paris."}]
    assert out["answer"]["stop_reason"] == "end_turn"
    assert upstream.bodies()[-1]["messages"][-1] == {"role": "tool", "tool_call_id": "call_js1", "content": "18 C"}
    assert out["headers"]["authorization"].startswith("Bearer ")  # how this SDK sends its key


def test_the_typescript_sdk_streams_text_and_raises_its_errors(scripted: tuple[Stack, str],
                                                              upstream: ScriptedUpstream) -> None:
    upstream.script(Reply([text("Hello"), text(" there"), text("!")], delay_s=0.02))
    out = _run(scripted, "sdkText")
    assert out["text"] == "Hello there!" and out["message"]["content"] == [{"type": "text", "text": "Hello there!"}]
    assert out["message"]["usage"]["output_tokens"] == 3
    assert out["notFound"] == {"status": 404, "name": "NotFoundError", "type": "not_found_error"}


def test_the_ai_sdk_anthropic_provider(scripted: tuple[Stack, str], upstream: ScriptedUpstream) -> None:
    upstream.script(Reply(tool_call_pieces(0, "call_js2", "get_weather", '{"city": "Paris"}'),
                          finish_reason="tool_calls"),
                    Reply([text("It is 18 C.")]), Reply([text("Hello"), text("!")]))
    out = _run(scripted, "aiSdk")
    assert (out["text"], out["steps"], out["toolResults"]) == ("It is 18 C.", 2, ["18 C in Paris"])
    assert out["finishReasons"] == ["tool-calls", "stop"] and out["streamed"] == "Hello!"
    assert (out["usage"]["inputTokens"], out["usage"]["outputTokens"]) == (10, 6)  # the call in 6 pieces
    assert "x-api-key" in out["headers"]  # how this provider sends its key
    history = upstream.bodies()[1]["messages"]
    assert [m["role"] for m in history] == ["user", "assistant", "tool"]
    assert history[2] == {"role": "tool", "tool_call_id": "call_js2", "content": "18 C in Paris"}
