"""determinism: how often an answer decoded inside a batch (``--parallel N``) is the same text as the same
request decoded alone (``--parallel 1``), on the default model.

Each round sends ``--requests`` requests at once to an engine of ``--parallel`` sequences: greedy free text,
seeded sampled free text, a json_schema answer and a forced tool call, in turn. Each answer is compared with
the same request's answer from a one-sequence engine (run alone, one at a time). With ``--prompt-cache-mib 0``
on both, nothing is shared between prompts, so what differs is only what the batch's company changed:
llama.cpp's kernels round a token's logits by the shape of the batch it is in, and a near tie then goes the
other way. Prints equal answers of all, per kind, and the first differing piece's position.
"""

from __future__ import annotations

import argparse
import threading
from typing import Any

from bench.report import table
from broker.request.generation import GenerationRequest, RequestLimits, validate_create_body

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TOPICS = ("rivers", "lamps", "winter", "bridges", "orchards", "copper", "islands", "markets", "candles", "mirrors",
          "harbors", "meadows", "castles", "ribbons", "forests", "letters")
KINDS = ("greedy", "seeded", "json_schema", "tool_call")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parallel", type=int, default=8, help="sequences of the batched engine (default 8)")
    p.add_argument("--requests", type=int, default=8, help="requests sent at once per round (default 8)")
    p.add_argument("--rounds", type=int, default=4, help="rounds (default 4)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per answer at most (default 64)")
    p.add_argument("--prompt-cache-mib", type=int, default=0, help="both engines' prompt cache (default 0: off)")
    p.add_argument("--n-threads", type=int, default=2, help="llama.cpp threads (default 2)")


def request(i: int, max_tokens: int) -> GenerationRequest:
    kind = KINDS[i % len(KINDS)]
    topic = TOPICS[i % len(TOPICS)]
    body: dict[str, Any] = {"messages": [{"role": "user", "content": f"Write about {topic}."}],
                            "max_tokens": max_tokens, "temperature": 0}
    if kind == "seeded":
        body.update(temperature=0.8, top_p=0.95, seed=i)
    elif kind == "json_schema":
        body["messages"] = [{"role": "user", "content": f"Describe a city known for {topic} as JSON."}]
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    elif kind == "tool_call":
        body["messages"] = [{"role": "user", "content": f"What is the weather where {topic} are?"}]
        body.update(tools=[WEATHER], tool_choice="required")
    return validate_create_body(body, RequestLimits(max_tokens=4096))[1]


def answer(eng: Any, req: GenerationRequest) -> list[object]:
    from generator.engines.pieces import ToolCallStart

    gen = eng.start(req, prefix_text="", max_tokens=req.max_tokens, stop=threading.Event())
    # A call's id is random: compared by index and name.
    return [(p.index, p.name) if isinstance(p, ToolCallStart) else p for p in gen.pieces]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from generator.engines.batch_engine import BatchedEngine
    from generator.engines.default_model import default_model_path
    from generator.engines.one_sequence import OneSequenceEngine

    path = default_model_path()
    if path is None:
        raise SystemExit("the default model is not installed (scripts/model-requirements.txt)")
    reqs = [request(i, args.max_tokens) for i in range(args.requests)]
    alone = OneSequenceEngine(str(path), n_threads=args.n_threads, n_ctx=2048, prompt_cache_mib=args.prompt_cache_mib)
    try:
        expected = [answer(alone, r) for r in reqs]
    finally:
        alone.close()
    batched = BatchedEngine(str(path), parallel=args.parallel, n_threads=args.n_threads, n_ctx=2048,
                            prompt_cache_mib=args.prompt_cache_mib)
    equal = dict.fromkeys(KINDS, 0)
    total = dict.fromkeys(KINDS, 0)
    first_diff: list[int] = []
    try:
        for _ in range(args.rounds):
            got: list[list[object]] = [[] for _ in reqs]
            barrier = threading.Barrier(len(reqs))

            def one(i: int, out: list[list[object]] = got, b: threading.Barrier = barrier) -> None:
                b.wait()
                out[i] = answer(batched, reqs[i])

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for i, (want, have) in enumerate(zip(expected, got, strict=True)):
                kind = KINDS[i % len(KINDS)]
                total[kind] += 1
                if want == have:
                    equal[kind] += 1
                else:
                    first_diff.append(next((j for j, (a, b) in enumerate(zip(want, have, strict=False)) if a != b),
                                           min(len(want), len(have))))
    finally:
        batched.close()
    rows: list[list[Any]] = [[k, equal[k], total[k]] for k in KINDS]
    rows.append(["all", sum(equal.values()), sum(total.values())])
    print(table(f"\n== {args.rounds} rounds x {args.requests} requests at once, --parallel {args.parallel}, "
                f"prompt cache {args.prompt_cache_mib} MiB: answers equal to the same request run alone",
                ["kind", "equal", "of"], rows))
    if first_diff:
        print(f"first differing piece of each differing answer: {sorted(first_diff)}")
    return {"params": {"parallel": args.parallel, "requests": args.requests, "rounds": args.rounds,
                       "max_tokens": args.max_tokens, "prompt_cache_mib": args.prompt_cache_mib},
            "equal": equal, "total": total, "first_diff": first_diff}
