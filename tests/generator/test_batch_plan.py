"""The batch's step plan (generator.engines.batch_plan) without a model: which sequences answer, which prompts
prefill how many tokens (under the step's budget, in order of arrival, up to a block boundary), which rows are
sampled and when the next turns being prepared may prefill. Each case runs steps as the batcher does: plan, then
every sequence's ``pos`` past its rows."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from generator.engines.batch_plan import PREFILL_STEP_TOKENS, StepPlan, plan_step
from generator.engines.prompt_cache import BLOCK_TOKENS

B = BLOCK_TOKENS


@dataclass(eq=False)
class Seq:
    """A sequence of the batch: ``cached`` is the prefix its begin finds in the cache."""

    name: str
    length: int
    pos: int = 0
    begun: bool = False
    cached: int = 0

    def __post_init__(self) -> None:
        self.tokens = list(range(self.length))


def answering(name: str) -> Seq:
    return Seq(name, 10, pos=12, begun=True)  # its prompt and two answered tokens


def begin(seq: Seq) -> None:
    seq.begun = True
    seq.pos = seq.cached


# What a step decodes, as plain names: answering sequences, prefill chunks (name, start, end), preparation
# chunks, sampled rows (row, name), preparations done, prompt tokens of the budget.
Step = tuple[list[str], list[tuple[str, int, int]], list[tuple[str, int, int]], list[tuple[int, str]], list[str], int]


def shown(plan: StepPlan[Seq, Seq]) -> Step:
    return ([s.name for s in plan.answering], [(c.of.name, c.start, c.end) for c in plan.prefills],
            [(c.of.name, c.start, c.end) for c in plan.preparations], [(i, s.name) for i, s in plan.sampled],
            [p.name for p in plan.prepared], plan.prefill_tokens)


def steps(running: list[Seq], preparing: list[Seq], n: int, budget: int = PREFILL_STEP_TOKENS) -> list[Step]:
    """``n`` steps, each applied as the batcher applies it (a prompt that ends its prefill then answers)."""
    out = []
    for _ in range(n):
        plan = plan_step(running, preparing, begin=begin, begin_preparation=begin, budget=budget)
        assert plan.rows == len(plan.answering) + sum(c.end - c.start for c in (*plan.prefills, *plan.preparations))
        for seq in plan.answering:
            seq.pos += 1
        for chunk in (*plan.prefills, *plan.preparations):
            chunk.of.pos = chunk.end
        for prep in plan.prepared:
            preparing.remove(prep)
        out.append(shown(plan))
    return out


CASES = {
    "all answering": (
        lambda: ([answering("a"), answering("b"), answering("c")], []), 1, PREFILL_STEP_TOKENS,
        [(["a", "b", "c"], [], [], [(0, "a"), (1, "b"), (2, "c")], [], 0)],
    ),
    "a new prompt prefilled block by block while the others answer, its last token sampled": (
        lambda: ([answering("a"), Seq("new", 2 * B + 22), answering("b")], []), 4, PREFILL_STEP_TOKENS,
        [(["a", "b"], [("new", 0, B)], [], [(0, "a"), (1, "b")], [], B),
         (["a", "b"], [("new", B, 2 * B)], [], [(0, "a"), (1, "b")], [], B),
         (["a", "b"], [("new", 2 * B, 2 * B + 22)], [], [(0, "a"), (1, "b"), (2 + 22 - 1, "new")], [], 22),
         (["a", "new", "b"], [], [], [(0, "a"), (1, "new"), (2, "b")], [], 0)],
    ),
    "a cached prefix skipped: the prefill starts at its end": (
        lambda: ([Seq("new", 2 * B + 5, cached=2 * B)], []), 2, PREFILL_STEP_TOKENS,
        [([], [("new", 2 * B, 2 * B + 5)], [], [(4, "new")], [], 5),
         (["new"], [], [], [(0, "new")], [], 0)],
    ),
    "the budget shared in order of arrival": (
        lambda: ([Seq("first", B + 36), Seq("second", 30), answering("a")], []), 3, PREFILL_STEP_TOKENS,
        [(["a"], [("first", 0, B)], [], [(0, "a")], [], B),
         (["a"], [("first", B, B + 36), ("second", 0, 28)], [], [(0, "a"), (36, "first")], [], B),
         (["first", "a"], [("second", 28, 30)], [], [(0, "first"), (1, "a"), (3, "second")], [], 2)],
    ),
    "a chunk ends at a block boundary even with budget left": (
        lambda: ([Seq("first", 3 * B, pos=B - 8, begun=True), Seq("second", 3 * B)], []), 1, 2 * B,
        [([], [("first", B - 8, B), ("second", 0, B)], [], [], [], B + 8)],
    ),
    "preparations wait while a generation runs": (
        lambda: ([Seq("new", 10)], [Seq("prep", 2 * B)]), 2, PREFILL_STEP_TOKENS,
        [([], [("new", 0, 10)], [], [(9, "new")], [], 10),
         (["new"], [], [], [(0, "new")], [], 0)],
    ),
    "preparations prefill while nothing runs, and end when prefilled or found cached": (
        lambda: ([], [Seq("cached", B, cached=B), Seq("prep", 2 * B, cached=B), Seq("later", B)]), 2,
        PREFILL_STEP_TOKENS,
        [([], [], [("prep", B, 2 * B)], [], ["cached", "prep"], B),
         ([], [], [("later", 0, B)], [], ["later"], B)],
    ),
    "an empty plan": (lambda: ([], []), 1, PREFILL_STEP_TOKENS, [([], [], [], [], [], 0)]),
}


@pytest.mark.parametrize("case", CASES)
def test_step_plans(case: str) -> None:
    make, n, budget, expected = CASES[case]
    running, preparing = make()
    assert steps(running, preparing, n, budget) == expected


def test_a_prompt_begins_only_when_the_budget_reaches_it() -> None:
    """Its cached prefix is copied in at the step that first prefills it, not before."""
    first, second = Seq("first", 3 * B), Seq("second", B, cached=B - 1)
    plan: StepPlan[Seq, Seq] = plan_step([first, second], [], begin=begin, begin_preparation=begin)
    assert first.begun and not second.begun and [c.of for c in plan.prefills] == [first]
