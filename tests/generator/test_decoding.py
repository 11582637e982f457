"""generator.engines.decoding: what a generation stopped mid-character leaves in its answer."""

from __future__ import annotations

from broker.events import FinishReason
from generator.engines.base import Generation
from generator.engines.decoding import SequenceDecoder
from generator.engines.detokenizer import IncrementalDetokenizer

# Token ids: 0 "ok", 1 and 2 the first two bytes of 你 (a byte-fallback vocabulary), 3 its last byte.
PIECES = [b"ok", b"\xe4", b"\xbd", b"\xa0"]


def _decoder() -> SequenceDecoder:
    return SequenceDecoder(Generation(prompt_tokens=0, pieces=iter(())), IncrementalDetokenizer(PIECES.__getitem__),
                           limit=100, eog=frozenset({99}), syntax=None, logprob=None)


def test_a_generation_stopped_inside_a_character_ends_without_a_replacement_character() -> None:
    """Stopped (handed over, parked, cancelled) after the first bytes of 你: the next owner continues from the
    stream's text, "ok", and makes the character again; a U+FFFD appended here would stay in the answer."""
    decoder = _decoder()
    assert decoder.take(0) + decoder.take(1) + decoder.take(2) == ["ok", "", ""]
    assert decoder.end() == []
    assert decoder.generation.finish_reason == FinishReason.LENGTH


def test_an_answer_that_ends_by_itself_inside_a_character_says_so() -> None:
    decoder = _decoder()
    assert decoder.take(1) == [""]
    assert decoder.take(99) == ["\ufffd"]  # end-of-generation: the model's own unfinished character
    assert decoder.generation.finish_reason == FinishReason.STOP
    decoder = _decoder()
    assert decoder.take(1) + decoder.take(2) + decoder.take(3) == ["", "", "你"]
