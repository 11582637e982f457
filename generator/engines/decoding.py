"""What one generation of the llama.cpp engine does with each token sampled for it: detokenize it, read tool
calls out of the text, add its log-probability, stop at the length limit or at end-of-generation, and set the
finish reason. One definition for both ways the engine decodes: a sequence alone in its context
(generator.engines.one_sequence, ``--parallel 1``) and a sequence among many in one batch (generator.engines.batch),
so an answer's text and finish reason never depend on which ran it."""

from __future__ import annotations

from collections.abc import Callable

from broker.events import FinishReason
from generator.engines.base import Generation
from generator.engines.detokenizer import IncrementalDetokenizer
from generator.engines.pieces import Piece, TokenLogprob
from generator.engines.tool_syntax import ToolCallSyntax


class SequenceDecoder:
    """Turns a generation's sampled tokens into its pieces. ``take`` each token; ``ended`` once it was the
    last (end-of-generation, or the ``limit``-th token); a generation stopped early (cancelled) calls ``end``
    for what the detokenizer and tool syntax still hold. A cancelled generation's finish reason stays
    "length": the caller knows why it stopped."""

    def __init__(self, generation: Generation, detok: IncrementalDetokenizer, *, limit: int,
                 eog: frozenset[int], syntax: ToolCallSyntax | None,
                 logprob: Callable[[int], TokenLogprob] | None) -> None:
        self.generation = generation
        self._detok = detok
        self._limit = limit
        self._eog = eog
        self._syntax = syntax
        self._logprob = logprob
        self.tokens = 0
        self.last = -1  # the token taken last: the one the next step decodes
        self.ended = False

    def take(self, token: int) -> list[Piece]:
        """The pieces of ``token`` (its log-probability read now, before the next decode overwrites the
        logits it came from)."""
        if token in self._eog:
            return self.end(FinishReason.STOP)
        self.last = token
        self.tokens += 1
        text = self._detok.push(token)
        prob = self._logprob(token) if self._logprob is not None else None
        syntax = self._syntax
        out: list[Piece]
        if self.tokens >= self._limit:
            self.ended = True
            self.generation.finish_reason = FinishReason.LENGTH
            # Merged into the last token, so a length-limited answer is exactly `limit` pieces.
            text += self._detok.flush()
            out = [text] if syntax is None else syntax.feed(text)
            if prob is not None:
                out.append(prob)
            if syntax is not None:
                out += syntax.end()
            return out
        out = [text] if syntax is None else syntax.feed(text)
        if prob is not None:
            out.append(prob)
        return out

    def end(self, finish: str = FinishReason.LENGTH) -> list[Piece]:
        """The generation ends here (``finish``: "stop" at end-of-generation, else it was stopped). Stopped, the
        bytes of a character it had begun are dropped, never flushed as U+FFFD: a stopped generation is often
        continued (handed over, parked, taken over), and its next owner continues from the stream's text, so a
        U+FFFD there would stay in the answer for good, where the character it began is made again."""
        self.ended = True
        if finish != FinishReason.STOP:
            self._detok.drop_unfinished()
        tail = self._detok.flush()
        syntax = self._syntax
        out: list[Piece] = []
        if syntax is None:
            if tail:
                out.append(tail)
        else:
            if tail:
                out += syntax.feed(tail)
            out += syntax.end()
            if finish == FinishReason.STOP and syntax.calls:
                finish = FinishReason.TOOL_CALLS
        self.generation.finish_reason = finish
        return out
