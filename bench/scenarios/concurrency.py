"""concurrency: twenty chats at once on the default model and one generator: does continuous batching turn
the CPU's headroom into throughput and quick first tokens?

``--chats`` chats sent at once (each a system prompt and a different short question, a streamed OpenAI chat
completion of at most ``--max-tokens`` greedy tokens, seed 0), from a load process of its own, after one
untimed warm-up request. The same prompts go to each system, one system after another in one run:

- llama.cpp's own ``llama-server -np N`` (N = rsb's default ``--parallel``), built from the llama.cpp inside
  llama-cpp-python's sdist, the engine's own commit (bench/llama_server.py; built once and cached, a few
  minutes the first time), same model file, threads and context per sequence;
- rsb ``rsb up --generators 1 --upstream`` that same llama-server (``--concurrency N``: one request in flight
  per slot), while it still runs;
- rsb with one generator, once per ``--parallel-values`` entry: ``rsb up --generators 1 --parallel N``
  (``default`` omits the flag: the default's own figure);
- ``engine`` (not run unless named): rsb's engine alone, the generator's default engine streaming straight from
  its own HTTP process (bench/engine_app.py: no Redis, no consumer, no queue), what of the gap to llama-server
  is the engine's and what the broker's;
- ``peer`` (not run unless named): llama-cpp-python's own OpenAI server on the same model file, with the
  generator's threads (``python -m llama_cpp.server --n_threads T --n_threads_batch T --interrupt_requests
  false``: it runs one request at a time, the others wait).

Measured per system: aggregate tokens/s (completion tokens of all chats / wall time from the first request
sent to the last stream's end), TTFT (each request sent to its first content chunk) p50 and p99 (of 20, the
p99 is the slowest), per-stream tokens/s after the first token (completion tokens - 1 over first to last
content chunk) p50 and min, and how many answers equal the first system's (greedy: what batching changes).

Goals (issue 43): rsb's default aggregate at least 0.95x llama-server's and its TTFT p99 at most 1.1x; rsb
``--upstream`` llama-server at least 0.95x llama-server alone; every rsb stream at least 20 tokens/s (min).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import time
from typing import Any

import httpx
import orjson

from bench import llama_server, procs
from bench.report import goal_row, print_goals, table
from bench.stats import ratio, summarize
from broker.redis.server import free_port

SYSTEM = "You are a helpful assistant. Answer in a few clear sentences."
QUESTIONS = (
    "How does a rainbow form?",
    "Why do leaves change color in autumn?",
    "What makes bread rise?",
    "How do bees make honey?",
    "Why is the sky blue?",
    "How does a compass work?",
    "What causes the tides?",
    "How do airplanes stay in the air?",
    "Why do cats purr?",
    "How is glass made?",
    "What is a black hole?",
    "How do vaccines work?",
    "Why does ice float on water?",
    "How does a refrigerator keep food cold?",
    "What causes earthquakes?",
    "How do plants make their food?",
    "Why do we have seasons?",
    "How does a battery store energy?",
    "What makes a volcano erupt?",
    "How do birds know where to migrate?",
)
SEED = 0
WARMUP = "Say hello."


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chats", type=int, default=20, help="chats sent at once (default 20)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each greedy answer (default 128)")
    p.add_argument("--systems", default="llama-server,upstream,rsb",
                   help="which to run, in order: llama-server, upstream (rsb --upstream that llama-server), rsb "
                   "(once per --parallel-values entry), engine (rsb's engine alone), peer "
                   "(default llama-server,upstream,rsb)")
    p.add_argument("--parallel-values", default="default",
                   help="rsb up --parallel values, in order; default omits the flag (default: default)")


def question(i: int) -> str:
    q = QUESTIONS[i % len(QUESTIONS)]
    return q if i < len(QUESTIONS) else f"{q} (Question {i + 1}.)"


# -- the load process ----------------------------------------------------------------------------------


async def _chat(http: httpx.AsyncClient, model: str, text: str, max_tokens: int, t0: float) -> dict[str, Any]:
    """One streamed chat completion of one question; times are seconds from ``t0`` (the burst's start)."""
    out = await stream_chat(http, model, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
                            max_tokens, t0)
    out["question"] = text
    return out


async def stream_chat(http: httpx.AsyncClient, model: str, messages: list[dict[str, str]], max_tokens: int,
                      t0: float) -> dict[str, Any]:
    """One streamed greedy chat completion of ``messages``; times are seconds from ``t0``."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "seed": SEED, "stream": True,
            "stream_options": {"include_usage": True}, "messages": messages}
    sent = time.perf_counter() - t0
    first: float | None = None
    last = sent
    pieces: list[str] = []
    chunks = 0
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish = None
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    last = time.perf_counter() - t0
                    if first is None:
                        first = last
                    pieces.append(piece)
                    chunks += 1
                finish = choice.get("finish_reason") or finish
            if chunk.get("usage"):
                usage = chunk["usage"]
                usage_tokens = int(usage.get("completion_tokens") or 0)
                prompt_tokens = usage.get("prompt_tokens")
                cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    end = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"no content in the answer to message {len(messages)}")
    # A server that sends no usage chunk: one content chunk is one token (llama-cpp-python's server does so).
    tokens = usage_tokens if usage_tokens is not None else chunks
    return {"sent_s": sent, "ttft_ms": (first - sent) * 1000, "first_s": first, "last_s": last,
            "end_s": end, "tokens": tokens, "chunks": chunks, "usage": usage_tokens is not None,
            "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
            "finish_reason": finish, "answer": "".join(pieces)}


async def burst(ctl: Any, base: str, model: str, chats: int, max_tokens: int) -> dict[str, Any]:
    """The load process: one warm-up chat, then ``chats`` at once."""
    limits = httpx.Limits(max_connections=chats + 2, max_keepalive_connections=chats + 2)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(900), limits=limits) as http:
        await _chat(http, model, WARMUP, 8, time.perf_counter())
        ctl.mark("start")
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_chat(http, model, question(i), max_tokens, t0) for i in range(chats)))
    return {"wall_s": max(r["end_s"] for r in results), "chats": list(results)}


# -- the systems -------------------------------------------------------------------------------------


def _rsb_has_parallel() -> bool:
    """Whether this checkout's ``rsb up`` has ``--parallel`` (continuous batching, issue 31)."""
    out = subprocess.run(procs.python_module("rsb", "up", "--help"), capture_output=True, text=True,
                         cwd=procs.ROOT, timeout=120).stdout
    return "--parallel" in out


def served_model(base: str) -> str:
    """The model the pod serves (its name is the model file's: issue 29's routing refuses any other)."""
    r = httpx.get(f"{base}/v1/models", timeout=30)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def _drive(base: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = procs.run_load("bench.scenarios.concurrency:burst", {
        "base": base, "model": model, "chats": args.chats, "max_tokens": args.max_tokens}, timeout_s=1800)
    return result


def _rsb(args: argparse.Namespace, parallel: str, has_flag: bool) -> dict[str, Any]:
    flag: tuple[str, ...] = ()
    if parallel != "default" and (parallel != "1" or has_flag):
        flag = ("--parallel", parallel)
    with procs.rsb_up(*flag) as url:
        out = _drive(url, served_model(url), args)
    out["command"] = "rsb up --generators 1" + "".join(f" {f}" for f in flag)
    return out


def _rsb_upstream(args: argparse.Namespace, url: str, slots: int) -> dict[str, Any]:
    with procs.rsb_up("--upstream", url, "--concurrency", str(slots), name="rsb-up-upstream") as rsb_url:
        out = _drive(rsb_url, served_model(rsb_url), args)
    out["command"] = "rsb up --generators 1 --upstream <llama-server> --concurrency " + str(slots)
    return out


def _llama_server(args: argparse.Namespace, with_upstream: bool, alone: bool) -> dict[str, dict[str, Any]]:
    """llama-server alone, then rsb --upstream it (same server process), as asked."""
    slots = llama_server.default_parallel()
    out: dict[str, dict[str, Any]] = {}
    with llama_server.serving(slots) as (url, cmd):
        command = " ".join(["llama-server", *cmd[1:]])
        if alone:
            out["llama-server"] = _drive(url, llama_server.ALIAS, args)
            out["llama-server"]["command"] = command
        if with_upstream:
            out["rsb-upstream"] = _rsb_upstream(args, url, slots)
            out["rsb-upstream"]["upstream_command"] = command
    return out


def _engine(args: argparse.Namespace) -> dict[str, Any]:
    from bench import engine_app

    with engine_app.serving() as url:
        out = _drive(url, engine_app.ALIAS, args)
    out["command"] = engine_app.COMMAND
    return out


def _peer(args: argparse.Namespace) -> dict[str, Any]:
    from generator.engines.default_model import default_model_path
    from generator.engines.llama import physical_cores

    model = default_model_path()
    assert model is not None, "the default model is not installed"
    threads = str(physical_cores())  # what rsb's generator uses without --n-threads
    port = free_port()
    argv = ["--model", str(model), "--port", str(port), "--host", "127.0.0.1", "--n_threads", threads,
            "--n_threads_batch", threads, "--n_ctx", "4096", "--interrupt_requests", "false", "--model_alias",
            "peer"]
    server = procs.Proc(procs.python_module("llama_cpp.server", *argv), "llama-cpp-server")
    try:
        procs.wait_http(f"http://127.0.0.1:{port}/v1/models", server, 120)
        out = _drive(f"http://127.0.0.1:{port}", "peer", args)
    finally:
        server.stop(30)
    out["command"] = "python -m llama_cpp.server " + " ".join(argv)
    return out


def summary(res: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
    chats = res["chats"]
    tokens = sum(c["tokens"] for c in chats)
    per_stream = [(c["tokens"] - 1) / (c["last_s"] - c["first_s"]) for c in chats
                  if c["tokens"] > 1 and c["last_s"] > c["first_s"]]
    same = None
    if reference is not None:
        same = sum(a["answer"] == b["answer"] for a, b in zip(chats, reference["chats"], strict=True))
    return {"completion_tokens": tokens, "wall_s": res["wall_s"], "aggregate_tps": tokens / res["wall_s"],
            "ttft_ms": summarize([c["ttft_ms"] for c in chats]), "stream_tps": summarize(per_stream),
            "stream_tps_min": min(per_stream, default=float("nan")),
            "finish_reasons": {r: sum(c["finish_reason"] == r for c in chats)
                               for r in sorted({str(c["finish_reason"]) for c in chats})},
            "same_answer_as_first": same}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"params": {"chats": args.chats, "max_tokens": args.max_tokens, "system": SYSTEM,
                                      "temperature": 0, "seed": SEED}}
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - {"llama-server", "upstream", "rsb", "engine", "peer"}
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)} (llama-server, upstream, rsb, engine, peer)")
    names: list[str] = []
    has_flag = _rsb_has_parallel() if "rsb" in systems else False
    out["rsb_has_parallel_flag"] = has_flag
    served = False
    for system in systems:
        if system in ("llama-server", "upstream"):
            if served:
                continue  # one llama-server process for both
            served = True
            runs = _llama_server(args, with_upstream="upstream" in systems, alone="llama-server" in systems)
            out.update(runs)
            names += list(runs)
        elif system == "rsb":
            for value in (v for v in args.parallel_values.split(",") if v):
                name = f"rsb-p{value}" if value != "default" else "rsb-default"
                out[name] = _rsb(args, value, has_flag)
                names.append(name)
        elif system == "engine":
            out["engine"] = _engine(args)
            names.append("engine")
        elif system == "peer":
            out["peer"] = _peer(args)
            names.append("peer")
    first = names[0] if names else None
    rows = []
    for name in names:
        ref = out[first] if first and name != first else None
        s = out[name]["summary"] = summary(out[name], ref)
        rows.append([name, s["completion_tokens"], s["wall_s"], s["aggregate_tps"], s["ttft_ms"]["p50"],
                     s["ttft_ms"]["p99"], s["stream_tps"]["p50"], s["stream_tps_min"],
                     "-" if s["same_answer_as_first"] is None else f"{s['same_answer_as_first']}/{args.chats}"])
    print(table(f"\n== {args.chats} chats at once, one generator, <= {args.max_tokens} greedy tokens each",
                ["system", "tokens", "wall s", "aggregate tok/s", "TTFT p50 ms", "TTFT p99 ms", "stream tok/s p50",
                 "stream tok/s min", f"same answer as {first}"], rows))
    for name in names:
        print(f"  {name}: {out[name]['command']}; finish reasons {out[name]['summary']['finish_reasons']}")
    goals = out["goals"] = issue43_goals(out)
    if goals:
        print_goals("concurrency", goals)
    return out


def issue43_goals(out: dict[str, Any]) -> list[list[Any]]:
    """Issue 43's goals over the systems that ran (each needs llama-server's figure, or is about rsb alone)."""
    goals: list[list[Any]] = []
    peer = out["llama-server"]["summary"] if "llama-server" in out else None
    if "rsb-default" in out:
        mine = out["rsb-default"]["summary"]
        if peer is not None:
            agg = out["default_vs_llama_server_aggregate"] = ratio(mine["aggregate_tps"], peer["aggregate_tps"])
            goals.append(goal_row("rsb default / llama-server: aggregate tokens/s", agg, ">= 0.95", agg >= 0.95,
                                  "x"))
            p99 = out["default_vs_llama_server_ttft_p99"] = ratio(mine["ttft_ms"]["p99"], peer["ttft_ms"]["p99"])
            goals.append(goal_row("rsb default / llama-server: TTFT p99", p99, "<= 1.1", p99 <= 1.1, "x"))
    if "rsb-upstream" in out and peer is not None:
        agg = out["upstream_vs_llama_server_aggregate"] = ratio(out["rsb-upstream"]["summary"]["aggregate_tps"],
                                                                 peer["aggregate_tps"])
        goals.append(goal_row("rsb --upstream llama-server / llama-server: aggregate", agg, ">= 0.95", agg >= 0.95,
                              "x"))
    for name in ("rsb-default", "rsb-upstream"):
        if name in out:
            low = out[name]["summary"]["stream_tps_min"]
            goals.append(goal_row(f"{name}: per-stream tokens/s, min", low, ">= 20", low >= 20))
    return goals
