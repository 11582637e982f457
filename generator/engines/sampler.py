"""Sampling one generation's tokens with llama.cpp's own samplers, and constrained decoding.

The chain is what ``Llama.generate`` builds for rsb's settings (top-k as a cost bound, top-p, temperature, a
seeded distribution; greedy at temperature 0), in C, with end-of-generation masked by a logit bias (not a
Python callback over the vocabulary) when ``ignore_eos`` is on.

A grammar (a JSON answer, a forced tool call) is applied as llama.cpp's common sampler applies it: the token is
sampled without it first, and only checked against it (one candidate); only a rejected token makes the
grammar filter the whole vocabulary before sampling again. Filtering the vocabulary (49k tokens for SmolLM2)
every token is what halved the speed of ``Llama.generate(grammar=...)`` (NOTES.md: 49 against 91 tokens/s);
most tokens of a JSON answer are what the model wanted anyway. Nothing is ever accepted into the grammar
that it has not admitted first: llama.cpp aborts the process on a token its grammar cannot take.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterable

import llama_cpp
import numpy as np
import numpy.typing as npt

from generator.engines.base import EngineError


class GrammarError(EngineError):
    """The grammar cannot be used: it does not compile, it admits no token, or the stored answer being
    continued does not match it."""


class Sampler:
    """Samples the tokens of one generation from the context's last logits. ``close`` frees the samplers."""

    def __init__(self, llm: llama_cpp.Llama, *, temperature: float, top_p: float, top_k: int, seed: int,
                 eog_ids: Iterable[int] = (), grammar: str | None = None) -> None:
        self._ctx = llm.ctx
        self._n_vocab = llm.n_vocab()
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        params = llama_cpp.llama_sampler_chain_default_params()
        chain = llama_cpp.llama_sampler_chain_init(params)
        self._chain = chain
        self._grammar: llama_cpp.llama_sampler_p | None = None
        masked = list(eog_ids) if grammar is None else []  # a grammar ends with end-of-generation
        if masked:
            biases = (llama_cpp.llama_logit_bias * len(masked))(
                *(llama_cpp.llama_logit_bias(t, -math.inf) for t in masked))
            llama_cpp.llama_sampler_chain_add(
                chain, llama_cpp.llama_sampler_init_logit_bias(self._n_vocab, len(masked), biases))
        if temperature <= 0.0:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
        else:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_k(top_k))
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(top_p, 1))
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(temperature))
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(seed))
        if grammar is not None:
            g = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
            if not g:
                self.close()
                raise GrammarError("llama.cpp could not compile the answer's grammar")
            self._grammar = g
            # One candidate, to check a token against the grammar.
            self._one = (llama_cpp.llama_token_data * 1)()
            self._one_array = llama_cpp.llama_token_data_array(self._one, 1, -1, False)
            # The whole vocabulary, for a resample; filled from the logits through numpy views.
            self._all = (llama_cpp.llama_token_data * self._n_vocab)()
            self._all_array = llama_cpp.llama_token_data_array(self._all, self._n_vocab, -1, False)
            view = np.ctypeslib.as_array(self._all).view(
                np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)]))
            self._ids: npt.NDArray[np.int32] = view["id"]
            self._logits: npt.NDArray[np.float32] = view["logit"]
            self._probs: npt.NDArray[np.float32] = view["p"]
            self._all_ids = np.arange(self._n_vocab, dtype=np.int32)
        self.resampled = 0  # tokens the grammar rejected (and so sampled again, under it)

    @property
    def constrained(self) -> bool:
        return self._grammar is not None

    def sample(self) -> int:
        token: int = llama_cpp.llama_sampler_sample(self._chain, self._ctx, -1)
        grammar = self._grammar
        if grammar is None:
            return token
        if not self.admits(token):
            token = self._resample(grammar)
        llama_cpp.llama_sampler_accept(grammar, token)
        return token

    def admits(self, token: int) -> bool:
        """Whether the grammar, in its current state, takes ``token`` next."""
        assert self._grammar is not None
        one, arr = self._one, self._one_array
        one[0].id = token  # type: ignore[assignment]  # ctypes converts the int
        one[0].logit = 1.0
        one[0].p = 0.0
        arr.data = ctypes.cast(one, llama_cpp.llama_token_data_p)  # type: ignore[assignment]  # a pointer, in C
        arr.size = 1
        arr.selected = -1
        arr.sorted = False
        llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(arr))
        return bool(one[0].logit != -math.inf)

    def _resample(self, grammar: llama_cpp.llama_sampler_p) -> int:
        self.resampled += 1
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, -1), shape=(self._n_vocab,))
        self._ids[:] = self._all_ids
        self._logits[:] = logits
        self._probs[:] = 0.0
        arr = self._all_array
        arr.data = ctypes.cast(self._all, llama_cpp.llama_token_data_p)  # type: ignore[assignment]  # as above
        arr.size = self._n_vocab
        arr.selected = -1
        arr.sorted = False
        llama_cpp.llama_sampler_apply(grammar, ctypes.byref(arr))
        llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size:
            raise GrammarError("the grammar admits no token here")
        chosen = arr.data[arr.selected]
        if chosen.logit == -math.inf:
            raise GrammarError("the grammar admits no token here")
        return int(chosen.id)

    def accept_text(self, tokens: Iterable[int]) -> None:
        """Advance the grammar over text already in the answer (a continuation), given as tokens."""
        if self._grammar is None:
            return
        for token in tokens:
            if not self.admits(token):
                raise GrammarError("the stored answer does not match its grammar: it cannot be continued")
            llama_cpp.llama_sampler_accept(self._grammar, token)

    def close(self) -> None:
        if self._grammar is not None:
            llama_cpp.llama_sampler_free(self._grammar)
            self._grammar = None
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
