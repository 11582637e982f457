"""generator: a long llama.cpp generation through the rsb worker into Redis vs a bare Llama.generate loop.

Same model (``--model smollm2``, the default: the real SmolLM2-135M-Instruct that ``rsb up`` serves; or
``--model demo``: the random-weight demo model of generator.engines.demo_model, far faster per token, so
rsb's own cost per token weighs far more), end-of-sequence masked so every run makes exactly ``--tokens``
tokens, prompt, seed, sampler, threads and context.
Bare: ``Llama.generate`` in its own process, a time stamp per token. rsb: ``rsb generator --ignore-eos``
and a stream created through the StreamStore; a token's time is the Redis entry id (ms) of the delta that
completed its text, the start is the ``started`` event (appended just before prefill, as the bare clock
starts before prefill). Token positions in the rsb text come from the bare run's pieces (same seed, so the
same tokens: checked by comparing the full texts). Rounds alternate bare / rsb; medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

from bench import procs
from bench.loadproc import Control
from bench.report import goal_row, print_goals, table
from bench.stats import ratio
from broker.events import parse_event_id
from broker.redis.connection import connect
from broker.request.generation import RequestLimits, parse_create_body
from broker.streams.stream_store import StreamStore

PROMPT = "Once upon a time, in a stream broker far away,"
SEED, TEMPERATURE, TOP_P, TOP_K = 1234, 0.8, 0.95, 40


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=("smollm2", "demo"), default="smollm2",
                   help="smollm2: the default model (real weights, ~50 tokens/s here); demo: random weights (default "
                        "smollm2)")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per generation (default 600 for smollm2, 4000 for demo)")
    p.add_argument("--rounds", type=int, default=3, help="alternating bare/rsb rounds (default 3)")
    p.add_argument("--n-threads", type=int, default=1, help="llama.cpp threads, both sides (default 1)")
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--embd", type=int, default=64, help="demo model width (default 64: the rsb demo model)")
    p.add_argument("--layers", type=int, default=2, help="demo model blocks (default 2)")
    p.add_argument("--window", type=int, default=None,
                   help="first/last N tokens compared (default a sixth of --tokens, at most 500)")


async def bare_generate(ctl: Control, model: str, tokens: int, n_threads: int, n_ctx: int,
                        rounds: int) -> dict[str, Any]:
    """Bare ``Llama.generate``: per-token times (s from start) of each round, and each token's text."""
    import llama_cpp
    import numpy as np

    from generator.engines.detokenizer import IncrementalDetokenizer, LlamaPieces

    llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                          verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    eog_ids = np.fromiter(sorted(t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)),
                          dtype=np.intp)
    bos = llm.token_bos()
    prompt = llm.tokenize(PROMPT.encode(), add_bos=False, special=True)
    if bos >= 0 and llama_cpp.llama_vocab_get_add_bos(vocab) and (not prompt or prompt[0] != bos):
        prompt.insert(0, bos)
    llm.eval([bos])
    llm.reset()

    def mask_eog(_ids: Any, scores: Any) -> Any:
        scores[eog_ids] = -np.inf
        return scores

    processors = llama_cpp.LogitsProcessorList([mask_eog])
    runs: list[list[float]] = []
    out_tokens: list[int] = []
    for _ in range(rounds):
        await ctl_wait(ctl)
        llm.reset()
        llm.set_seed(SEED)
        out_tokens = []
        times: list[float] = []
        t0 = time.perf_counter()
        for tok in llm.generate(prompt, temp=TEMPERATURE, top_p=TOP_P, top_k=TOP_K, min_p=0.0, typical_p=1.0,
                                repeat_penalty=1.0, logits_processor=processors):
            times.append(time.perf_counter() - t0)
            out_tokens.append(tok)
            if len(out_tokens) >= tokens:
                break
        runs.append(times)
        ctl.mark("round")
    space_prefix = llama_cpp.llama_vocab_type(vocab) == llama_cpp.LLAMA_VOCAB_TYPE_SPM and (
        llm.metadata.get("tokenizer.ggml.add_space_prefix", "true") != "false")
    detok = IncrementalDetokenizer(LlamaPieces(vocab, llm.n_vocab()), strip_leading_space=space_prefix and bool(
        llama_cpp.llama_vocab_is_control(vocab, prompt[-1])))
    pieces = [detok.push(t) for t in out_tokens]
    pieces[-1] += detok.flush()
    return {"runs": runs, "pieces": pieces, "prompt_tokens": len(prompt)}


async def ctl_wait(ctl: Control) -> None:
    ctl.mark("ready")
    await ctl.wait_go()


async def rsb_generate(redis_url: str, tokens: int) -> list[tuple[int, str, str]]:
    """Create one stream, wait for its end, return its events as (id ms, type, delta text)."""
    redis = connect(redis_url)
    store = StreamStore(redis)
    sid = uuid.uuid4()
    _, req = parse_create_body(orjson.dumps({"prompt": PROMPT, "max_tokens": tokens, "seed": SEED,
                                             "temperature": TEMPERATURE, "top_p": TOP_P}),
                               RequestLimits(max_tokens=1 << 20, default_max_tokens=tokens))
    await store.create(sid, req, model="demo", max_queue=0, retention_s=3600)
    while True:
        st = await store.status(sid)
        if st is not None and st.status in ("done", "error", "cancelled"):
            break
        await asyncio.sleep(0.05)
    events, after = [], None
    while page := await store.read(sid, after, count=4096):
        events += page
        after = page[-1].id
    await redis.aclose()
    out = []
    for e in events:
        key = parse_event_id(e.id)
        assert key is not None
        out.append((key[0], e.type, e.json().get("text", "") if e.type == "delta" else ""))
    return out


def _rsb_times(events: list[tuple[int, str, str]], pieces: list[str]) -> tuple[list[float], bool]:
    """Per-token times (s from ``started``) of an rsb run, via the bare run's per-token text lengths."""
    start = next(ms for ms, t, _ in events if t == "started")
    deltas = [(ms, text) for ms, t, text in events if t == "delta"]
    same = "".join(t for _, t in deltas) == "".join(pieces)
    ends, cum = [], 0
    for _, text in deltas:
        cum += len(text)
        ends.append(cum)
    total = ends[-1] if ends else 0
    times, cum = [], 0
    for i, p in enumerate(pieces):
        cum += len(p)
        target = cum if same else round(total * (i + 1) / len(pieces))
        j = min(bisect.bisect_left(ends, target), len(deltas) - 1)
        times.append((deltas[j][0] - start) / 1000)
    return times, same


def _rates(times: list[float], window: int) -> dict[str, float]:
    n = len(times)
    return {"tokens": n, "tokens_per_s": n / times[-1], "first_window_s": times[window - 1],
            "last_window_s": times[-1] - times[n - window - 1]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from generator.engines.default_model import default_model
    from generator.engines.demo_model import build_demo_model

    if args.tokens is None:
        args.tokens = 600 if args.model == "smollm2" else 4000
    if args.window is None:
        args.window = min(500, args.tokens // 6)
    if args.model == "smollm2":
        model = str(default_model().path)
        model_name = "SmolLM2-135M-Instruct (the default model)"
    else:
        tmp = Path(tempfile.mkdtemp(prefix="rsb-bench-model-"))
        model = str(build_demo_model(tmp / f"demo-{args.embd}x{args.layers}.gguf", embd=args.embd,
                                     layers=args.layers))
        model_name = f"demo {args.embd}x{args.layers} (random weights)"
    out: dict[str, Any] = {"params": {"tokens": args.tokens, "rounds": args.rounds, "n_threads": args.n_threads,
                                      "n_ctx": args.n_ctx, "model": model_name,
                                      "prompt": PROMPT, "seed": SEED, "temperature": TEMPERATURE, "top_p": TOP_P}}
    bare_runs: list[dict[str, float]] = []
    rsb_runs: list[dict[str, float]] = []
    with procs.redis_server() as server, procs.procs() as started:
        gen = procs.start_llama_generator(server.url, model, "--ignore-eos", "--n-threads", str(args.n_threads),
                                          "--n-ctx", str(args.n_ctx))
        started.append(gen)
        bare = procs.Load("bench.scenarios.generator:bare_generate",
                          {"model": model, "tokens": args.tokens, "n_threads": args.n_threads, "n_ctx": args.n_ctx,
                           "rounds": args.rounds}, name="bare")
        rsb_events = []
        try:
            for _ in range(args.rounds):
                bare.marks.pop("round", None)
                bare.wait_mark("ready", 120)
                bare.marks.pop("ready", None)
                bare.go()
                bare.wait_mark("round", 600)
                rsb_events.append(asyncio.run(rsb_generate(server.url, args.tokens)))
            res = bare.finish(120)
        finally:
            bare.kill()
    pieces = res["pieces"]
    same_all = True
    for times in res["runs"]:
        bare_runs.append(_rates(times, args.window))
    for events in rsb_events:
        times, same = _rsb_times(events, pieces)
        same_all = same_all and same
        rsb_runs.append(_rates(times, args.window))

    def med(runs: list[dict[str, float]], k: str) -> float:
        return statistics.median(r[k] for r in runs)

    b_tps, r_tps = med(bare_runs, "tokens_per_s"), med(rsb_runs, "tokens_per_s")
    out["bare"] = {"runs": bare_runs, "tokens_per_s": b_tps}
    out["rsb"] = {"runs": rsb_runs, "tokens_per_s": r_tps, "same_text_as_bare": same_all}
    out["ratio_tokens_per_s"] = rr = ratio(r_tps, b_tps)
    first, last = med(rsb_runs, "first_window_s"), med(rsb_runs, "last_window_s")
    b_first, b_last = med(bare_runs, "first_window_s"), med(bare_runs, "last_window_s")
    w = args.window
    out["rsb"]["last_over_first_window"] = lf = ratio(last, first)
    out["bare"]["last_over_first_window"] = ratio(b_last, b_first)
    # What rsb adds per token in each window (the engine itself slows down as the context fills).
    over_first, over_last = (first - b_first) / w * 1000, (last - b_last) / w * 1000
    out["rsb"]["overhead_ms_per_token_first_window"] = over_first
    out["rsb"]["overhead_ms_per_token_last_window"] = over_last
    print(table(f"\n== generator: {args.tokens} tokens, {model_name}, "
                f"{args.n_threads} thread(s), median of {args.rounds}",
                ["path", "tokens/s", f"first {w} s", f"last {w} s", "runs tokens/s"],
                [["bare Llama.generate", b_tps, med(bare_runs, "first_window_s"), med(bare_runs, "last_window_s"),
                  " ".join(f"{r['tokens_per_s']:.0f}" for r in bare_runs)],
                 ["rsb worker -> Redis", r_tps, first, last, " ".join(f"{r['tokens_per_s']:.0f}" for r in rsb_runs)]]))
    print(f"rsb text identical to bare (same tokens): {same_all}; rsb overhead per token: first {w} "
          f"{over_first:.3f} ms, last {w} {over_last:.3f} ms")
    # llama.cpp itself slows down as its context fills: rsb may not add to that (its own slowdown within 0.02).
    b_lf = out["bare"]["last_over_first_window"]
    out["goals"] = {"ge_98pct_tokens_per_s": rr >= 0.98, "slowdown_as_bare": lf <= b_lf + 0.02,
                    "overhead_flat": over_last <= max(over_first, 0.0) + 0.005}
    print_goals("generator", [
        goal_row("rsb / bare tokens/s", rr * 100, ">= 98%", rr >= 0.98, "%"),
        goal_row(f"last {w} / first {w} time (rsb)", lf, f"<= {b_lf + 0.02:.2f} (bare's + 0.02)",
                 out["goals"]["slowdown_as_bare"]),
        goal_row(f"rsb overhead ms/token, last {w} vs first", over_last,
                 f"<= {max(over_first, 0.0) + 0.005:.3f}", out["goals"]["overhead_flat"]),
    ])
    return out
