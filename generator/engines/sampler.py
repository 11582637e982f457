"""Sampling one generation's tokens with llama.cpp's own samplers, and constrained decoding.

The chain is what ``Llama.generate`` builds for rsb's settings (top-k as a cost bound, top-p, temperature, a
seeded distribution; greedy at temperature 0), in C, with end-of-generation masked by a logit bias (not a
Python callback over the vocabulary) when ``ignore_eos`` is on.

A grammar (a JSON answer, a forced tool call) is applied as llama.cpp's common sampler applies it: the token is
sampled without it first, and only checked against it (one candidate); only a rejected token makes the
grammar filter the candidates before sampling again. Filtering the whole vocabulary (49k tokens for SmolLM2)
every token is what halved the speed of ``Llama.generate(grammar=...)`` (NOTES.md: 49 against 91 tokens/s);
most tokens of a JSON answer are what the model wanted anyway. On a rejection rsb filters the top-k candidates
(the cost bound the free sampler has anyway), and the whole vocabulary only when none of them is admitted: the
best admitted token is the same either way (so greedy answers are), and sampling draws from the admitted part
of the top k. Nothing is ever accepted into the grammar that it has not admitted first: llama.cpp aborts the
process on a token its grammar cannot take.

A constrained answer is also kept valid UTF-8, which llama.cpp's grammar does not ensure: its decoder reads a
multi-byte character without checking that the bytes after the first are continuation bytes, so a model that
writes stray bytes (random weights do) would get U+FFFD into a JSON string and past a ``maxLength``. Tokens
that cannot come next in valid UTF-8 are masked before a resample (per the number of continuation bytes the
text still owes: four masks computed once per model), and every chosen token is checked with a strict
incremental decoder.
"""

from __future__ import annotations

import codecs
import ctypes
import math
from collections.abc import Callable, Iterable, Sequence

import llama_cpp
import numpy as np
import numpy.typing as npt

from generator.engines.base import EngineError


class GrammarError(EngineError):
    """The grammar cannot be used: it does not compile, it admits no token, or the stored answer being
    continued does not match it."""


PieceFn = Callable[[int], bytes]


def _utf8_owed(buffered: bytes) -> int:
    """Continuation bytes still owed by an incomplete character (the decoder's buffered bytes)."""
    if not buffered:
        return 0
    lead = buffered[0]
    return (2 if lead < 0xE0 else 3 if lead < 0xF0 else 4) - len(buffered)


def utf8_masks(pieces: PieceFn, n_vocab: int) -> Sequence[npt.NDArray[np.bool_]]:
    """For 0 to 3 continuation bytes owed, which tokens can come next in valid UTF-8 (ignoring the narrower
    second-byte ranges of E0, ED, F0 and F4: the strict decoder catches those)."""
    masks = [np.zeros(n_vocab, dtype=np.bool_) for _ in range(4)]
    for t in range(n_vocab):
        b = pieces(t)
        for owed in range(4):
            head, rest = b[:owed], b[owed:]
            if not all(0x80 <= c < 0xC0 for c in head) or (rest and 0x80 <= rest[0] < 0xC0):
                continue
            try:
                codecs.getincrementaldecoder("utf-8")().decode(rest)
            except UnicodeDecodeError:
                continue
            masks[owed][t] = True
    return masks


class Sampler:
    """Samples the tokens of one generation from the context's last logits. ``close`` frees the samplers."""

    def __init__(self, llm: llama_cpp.Llama, *, temperature: float, top_p: float, top_k: int, seed: int,
                 masked_ids: Iterable[int] = (), grammar: str | None = None, pieces: PieceFn | None = None,
                 utf8: Sequence[npt.NDArray[np.bool_]] | None = None) -> None:
        """``masked_ids``: tokens never to sample (end-of-generation for ``ignore_eos``; with a grammar, the
        tokens whose bytes no valid UTF-8 contains, which llama.cpp's grammar decoder does not refuse)."""
        self._ctx = llm.ctx
        self._n_vocab = llm.n_vocab()
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        params = llama_cpp.llama_sampler_chain_default_params()
        chain = llama_cpp.llama_sampler_chain_init(params)
        self._chain = chain
        self._grammar: llama_cpp.llama_sampler_p | None = None
        masked = list(masked_ids)
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
            self._top_k = llama_cpp.llama_sampler_init_top_k(top_k)
            assert pieces is not None and utf8 is not None, "a grammar needs the pieces and the UTF-8 masks"
            self._piece = pieces
            self._utf8_masks = utf8
            self._utf8 = codecs.getincrementaldecoder("utf-8")()
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
        self._take(grammar, token)
        return token

    def _take(self, grammar: llama_cpp.llama_sampler_p, token: int) -> None:
        self._utf8.decode(self._piece(token))
        llama_cpp.llama_sampler_accept(grammar, token)

    def _utf8_admits(self, token: int) -> bool:
        state = self._utf8.getstate()
        try:
            self._utf8.decode(self._piece(token))
            return True
        except UnicodeDecodeError:
            return False
        finally:
            self._utf8.setstate(state)

    def admits(self, token: int) -> bool:
        """Whether the grammar, in its current state, takes ``token`` next (and the text stays valid UTF-8)."""
        assert self._grammar is not None
        if not self._utf8_admits(token):
            return False
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
        owed = _utf8_owed(self._utf8.getstate()[0])
        banned: list[int] = []
        for _ in range(8):  # a token the masks let through but the strict decoder refuses (rare): again without it
            token = self._resample_once(grammar, self._utf8_masks[owed], banned)
            if self._utf8_admits(token):
                return token
            banned.append(token)
        raise GrammarError("no token keeps the answer valid UTF-8 here")

    def _resample_once(self, grammar: llama_cpp.llama_sampler_p, utf8: npt.NDArray[np.bool_],
                       banned: list[int]) -> int:
        arr = self._all_array
        for top_k_first in (True, False):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, -1), shape=(self._n_vocab,))
            self._ids[:] = self._all_ids
            self._logits[:] = np.where(utf8, logits, -np.inf)
            if banned:
                self._logits[banned] = -np.inf
            self._probs[:] = 0.0
            arr.data = ctypes.cast(self._all, llama_cpp.llama_token_data_p)  # type: ignore[assignment]  # as above
            arr.size = self._n_vocab
            arr.selected = -1
            arr.sorted = False
            if top_k_first:
                llama_cpp.llama_sampler_apply(self._top_k, ctypes.byref(arr))
            llama_cpp.llama_sampler_apply(grammar, ctypes.byref(arr))
            # Rejected candidates are -inf wherever they were: the top-k order no longer holds (the next
            # samplers would take the first candidate for the most likely).
            arr.sorted = False
            if any(arr.data[i].logit != -math.inf for i in range(arr.size)):
                break
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
            self._take(self._grammar, token)

    def close(self) -> None:
        if self._grammar is not None:
            llama_cpp.llama_sampler_free(self._grammar)
            llama_cpp.llama_sampler_free(self._top_k)
            self._grammar = None
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
