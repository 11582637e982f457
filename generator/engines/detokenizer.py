"""Incremental, UTF-8-safe detokenization at O(1) cost per token.

llama-cpp-python's streaming completion re-detokenizes the whole answer at every step (O(n^2)); here each
token's raw piece bytes are looked up once and fed to an incremental UTF-8 decoder, which holds back a
character split across tokens until its last byte arrives."""

from __future__ import annotations

import codecs
import ctypes
from collections.abc import Callable
from typing import Any

#: Maps a token id to the raw bytes of its piece (SPM's "▁" already turned into a space).
PieceFn = Callable[[int], bytes]


class IncrementalDetokenizer:
    """Turns token ids, one at a time, into text. ``push`` returns the text completed by that token ("" when
    the token ends inside a character); ``flush`` returns what is still held back at the end (an unfinished
    character becomes U+FFFD). Invalid byte sequences become U+FFFD as soon as they are known invalid.

    ``strip_leading_space`` drops one leading space from the first token's piece: SPM tokenizers insert a
    dummy space before text that follows a control token (BOS, for an empty prompt), so that space is not
    part of the answer; keeping it would also double it when the answer is re-tokenized to resume."""

    __slots__ = ("_decoder", "_piece", "_strip")

    def __init__(self, piece: PieceFn, *, strip_leading_space: bool = False) -> None:
        self._piece = piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip = strip_leading_space

    def push(self, token: int) -> str:
        raw = self._piece(token)
        if self._strip:
            self._strip = False
            if raw[:1] == b" ":
                raw = raw[1:]
        return self._decoder.decode(raw)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)

    def drop_unfinished(self) -> None:
        """Forget the bytes of a character still held back (what a generation stopped early leaves: its next owner
        makes the character again from the text before it; flushed, it would be a U+FFFD in the stream)."""
        self._decoder.reset()


class LlamaPieces:
    """``PieceFn`` for a llama.cpp vocabulary, caching each piece on first use so the cost per token stays a
    list lookup. Control tokens render as "" (``special=False``), like llama's own detokenize."""

    __slots__ = ("_cache", "_to_piece", "_vocab")

    def __init__(self, vocab: Any, n_vocab: int) -> None:
        import llama_cpp

        self._vocab = vocab
        self._to_piece = llama_cpp.llama_token_to_piece
        self._cache: list[bytes | None] = [None] * n_vocab

    @classmethod
    def for_llama(cls, llm: Any) -> LlamaPieces:
        """The pieces of a ``llama_cpp.Llama``'s vocabulary."""
        import llama_cpp

        return cls(llama_cpp.llama_model_get_vocab(llm.model), llm.n_vocab())

    def __call__(self, token: int) -> bytes:
        try:
            piece = self._cache[token]
        except IndexError:
            return b""  # out-of-vocab ids cannot come from the sampler; render them as nothing
        if piece is None:
            piece = self._lookup(token)
            self._cache[token] = piece
        return piece

    def _lookup(self, token: int) -> bytes:
        # A buffer per lookup, not one per vocabulary: generations look pieces up from their own threads (and
        # the batcher from its), and ctypes lets go of the GIL inside the call, so a shared buffer handed one
        # thread another token's bytes. Only a first use of a token gets here.
        buf = ctypes.create_string_buffer(64)
        # lstrip=0: the raw piece, leading space included; llama's own detokenize strips it only after BOS.
        n = self._to_piece(self._vocab, token, buf, len(buf), 0, False)
        if n < 0:  # buffer too small: -n is the size needed
            buf = ctypes.create_string_buffer(-n)
            n = self._to_piece(self._vocab, token, buf, len(buf), 0, False)
        return buf.raw[: max(n, 0)]
