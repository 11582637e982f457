"""``python3 -m bench.requantize``: the default model (SmolLM2-135M-Instruct Q4_1) against itself requantized
to Q8_0 by llama.cpp's own quantizer: prefill and decode speed (alternating rounds, one thread each, so the
machine's noise hits both alike) and the greedy answers to a few prompts. docs/benchmarks.md records a run."""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
from pathlib import Path

import llama_cpp

from broker.request.generation import GenerationRequest, Message
from generator.engines.default_model import default_model_path
from generator.engines.one_sequence import OneSequenceEngine

Q8_PATH = Path("/tmp/rsb-smollm2-135m-instruct-q8_0.gguf")
PROMPTS = ("What is the capital of France?", "Give me three tips for sleeping better.",
           "Translate 'good morning' into Spanish.", "What is 12 times 7?", "Write a haiku about autumn.",
           "Explain what a CPU does in one sentence.")
LONG = "Summarize: " + " ".join(["the river runs past the old mill and the stone bridge"] * 45)


def requantize(src: Path, dst: Path) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError("llama_model_quantize failed")


def request(text: str, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(messages=(Message("user", text),), prompt=None, model=None, max_tokens=max_tokens,
                             temperature=0.0, top_p=1.0, seed=1, stop=(), cancel_on_disconnect=False)


def answer(eng: OneSequenceEngine, text: str, max_tokens: int) -> str:
    gen = eng.start(request(text, max_tokens), prefix_text="", max_tokens=max_tokens, stop=threading.Event())
    return "".join(str(p) for p in gen.pieces)


def main() -> None:
    src = default_model_path()
    assert src is not None, "the default model is not installed"
    if not Q8_PATH.exists():
        requantize(src, Q8_PATH)
    engines = {"Q4_1": OneSequenceEngine(str(src), n_threads=1, n_ctx=2048, prompt_cache_mib=0),
               "Q8_0": OneSequenceEngine(str(Q8_PATH), n_threads=1, n_ctx=2048, prompt_cache_mib=0)}
    rates: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "decode": []} for k in engines}
    for _ in range(3):
        for name, eng in engines.items():
            n = len(eng.tokenize_prompt(request(LONG, 1)))
            t0 = time.perf_counter()
            answer(eng, LONG, 1)
            rates[name]["prefill"].append(n / (time.perf_counter() - t0))
            gen = eng.start(request("Write a story about a cat.", 64), prefix_text="", max_tokens=64,
                            stop=threading.Event())
            pieces = iter(gen.pieces)
            next(pieces)
            t0 = time.perf_counter()
            k = sum(1 for _ in pieces)
            rates[name]["decode"].append(k / (time.perf_counter() - t0))
    for name, r in rates.items():
        print(f"{name}: prefill {statistics.median(r['prefill']):.0f} tokens/s {[round(x) for x in r['prefill']]}, "
              f"decode {statistics.median(r['decode']):.0f} tokens/s {[round(x) for x in r['decode']]}")
    same = 0
    for prompt in PROMPTS:
        outs = {name: answer(eng, prompt, 40) for name, eng in engines.items()}
        same += outs["Q4_1"] == outs["Q8_0"]
        print(f"{prompt!r}\n  Q4_1: {outs['Q4_1']!r}\n  Q8_0: {outs['Q8_0']!r}")
    print(f"identical greedy answers: {same} of {len(PROMPTS)}; sizes {src.stat().st_size / 1e6:.0f} MB, "
          f"{Q8_PATH.stat().st_size / 1e6:.0f} MB")
    for eng in engines.values():
        eng.close()


if __name__ == "__main__":
    main()
