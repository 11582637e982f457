from __future__ import annotations

import ctypes
import itertools
import random
from typing import TYPE_CHECKING

import pytest

from generator.engines.detokenizer import IncrementalDetokenizer, LlamaPieces

if TYPE_CHECKING:
    import llama_cpp  # the tests on a real vocabulary get it from demo_llm; the others run without it


def decode_split(data: bytes, cuts: tuple[int, ...]) -> tuple[list[str], str]:
    """Feed ``data`` cut at ``cuts`` as one token per chunk; return the per-token texts and the flush."""
    bounds = [0, *cuts, len(data)]
    chunks = [data[a:b] for a, b in itertools.pairwise(bounds)]
    detok = IncrementalDetokenizer(lambda tok: chunks[tok])
    return [detok.push(i) for i in range(len(chunks))], detok.flush()


def all_splits(data: bytes) -> list[tuple[int, ...]]:
    inner = range(1, len(data))
    return [c for r in range(len(data)) for c in itertools.combinations(inner, r)]


SAMPLES = [
    "你好",  # 3-byte characters
    "a😀b",  # a 4-byte character
    "é€😀",  # 2-, 3- and 4-byte characters back to back
]
INVALID = [
    b"\xff",  # never valid in UTF-8
    b"a\x80b",  # lone continuation byte
    b"\xe4\xbdx",  # truncated 3-byte sequence followed by ASCII
    b"\xc0\xafz",  # overlong encoding
    b"\xed\xa0\x80",  # UTF-16 surrogate
    b"\xf0\x9f\x98",  # truncated at the very end
]


@pytest.mark.parametrize("data", [s.encode() for s in SAMPLES] + INVALID, ids=repr)
def test_every_split_into_tokens_gives_the_same_text(data: bytes) -> None:
    expected = data.decode("utf-8", errors="replace")
    for cuts in all_splits(data):
        texts, tail = decode_split(data, cuts)
        assert "".join(texts) + tail == expected, cuts


def test_a_token_ending_mid_character_yields_nothing_until_the_character_completes() -> None:
    emoji = "😀".encode()
    texts, tail = decode_split(b"x" + emoji + b"y", (1, 2, 3, 4, 5))
    assert texts == ["x", "", "", "", "😀", "y"]
    assert tail == ""


def test_an_unfinished_character_at_the_end_is_flushed_as_replacement() -> None:
    texts, tail = decode_split("ok你".encode()[:-1], (2,))
    assert texts == ["ok", ""]
    assert tail == "\ufffd"


def test_invalid_bytes_come_out_as_soon_as_they_are_known_invalid() -> None:
    texts, tail = decode_split(b"\xe4\xbdx\xff", (2, 3))
    assert texts == ["", "\ufffdx", "\ufffd"]
    assert tail == ""


def test_random_mixed_text_in_random_splits() -> None:
    rng = random.Random(7)
    alphabet = "ab ,\n中文字😀🎉éß\u200d"
    for _ in range(200):
        data = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 30))).encode()
        if rng.random() < 0.3:  # corrupt a byte
            i = rng.randrange(len(data))
            data = data[:i] + bytes([rng.randrange(256)]) + data[i + 1 :]
        cuts = tuple(sorted(rng.sample(range(1, len(data)), rng.randrange(len(data))))) if len(data) > 1 else ()
        texts, tail = decode_split(data, cuts)
        assert "".join(texts) + tail == data.decode("utf-8", errors="replace")


def test_strip_leading_space_applies_to_the_first_token_only() -> None:
    pieces = [b" Hello", b" world"]
    detok = IncrementalDetokenizer(lambda t: pieces[t], strip_leading_space=True)
    assert [detok.push(0), detok.push(1)] == ["Hello", " world"]
    detok = IncrementalDetokenizer(lambda t: pieces[t])
    assert detok.push(0) == " Hello"


def test_each_token_is_looked_up_once() -> None:
    calls: list[int] = []

    def piece(tok: int) -> bytes:
        calls.append(tok)
        return b"x"

    detok = IncrementalDetokenizer(piece)
    for i in range(1000):
        detok.push(i % 7)
    assert len(calls) == 1000  # no re-detokenizing of earlier tokens


# The byte-token path through a real llama.cpp vocabulary.


def test_llama_pieces_keep_the_leading_space_and_raw_bytes(demo_llm: llama_cpp.Llama) -> None:
    pieces = LlamaPieces.for_llama(demo_llm)
    text = "the 😀 你好 \xff"
    tokens = demo_llm.tokenize(text.encode(), add_bos=False, special=False)
    raw = [pieces(t) for t in tokens]
    assert raw[0] == b" the"  # SPM's dummy space prefix is part of the first piece
    assert b"".join(raw) == b" " + text.encode()
    assert any(len(p) == 1 and p[0] >= 0x80 for p in raw)  # went through byte tokens
    detok = IncrementalDetokenizer(pieces)
    texts = [detok.push(t) for t in tokens]
    assert "".join(texts) + detok.flush() == " " + text
    assert "" in texts  # the emoji's first byte tokens are held back
    assert pieces(demo_llm.token_bos()) == b"" and pieces(demo_llm.token_eos()) == b""


def test_llama_pieces_cache_and_grow_their_buffer(demo_llm: llama_cpp.Llama) -> None:
    pieces = LlamaPieces.for_llama(demo_llm)
    long_piece = b"y" * 200
    calls: list[int] = []

    def fake_to_piece(vocab: object, token: int, buf: ctypes.c_char_p | bytes | ctypes.Array[ctypes.c_char],
                      length: int, lstrip: int, special: bool) -> int:
        calls.append(length)
        if length < len(long_piece):
            return -len(long_piece)
        assert isinstance(buf, ctypes.Array)  # LlamaPieces passes its ctypes.create_string_buffer
        buf.raw = long_piece
        return len(long_piece)

    pieces._to_piece = fake_to_piece
    assert pieces(5) == long_piece
    assert pieces(5) == long_piece
    assert calls == [64, 200]


def test_matches_llama_detokenize_on_generated_tokens(demo_llm: llama_cpp.Llama) -> None:
    prompt = demo_llm.tokenize(b"Once upon a time", add_bos=True)
    demo_llm.reset()
    demo_llm.set_seed(3)
    # 400 tokens: the fixture's Llama has the default n_ctx of 512.
    generated = list(itertools.islice(demo_llm.generate(prompt, temp=1.0, top_k=0, min_p=0.0), 400))
    detok = IncrementalDetokenizer(LlamaPieces.for_llama(demo_llm))
    text = "".join(detok.push(t) for t in generated) + detok.flush()
    # llama's detokenize strips a leading space only when the list starts with BOS, which these do not.
    assert text == demo_llm.detokenize(generated).decode("utf-8", errors="replace")
    with_bos = demo_llm.detokenize([demo_llm.token_bos(), *generated])
    stripped = IncrementalDetokenizer(LlamaPieces.for_llama(demo_llm), strip_leading_space=True)
    assert "".join(stripped.push(t) for t in generated) + stripped.flush() == with_bos.decode("utf-8", "replace")


def test_a_stopped_generation_drops_the_character_it_began() -> None:
    chunks = [b"ok", "你".encode()[:2]]
    detok = IncrementalDetokenizer(lambda tok: chunks[tok])
    assert [detok.push(0), detok.push(1)] == ["ok", ""]
    detok.drop_unfinished()
    assert detok.flush() == ""
