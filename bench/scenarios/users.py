"""users: twenty users each holding a five-turn conversation on one CPU (seed 000's incident), rsb against
llama.cpp's own llama-server.

``--users`` users start at once; each holds a conversation of ``--turns`` turns: a streamed greedy chat
completion (seed 0) of at most ``--max-tokens`` tokens whose prompt is the whole history (the system prompt,
every earlier question and answer, the new question), then ``--think-s`` seconds of thinking before the next
question. The first question is one of ``bench concurrency``'s twenty, the next ones follow-ups. One untimed
warm-up request first; the load runs in a process of its own. The systems, one after another in one run:

- llama.cpp's own ``llama-server -np N`` (N = rsb's default ``--parallel``; bench/llama_server.py builds it
  from the engine's own llama.cpp commit), its prompt cache as it ships (each slot keeps its last prompt's KV,
  a request goes to the slot whose cache matches it best, ``--cache-ram`` holds the others);
- rsb's default: ``rsb up --generators 1`` (its prompt cache, chat-affine claiming; ``--rsb-flags`` adds flags);
- ``engine`` (not run unless named): rsb's default engine alone, streaming straight from its own HTTP process
  (bench/engine_app.py: no Redis, no consumer, no queue): what of the gap is the engine's, what the broker's.

Measured per system and turn: TTFT (question sent to first content chunk) p50 and p99 over the users; the
aggregate tokens/s (all completion tokens / wall time from the first question to the last answer's end,
thinking included, the same for both systems).

Goals (issue 43): rsb's turn-5 TTFT p99 at most 0.7x llama-server's, and its aggregate at least 1.0x.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import time
from typing import Any

import httpx

from bench import llama_server, procs
from bench.report import goal_row, print_goals, table
from bench.scenarios.concurrency import SYSTEM, WARMUP, question, served_model, stream_chat
from bench.stats import ratio, summarize

FOLLOW_UPS = (
    "Tell me more about that.",
    "Can you give a concrete example?",
    "Why does that matter in everyday life?",
    "Sum it all up in one sentence.",
    "What else should I know?",
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--users", type=int, default=20, help="users, all starting at once (default 20)")
    p.add_argument("--turns", type=int, default=5, help="turns of each user's conversation (default 5)")
    p.add_argument("--max-tokens", type=int, default=96, help="max_tokens of each greedy answer (default 96)")
    p.add_argument("--think-s", type=float, default=1.0, help="seconds between an answer and the next question")
    p.add_argument("--systems", default="llama-server,rsb",
                   help="which to run, in order: llama-server, rsb, engine (default llama-server,rsb)")
    p.add_argument("--rsb-flags", action="append", default=None,
                   help="extra flags for rsb up (e.g. \"--prompt-cache-mib 1024\"); repeated, rsb runs once per "
                   "value (\"\" is the default), in order")


def turn_question(user: int, turn: int) -> str:
    return question(user) if turn == 0 else FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]


# -- the load process ----------------------------------------------------------------------------------


async def _user(http: httpx.AsyncClient, model: str, user: int, turns: int, max_tokens: int, think_s: float,
                t0: float) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for turn in range(turns):
        if turn:
            await asyncio.sleep(think_s)
        messages.append({"role": "user", "content": turn_question(user, turn)})
        r = await stream_chat(http, model, list(messages), max_tokens, t0)
        r.update(user=user, turn=turn + 1, prompt_chars=sum(len(m["content"]) for m in messages))
        messages.append({"role": "assistant", "content": r["answer"]})
        out.append(r)
    return out


async def conversations(ctl: Any, base: str, model: str, users: int, turns: int, max_tokens: int,
                        think_s: float) -> dict[str, Any]:
    """The load process: one warm-up chat, then ``users`` conversations at once."""
    limits = httpx.Limits(max_connections=users + 2, max_keepalive_connections=users + 2)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(900), limits=limits) as http:
        await stream_chat(http, model, [{"role": "user", "content": WARMUP}], 8, time.perf_counter())
        ctl.mark("start")
        t0 = time.perf_counter()
        per_user = await asyncio.gather(*(_user(http, model, u, turns, max_tokens, think_s, t0)
                                          for u in range(users)))
    answers = [r for rs in per_user for r in rs]
    return {"wall_s": max(r["end_s"] for r in answers), "answers": answers}


# -- the systems -------------------------------------------------------------------------------------


def _drive(base: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = procs.run_load("bench.scenarios.users:conversations", {
        "base": base, "model": model, "users": args.users, "turns": args.turns, "max_tokens": args.max_tokens,
        "think_s": args.think_s}, timeout_s=3600)
    return result


def _rsb(args: argparse.Namespace, rsb_flags: str) -> dict[str, Any]:
    flags = shlex.split(rsb_flags)
    with procs.rsb_up(*flags) as url:
        out = _drive(url, served_model(url), args)
    out["command"] = " ".join(["rsb up --generators 1", *flags])
    return out


def _llama_server(args: argparse.Namespace) -> dict[str, Any]:
    with llama_server.serving(llama_server.default_parallel()) as (url, cmd):
        out = _drive(url, llama_server.ALIAS, args)
    out["command"] = " ".join(["llama-server", *cmd[1:]])
    return out


def _engine(args: argparse.Namespace) -> dict[str, Any]:
    from bench import engine_app

    with engine_app.serving() as url:
        out = _drive(url, engine_app.ALIAS, args)
    out["command"] = engine_app.COMMAND
    return out


def summary(res: dict[str, Any], turns: int) -> dict[str, Any]:
    answers = res["answers"]
    tokens = sum(a["tokens"] for a in answers)
    per_turn = {}
    for t in range(1, turns + 1):
        these = [a for a in answers if a["turn"] == t]
        per_turn[t] = {"ttft_ms": summarize([a["ttft_ms"] for a in these]),
                       "prompt_chars_p50": summarize([a["prompt_chars"] for a in these])["p50"],
                       "tokens": sum(a["tokens"] for a in these),
                       # The prompt tokens evaluated (not served from a prompt cache), where the server says
                       # (usage.prompt_tokens_details.cached_tokens): what a cache saves, whatever the CPU's noise.
                       "prefilled_tokens": sum(a["prompt_tokens"] - (a["cached_tokens"] or 0) for a in these)
                       if all(a.get("prompt_tokens") is not None for a in these) else None}
    return {"completion_tokens": tokens, "wall_s": res["wall_s"], "aggregate_tps": tokens / res["wall_s"],
            "turns": per_turn}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"params": {"users": args.users, "turns": args.turns, "max_tokens": args.max_tokens,
                                      "think_s": args.think_s, "system": SYSTEM, "temperature": 0, "seed": 0,
                                      "rsb_flags": args.rsb_flags or [""]}}
    names = []
    for system in (s for s in args.systems.split(",") if s):
        if system == "llama-server":
            out[system] = _llama_server(args)
            names.append(system)
        elif system == "rsb":
            for flags in args.rsb_flags or [""]:
                name = f"rsb {flags}" if flags else "rsb-default"
                out[name] = _rsb(args, flags)
                names.append(name)
        elif system == "engine":
            out[system] = _engine(args)
            names.append(system)
        else:
            raise SystemExit(f"unknown system {system!r} (llama-server, rsb, engine)")
    rows = []
    for name in names:
        s = out[name]["summary"] = summary(out[name], args.turns)
        rows.append([name, s["completion_tokens"], s["wall_s"], s["aggregate_tps"]]
                    + [f"{s['turns'][t]['ttft_ms']['p50'] / 1000:.1f} / {s['turns'][t]['ttft_ms']['p99'] / 1000:.1f}"
                       for t in range(1, args.turns + 1)])
    print(table(f"\n== {args.users} users x {args.turns} turns (whole history each turn, {args.think_s:g} s "
                f"thinking, <= {args.max_tokens} greedy tokens): TTFT p50 / p99 in s per turn",
                ["system", "tokens", "wall s", "aggregate tok/s"] + [f"turn {t}" for t in range(1, args.turns + 1)],
                rows))
    print(table("prompt tokens evaluated per turn (not from a prompt cache), all users",
                ["system"] + [f"turn {t}" for t in range(1, args.turns + 1)],
                [[name] + ["-" if out[name]["summary"]["turns"][t]["prefilled_tokens"] is None
                           else out[name]["summary"]["turns"][t]["prefilled_tokens"]
                           for t in range(1, args.turns + 1)] for name in names]))
    for name in names:
        print(f"  {name}: {out[name]['command']}")
    if "llama-server" in out:
        peer = out["llama-server"]["summary"]
        last = args.turns
        goals = []
        for rsb in (n for n in names if n != "llama-server"):
            mine = out[rsb]["summary"]
            p99 = ratio(mine["turns"][last]["ttft_ms"]["p99"], peer["turns"][last]["ttft_ms"]["p99"])
            agg = ratio(mine["aggregate_tps"], peer["aggregate_tps"])
            out[rsb]["vs_llama_server"] = {f"turn_{last}_ttft_p99": p99, "aggregate": agg}
            goals += [goal_row(f"{rsb} / llama-server: turn-{last} TTFT p99", p99, "<= 0.7", p99 <= 0.7, "x"),
                      goal_row(f"{rsb} / llama-server: aggregate tokens/s", agg, ">= 1.0", agg >= 1.0, "x")]
        if goals:
            print_goals("users", goals)
    return out
