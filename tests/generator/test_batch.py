"""Continuous batching (``--parallel N``, generator.engines.batch) on the real default model: free text, a
json_schema answer and a forced tool call decoded in one batch, each valid and each the answer decoded alone;
one cancelled mid-answer while the others run to their end; a prompt sharing a running one's prefix copies its
KV; and a worker SIGKILLed in the middle of a batch, after which each generation continues exactly once."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import redis
from helpers import LLAMA_EXTRA, create, eventually, read_sse
from servers import StackFactory

pytest.importorskip("llama_cpp", reason=LLAMA_EXTRA)

from broker.redis.server import RedisServer
from broker.request.generation import GenerationRequest, RequestLimits, validate_create_body
from generator.engines.base import Generation
from generator.engines.batch_engine import BatchedEngine
from generator.engines.llama import LlamaEngine
from generator.engines.one_sequence import OneSequenceEngine
from generator.engines.pieces import Piece, ToolCallStart

pytestmark = pytest.mark.slow  # the real default model

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}


def request(content: str, **body: Any) -> GenerationRequest:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 48, "temperature": 0, **body}
    return validate_create_body(body, RequestLimits(max_tokens=4096))[1]


# Four kinds in one batch: free text (two, one seeded and sampled), a JSON answer, a forced tool call.
MIXED = [
    request("Write one sentence about rivers."),
    request("Name three colours.", temperature=0.8, seed=7),
    request("Describe Paris as JSON.", response_format={"type": "json_schema", "json_schema": {
        "name": "city", "schema": CITY, "strict": True}}),
    request("What is the weather in Oslo?", tools=[WEATHER], tool_choice="required"),
    request("Tell me a short story about a lamp.", max_tokens=64),
    request("Why is the sky blue?", temperature=0.9, top_p=0.9, seed=3),
]


def run(eng: LlamaEngine, req: GenerationRequest, stop: threading.Event | None = None,
        seen: threading.Event | None = None) -> tuple[list[Piece], Generation]:
    gen = eng.start(req, prefix_text="", max_tokens=req.max_tokens, stop=stop or threading.Event())
    pieces: list[Piece] = []
    for p in gen.pieces:
        pieces.append(p)
        if seen is not None:
            seen.set()
    return pieces, gen


def text_of(pieces: list[Piece]) -> str:
    return "".join(p for p in pieces if isinstance(p, str))


@pytest.fixture(scope="module")
def batched(default_gguf: Path) -> Iterator[LlamaEngine]:
    eng = BatchedEngine(str(default_gguf), parallel=6, n_threads=2, n_ctx=1024)
    yield eng
    eng.close()


def together(eng: LlamaEngine, reqs: list[GenerationRequest]) -> tuple[list[tuple[list[Piece], Generation]], int]:
    """Every request at once; and the most sequences one step decoded (the batch really held them together)."""
    widest = [0]

    def step(sequences: int, prefilled: int, seconds: float) -> None:
        widest[0] = max(widest[0], sequences)

    eng.observe_steps(step)
    out: list[Any] = [None] * len(reqs)
    start = threading.Barrier(len(reqs))

    def one(i: int) -> None:
        start.wait()
        out[i] = run(eng, reqs[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out, widest[0]


def test_mixed_answers_in_one_batch_are_each_valid(batched: LlamaEngine) -> None:
    got, widest = together(batched, MIXED)
    assert widest == len(MIXED)  # all six were decoded in one batch at some step
    for (pieces, gen), req in zip(got, MIXED, strict=True):
        n = sum(1 for p in pieces if isinstance(p, str))
        assert 0 < n <= req.max_tokens and gen.finish_reason in ("stop", "length", "tool_calls")
        assert gen.prompt_tokens > 0
    jsonschema.validate(json.loads(text_of(got[2][0])), CITY)
    call = got[3][0]
    starts = [i for i, p in enumerate(call) if isinstance(p, ToolCallStart)]
    assert len(starts) == 1 and got[3][1].finish_reason == "tool_calls"
    start = call[starts[0]]
    assert isinstance(start, ToolCallStart) and start.name == "get_weather"
    arguments = json.loads(text_of(call[starts[0] + 1:]))
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])  # type: ignore[index]


def test_answers_decoded_in_one_batch_are_those_decoded_alone(default_gguf: Path) -> None:
    # The same kernels both ways (flash attention, a stream of cells per sequence): what the batch's company
    # changes is nothing. No prompt cache on either side, so no prefix comes from another batch's rounding.
    alone = OneSequenceEngine(str(default_gguf), n_threads=2, n_ctx=1024, prompt_cache_mib=0)
    try:
        expected = [text_of(run(alone, req)[0]) for req in MIXED]
    finally:
        alone.close()
    eng = BatchedEngine(str(default_gguf), parallel=6, n_threads=2, n_ctx=1024, prompt_cache_mib=0)
    try:
        got, widest = together(eng, MIXED)
    finally:
        eng.close()
    assert widest == len(MIXED)
    assert [text_of(pieces) for pieces, _ in got] == expected


def test_one_cancelled_mid_answer_leaves_at_once_and_the_others_run_to_their_end(default_gguf: Path) -> None:
    eng = BatchedEngine(str(default_gguf), parallel=4, n_threads=2, n_ctx=1024, ignore_eos=True)
    try:
        reqs = [request(f"Count from {i} upwards.", max_tokens=60) for i in range(4)]
        stop, seen = threading.Event(), threading.Event()
        results: list[Any] = [None] * 4

        def one(i: int) -> None:
            results[i] = run(eng, reqs[i], stop if i == 0 else None, seen if i == 0 else None)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        assert seen.wait(120)  # the victim is answering, its batch-mates beside it
        stop.set()
        threads[0].join(30)
        assert not threads[0].is_alive()
        for t in threads[1:]:
            t.join(300)
        victim = sum(1 for p in results[0][0] if isinstance(p, str))
        assert 0 < victim < 60
        for pieces, gen in results[1:]:
            assert sum(1 for p in pieces if isinstance(p, str)) == 60 and gen.finish_reason == "length"
    finally:
        eng.close()


def test_a_prompt_sharing_a_running_ones_prefix_copies_its_kv(batched: LlamaEngine) -> None:
    long = "Here is a list of words to remember: " + " ".join(f"word{i}" for i in range(150))
    first = request(long + " Which is the first?", max_tokens=200)
    stop, seen = threading.Event(), threading.Event()
    t = threading.Thread(target=run, args=(batched, first, stop, seen))
    t.start()
    try:
        assert seen.wait(120)  # its prompt is prefilled: it answers now, and holds the prefix
        second = request(long + " Which is the last?")
        _, gen = run(batched, second)
        # Token by token, not whole blocks: every token the two prompts share (their cells are shared).
        a, b = batched.tokenize_prompt(first), batched.tokenize_prompt(second)
        common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        assert gen.cached_tokens == common >= 150
        other = request("An unrelated question?")  # shares only the chat template's opening
        c = batched.tokenize_prompt(other)
        assert run(batched, other)[1].cached_tokens == next(i for i, (x, y) in enumerate(zip(a, c, strict=False)) if x != y) < 30
    finally:
        stop.set()
        t.join(60)


def chat(*contents: str, max_tokens: int = 100) -> GenerationRequest:
    """A chat of alternating user and assistant messages (the last one the user's)."""
    roles = ("user", "assistant")
    return request("", messages=[{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)],
                   max_tokens=max_tokens)


def test_a_chats_next_turn_is_prepared_while_the_batch_is_idle(default_gguf: Path) -> None:
    """After a chat's answer the batcher prefills the whole blocks its next turn starts with (the history, this
    answer, the next user message's opening) into the cache while no generation runs: the next turn reuses every
    whole block it shares with them, the answer's included, not only the last prompt's."""
    eng = BatchedEngine(str(default_gguf), parallel=2, n_threads=2, n_ctx=1024)
    try:
        # A 211-token prompt and an answer of up to 70: the next turn shares the block past the prompt's last.
        first = chat("Here are some words: " + " ".join(f"w{i}" for i in range(60)) + ". Tell a long story.",
                     max_tokens=70)
        pieces, gen = run(eng, first)
        answer = text_of(pieces)
        assert gen.after is not None
        gen.after(answer)
        opening = eng._next_turn_tokens(first, answer)
        assert opening is not None
        whole = opening[:len(opening) // 64 * 64]
        assert eng._cache is not None
        eventually(lambda: eng._cache.holds(whole), 60, "the next turn prepared")
        assert first.messages is not None
        second = chat(*(m.content for m in first.messages), answer, "And then?", max_tokens=4)
        _, gen2 = run(eng, second)
        tokens = eng.tokenize_prompt(second)
        common = next(i for i, (a, b) in enumerate(zip(tokens, opening, strict=False)) if a != b)
        last_prompt = len(eng.tokenize_prompt(first))
        # The prepared blocks at least (the first turn's own cells, kept, may give a few tokens more).
        assert gen2.cached_tokens >= common // 64 * 64 > last_prompt
    finally:
        eng.close()


def test_a_chats_next_turn_reuses_its_last_turn_prompt_and_answer(default_gguf: Path) -> None:
    """A finished sequence's prompt and answer are kept in the cache (its turn): the next turn reuses them token
    by token and evaluates only what is new (its last message and the template around it), as a llama-server
    slot does; a chat's prompt shorter than a block reuses another chat's system prompt too."""
    eng = BatchedEngine(str(default_gguf), parallel=2, n_threads=2, n_ctx=1024)
    try:
        system = "You are a helpful assistant. Answer in a few clear sentences, and be kind."
        first = request("", messages=[{"role": "system", "content": system},
                                      {"role": "user", "content": "How does a rainbow form?"}], max_tokens=60)
        pieces, gen = run(eng, first)
        assert gen.cached_tokens == 0
        answer = text_of(pieces)
        assert first.messages is not None
        second = request("", messages=[*({"role": m.role, "content": m.content} for m in first.messages),
                                       {"role": "assistant", "content": answer},
                                       {"role": "user", "content": "And why is it curved?"}], max_tokens=8)
        _, gen2 = run(eng, second)
        new = len(eng.tokenize_prompt(second)) - len(eng.tokenize_prompt(first))
        assert gen2.prompt_tokens - gen2.cached_tokens <= 24  # the new message and its template's tokens
        assert gen2.cached_tokens > len(eng.tokenize_prompt(first)) and new > 24
        # Another chat, same system prompt (under one 64-token block): reuses it from the kept turns.
        other = request("", messages=[{"role": "system", "content": system},
                                      {"role": "user", "content": "Why do cats purr?"}], max_tokens=4)
        _, gen3 = run(eng, other)
        assert gen3.cached_tokens >= len(eng.tokenize_prompt(request("", messages=[
            {"role": "system", "content": system}, {"role": "user", "content": ""}]))) - 8
    finally:
        eng.close()


def test_finished_turns_fill_the_cache_within_its_budget_and_every_chat_runs_to_its_end(default_gguf: Path) -> None:
    """A small context (2 sequences x 256 tokens) and a small cache: every chat runs to its end, each
    finished turn is kept while the budget allows (the least recent dropped), and a chat repeated reuses its
    last turn token by token."""
    eng = BatchedEngine(str(default_gguf), parallel=2, n_threads=2, n_ctx=256, prompt_cache_mib=8)
    cache = eng._cache
    assert cache is not None
    try:
        for i in range(8):
            words = " ".join(f"t{i}w{j}" for j in range(30))
            pieces, gen = run(eng, request(f"Repeat these: {words}", max_tokens=60))
            assert gen.finish_reason is not None and text_of(pieces)
            assert 1 <= len(cache) and cache.bytes <= cache.budget_bytes
        again = request(f"Repeat these: {words}", max_tokens=4)
        _, gen = run(eng, again)
        assert gen.cached_tokens == len(eng.tokenize_prompt(again)) - 1
    finally:
        eng.close()


def test_a_generation_takes_the_sequence_id_a_preparation_holds(default_gguf: Path) -> None:
    """Two next turns being prepared hold both sequences of a --parallel 2 batch: two new generations still run
    (the preparations give their ids up), and every id is free again once all is done."""
    eng = BatchedEngine(str(default_gguf), parallel=2, n_threads=2, n_ctx=1024)
    batcher = eng._batcher
    assert batcher is not None
    try:
        for n in (1, 2):  # long openings: each preparation takes seconds to prefill
            words = " ".join(f"item{n}x{i}" for i in range(150))  # ~750 tokens (of a 1,024-token sequence)
            opening = eng._next_turn_tokens(chat(f"Remember these: {words}"), "Done.")
            assert opening is not None
            batcher.prepare(opening, "")
        eventually(lambda: len(batcher._preparing) == 2, 30, "both preparations holding a sequence")
        results: list[tuple[list[Piece], Generation]] = []
        threads = [threading.Thread(target=lambda q=q: results.append(run(eng, request(q, max_tokens=8))))
                   for q in ("Name a colour.", "Name a fruit.")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(results) == 2 and all(text_of(p) for p, _ in results)
        eventually(lambda: not batcher._preparing and not batcher._running and sorted(batcher._free_ids) == [0, 1],
                   60, "every sequence id free again")
    finally:
        eng.close()


def test_a_worker_sigkilled_mid_batch_continues_each_generation_exactly_once(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
        default_gguf: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    victim = s.generator("--parallel", "4", "--lease-s", "1", model=default_gguf)
    n, max_tokens = 4, 160
    with s.client() as c:
        sids = [create(c, messages=[{"role": "user", "content": f"Tell story number {i}."}],
                       max_tokens=max_tokens, seed=i).json()["id"] for i in range(n)]

        def all_answering() -> bool:
            return all(int(redis_client.hget(f"rsb:{{p0}}:s:{sid}:meta", "seq") or 0) >= 5 for sid in sids)

        eventually(all_answering, timeout_s=120)
        victim.signal(signal.SIGKILL)
        victim.wait(5)
        s.generator("--parallel", "4", "--lease-s", "1", model=default_gguf)
        for sid in sids:
            read = read_sse(c, f"/v1/streams/{sid}/events")
            types = [e.event for e in read.events]
            assert types[0] == "queued" and types.count("started") == 1 and types[-1] == "done", types[:5]
            ids = read.ids
            assert len(ids) == len(set(ids))  # no event twice
            assert redis_client.hget(f"rsb:{{p0}}:s:{sid}:meta", "attempts") == b"2"
            usage = read.events[-1].data["usage"]
            assert usage["completion_tokens"] == max_tokens
