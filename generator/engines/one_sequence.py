"""One generation at a time (``--parallel 1``), in the Llama's own context: a generation holds the context from
its first ``next()`` until it ends or is closed, and prefills its prompt from the longest prefix of whole blocks
the context still holds (``live``: the last prompt's) or the prompt cache holds (generator.engines.prompt_cache),
so a seeded answer is the same text whatever the cache held. What it shares with the batched engine (the model,
tokenizing, each generation's sampler and decoder) is generator.engines.llama's ``LlamaEngine``."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import llama_cpp

from broker.request.generation import GenerationRequest
from generator.engines.base import Generation
from generator.engines.kv_state import keep_prompt_blocks, load_sequence_state
from generator.engines.llama import (
    DEFAULT_CACHE_MIB,
    PROGRESS_CHUNK_TOKENS,
    PROGRESS_MIN_TOKENS,
    LlamaEngine,
)
from generator.engines.pieces import Piece
from generator.engines.prompt_cache import BLOCK_TOKENS, blocks, reusable, shared_blocks, whole_blocks
from generator.engines.sampler import Sampler


class OneSequenceEngine(LlamaEngine):
    """Generations run one at a time: the context is held by a lock from a generation's first ``next()`` until it
    ends or is closed; a generation the same thread left suspended is ended when the next one starts."""

    def __init__(
        self,
        model_path: str,
        *,
        n_threads: int | None = None,
        n_ctx: int = 4096,
        ignore_eos: bool = False,
        name: str | None = None,
        top_k: int = 40,
        prompt_cache_mib: int = DEFAULT_CACHE_MIB,
    ) -> None:
        self._lock = threading.Lock()
        self._waiting = 0  # threads waiting for the context
        self._waiting_lock = threading.Lock()
        # The whole prefill blocks the context's KV holds (generator.engines.prompt_cache: live), and whose
        # prompt they are (its scope).
        self._live: list[int] = []
        self._live_scope = ""
        self._active: Iterator[Piece] | None = None
        self._active_thread = 0
        #: Tokens of the last constrained answer that its grammar rejected (and were sampled again): for the
        #: benchmark (bench/scenarios/constrained.py).
        self.last_resampled = 0
        super().__init__(model_path, own_ctx=n_ctx, sequences=1, n_threads=n_threads, ignore_eos=ignore_eos,
                         name=name, top_k=top_k, prompt_cache_mib=prompt_cache_mib)

    def _prepare_next_turn(self, tokens: list[int], scope: str) -> None:
        """After a chat's answer, while nothing else wants the context: prefill the whole blocks of the chat's
        next turn's opening (``_next_turn_tokens``), so that turn evaluates only its new message, not also the
        tail of this prompt and this answer. Exact like any prefill block (generator.engines.prompt_cache);
        stopped between blocks as soon as a generation waits for the context, and skipped if one holds it."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._closed or self._waiting:
                return
            reused = shared_blocks(self._live, tokens, len(tokens))
            if reused < len(self._live) or self._live_scope != scope:
                return  # the context holds another prompt now
            self._llm.n_tokens = reused
            for start, end in blocks(reused, whole_blocks(tokens)):
                if self._waiting:
                    break
                self._llm.eval(tokens[start:end])
                self._live = tokens[:end]
        finally:
            self._lock.release()

    def _take_context(self) -> None:
        prev = self._active
        if prev is not None and self._active_thread == threading.get_ident():
            # A generation this thread left suspended can never resume while we wait for it: end it, or
            # the lock it holds deadlocks us.
            close = getattr(prev, "close", None)
            if close is not None:
                close()
        with self._waiting_lock:
            self._waiting += 1  # a next turn's preparation gives way (between blocks)
        try:
            self._lock.acquire()
        finally:
            with self._waiting_lock:
                self._waiting -= 1

    def _run(
        self,
        generation: Generation,
        request: GenerationRequest,
        tokens: list[int],
        max_tokens: int,
        stop: threading.Event,
        grammar: str | None = None,
        written: str = "",
        scope: str = "",
    ) -> Iterator[Piece]:
        if stop.is_set():
            return
        self._take_context()
        sampler: Sampler | None = None
        try:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._active = generation.pieces
            self._active_thread = threading.get_ident()
            if not self._prefill(generation, tokens, stop, scope):
                return
            made = self._sequence(generation, request, tokens, max_tokens, grammar, written, self._llm.ctx)
            if made is None:
                return
            sampler, decoder = made
            while True:
                yield from decoder.take(sampler.sample())
                if decoder.ended:
                    return
                # Checked before the decode of this token (the next step).
                if stop.is_set():
                    break
                self._llm.eval([decoder.last])
            yield from decoder.end()
        finally:
            if sampler is not None:
                self.last_resampled = sampler.resampled
                sampler.close()
            self._active = None
            self._lock.release()

    def _prefill(self, generation: Generation, tokens: list[int], stop: threading.Event, scope: str) -> bool:
        """Evaluate ``tokens`` from the longest prefix of whole blocks the prompt cache holds for ``scope``, block by
        block (generator.engines.prompt_cache: what keeps a seeded answer independent of the cache). A long prompt
        reports progress between blocks, and a cancel stops it there (False) instead of after the whole
        prefill."""
        llm = self._llm
        limit = reusable(tokens) if self.caches_prompts else 0  # off: every prompt evaluated in full
        reused = shared_blocks(self._live, tokens, limit) if self._live_scope == scope else 0
        entry, from_entry = self._cache.best(tokens, limit, scope)
        if entry is not None and from_entry > reused:
            self._stash_live()
            self._live = []
            reused = from_entry if self._load_state(entry.state) else 0
        elif reused < len(self._live):
            self._stash_live()
        self._live = tokens[:reused]
        self._live_scope = scope
        llm.n_tokens = reused  # Llama.eval drops the KV past it before it decodes
        generation.cached_tokens = reused
        on_progress = generation.on_progress
        report = on_progress is not None and len(tokens) > PROGRESS_MIN_TOKENS
        for start, end in blocks(reused, len(tokens)):
            if stop.is_set():
                return False
            if report and end == len(tokens) and end - start > 1:
                # The last block in two steps, so the last report says all but the token that starts the
                # answer. Not a whole-block batch any more: never kept (below).
                llm.eval(tokens[start:end - 1])
                assert on_progress is not None
                on_progress(end - 1, len(tokens))
                llm.eval(tokens[end - 1:end])
                break
            llm.eval(tokens[start:end])
            if end - start == BLOCK_TOKENS:
                self._live = tokens[:end]
            if report and end % PROGRESS_CHUNK_TOKENS == 0 and end < len(tokens):
                assert on_progress is not None
                on_progress(end, len(tokens))
        return True

    def _stash_live(self) -> None:
        """Copy the whole blocks the context holds into the prompt cache before another prompt overwrites
        them (the answer after them is dropped first: never reused)."""
        keep_prompt_blocks(self._llm.ctx, 0, self._cache, self._live, self._live_scope)

    def _load_state(self, state: bytes) -> bool:
        """Replace the context's KV with a cached state; False (and an empty KV: evaluate from scratch) if
        llama.cpp refuses it."""
        ctx = self._llm.ctx
        mem = llama_cpp.llama_get_memory(ctx)
        llama_cpp.llama_memory_clear(mem, True)
        if load_sequence_state(ctx, 0, state):
            return True
        llama_cpp.llama_memory_clear(mem, True)
        return False

    def close(self) -> None:
        if self._closed:
            return
        self._take_context()
        try:
            self._closed = True
            self._llm.close()
        finally:
            self._lock.release()
