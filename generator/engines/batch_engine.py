"""Generations decoded together (``--parallel N``): up to N at once, each a sequence of the batcher's context
(generator.engines.batch), the rest waiting for a free one. What it shares with the one-sequence engine (the
model, tokenizing, each generation's sampler and decoder) is generator.engines.llama's ``LlamaEngine``; the
Llama's own context here only warms up."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from broker.request.generation import GenerationRequest
from generator.engines.base import Generation, StepObserver
from generator.engines.batch import BatchedSequence, Batcher
from generator.engines.llama import DEFAULT_CACHE_MIB, LlamaEngine
from generator.engines.pieces import Piece

# The size of the Llama's own context (it only warms up: the batcher's holds the sequences).
_IDLE_CTX = 256


class BatchedEngine(LlamaEngine):
    """Up to ``parallel`` generations run at once in one batch; the rest wait for a free sequence."""

    def __init__(
        self,
        model_path: str,
        *,
        parallel: int,
        n_threads: int | None = None,
        n_ctx: int = 4096,
        ignore_eos: bool = False,
        name: str | None = None,
        top_k: int = 40,
        prompt_cache_mib: int = DEFAULT_CACHE_MIB,
    ) -> None:
        super().__init__(model_path, own_ctx=_IDLE_CTX, sequences=parallel, n_threads=n_threads,
                         ignore_eos=ignore_eos, name=name, top_k=top_k, prompt_cache_mib=prompt_cache_mib)
        self._batcher = Batcher(self._llm, sequences=parallel, n_ctx=n_ctx,
                                cache=self._cache if self.caches_prompts else None)
        self.n_ctx = self._batcher.n_ctx

    def _run(self, generation: Generation, request: GenerationRequest, tokens: list[int], max_tokens: int,
             stop: threading.Event, grammar: str | None = None, written: str = "", scope: str = "",
             ) -> Iterator[Piece]:
        """A generation among the batcher's sequences (generator.engines.batch): set up here, in its own
        thread, then decoded by the batcher, whose pieces it hands on."""
        if stop.is_set():
            return
        if self._closed:
            raise RuntimeError("engine is closed")
        batcher = self._batcher
        made = self._sequence(generation, request, tokens, max_tokens, grammar, written, batcher.ctx)
        if made is None:
            return
        seq = BatchedSequence(tokens, scope, generation, stop, *made)
        batcher.submit(seq)
        try:
            while (pieces := seq.pieces()) is not None:
                yield from pieces
        finally:
            seq.abandoned = True  # read no further (or ended): the batcher drops it at its next step

    def _prepare_next_turn(self, tokens: list[int], scope: str) -> None:
        self._batcher.prepare(tokens, scope)

    def observe_steps(self, observer: StepObserver) -> None:
        self._batcher.on_step = observer

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._batcher.close()
        self._llm.close()
