"""Fixtures for the llama.cpp engine tests: one demo model per session, engines on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import pytest

from generator.demo_model import build_demo_model
from generator.llama_engine import LlamaEngine


@pytest.fixture(scope="session")
def demo_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo-model") / "demo.gguf")


@pytest.fixture(scope="session")
def demo_llm(demo_gguf: Path) -> Iterator[llama_cpp.Llama]:
    llm = llama_cpp.Llama(model_path=str(demo_gguf), n_threads=1, verbose=False)
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def engine(demo_gguf: Path) -> Iterator[LlamaEngine]:
    """EOS masked, so answers are exactly max_tokens long. One thread: the test machine is shared."""
    eng = LlamaEngine(str(demo_gguf), n_threads=1, n_ctx=2048, ignore_eos=True)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def engine_eos(demo_gguf: Path) -> Iterator[LlamaEngine]:
    """EOS allowed: answers end early about once per vocabulary-size tokens."""
    eng = LlamaEngine(str(demo_gguf), n_threads=1, n_ctx=4096)
    yield eng
    eng.close()
