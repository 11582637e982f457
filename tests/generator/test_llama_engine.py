from __future__ import annotations

import threading
from pathlib import Path

import pytest
from helpers import LLAMA_EXTRA

pytest.importorskip("llama_cpp", reason=LLAMA_EXTRA)

from broker.request.generation import GenerationRequest, Message
from generator.engines.base import Engine, EngineError, Generation, PromptTooLong
from generator.engines.batch_engine import BatchedEngine
from generator.engines.demo_model import DEMO_MODEL_NAME
from generator.engines.llama import LlamaEngine
from generator.engines.one_sequence import OneSequenceEngine


def request(
    prompt: str | None = "Once upon a time",
    *,
    messages: tuple[Message, ...] | None = None,
    seed: int | None = 1,
    temperature: float = 0.8,
    top_p: float = 0.95,
) -> GenerationRequest:
    return GenerationRequest(
        messages=messages,
        prompt=None if messages is not None else prompt,
        model=None,
        max_tokens=16,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=(),
        cancel_on_disconnect=False,
    )


def run(
    eng: LlamaEngine, req: GenerationRequest, max_tokens: int, prefix_text: str = ""
) -> tuple[Generation, list[str]]:
    gen = eng.start(req, prefix_text=prefix_text, max_tokens=max_tokens, stop=threading.Event())
    return gen, [str(p) for p in gen.pieces]  # plain requests: text pieces only


def test_is_an_engine_named_after_the_model(engine: LlamaEngine, demo_gguf: Path) -> None:
    e: Engine = engine
    assert e.name == DEMO_MODEL_NAME
    named = OneSequenceEngine(str(demo_gguf), n_threads=1, n_ctx=256, name="custom")
    assert named.name == "custom"
    named.close()
    with pytest.raises(RuntimeError):
        named.start(request(), prefix_text="", max_tokens=1, stop=threading.Event())


@pytest.mark.parametrize("max_tokens", [1, 7, 500])
def test_ignore_eos_gives_exactly_max_tokens(engine: LlamaEngine, max_tokens: int) -> None:
    for seed in (1, 2):
        gen, pieces = run(engine, request(seed=seed), max_tokens)
        assert len(pieces) == max_tokens
        assert gen.finish_reason == "length"


@pytest.mark.slow  # up to 40 answers of 1,500 tokens
def test_eos_ends_with_stop_and_ignore_eos_never_samples_it(engine: LlamaEngine, engine_eos: LlamaEngine) -> None:
    # Random weights sample EOS about once per vocabulary size; find seeds where it happens early.
    stopped = []
    for seed in range(40):
        gen, pieces = run(engine_eos, request(seed=seed, temperature=1.5, top_p=1.0), 1500)
        if gen.finish_reason == "stop":
            assert len(pieces) < 1500
            stopped.append(seed)
        else:
            assert len(pieces) == 1500
        if len(stopped) == 3:
            break
    assert len(stopped) == 3
    for seed in stopped:
        gen, pieces = run(engine, request(seed=seed, temperature=1.5, top_p=1.0), 1500)
        assert (len(pieces), gen.finish_reason) == (1500, "length")


def test_stop_event_stops_before_the_next_decode(engine: LlamaEngine) -> None:
    stop = threading.Event()
    gen = engine.start(request(), prefix_text="", max_tokens=1000, stop=stop)
    pieces: list[str] = []
    for piece in gen.pieces:
        assert isinstance(piece, str)
        pieces.append(piece)
        if len(pieces) == 5:
            stop.set()
    assert len(pieces) <= 6 and all(c == "\ufffd" for c in "".join(pieces[5:]))  # at most a flushed tail
    # Tokens 1-4 were decoded to sample tokens 2-5; the 5th was never decoded.
    assert engine._llm.n_tokens == gen.prompt_tokens + 4


def test_stop_already_set_produces_nothing(engine: LlamaEngine) -> None:
    stop = threading.Event()
    stop.set()
    gen = engine.start(request(), prefix_text="", max_tokens=10, stop=stop)
    assert list(gen.pieces) == []


def test_same_seed_same_text_across_sequential_generations(engine: LlamaEngine) -> None:
    _, first = run(engine, request(seed=42), 200)
    run(engine, request("Something else entirely", seed=42), 50)  # leaves the KV cache dirty
    _, again = run(engine, request(seed=42), 200)
    _, different = run(engine, request(seed=43), 200)
    assert "".join(first) == "".join(again) != "".join(different)
    assert first == again


def test_greedy_ignores_the_seed(engine: LlamaEngine) -> None:
    _, a = run(engine, request(seed=1, temperature=0.0), 50)
    _, b = run(engine, request(seed=2, temperature=0.0), 50)
    assert a == b


def test_unseeded_requests_differ(engine: LlamaEngine) -> None:
    texts = {"".join(run(engine, request(seed=None, temperature=1.0), 30)[1]) for _ in range(3)}
    assert len(texts) > 1


def test_messages_go_through_the_chat_template(engine: LlamaEngine) -> None:
    msgs = (Message("system", "Be brief."), Message("user", "Hi there"))
    expected = "<s><|system|>\nBe brief.</s>\n<|user|>\nHi there</s>\n<|assistant|>\n"
    tokens = engine._llm.tokenize(expected.encode(), add_bos=False, special=True)
    assert tokens[0] == engine._llm.token_bos() and tokens.count(engine._llm.token_eos()) == 2
    assert engine.tokenize_prompt(request(messages=msgs)) == tokens
    gen, pieces = run(engine, request(messages=msgs), 20)
    assert gen.prompt_tokens == len(tokens) and len(pieces) == 20


def test_plain_prompt_gets_bos_once(engine: LlamaEngine) -> None:
    bos = engine._llm.token_bos()
    assert engine.tokenize_prompt(request("Hello"))[0] == bos
    assert engine.tokenize_prompt(request("<s>Hello")).count(bos) == 1
    assert engine.tokenize_prompt(request("")) == [bos]


def test_prefix_text_is_continued(engine: LlamaEngine) -> None:
    req = request("The model")
    first, pieces = run(engine, req, 30)
    partial = "".join(pieces[:12])
    cont, more = run(engine, req, 10, prefix_text=partial)
    expected = len(engine._llm.tokenize(("The model" + partial).encode(), add_bos=True, special=True))
    assert cont.prompt_tokens == expected > first.prompt_tokens
    assert len(more) == 10
    # The continuation is tokenized as one string with the prompt: no space or BOS is inserted between.
    assert engine.tokenize_prompt(req, " world") == engine.tokenize_prompt(request("The model world"))


@pytest.mark.parametrize("prompt", ["Hello", ""])
def test_text_matches_a_bare_generate_loop_detokenized_by_llama(engine_eos: LlamaEngine, prompt: str) -> None:
    llm = engine_eos._llm
    for seed in range(4):
        req = request(prompt, seed=seed)
        gen, pieces = run(engine_eos, req, 300)
        tokens = engine_eos.tokenize_prompt(req)
        llm.reset()
        llm.set_seed(seed)
        reference: list[int] = []
        for tok in llm.generate(tokens, temp=0.8, top_p=0.95, top_k=40, min_p=0.0, repeat_penalty=1.0):
            if tok == llm.token_eos() or len(reference) == 300:
                break
            reference.append(tok)
        # After a text prompt the first piece keeps its space (it is real text); after a bare BOS it is
        # SPM's dummy prefix, which llama's detokenize strips when the list starts with BOS.
        expected = llm.detokenize(tokens[-1:] + reference if prompt == "" else reference)
        assert "".join(pieces) == expected.decode("utf-8", errors="replace")
        assert gen.finish_reason == ("length" if len(reference) == 300 else "stop")
        assert len(pieces) >= len(reference)


def test_prompt_too_long(demo_gguf: Path) -> None:
    eng = OneSequenceEngine(str(demo_gguf), n_threads=1, n_ctx=128, ignore_eos=True)
    try:
        n_ctx = eng.n_ctx  # llama.cpp rounds the context up (to 256 here)
        assert n_ctx >= 128
        long_prompt = " the" * n_ctx
        with pytest.raises(PromptTooLong) as err:
            eng.start(request(long_prompt), prefix_text="", max_tokens=1, stop=threading.Event())
        assert isinstance(err.value, EngineError) and err.value.code == "context_length_exceeded" and str(n_ctx) in str(err.value)
        n = len(eng.tokenize_prompt(request(" the" * 50)))
        fits = n_ctx - 1 - n
        _, pieces = run(eng, request(" the" * 50), fits)
        assert len(pieces) == fits
        with pytest.raises(PromptTooLong):
            eng.start(request(" the" * 50), prefix_text="", max_tokens=fits + 1, stop=threading.Event())
        with pytest.raises(PromptTooLong):  # the continued answer counts too
            eng.start(request(" the" * 50), prefix_text=" the", max_tokens=fits, stop=threading.Event())
        # Past the PromptTooLong check (white box), generation still stops at the end of the context.
        tokens = eng.tokenize_prompt(request(" the" * 50))
        gen = Generation(prompt_tokens=len(tokens), pieces=iter(()), finish_reason="unset")
        gen.pieces = eng._run(gen, request(" the" * 50), tokens, 10**6, threading.Event())
        assert len(list(gen.pieces)) == n_ctx - len(tokens)
        assert gen.finish_reason == "length"
    finally:
        eng.close()


def test_an_abandoned_generation_does_not_deadlock_the_next(engine: LlamaEngine) -> None:
    old = engine.start(request(), prefix_text="", max_tokens=100, stop=threading.Event())
    assert len([next(old.pieces) for _ in range(3)]) == 3
    _, pieces = run(engine, request(seed=5), 20)
    assert len(pieces) == 20
    assert list(old.pieces) == []  # it was ended, not resumed on a context that moved on


def test_generations_from_two_threads_are_serialized(engine: LlamaEngine) -> None:
    results: dict[int, str] = {}
    _, solo = run(engine, request(seed=9), 300)

    def work(i: int) -> None:
        results[i] = "".join(run(engine, request(seed=9), 300)[1])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {0: "".join(solo), 1: "".join(solo)}


async def test_a_generation_abandoned_while_its_hand_off_is_full_frees_the_engine_for_the_next(
        engine: LlamaEngine) -> None:
    """A worker stops reading a generation mid-answer (it parks, or ends it) while the inference thread waits for
    room in the hand-off: the thread ends the generation, so llama.cpp's one context is free for the next one,
    whichever thread runs it (a suspended generation held the engine's lock until collected, and the next
    generation's thread waited for ever unless it happened to reuse the first one's identity)."""
    import asyncio

    from generator.handoff import StopSignal, TokenHandoff, produce

    loop = asyncio.get_running_loop()
    handoff = TokenHandoff(loop, 4)
    stop = StopSignal()
    first = produce(engine, request(), handoff, prefix_text="", max_tokens=1000, stop=stop)
    await asyncio.sleep(0.3)  # deliberate: the thread fills the 4 places and waits for room
    stop.set()
    handoff.abandon()
    await asyncio.wait_for(first, 10)
    # Another thread now lives (a DNS lookup, a reconnect): the next generation's thread has a new identity.
    hold = threading.Event()
    other = threading.Thread(target=hold.wait)
    other.start()
    try:
        nxt = TokenHandoff(loop, 64)
        second = produce(engine, request(), nxt, prefix_text="", max_tokens=5, stop=StopSignal())
        pieces: list[object] = []
        async with asyncio.timeout(10):
            while True:
                batch = await nxt.get()
                pieces += batch.pieces
                if batch.closed:
                    break
        await second
        assert len(pieces) == 5
    finally:
        hold.set()
        other.join()


def test_penalties_and_logit_bias_change_what_is_sampled(engine: LlamaEngine) -> None:
    import dataclasses

    from broker.request.sampling import Sampling

    greedy = request(temperature=0.0)
    _, plain = run(engine, greedy, 120)
    # logit_bias -100 on the token greedy decoding starts with (every token that reads as it): another one starts.
    first = tuple((t, -100.0) for t in range(engine._llm.n_vocab())
                  if engine._pieces(t).decode("utf-8", "ignore").strip() == plain[0].strip())
    _, banned = run(engine, dataclasses.replace(greedy, sampling=Sampling(logit_bias=first)), 120)
    assert banned[0] != plain[0]
    # A token past the vocabulary is never sampled: its bias changes nothing.
    _, outside = run(engine, dataclasses.replace(greedy, sampling=Sampling(logit_bias=((10**8, 50.0),))), 120)
    assert outside == plain
    # Random weights repeat themselves under greedy decoding; penalties on what was written make them repeat less.
    _, penalized = run(engine, dataclasses.replace(greedy, sampling=Sampling(presence_penalty=2.0,
                                                                             frequency_penalty=2.0)), 120)
    assert len(set(penalized)) > len(set(plain)), (len(set(penalized)), len(set(plain)))


@pytest.mark.parametrize("parallel", [1, 2])
def test_the_engine_never_decodes_on_the_thread_that_made_it(demo_gguf: Path, parallel: int,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """An OpenMP llama.cpp keeps a team of threads for every thread that has decoded, while it lives, and then
    decodes slower on every other thread (generator.engines.llama.on_a_thread_that_ends): the generator makes its
    engine on the main thread and generates on others, so neither the warm-ups nor a generation decode there."""
    import llama_cpp
    import llama_cpp.llama_cpp as bindings

    decoded_on: set[int] = set()
    real = bindings.llama_decode

    def recording(ctx: object, batch: object) -> int:
        decoded_on.add(threading.get_ident())
        return int(real(ctx, batch))

    # Llama.eval calls the bindings' function, the batcher the package's re-export of it.
    monkeypatch.setattr(bindings, "llama_decode", recording)
    monkeypatch.setattr(llama_cpp, "llama_decode", recording)
    eng: LlamaEngine = (BatchedEngine(str(demo_gguf), parallel=parallel, n_threads=1, n_ctx=512, ignore_eos=True)
                        if parallel > 1 else OneSequenceEngine(str(demo_gguf), n_threads=1, n_ctx=512, ignore_eos=True))
    try:
        made: list[list[str]] = []
        generating = threading.Thread(target=lambda: made.append(run(eng, request(), 4)[1]))
        generating.start()
        generating.join(timeout=60)
        assert made and len(made[0]) == 4
        assert decoded_on, "the recording saw no decode: it no longer sees the engine's calls"
        assert threading.get_ident() not in decoded_on
    finally:
        eng.close()
