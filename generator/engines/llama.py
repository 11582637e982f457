"""The llama.cpp engine: one ``llama_cpp.Llama`` (the model, and one llama.cpp context) per process, decoded token
by token with llama.cpp's samplers (generator.engines.sampler) and our own incremental detokenizer, so the cost
per token stays flat.

``LlamaEngine`` is what both ways of decoding share: the model and its vocabulary's tables, tokenizing (chat
template, control tokens), each generation's sampler and decoder (generator.engines.decoding), the prompt cache
and the chat's next turn to prepare after an answer. A subclass decodes: ``OneSequenceEngine``
(generator.engines.one_sequence, ``--parallel 1``: one generation at a time in the Llama's own context) or
``BatchedEngine`` (generator.engines.batch_engine, ``--parallel N``: up to N at once in one batch).

Typed output. A ``response_format`` or a forced ``tool_choice`` constrains the answer with a grammar
(generator.engines.grammar); tools the model may call are rendered into the prompt (generator.engines.chat)
and its calls are read out of its text (generator.engines.tool_syntax). A continued generation replays the
answer so far into the prompt as the model wrote it (calls included) and into the grammar, so it resumes
mid-value: the final JSON is valid and nothing is written twice."""

from __future__ import annotations

import os
import secrets
import threading
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import llama_cpp
import numpy as np
import numpy.typing as npt

from broker.events import FinishReason
from broker.request.generation import GenerationRequest, Message
from generator.engines.base import Engine, EngineError, Generation, PromptTooLong
from generator.engines.chat import ChatTemplate
from generator.engines.control_tokens import SPECIAL, ControlTokens
from generator.engines.decoding import SequenceDecoder
from generator.engines.detokenizer import IncrementalDetokenizer, LlamaPieces
from generator.engines.grammar import answer_grammar
from generator.engines.pieces import PartialAnswer, Piece, TokenLogprob
from generator.engines.prompt_cache import BLOCK_TOKENS, PromptCache
from generator.engines.sampler import GrammarError, Sampler, utf8_masks
from generator.engines.tool_syntax import ToolCallSyntax, replay_text
from generator.settings import EngineSettings

# llama.cpp reads this seed as "pick a random one", so a request's seed must never be passed as it.
_RANDOM_SEED = llama_cpp.LLAMA_DEFAULT_SEED


#: Prompts longer than this report their prefill progress, every PROGRESS_CHUNK_TOKENS tokens (a whole number
#: of prefill blocks), however they are decoded.
PROGRESS_MIN_TOKENS = 512
PROGRESS_CHUNK_TOKENS = 4 * BLOCK_TOKENS
DEFAULT_CACHE_MIB: int = EngineSettings().prompt_cache_mib
_MIB = 1 << 20


def on_a_thread_that_ends(call: Callable[[], object]) -> None:
    """Run ``call`` (a llama.cpp decode) on a thread of its own, and wait for it.

    Why: llama.cpp built with OpenMP (the default build) decodes on libgomp's threads, and libgomp keeps a team
    of them for every thread that has decoded, for as long as that thread lives. Once it manages more threads
    than there are CPUs, its workers stop spinning between the graph's steps and sleep instead, and every decode
    on any thread gets slower: on 2 cores, a decode from the main thread (the warm-up) made every later one on a
    generation's thread 1.7x to 4x slower (docs/benchmarks.md). So this engine decodes only on threads that end
    (a generation's, the warm-up's) or on the one that decodes everything (the batcher's), never on the caller's
    (the event loop's)."""
    # A one-thread pool: its thread ends at the shutdown that leaving the block waits for; result() re-raises.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rsb-llama-warm-up") as pool:
        pool.submit(call).result()


def physical_cores() -> int:
    """Physical cores: llama.cpp gains nothing from hyperthreads and loses from oversubscription."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except ImportError:
        n = None
    return n or os.cpu_count() or 1


class LlamaEngine(Engine):
    """``Engine`` over llama-cpp-python, the part both ways of decoding share; a subclass decodes
    (``OneSequenceEngine``, ``BatchedEngine``).

    Sampling follows the request's temperature, top_p and top_k (temperature 0 is greedy), with ``top_k`` (the
    engine's, unless the request sets one) as a cost bound and no min_p/typical/repeat penalties. ``seed=None``
    draws a random seed. A cancelled generation (``stop`` set) ends without touching ``finish_reason``: the caller
    knows why it stopped.
    ``ignore_eos`` masks every end-of-generation token, so answers run to ``max_tokens``."""

    def __init__(
        self,
        model_path: str,
        *,
        own_ctx: int,
        sequences: int,
        n_threads: int | None,
        ignore_eos: bool,
        name: str | None,
        top_k: int,
        prompt_cache_mib: int,
    ) -> None:
        """``own_ctx``: the size of the Llama's own context; ``sequences``: generations decoded at once."""
        threads = n_threads or physical_cores()
        # Flash attention, as llama-server's default (auto: on, on a CPU) and the batch's (generator.engines.batch):
        # one kernel for both engines, so an answer decoded inside a batch is the one decoded alone (32 of 32 in
        # `bench determinism`, 4 of 32 with the plain kernel here), and the batch is 12% quicker with it.
        self._llm = llama_cpp.Llama(
            model_path=model_path, n_ctx=own_ctx, n_threads=threads, n_threads_batch=threads, verbose=False,
            flash_attn=True,
        )
        llm = self._llm
        self.n_ctx: int = llm.n_ctx()
        #: Generations decoded at once (``--parallel``): the worker runs this many, one slot per sequence.
        self.sequences = sequences
        self.ignore_eos = ignore_eos
        self.top_k = top_k
        metadata: dict[str, str] = llm.metadata
        self.name: str = name or metadata.get("general.name") or Path(model_path).stem

        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        n_vocab = llm.n_vocab()
        self._vocab = vocab
        self._bos: int = llm.token_bos()
        self._add_bos = self._bos >= 0 and bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        # Once at load, so the per-token end check is a set lookup, not a ctypes call.
        self._eog = frozenset(t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t))
        self._eog_ids: npt.NDArray[np.intp] = np.fromiter(sorted(self._eog), dtype=np.intp)
        self._space_prefix = llama_cpp.llama_vocab_type(vocab) == llama_cpp.LLAMA_VOCAB_TYPE_SPM and (
            metadata.get("tokenizer.ggml.add_space_prefix", "true") != "false"
        )
        self._pieces = LlamaPieces(vocab, n_vocab)
        self._controls = ControlTokens({self._token_text(t): (t, attr) for t in range(n_vocab)
                                        if (attr := llama_cpp.llama_vocab_get_attr(vocab, t)) & SPECIAL})

        self.chat = ChatTemplate(metadata.get("tokenizer.chat_template"), bos_token=self._token_text(self._bos),
                                 eos_token=self._token_text(llm.token_eos()))

        # The prompt cache (generator.engines.prompt_cache): the states of earlier prompts.
        self._cache = PromptCache(max(0, prompt_cache_mib) * _MIB)
        self.caches_prompts = prompt_cache_mib > 0
        self._byte_tokens: dict[int, int] | None = None
        self._invalid_utf8: list[int] | None = None
        self._utf8: Sequence[npt.NDArray[np.bool_]] | None = None  # built on the first constrained answer
        self._closed = False

        # The first decode allocates compute buffers; pay that here rather than in the first request (on a
        # thread that ends: on_a_thread_that_ends says why).
        warm_up = self._bos if self._bos >= 0 else 0
        on_a_thread_that_ends(lambda: llm.eval([warm_up]))
        self._reset()

    def _reset(self) -> None:
        # Through a typed alias: Llama.reset is unannotated.
        reset: Callable[[], None] = self._llm.reset
        reset()

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return bytes(llama_cpp.llama_vocab_get_text(self._vocab, token)).decode("utf-8", errors="replace")

    def tokenize_prompt(self, request: GenerationRequest, prefix_text: str = "") -> list[int]:
        """The tokens a generation for ``request`` starts from: the prompt (chat template applied to
        ``messages``, with the tools the model may call) with ``prefix_text`` appended. Both are tokenized as
        one string, so the answer text being continued is split into tokens as if it had always been part of
        the prompt."""
        shield = self._controls.shield()  # the client's text is text (generator.engines.control_tokens)
        if request.messages is not None:
            prompt = self.chat.render_chat(request.messages, request.tools if request.offers_tools else (),
                                           text=shield.deep)
        else:
            prompt = request.prompt or ""
        text = prompt + shield(prefix_text)
        tokens: list[int]
        if shield.used:
            tokens = shield.tokenize(text, lambda raw: self._llm.tokenize(raw.encode("utf-8"), add_bos=False,
                                                                          special=False))
        else:
            # special=True like llama-cpp-python's completions: templates spell BOS/EOS and role markers as text.
            tokens = self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        if self._add_bos and (not tokens or tokens[0] != self._bos):
            tokens.insert(0, self._bos)
        if not tokens:
            raise EngineError("the prompt is empty and the model adds no BOS token")
        return tokens

    def count_tokens(self, request: GenerationRequest) -> int:
        """generator.engines.base.TokenCounter: the tokenizer and the template are read-only, so this runs on any
        thread, beside the inference thread."""
        return len(self.tokenize_prompt(request))

    def start(
        self,
        request: GenerationRequest,
        *,
        prefix_text: str,
        max_tokens: int,
        stop: threading.Event,
        partial: PartialAnswer | None = None,
        cache_scope: str = "",
        tier: str = "",
    ) -> Generation:
        if self._closed:
            raise RuntimeError("engine is closed")
        # The answer so far as the model wrote it: its text, then its calls in the call syntax (all closed but
        # the one the stored answer ended in).
        written = prefix_text
        if partial is not None and partial.calls:
            written = replay_text(prefix_text, ((c.name, c.arguments, c.index != partial.ends_in)
                                                for c in partial.calls))
        grammar = answer_grammar(request)
        tokens = self.tokenize_prompt(request, written)
        if len(tokens) > self.n_ctx - 1 - max_tokens:
            raise PromptTooLong(len(tokens), max_tokens, self.n_ctx)
        generation = Generation(prompt_tokens=len(tokens), pieces=iter(()))
        generation.pieces = self._run(generation, request, tokens, max_tokens, stop, grammar, written, cache_scope)
        if self.caches_prompts and request.messages is not None and not request.offers_tools and grammar is None:
            def after(answer: str) -> None:
                tokens = self._next_turn_tokens(request, answer)
                if tokens is None:
                    return
                self._prepare_next_turn(tokens, cache_scope)

            generation.after = after
        return generation

    @abstractmethod
    def _run(self, generation: Generation, request: GenerationRequest, tokens: list[int], max_tokens: int,
             stop: threading.Event, grammar: str | None = None, written: str = "", scope: str = "",
             ) -> Iterator[Piece]:
        """The pieces of a generation from ``tokens`` (its sampler and decoder: ``_sequence``), lazily: the
        prefill and the decode run as they are read, on the reader's thread or the batcher's."""

    @abstractmethod
    def _prepare_next_turn(self, tokens: list[int], scope: str) -> None:
        """After a chat's answer: prefill the whole blocks of the chat's next turn's opening (``tokens``:
        ``_next_turn_tokens``) into the prompt cache while no generation wants the decoder, so that turn
        evaluates only its new message, not also the tail of this prompt and this answer."""

    def _next_turn_tokens(self, request: GenerationRequest, answer: str) -> list[int] | None:
        """What a chat's next turn will start with: its messages, this answer, the next user message's opening
        (None: the template refuses an empty message)."""
        assert request.messages is not None
        messages = (*request.messages, Message("assistant", answer), Message("user", ""))
        try:
            return self.tokenize_prompt(replace(request, messages=messages))
        except EngineError:
            return None

    def _sequence(self, generation: Generation, request: GenerationRequest, tokens: list[int], max_tokens: int,
                  grammar: str | None, written: str, ctx: llama_cpp.llama_context_p,
                  ) -> tuple[Sampler, SequenceDecoder] | None:
        """The sampler (on ``ctx``) and decoder of a generation from ``tokens``; None when the context leaves
        no room for a token (finish reason "length")."""
        # Never decode past the context: llama.cpp fails there instead of stopping.
        limit = min(max_tokens, self.n_ctx - len(tokens))
        if limit <= 0:
            generation.finish_reason = FinishReason.LENGTH
            return None
        seed = request.seed
        if seed is None:
            seed = secrets.randbelow(_RANDOM_SEED)
        elif seed == _RANDOM_SEED:
            seed -= 1
        # A grammar ends with end-of-generation, so ignore_eos does not apply to a constrained answer.
        masked = self._never_utf8() if grammar is not None else self._eog if self.ignore_eos else ()
        top_k = self.top_k if request.sampling.top_k is None else request.sampling.top_k
        sampler = Sampler(self._llm, temperature=request.temperature, top_p=request.top_p, top_k=top_k,
                          seed=seed, masked_ids=masked, grammar=grammar, pieces=self._pieces,
                          utf8=self._utf8_masks() if grammar is not None else None, sampling=request.sampling,
                          ctx=ctx)
        try:
            if written and sampler.constrained:
                sampler.accept_text(self._text_tokens(written))
        except BaseException:
            sampler.close()
            raise
        syntax: ToolCallSyntax | None = None
        if request.offers_tools:
            syntax = ToolCallSyntax()
            syntax.prime(written)
        detok = IncrementalDetokenizer(
            self._pieces,
            strip_leading_space=self._space_prefix and bool(llama_cpp.llama_vocab_is_control(self._vocab, tokens[-1])),
        )
        top = request.sampling.top_logprobs
        logprob = (lambda token: self._logprob(sampler, token, top)) if request.sampling.logprobs else None
        return sampler, SequenceDecoder(generation, detok, limit=limit, eog=self._eog, syntax=syntax, logprob=logprob)

    def _logprob(self, sampler: Sampler, token: int, top: int) -> TokenLogprob:
        lp, best = sampler.logprobs(token, top)

        def shown(t: int) -> tuple[str, tuple[int, ...]]:
            b = self._pieces(t)
            return b.decode("utf-8", "replace"), tuple(b)

        text, raw = shown(token)
        return TokenLogprob(text, lp, raw, tuple((shown(t)[0], p, shown(t)[1]) for t, p in best))

    def _utf8_masks(self) -> Sequence[npt.NDArray[np.bool_]]:
        if self._utf8 is None:
            self._utf8 = utf8_masks(self._pieces, self._llm.n_vocab())
        return self._utf8

    def _never_utf8(self) -> list[int]:
        """Tokens with a byte that valid UTF-8 never holds (C0, C1, F5-FF): masked in constrained answers."""
        if self._invalid_utf8 is None:
            bad = frozenset((0xC0, 0xC1, *range(0xF5, 0x100)))
            self._invalid_utf8 = [t for t in range(self._llm.n_vocab()) if not bad.isdisjoint(self._pieces(t))]
        return self._invalid_utf8

    def _text_tokens(self, text: str) -> list[int]:
        """``text`` as tokens of one byte each (every byte has one: llama's 256 byte tokens, or a byte-level
        BPE's), to advance a grammar over text exactly, whatever the tokenizer would merge it into."""
        table = self._byte_tokens
        if table is None:
            table = {}
            for t in range(self._llm.n_vocab()):
                piece = self._pieces(t)
                if len(piece) == 1 and piece[0] not in table and not llama_cpp.llama_vocab_is_control(self._vocab, t):
                    table[piece[0]] = t
            self._byte_tokens = table
        try:
            return [table[b] for b in text.encode("utf-8")]
        except KeyError:
            raise GrammarError("the model's vocabulary lacks a token for a byte of the stored answer") from None

    @abstractmethod
    def close(self) -> None: ...
