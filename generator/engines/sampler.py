"""Sampling one generation's tokens with llama.cpp's own samplers, and constrained decoding.

The chain is what ``Llama.generate`` builds for rsb's settings (top-k as a cost bound, top-p, temperature, a
seeded distribution; greedy at temperature 0), in C, with end-of-generation masked by a logit bias (not a
Python callback over the vocabulary) when ``ignore_eos`` is on.

A grammar (a JSON answer, a forced tool call) is applied as llama.cpp's common sampler applies it: the token is
sampled without it first, and only checked against it (one candidate); only a rejected token makes the
grammar filter the candidates before sampling again. Filtering the whole vocabulary (49k tokens for SmolLM2)
every token is what halved the speed of ``Llama.generate(grammar=...)`` (docs/dependencies.md: 49 against 91 tokens/s);
most tokens of a JSON answer are what the model wanted anyway. On a rejection rsb filters the top-k candidates
(the cost bound the free sampler has anyway); when none of them is admitted, the ``WIDE`` most likely tokens and
every token of one character (which can spell any text: when the grammar admits anything, it admits one of them),
and the whole vocabulary only if even those fail (a vocabulary without byte tokens). Filtering 49k tokens costs
15-35 ms under a grammar of many stacks (10-100 x a one-token check); the wide set, under 2k tokens, a
millisecond. The best admitted token is the best of the top ``WIDE`` when one of them is admitted (so greedy
answers are what a whole-vocabulary filter picks), and sampling draws from the admitted part of the first set
that has one. Nothing is ever accepted into the grammar that it has not admitted first: llama.cpp aborts the
process on a token its grammar cannot take.

A step's grammar work is bounded at create (broker.schema.cost), and again here: a constrained step that takes
more than ``STEP_BUDGET_S`` of the thread's CPU ends the generation with ``GrammarTooCostly`` (so cancels, the
deadline and shutdown, checked between steps, never wait on more than one such step).

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
import functools
import math
import time
from collections.abc import Callable, Iterable, Sequence

import llama_cpp
import numpy as np
import numpy.typing as npt

from broker.request.sampling import DEFAULT, Sampling
from generator.engines.base import EngineError


class GrammarError(EngineError):
    """The grammar cannot be used: it does not compile, it admits no token, or the stored answer being
    continued does not match it."""


class GrammarTooCostly(GrammarError):
    """One sampling step under the grammar took more than STEP_BUDGET_S of CPU."""

    code = "schema_too_costly"


#: The most CPU one constrained sampling step may take (the worst schema rsb admits measured ~40 ms).
STEP_BUDGET_S = 1.0
#: The most likely tokens filtered by the grammar when none of the top-k is admitted.
WIDE = 1024


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


@functools.lru_cache(maxsize=8)
def _single_char_tokens(pieces: PieceFn, n_vocab: int) -> npt.NDArray[np.int32]:
    """Tokens of one byte or one character, which together spell any text, and those of none (end of generation
    and other control tokens). Once per model."""
    out = []
    for t in range(n_vocab):
        b = pieces(t)
        if len(b) <= 1 or (len(b) <= 4 and len(b.decode("utf-8", "ignore")) == 1):
            out.append(t)
    return np.array(out, dtype=np.int32)


class Sampler:
    """Samples the tokens of one generation from the logits at ``idx`` of its context's last decode (-1: the
    last ones; a batch of many sequences sets each sequence's row before sampling it). ``close`` frees the
    samplers."""

    def __init__(self, llm: llama_cpp.Llama, *, temperature: float, top_p: float, top_k: int, seed: int,
                 masked_ids: Iterable[int] = (), grammar: str | None = None, pieces: PieceFn | None = None,
                 utf8: Sequence[npt.NDArray[np.bool_]] | None = None, sampling: Sampling = DEFAULT,
                 ctx: llama_cpp.llama_context_p | None = None) -> None:
        """``masked_ids``: tokens never to sample (end-of-generation for ``ignore_eos``; with a grammar, the
        tokens whose bytes no valid UTF-8 contains, which llama.cpp's grammar decoder does not refuse).
        ``sampling``: OpenAI's presence and frequency penalties (on the logits of tokens this generation wrote,
        as OpenAI defines them) and ``logit_bias`` (added to the logits). ``ctx``: the context it samples from,
        if not ``llm``'s own (the batched engine's)."""
        self._ctx = ctx if ctx is not None else llm.ctx
        self.idx = -1
        self._n_vocab = llm.n_vocab()
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        self._presence = sampling.presence_penalty
        self._frequency = sampling.frequency_penalty
        self._counts: dict[int, int] | None = {} if sampling.penalized else None
        params = llama_cpp.llama_sampler_chain_default_params()
        chain = llama_cpp.llama_sampler_chain_init(params)
        self._chain = chain
        self._grammar: llama_cpp.llama_sampler_p | None = None
        # A token past the vocabulary is never sampled anyway: its bias changes nothing.
        bias = {t: b for t, b in sampling.logit_bias if t < self._n_vocab}
        bias.update((t, -math.inf) for t in masked_ids)
        if bias:
            biases = (llama_cpp.llama_logit_bias * len(bias))(
                *(llama_cpp.llama_logit_bias(t, b) for t, b in bias.items()))
            llama_cpp.llama_sampler_chain_add(
                chain, llama_cpp.llama_sampler_init_logit_bias(self._n_vocab, len(bias), biases))
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
            self._singles = _single_char_tokens(pieces, self._n_vocab) if pieces is not None else self._all_ids
            assert pieces is not None and utf8 is not None, "a grammar needs the pieces and the UTF-8 masks"
            self._piece = pieces
            self._utf8_masks = utf8
            self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self.resampled = 0  # tokens the grammar rejected (and so sampled again, under it)

    @property
    def constrained(self) -> bool:
        return self._grammar is not None

    def sample(self) -> int:
        counts = self._counts
        if counts:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, self.idx), shape=(self._n_vocab,))
            ids = np.fromiter(counts, dtype=np.intp, count=len(counts))
            times = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
            logits[ids] -= times * self._frequency + self._presence  # in place: the next decode overwrites them
        token = self._pick()
        if counts is not None:
            counts[token] = counts.get(token, 0) + 1
        return token

    def _pick(self) -> int:
        token: int = llama_cpp.llama_sampler_sample(self._chain, self._ctx, self.idx)
        grammar = self._grammar
        if grammar is None:
            return token
        t0 = time.thread_time()
        if not self.admits(token):
            token = self._resample(grammar)
        self._take(grammar, token)
        spent = time.thread_time() - t0
        if spent > STEP_BUDGET_S:
            raise GrammarTooCostly(f"one step of constrained decoding took {spent:.1f} s of CPU (at most "
                                   f"{STEP_BUDGET_S:g} s): the schema is too costly for the grammar engine")
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
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, self.idx), shape=(self._n_vocab,))
        masked = np.where(utf8, logits, -np.inf).astype(np.float32)
        if banned:
            masked[banned] = -np.inf
        for tier in ("top_k", "wide", "all"):
            if tier == "wide":
                # At most the vocabulary: a small one (the tests' 289 tokens) has fewer than WIDE.
                wide = min(WIDE, self._n_vocab)
                ids = np.union1d(np.argpartition(masked, -wide)[-wide:], self._singles).astype(np.int32)
            else:
                ids = self._all_ids
            n = len(ids)
            self._ids[:n] = ids
            self._logits[:n] = masked[ids]
            self._probs[:n] = 0.0
            arr.data = ctypes.cast(self._all, llama_cpp.llama_token_data_p)  # type: ignore[assignment]  # as above
            arr.size = n
            arr.selected = -1
            arr.sorted = False
            if tier == "top_k":
                llama_cpp.llama_sampler_apply(self._top_k, ctypes.byref(arr))
            llama_cpp.llama_sampler_apply(grammar, ctypes.byref(arr))
            # Rejected candidates are -inf wherever they were: the top-k order no longer holds (the next
            # samplers would take the first candidate for the most likely).
            arr.sorted = False
            if np.isfinite(self._logits[: arr.size]).any():
                break
        llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size:
            raise GrammarError("the grammar admits no token here")
        chosen = arr.data[arr.selected]
        if chosen.logit == -math.inf:
            raise GrammarError("the grammar admits no token here")
        return int(chosen.id)

    def logprobs(self, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
        """The log-probability of ``token`` under the model's last logits, and the ``top`` likeliest tokens'
        (before the chosen token's decode overwrites the logits)."""
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, self.idx), shape=(self._n_vocab,))
        peak = float(logits.max())
        norm = peak + math.log(float(np.exp(logits - peak).sum()))
        best: list[tuple[int, float]] = []
        top = min(top, self._n_vocab)
        if top:
            ids = np.argpartition(logits, -top)[-top:]
            best = sorted(((int(i), float(logits[i]) - norm) for i in ids), key=lambda x: -x[1])
        return float(logits[token]) - norm, best

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
