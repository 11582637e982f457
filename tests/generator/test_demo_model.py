from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import LLAMA_EXTRA

pytest.importorskip("llama_cpp", reason=LLAMA_EXTRA)

import gguf
import llama_cpp

from generator.engines import demo_model
from generator.engines.demo_model import DEMO_MODEL_NAME, build_demo_model, default_demo_model_path, ensure_demo_model


def test_builds_and_loads_fast(demo_gguf: Path) -> None:
    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(demo_gguf), n_threads=1, verbose=False)
    elapsed = time.perf_counter() - t
    try:
        assert 1000 <= llm.n_vocab() <= 2000
        assert elapsed < 1.0  # ~0.01 s when the machine is idle; generous for a shared one
    finally:
        llm.close()


def test_metadata_says_it_is_a_demo(demo_llm: llama_cpp.Llama) -> None:
    name = demo_llm.metadata["general.name"]
    assert name == DEMO_MODEL_NAME
    assert "demo" in name and "random" in name
    assert "{{ bos_token }}" in demo_llm.metadata["tokenizer.chat_template"]


def test_vocab_has_all_256_byte_tokens(demo_gguf: Path, demo_llm: llama_cpp.Llama) -> None:
    reader = gguf.GGUFReader(demo_gguf)
    field = reader.fields["tokenizer.ggml.token_type"]
    types = [int(field.parts[i][0]) for i in field.data]
    assert types.count(gguf.TokenType.BYTE) == 256
    vocab = llama_cpp.llama_model_get_vocab(demo_llm.model)
    pieces = []
    for tok in range(demo_llm.n_vocab()):
        if llama_cpp.llama_vocab_get_attr(vocab, tok) & llama_cpp.LLAMA_TOKEN_ATTR_BYTE:
            pieces.append(demo_llm.detokenize([tok]))
    assert sorted(pieces) == [bytes([b]) for b in range(256)]


@pytest.mark.parametrize(
    "text",
    ["你好\uff0c世界", "emoji 😀🎉 ok", "mixed 中文 and Ελληνικά \x00\x7f\t\n", "\U0010ffff"],
)
def test_tokenizing_unseen_characters_falls_back_to_bytes(demo_llm: llama_cpp.Llama, text: str) -> None:
    tokens = demo_llm.tokenize(text.encode(), add_bos=True, special=False)
    # After BOS llama strips the SPM dummy space, so the round trip is exact.
    assert demo_llm.detokenize(tokens).decode() == text


def test_common_words_are_single_tokens(demo_llm: llama_cpp.Llama) -> None:
    tokens = demo_llm.tokenize(b"the model", add_bos=False, special=False)
    assert [demo_llm.detokenize([t]) for t in tokens] == [b" the", b" model"]


def test_build_is_deterministic(tmp_path: Path) -> None:
    a = build_demo_model(tmp_path / "a.gguf", embd=32, layers=1)
    b = build_demo_model(tmp_path / "b.gguf", embd=32, layers=1)
    c = build_demo_model(tmp_path / "c.gguf", embd=32, layers=1, seed=1)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_ensure_builds_once_into_the_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RSB_CACHE_DIR", str(tmp_path / "cache"))
    path = default_demo_model_path()
    assert path.parent == tmp_path / "cache" and DEMO_MODEL_NAME in path.name
    assert ensure_demo_model() == path and path.is_file()

    def fail(*_: object, **__: object) -> Path:
        raise AssertionError("rebuilt")

    monkeypatch.setattr(demo_model, "build_demo_model", fail)
    assert ensure_demo_model() == path
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(path: Path, **_: object) -> Path:
        Path(path).write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(demo_model, "build_demo_model", fail)
    with pytest.raises(OSError):
        ensure_demo_model(tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []
