"""The prompt cache is scoped per tenant by default: with two API keys, bob's probes of alice's templated prompt
get the same ``cached_tokens`` (what his own earlier probes left: so no quicker first token either) whether his
guess of her secret is right or wrong, while alice's own next request reuses her whole prefix.
``--prompt-cache-scope global`` shares the cache, and the same probes tell the right guess apart: what the
default closes."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
from helpers import LLAMA_EXTRA, create, read_sse
from servers import StackFactory

from broker.redis.server import RedisServer
from consumer.edge.auth import new_key

pytest.importorskip("llama_cpp", reason=LLAMA_EXTRA)

TEMPLATE = ("You are the support assistant of a bank. The customer's account is verified. Never reveal the "
            "customer's secret PIN, which is {pin}. Always answer politely and briefly, and mention no number. "
            "Here are the house rules, which you follow in every answer. ") + " ".join(
    f"Rule {i}: be kind, be exact, and say nothing you do not know." for i in range(1, 13))


def messages(pin: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": TEMPLATE.format(pin=pin)}, {"role": "user", "content": "Hello"}]


def usage_of(c: httpx.Client, msgs: list[dict[str, str]]) -> dict[str, Any]:
    res = create(c, messages=msgs, max_tokens=2, seed=1)
    assert res.status_code == 201, res.text
    last = read_sse(c, res.json()["events_url"]).events[-1]
    assert last.event == "done", last
    usage: dict[str, Any] = last.data["usage"]
    return usage


def keys(tmp_path: Path) -> tuple[Path, dict[str, str], dict[str, str]]:
    alice, alice_entry = new_key("alice")
    bob, bob_entry = new_key("bob")
    path = tmp_path / "keys.json"
    path.write_bytes(orjson.dumps({"keys": [alice_entry, bob_entry]}))
    return path, {"Authorization": f"Bearer {alice}"}, {"Authorization": f"Bearer {bob}"}


def probe(stack_factory: StackFactory, redis_url: str, tmp_path: Path, *scope: str) -> dict[str, int]:
    """alice's prompt, then bob's guesses of her PIN (a first wrong one, the right one, another wrong one), then
    alice's again: cached_tokens of each."""
    path, alice, bob = keys(tmp_path)
    s = stack_factory(redis_url)
    s.consumer("--api-keys", str(path))
    s.generator(*scope)  # one worker: every request meets the same cache
    out: dict[str, int] = {}
    with s.client() as c:
        for name, headers, pin in (("alice", alice, "4821"), ("bob_first", bob, "1111"), ("bob_right", bob, "4821"),
                                   ("bob_wrong", bob, "2222"), ("alice_again", alice, "4821")):
            c.headers.update(headers)
            out[name] = usage_of(c, messages(pin))["cached_tokens"]
    return out


@pytest.mark.slow
def test_one_key_never_gets_cached_tokens_from_anothers_prompts(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path) -> None:
    got = probe(stack_factory, redis_server.url, tmp_path)
    assert got["alice"] == 0 and got["bob_first"] == 0, got
    # Each later guess shares with bob's first only the blocks before the PIN: right or wrong, the same.
    assert got["bob_right"] == got["bob_wrong"], got
    assert got["alice_again"] > got["bob_right"], got  # her own whole prefix is still cached for her


@pytest.mark.slow
def test_a_global_scope_shares_the_cache_across_keys(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path) -> None:
    got = probe(stack_factory, redis_server.url, tmp_path, "--prompt-cache-scope", "global")
    # The oracle the default closes: the right guess shares alice's blocks past the PIN, a wrong one fewer.
    assert got["bob_right"] > got["bob_wrong"], got


@pytest.mark.parametrize("parallel", [1, 3])
def test_engine_scopes_keep_apart(demo_gguf: Path, parallel: int) -> None:
    # Batched too: a sequence copies a prefix only from its own scope's running sequences and cache entries.
    from broker.request.generation import GenerationRequest
    from generator.engines.batch_engine import BatchedEngine
    from generator.engines.llama import LlamaEngine
    from generator.engines.one_sequence import OneSequenceEngine

    eng: LlamaEngine = (
        BatchedEngine(str(demo_gguf), parallel=parallel, n_threads=1, n_ctx=2048, ignore_eos=True, prompt_cache_mib=64)
        if parallel > 1 else OneSequenceEngine(str(demo_gguf), n_threads=1, n_ctx=2048, ignore_eos=True, prompt_cache_mib=64))
    try:
        req = GenerationRequest(messages=None, prompt="lamp river " * 150, model=None, max_tokens=4,
                                temperature=0.0, top_p=1.0, seed=1, stop=(), cancel_on_disconnect=False)

        def run(scope: str) -> tuple[str, int]:
            gen = eng.start(req, prefix_text="", max_tokens=4, stop=threading.Event(), cache_scope=scope)
            return "".join(str(p) for p in gen.pieces), gen.cached_tokens

        first, c0 = run("alice")
        theirs, c1 = run("bob")  # the cache holds alice's blocks: not bob's to reuse
        other, c2 = run("")  # nor everyone's
        mine, c3 = run("alice")  # alice's own (live, or kept in the LRU when another prompt replaced them)
        assert (c0, c1, c2) == (0, 0, 0) and c3 > 0
        assert first == theirs == other == mine  # the same greedy answer, cached or not
    finally:
        eng.close()
