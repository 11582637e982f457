"""The llama.cpp engine's prompt cache: a prompt sharing a prefix with recent ones evaluates only what is new
(``cached_tokens``), and a seeded answer is the same text whatever the cache held."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import LLAMA_EXTRA

pytest.importorskip("llama_cpp", reason=LLAMA_EXTRA)

from broker.request.generation import GenerationRequest, Message
from generator.engines.llama import LlamaEngine
from generator.engines.one_sequence import OneSequenceEngine
from generator.engines.prompt_cache import BLOCK_TOKENS, PromptCache, shared_blocks

WORDS = ("river stone cloud lamp orchard silver quiet engine harbor window meadow copper lantern thistle "
         "valley ember").split()


def text(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def prompt_request(prompt: str, seed: int = 5) -> GenerationRequest:
    return GenerationRequest(messages=None, prompt=prompt, model=None, max_tokens=12, temperature=0.9,
                             top_p=0.95, seed=seed, stop=(), cancel_on_disconnect=False)


def chat_request(turns: list[str], answers: list[str], seed: int = 5) -> GenerationRequest:
    msgs = [Message("system", "You are terse.")]
    for i, user in enumerate(turns):
        msgs.append(Message("user", user))
        if i < len(answers):
            msgs.append(Message("assistant", answers[i]))
    return GenerationRequest(messages=tuple(msgs), prompt=None, model=None, max_tokens=12, temperature=0.9,
                             top_p=0.95, seed=seed, stop=(), cancel_on_disconnect=False)


def generate(eng: LlamaEngine, req: GenerationRequest) -> tuple[str, int]:
    gen = eng.start(req, prefix_text="", max_tokens=req.max_tokens, stop=threading.Event())
    out = "".join(str(p) for p in gen.pieces)
    return out, gen.cached_tokens


@pytest.fixture(scope="module")
def cached(demo_gguf: Path) -> Iterator[LlamaEngine]:
    eng = OneSequenceEngine(str(demo_gguf), n_threads=1, n_ctx=2048, ignore_eos=True, prompt_cache_mib=64)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def fresh(demo_gguf: Path) -> Iterator[LlamaEngine]:
    """No cache kept; each reference answer is preceded by an unrelated prompt, so nothing is reused."""
    eng = OneSequenceEngine(str(demo_gguf), n_threads=1, n_ctx=2048, ignore_eos=True, prompt_cache_mib=0)
    yield eng
    eng.close()


def reference(fresh: LlamaEngine, req: GenerationRequest) -> str:
    generate(fresh, prompt_request("zz " * 3))
    out, cached_tokens = generate(fresh, req)
    assert cached_tokens == 0
    return out


def test_seeded_answers_are_the_same_whatever_the_cache_held(cached: LlamaEngine, fresh: LlamaEngine) -> None:
    base = text(1, 400)
    words = base.split()
    # Prompts sharing prefixes of many lengths (under a block, a few blocks, nearly all), and unrelated ones.
    prompts = [" ".join(words[:n]) + " " + text(100 + n, 30) for n in (5, 60, 120, 121, 200, 333, 399)]
    prompts += [base, base + " " + text(7, 40), text(2, 250), text(2, 250) + " " + text(3, 20)]
    requests = [prompt_request(p) for p in prompts]
    expected = [reference(fresh, r) for r in requests]
    rng = random.Random(0)
    order = list(range(len(requests))) * 2
    rng.shuffle(order)
    hits = 0
    for i in order:
        out, cached_tokens = generate(cached, requests[i])
        assert out == expected[i], f"prompt {i} changed with {cached_tokens} cached tokens"
        assert cached_tokens % BLOCK_TOKENS == 0
        assert cached_tokens < len(cached.tokenize_prompt(requests[i]))
        hits += cached_tokens > 0
    assert hits >= len(requests)  # the second time round, every prompt had its own blocks cached


def test_follow_up_turns_report_cached_tokens_and_keep_their_text(cached: LlamaEngine, fresh: LlamaEngine) -> None:
    # Three chats interleaved turn by turn: each turn follows another chat's, so its prefix comes back from
    # the LRU, not from the context.
    chats = [[text(10 * c + t, 90) for t in range(3)] for c in range(3)]
    answers: list[list[str]] = [[], [], []]
    for turn in range(3):
        for c in range(3):
            req = chat_request(chats[c][:turn + 1], answers[c])
            want = reference(fresh, req)
            out, cached_tokens = generate(cached, req)
            assert out == want
            if turn > 0:
                # The earlier turns' whole blocks, at least.
                previous = len(cached.tokenize_prompt(chat_request(chats[c][:turn], answers[c][:turn - 1])))
                assert cached_tokens >= previous // BLOCK_TOKENS * BLOCK_TOKENS > 0
            answers[c].append(out)


def test_a_continued_answer_reuses_its_prompt(cached: LlamaEngine, fresh: LlamaEngine) -> None:
    """A crash continuation's prompt is the prompt plus the answer so far: the prompt's blocks are reused."""
    req = prompt_request(text(40, 200))
    generate(cached, req)
    gen = cached.start(req, prefix_text=" river stone", max_tokens=8, stop=threading.Event())
    out = "".join(str(p) for p in gen.pieces)
    assert gen.cached_tokens >= (len(cached.tokenize_prompt(req)) - 1) // BLOCK_TOKENS * BLOCK_TOKENS > 0
    generate(fresh, prompt_request("zz"))
    ref = fresh.start(req, prefix_text=" river stone", max_tokens=8, stop=threading.Event())
    assert out == "".join(str(p) for p in ref.pieces) and ref.cached_tokens == 0


def test_the_cache_keeps_to_its_budget_and_drops_the_least_recent() -> None:
    cache = PromptCache(budget_bytes=100, block=2)
    cache.put([1, 2], b"x" * 40)
    cache.put([3, 4], b"x" * 40)
    assert cache.best([1, 2, 9], limit=2)[1] == 2  # touches [1, 2]
    cache.put([5, 6], b"x" * 40)  # over budget: [3, 4] goes
    assert cache.bytes == 80 and cache.best([3, 4, 9], limit=2) == (None, 0)
    cache.put([1, 2, 7, 8], b"x" * 50)  # covers [1, 2], which it replaces
    assert len(cache) == 2 and cache.bytes == 90
    cache.put([1, 2], b"x" * 10)  # already covered
    assert cache.bytes == 90
    cache.put([9, 9], b"x" * 101)  # larger than the whole budget
    assert cache.bytes == 90
    assert shared_blocks([1, 2, 3, 4], [1, 2, 3, 5], limit=4, block=2) == 2
    assert shared_blocks([1, 2, 3, 4], [1, 2, 3, 4, 5], limit=3, block=2) == 2


def test_answer_tokens_are_never_reused(default_gguf: Path) -> None:
    """A continuation's prompt holds the answer so far, whose tokens were decoded one at a time: on the real
    model their KV differs from a prefill's (logits apart by up to 0.4 here), so reusing it would change the
    seeded text that follows."""
    eng = OneSequenceEngine(str(default_gguf), n_threads=1, n_ctx=1024, ignore_eos=True, prompt_cache_mib=64)
    try:
        req = GenerationRequest(messages=(Message("user", "Write a long story about a lighthouse keeper. " + text(9, 80)),),
                                prompt=None, model=None, max_tokens=150, temperature=1.0, top_p=1.0, seed=3,
                                stop=(), cancel_on_disconnect=False)
        first = eng.start(req, prefix_text="", max_tokens=150, stop=threading.Event())
        pieces = [str(p) for p in first.pieces]
        so_far = "".join(pieces[:140])
        cont = eng.start(req, prefix_text=so_far, max_tokens=40, stop=threading.Event())
        text_cached = "".join(str(p) for p in cont.pieces)
        generate(eng, prompt_request("zz"))
        eng._cache.clear()
        ref = eng.start(req, prefix_text=so_far, max_tokens=40, stop=threading.Event())
        assert "".join(str(p) for p in ref.pieces) == text_cached and ref.cached_tokens == 0
        assert 0 < cont.cached_tokens <= len(eng.tokenize_prompt(req))
    finally:
        eng.close()


def test_a_prepared_next_turn_reuses_the_last_answer_too(cached: LlamaEngine, fresh: LlamaEngine) -> None:
    """After an answer (the worker's inference thread calls ``after``: generator.handoff), the engine prefills
    the whole blocks the chat's next turn starts with, the answer included, so that turn evaluates little more
    than its new message; its seeded text is what a fresh evaluation gives."""
    turns, answers = [text(70, 90), text(71, 90), text(72, 90)], list[str]()
    for t in range(len(turns)):
        req = replace(chat_request(turns[:t + 1], answers), max_tokens=100)
        assert req.messages is not None
        gen = cached.start(req, prefix_text="", max_tokens=req.max_tokens, stop=threading.Event())
        out = "".join(str(p) for p in gen.pieces)
        assert out == reference(fresh, req)
        if t > 0:
            # Every whole block the next turn shares with the last prompt and its answer came from the cache.
            tokens = cached.tokenize_prompt(req)
            before = cached.tokenize_prompt(replace(req, messages=(*req.messages[:-1], Message("user", ""))))
            common = next(i for i, (a, b) in enumerate(zip(tokens, before, strict=False)) if a != b)
            last_prompt = len(cached.tokenize_prompt(chat_request(turns[:t], answers[:t - 1])))
            assert gen.cached_tokens == common // BLOCK_TOKENS * BLOCK_TOKENS > last_prompt
        assert gen.after is not None
        gen.after(out)
        answers.append(out)


def test_longest_reuses_any_entry_token_by_token_in_its_scope_only() -> None:
    """The batched engine's search: any length (not whole blocks), at most the limit, never another scope's."""
    cache = PromptCache(1 << 20, block=4)
    cache.put([1, 2, 3, 4, 5, 6, 7], b"turn", "alice")
    cache.put([1, 2, 9], b"other", "alice")
    cache.put([1, 2, 3, 4, 5, 6, 7, 8], b"bob's", "bob")
    entry, n = cache.longest([1, 2, 3, 4, 5, 6, 0], 10, "alice")
    assert entry is not None and entry.state == b"turn" and n == 6  # six tokens: not a whole number of blocks
    assert cache.longest([1, 2, 3, 4, 5, 6, 0], 5, "alice")[1] == 5
    assert cache.longest([1, 2, 3], 10, "carol") == (None, 0)
    assert cache.best([1, 2, 3, 4, 5, 6, 0], 10, "alice")[1] == 4  # the exact engine's search: whole blocks only
