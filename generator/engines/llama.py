"""The llama.cpp engine: one ``llama_cpp.Llama`` (one llama.cpp context) per process, driven through
``Llama.generate`` with our own incremental detokenizer, so the cost per token stays flat."""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt

from broker.request import GenerationRequest
from generator.engines.base import Engine, EngineError, Generation, PromptTooLong
from generator.engines.chat import ChatTemplate
from generator.engines.detokenizer import IncrementalDetokenizer, LlamaPieces

# llama.cpp reads this seed as "pick a random one", so a request's seed must never be passed as it.
_RANDOM_SEED = llama_cpp.LLAMA_DEFAULT_SEED


# Prompts longer than this report their prefill progress, every PROGRESS_CHUNK_TOKENS tokens.
PROGRESS_MIN_TOKENS = 512
PROGRESS_CHUNK_TOKENS = 256


def physical_cores() -> int:
    """Physical cores: llama.cpp gains nothing from hyperthreads and loses from oversubscription."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except ImportError:
        n = None
    return n or os.cpu_count() or 1


class LlamaEngine(Engine):
    """``Engine`` over llama-cpp-python. Generations run one at a time: the context is held by a lock from
    a generation's first ``next()`` until it ends or is closed; a generation the same thread left suspended
    is ended when the next one starts.

    Sampling follows the request's temperature and top_p (temperature 0 is greedy), with ``top_k`` as a
    cost bound and no min_p/typical/repeat penalties. ``seed=None`` draws a random seed. A cancelled
    generation (``stop`` set) ends without touching ``finish_reason``: the caller knows why it stopped.
    ``ignore_eos`` masks every end-of-generation token, so answers run to ``max_tokens``."""

    def __init__(
        self,
        model_path: str,
        *,
        n_threads: int | None = None,
        n_ctx: int = 4096,
        ignore_eos: bool = False,
        name: str | None = None,
        top_k: int = 40,
    ) -> None:
        threads = n_threads or physical_cores()
        self._llm = llama_cpp.Llama(
            model_path=model_path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False
        )
        llm = self._llm
        self.n_ctx: int = llm.n_ctx()
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

        self.chat = ChatTemplate(metadata.get("tokenizer.chat_template"), bos_token=self._token_text(self._bos),
                                 eos_token=self._token_text(llm.token_eos()))

        self._lock = threading.Lock()
        self._active: Iterator[str] | None = None
        self._active_thread = 0
        self._closed = False

        # The first decode allocates compute buffers; pay that here rather than in the first request.
        llm.eval([self._bos if self._bos >= 0 else 0])
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
        ``messages``) with ``prefix_text`` appended. Both are tokenized as one string, so the answer text
        being continued is split into tokens as if it had always been part of the prompt."""
        if request.messages is not None:
            prompt = self.chat.render([{"role": m.role, "content": m.content} for m in request.messages])
        else:
            prompt = request.prompt or ""
        # special=True like llama-cpp-python's completions: templates spell BOS/EOS and role markers as text.
        tokens: list[int] = self._llm.tokenize((prompt + prefix_text).encode("utf-8"), add_bos=False, special=True)
        if self._add_bos and (not tokens or tokens[0] != self._bos):
            tokens.insert(0, self._bos)
        if not tokens:
            raise EngineError("the prompt is empty and the model adds no BOS token")
        return tokens

    def start(
        self,
        request: GenerationRequest,
        *,
        prefix_text: str,
        max_tokens: int,
        stop: threading.Event,
    ) -> Generation:
        if self._closed:
            raise RuntimeError("engine is closed")
        tokens = self.tokenize_prompt(request, prefix_text)
        if len(tokens) > self.n_ctx - 1 - max_tokens:
            raise PromptTooLong(len(tokens), max_tokens, self.n_ctx)
        generation = Generation(prompt_tokens=len(tokens), pieces=iter(()))
        generation.pieces = self._run(generation, request, tokens, max_tokens, stop)
        return generation

    def _take_context(self) -> None:
        prev = self._active
        if prev is not None and self._active_thread == threading.get_ident():
            # A generation this thread left suspended can never resume while we wait for it: end it, or
            # the lock it holds deadlocks us.
            close = getattr(prev, "close", None)
            if close is not None:
                close()
        self._lock.acquire()

    def _run(
        self,
        generation: Generation,
        request: GenerationRequest,
        tokens: list[int],
        max_tokens: int,
        stop: threading.Event,
    ) -> Iterator[str]:
        if stop.is_set():
            return
        self._take_context()
        try:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._active = generation.pieces
            self._active_thread = threading.get_ident()
            llm = self._llm
            # A full reset, not generate()'s prefix reuse: re-evaluating the whole prompt every time keeps
            # the arithmetic, and so a seeded answer, identical whatever ran before.
            self._reset()
            seed = request.seed
            if seed is None:
                seed = secrets.randbelow(_RANDOM_SEED)
            elif seed == _RANDOM_SEED:
                seed -= 1
            llm.set_seed(seed)
            on_progress = generation.on_progress
            if on_progress is not None and len(tokens) > PROGRESS_MIN_TOKENS:
                # A long prompt is evaluated in steps (all but its last token: generate() then finds the
                # cached prefix and decodes only that one), reporting progress between steps; a cancel
                # stops it between steps instead of after the whole prefill.
                end = len(tokens) - 1
                for start in range(0, end, PROGRESS_CHUNK_TOKENS):
                    if stop.is_set():
                        return
                    llm.eval(tokens[start:min(start + PROGRESS_CHUNK_TOKENS, end)])
                    on_progress(min(start + PROGRESS_CHUNK_TOKENS, end), len(tokens))

            detok = IncrementalDetokenizer(
                self._pieces,
                strip_leading_space=self._space_prefix
                and bool(llama_cpp.llama_vocab_is_control(self._vocab, tokens[-1])),
            )
            eog = self._eog
            # Never decode past the context: llama.cpp fails there instead of stopping.
            limit = min(max_tokens, self.n_ctx - len(tokens))
            if limit <= 0:
                generation.finish_reason = "length"
                return
            processors = None
            if self.ignore_eos and len(self._eog_ids):
                eog_ids = self._eog_ids

                def mask_eog(_ids: Any, scores: npt.NDArray[np.single]) -> npt.NDArray[np.single]:
                    scores[eog_ids] = -np.inf
                    return scores

                processors = llama_cpp.LogitsProcessorList([mask_eog])

            sampled = llm.generate(
                tokens,
                temp=request.temperature,
                top_p=request.top_p,
                top_k=self.top_k,
                min_p=0.0,
                typical_p=1.0,
                repeat_penalty=1.0,
                logits_processor=processors,
            )
            n = 0
            finish = "length"
            try:
                for token in sampled:
                    if token in eog:
                        finish = "stop"
                        break
                    n += 1
                    if n >= limit:
                        generation.finish_reason = "length"
                        # Merged into the last token, so a length-limited answer is exactly `limit` pieces.
                        yield detok.push(token) + detok.flush()
                        return
                    yield detok.push(token)
                    # Checked before resuming `sampled`, whose next step is the decode of this token.
                    if stop.is_set():
                        break
            finally:
                sampled.close()
            generation.finish_reason = finish
            tail = detok.flush()
            if tail:
                yield tail
        finally:
            self._active = None
            self._lock.release()

    def close(self) -> None:
        if self._closed:
            return
        self._take_context()
        try:
            self._closed = True
            self._llm.close()
        finally:
            self._lock.release()
