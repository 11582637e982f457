"""chat: time to first token of interleaved chats, turn by turn, on the default model: is a follow-up turn's
first token as quick as the first turn's, whatever its history?

``--chats`` chats of ``--turns`` turns, interleaved turn by turn (chat 0's turn 1, chat 1's turn 1, ..., chat
0's turn 2, ...), one request at a time, each turn a user message of about ``--user-words`` words and a
greedy answer of ``--answer-tokens`` tokens that goes into the next turn's history. Sent as OpenAI chat
completions (streamed; TTFT = request sent to first content chunk) to three systems in one run, each with
the same prompts:

- rsb with its prompt cache: ``rsb up --generators 2 --n-threads 1`` (chat-affine claiming sends each turn
  to the generator that ran the last one);
- rsb without: the same with ``--prompt-cache-mib 0`` (every turn evaluates its whole history, as before);
- llama-cpp-python's own OpenAI server with its prompt cache on (``python -m llama_cpp.server --cache true``,
  one thread: one request at a time runs here, as on one rsb generator).

Goals: rsb's turn-5 TTFT p50 at most 1.2x its turn-1 p50, and at every turn at most the peer's.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import httpx
import orjson

from bench import procs
from bench.report import goal_row, print_goals, table
from bench.stats import ratio, summarize
from broker.redis.server import free_port

WORDS = ("river stone cloud lamp orchard silver quiet engine harbor window meadow copper lantern thistle valley "
         "ember garden letter market bridge winter summer forest castle ribbon pocket island candle mirror").split()
SYSTEM = "You are a helpful assistant. Answer briefly."


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chats", type=int, default=3, help="interleaved chats (default 3)")
    p.add_argument("--turns", type=int, default=5, help="turns per chat (default 5)")
    p.add_argument("--user-words", type=int, default=160, help="words per user message (~250 tokens; default 160)")
    p.add_argument("--answer-tokens", type=int, default=16, help="greedy answer length in tokens (default 16)")
    p.add_argument("--systems", default="rsb-cache,rsb-nocache,peer",
                   help="which to run, in order (default rsb-cache,rsb-nocache,peer)")


def user_message(chat: int, turn: int, words: int) -> str:
    rng = random.Random(chat * 1000 + turn)
    return f"Question {turn + 1}: what do these words have in common? " + " ".join(
        rng.choice(WORDS) for _ in range(words))


def ttft(http: httpx.Client, model: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str, int]:
    """(ms to the first content chunk, the answer, cached prompt tokens as the server reports them)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    cached = 0
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if first is None:
                        first = time.perf_counter()
                    text.append(piece)
            usage = chunk.get("usage") or {}
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or cached)
    assert first is not None, "no content"
    return (first - t0) * 1000, "".join(text), cached


def run_chats(base: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    chats = [[{"role": "system", "content": SYSTEM}] for _ in range(args.chats)]
    per_turn: list[list[float]] = [[] for _ in range(args.turns)]
    cached: list[list[int]] = [[] for _ in range(args.turns)]
    with httpx.Client(base_url=base, timeout=600) as http:
        for t in range(args.turns):
            for c, msgs in enumerate(chats):
                msgs.append({"role": "user", "content": user_message(c, t, args.user_words)})
                ms, answer, n_cached = ttft(http, model, msgs, args.answer_tokens)
                per_turn[t].append(ms)
                cached[t].append(n_cached)
                msgs.append({"role": "assistant", "content": answer})
    return {"ttft_ms": [summarize(v) for v in per_turn], "cached_tokens": cached}


def _rsb(args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    port = free_port()
    up = procs.Proc(procs.python_module("rsb", "up", "--generators", "2", "--n-threads", "1", "--port", str(port),
                                        "--log-level", "info", *procs.UNLIMITED_LOAD, *extra), "rsb-up")
    try:
        procs.wait_http(f"http://127.0.0.1:{port}/healthz", up, 120)
        deadline = time.monotonic() + 120
        while up.output().count("generator ready") < 2:
            if not up.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"rsb up: generators not ready:\n{up.output()[-3000:]}")
            time.sleep(0.1)
        return run_chats(f"http://127.0.0.1:{port}", "rsb", args)
    finally:
        up.stop(30)


def _peer(args: argparse.Namespace) -> dict[str, Any]:
    from generator.engines.default_model import default_model_path

    model = default_model_path()
    assert model is not None, "the default model is not installed"
    port = free_port()
    server = procs.Proc(procs.python_module(
        "llama_cpp.server", "--model", str(model), "--port", str(port), "--host", "127.0.0.1", "--n_threads", "1",
        "--n_threads_batch", "1", "--n_ctx", "4096", "--cache", "true", "--model_alias", "peer"), "llama-cpp-server")
    try:
        procs.wait_http(f"http://127.0.0.1:{port}/v1/models", server, 120)
        return run_chats(f"http://127.0.0.1:{port}", "peer", args)
    finally:
        server.stop(30)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"params": {"chats": args.chats, "turns": args.turns, "user_words": args.user_words,
                                      "answer_tokens": args.answer_tokens}}
    runners = {"rsb-cache": lambda: _rsb(args), "rsb-nocache": lambda: _rsb(args, "--prompt-cache-mib", "0"),
               "peer": lambda: _peer(args)}
    systems = [s for s in args.systems.split(",") if s]
    for name in systems:
        out[name] = runners[name]()
    rows = []
    for t in range(args.turns):
        row: list[Any] = [t + 1]
        for name in systems:
            s = out[name]["ttft_ms"][t]
            row += [s["p50"], s["p99"]]
        rows.append(row)
    header = ["turn"] + [f"{n} {q}" for n in systems for q in ("p50", "p99")]
    print(table(f"\n== {args.chats} interleaved chats x {args.turns} turns, ~{args.user_words}-word user messages, "
                f"{args.answer_tokens}-token greedy answers: TTFT ms", header, rows))
    goals = []
    if "rsb-cache" in out:
        mine = out["rsb-cache"]["ttft_ms"]
        growth = ratio(mine[-1]["p50"], mine[0]["p50"])
        out["rsb_last_to_first_turn_p50"] = growth
        goals.append(goal_row(f"rsb turn {args.turns} / turn 1 TTFT p50", growth, "<= 1.2", growth <= 1.2, "x"))
        if "peer" in out:
            peer = out["peer"]["ttft_ms"]
            worst = max(ratio(mine[t]["p50"], peer[t]["p50"]) for t in range(args.turns))
            out["rsb_to_peer_worst_turn_p50"] = worst
            goals.append(goal_row("rsb / peer TTFT p50, worst turn", worst, "<= 1", worst <= 1.0, "x"))
        if "rsb-nocache" in out:
            out["nocache_last_to_first_turn_p50"] = ratio(out["rsb-nocache"]["ttft_ms"][-1]["p50"],
                                                          out["rsb-nocache"]["ttft_ms"][0]["p50"])
    if goals:
        print_goals("chat", goals)
    return out
