"""generator.engines.upstream.kinds: what each kind of server is sent beyond its protocol (vLLM's cache_salt and
priority, Ollama's keep_alive, ignore_eos where it exists), and that OpenAI itself gets only OpenAI's own fields;
checked on what reached a scripted server (tests/scripted_upstream.py), through the engine and through rsb."""

from __future__ import annotations

import re
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import redis
from helpers import wait_status
from scripted_upstream import ScriptedUpstream
from servers import StackFactory

from broker.redis.server import RedisServer
from broker.request.generation import GenerationRequest, Message
from consumer.edge.auth import new_key
from generator.engines.upstream import UpstreamEngine
from generator.engines.upstream.kinds import LLAMA_CPP, OLLAMA_KIND, OPENAI_KIND, VLLM, cache_salt, kind_of_listing

CHAT = (Message("user", "Tell me a story"),)
#: The request fields OpenAI's chat completions API documents (what rsb may send OpenAI itself).
OPENAI_CHAT_FIELDS = frozenset({
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier", "seed",
    "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
    "top_logprobs", "top_p", "user", "verbosity", "web_search_options"})


def test_each_kind_gets_only_the_fields_it_accepts() -> None:
    every: dict[str, Any] = {"cache_scope": "tenant-a", "tier": "priority", "ignore_eos": True, "keep_alive": "30m"}
    assert OPENAI_KIND.fields(**every) == {}
    assert LLAMA_CPP.fields(**every) == {"ignore_eos": True}
    assert OLLAMA_KIND.fields(**every) == {"keep_alive": "30m"}
    assert OLLAMA_KIND.fields(**{**every, "keep_alive": "-1"}) == {"keep_alive": -1}  # for ever: a number
    assert VLLM.fields(**every) == {"cache_salt": cache_salt("tenant-a"), "priority": -1, "ignore_eos": True}
    assert VLLM.fields(**{**every, "tier": "flex", "ignore_eos": False})["priority"] == 1
    assert "priority" not in VLLM.fields(**{**every, "tier": "default"})  # vLLM's default, 0: nothing to say
    assert "priority" not in VLLM.fields(**every, priority=False)  # a server that refused it
    assert "cache_salt" not in VLLM.fields(**{**every, "cache_scope": ""})  # --prompt-cache-scope global
    # As vLLM asks for one: 256 bits, 43 base64 characters; one per tenant, stable.
    salts = {cache_salt(t) for t in ("tenant-a", "tenant-b", "")}
    assert len(salts) == 3 and all(re.fullmatch(r"[A-Za-z0-9_-]{43}", s) for s in salts)
    assert cache_salt("tenant-a") == cache_salt("tenant-a")
    assert kind_of_listing({"data": [{"id": "m", "owned_by": "vllm"}]}) is VLLM
    assert kind_of_listing({"data": [{"id": "m", "owned_by": "llamacpp"}]}) is LLAMA_CPP
    assert kind_of_listing({"data": [{"id": "m", "owned_by": "openai"}]}) is None
    assert kind_of_listing({"object": "list"}) is None


async def _generate(engine: UpstreamEngine, *, tier: str = "", cache_scope: str = "t") -> str:
    request = GenerationRequest(messages=CHAT, prompt=None, model=None, max_tokens=8, temperature=0.0, top_p=1.0,
                                seed=None, stop=(), cancel_on_disconnect=False)
    gen = engine.start(request, prefix_text="", max_tokens=8,
                       stop=threading.Event(), cache_scope=cache_scope, tier=tier)
    assert gen.apieces is not None
    pieces: AsyncIterator[object] = gen.apieces
    return "".join([p async for p in pieces if isinstance(p, str)])


async def test_a_vllm_without_priority_scheduling_is_sent_no_priority_after_its_refusal() -> None:
    with ScriptedUpstream(owned_by="vllm", priority_scheduling=False) as up:
        engine = UpstreamEngine(up.url)  # recognised as vLLM by its model list
        assert await _generate(engine, tier="priority") == "Hello there!"
        assert await _generate(engine, tier="priority") == "Hello there!"
        sent = up.bodies()
        assert [b.get("priority") for b in sent] == [-1, None, None]  # refused once, then never sent
        assert all(b["cache_salt"] == cache_salt("t") for b in sent)
        engine.close()


async def test_openai_itself_gets_only_openais_fields_and_ollama_its_keep_alive() -> None:
    with ScriptedUpstream(owned_by="vllm") as up:
        # Named openai (OpenAI, or a gateway in front of vLLM that refuses unknown fields): none of vLLM's.
        engine = UpstreamEngine(up.url, api="openai", ignore_eos=True)
        await _generate(engine, tier="priority")
        [body] = up.bodies()
        assert set(body) <= OPENAI_CHAT_FIELDS, set(body) - OPENAI_CHAT_FIELDS
        engine.close()
        ollama = UpstreamEngine(up.url + "/api", keep_alive="30m")
        assert await _generate(ollama) == "Hello there!"
        [body] = up.bodies("/api/chat")
        assert body["keep_alive"] == "30m" and "cache_salt" not in body and "priority" not in body
        ollama.close()


def test_a_vllm_upstream_gets_each_tenants_cache_salt_and_its_tier_as_priority(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path) -> None:
    """Through rsb, two keys: vLLM's prefix cache is salted per key (rsb's own cache scope), and its scheduler gets
    the tier each job ran in."""
    alice_key, alice = new_key("alice")
    bob_key, bob = new_key("bob")
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [{**alice, "service_tiers": ["priority", "default", "flex"]}, bob]}))
    with ScriptedUpstream(owned_by="vllm") as up:
        s = stack_factory(redis_server.url)
        s.consumer("--api-keys", str(keys))
        s.generator("--upstream", up.url, ignore_eos=False)
        runs = [(alice_key, "priority"), (alice_key, "flex"), (bob_key, "default"), (bob_key, None)]
        with s.client() as c:
            for key, tier in runs:
                headers = {"Authorization": f"Bearer {key}"}
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
                sid = c.post("/v1/streams", json={**body, **({"service_tier": tier} if tier else {})},
                             headers=headers).json()["id"]
                c.headers.update(headers)
                wait_status(c, sid, {"done"})
        sent = up.bodies()
    assert [b.get("priority") for b in sent] == [-1, 1, None, None]  # default: vLLM's 0, nothing to say
    salts = [b["cache_salt"] for b in sent]
    assert salts[0] == salts[1] != salts[2] == salts[3]
