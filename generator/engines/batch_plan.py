"""What one step of the batch decodes (generator.engines.batch), decided over plain data: no llama.cpp, so the
rules are tested without a model (tests/generator/test_batch_plan.py).

A step's batch holds, in this order: the next token of every sequence that is answering (each sampled); then up
to ``budget`` prompt tokens (``PREFILL_STEP_TOKENS``) of the prompts still being prefilled, in order of arrival,
each chunk ending at a prefill block's boundary (generator.engines.prompt_cache: prompts prefill in whole,
cacheable blocks), a prompt's last token sampled in the step that prefills it; then, only while no generation
runs, the same budget's blocks of the next turns being prepared (never sampled). A prompt or a preparation
starts (``begin``: the batcher copies its cached prefix in, which sets ``pos``) when the budget first reaches
it. The batcher then hands llama.cpp these rows in order of sequence id (a stable sort: a prompt's rows keep
their order), which is how llama.cpp makes one pass of sequences whose ids follow each other."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from generator.engines.prompt_cache import BLOCK_TOKENS

#: Prompt tokens one step prefills at most (across the prompts waiting): what bounds the time a step adds to
#: the answers already running. One prefill block, so prefilled prompts stay in whole cacheable blocks.
PREFILL_STEP_TOKENS = BLOCK_TOKENS


class Prefilling(Protocol):
    """A sequence of the batch as the plan sees it: its prompt, the positions its KV holds, whether it began."""

    tokens: list[int]
    pos: int
    begun: bool


S = TypeVar("S", bound=Prefilling)
P = TypeVar("P", bound=Prefilling)
T = TypeVar("T", bound=Prefilling)


@dataclass(frozen=True, slots=True)
class Chunk(Generic[T]):
    """Prompt positions [start, end) of ``of``, in this step's batch."""

    of: T
    start: int
    end: int


@dataclass(slots=True)
class StepPlan(Generic[S, P]):
    """One step's batch: ``answering`` (a row each, first), then ``prefills``' rows, then ``preparations``'."""

    answering: list[S] = field(default_factory=list)
    prefills: list[Chunk[S]] = field(default_factory=list)
    preparations: list[Chunk[P]] = field(default_factory=list)
    #: Rows whose logits are sampled, and for which sequence: every answering one, and each prompt whose
    #: prefill this step ends (its last token's row).
    sampled: list[tuple[int, S]] = field(default_factory=list)
    #: Preparations done once this step is decoded (or found whole in the cache: no rows).
    prepared: list[P] = field(default_factory=list)
    #: Prompt tokens of the step (of the budget).
    prefill_tokens: int = 0

    @property
    def rows(self) -> int:
        return (len(self.answering) + sum(c.end - c.start for c in self.prefills)
                + sum(c.end - c.start for c in self.preparations))


def prefilling(seq: Prefilling) -> bool:
    return seq.pos < len(seq.tokens)


def _take(seq: Prefilling, budget: int) -> int:
    """Prompt tokens ``seq`` prefills in a step with ``budget`` left: up to its next block boundary."""
    return min(budget, len(seq.tokens) - seq.pos, BLOCK_TOKENS - seq.pos % BLOCK_TOKENS)


def plan_step(running: Sequence[S], preparing: Sequence[P], *, begin: Callable[[S], object],
              begin_preparation: Callable[[P], object], budget: int = PREFILL_STEP_TOKENS) -> StepPlan[S, P]:
    """The batch of one step over ``running`` (in order of arrival) and ``preparing``. Only ``begin`` and
    ``begin_preparation`` change anything (a sequence's ``begun`` and ``pos``); the batcher moves each sequence's
    ``pos`` past its rows."""
    plan: StepPlan[S, P] = StepPlan()
    for seq in running:
        if not prefilling(seq):
            plan.sampled.append((len(plan.answering), seq))
            plan.answering.append(seq)
    rows = len(plan.answering)
    left = budget
    for seq in running:
        if left <= 0:
            break
        if not prefilling(seq):
            continue
        if not seq.begun:
            begin(seq)
        take = _take(seq, left)
        plan.prefills.append(Chunk(seq, seq.pos, seq.pos + take))
        rows += take
        left -= take
        if seq.pos + take >= len(seq.tokens):
            plan.sampled.append((rows - 1, seq))
    # A preparation only while no generation runs: its blocks would slow every answer's step.
    for prep in preparing if not running else ():
        if left <= 0:
            break
        if not prep.begun:
            begin_preparation(prep)
            if not prefilling(prep):
                plan.prepared.append(prep)  # all of it was cached already
                continue
        take = _take(prep, left)
        plan.preparations.append(Chunk(prep, prep.pos, prep.pos + take))
        rows += take
        left -= take
        if prep.pos + take >= len(prep.tokens):
            plan.prepared.append(prep)
    plan.prefill_tokens = budget - left
    return plan
