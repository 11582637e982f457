"""The prompt cache of the in-process llama.cpp engine: the KV state of recent prompts, so a follow-up turn
(or any prompt sharing a prefix with a recent one) starts from the longest cached prefix instead of
re-evaluating the whole history.

Exactness (one sequence, ``--parallel 1``). A seeded answer must not depend on what the cache held. Every
prompt is evaluated in fixed, aligned blocks (positions [0, B), [B, 2B), ...: ``blocks``), and only whole blocks
of *prefilled* prompt tokens are ever reused. The KV of block k is then a function of the tokens of blocks 0..k
alone, computed by the same batch shapes whether it was computed now or for an earlier prompt, so a cached prefix
is bit-identical to a fresh evaluation. An answer's tokens are never reused: they were decoded one at a time,
and their KV is not what a prefill of the same tokens computes.

Where the states live. The context itself holds the last prompt's KV (``live``): the same chat's next turn
trims it to the shared prefix and goes on, at no cost. Before a different prompt overwrites it, its whole
blocks are copied out (llama.cpp's per-sequence state, ``llama_state_seq_get_data``) into an LRU of entries
within a byte budget; a prompt whose best prefix is in an entry copies it back in. For SmolLM2-135M a token's
KV is 23 KiB (30 layers x 3 KV heads x 64 x K and V in f16): a 1,000-token prefix is 23 MiB, copied out or in
within a few milliseconds, against seconds to evaluate it again.

The batched engine (generator.engines.batch) keeps more and reuses it finer, since a batch is not exact anyway:
a sequence that leaves puts its whole turn here, prompt and answer, and a prompt reuses the longest prefix of
any entry token by token (``longest``), so a chat's next turn evaluates only its new message, as a llama-server
slot reuses its last prompt and answer.

Scope. Every entry, and the live prompt, belongs to a scope (a tenant, or "" for everyone: ``--prompt-cache-
scope``), and a prompt reuses only its own scope's blocks. A shared cache is an oracle: a prompt that shares a
prefix with another tenant's recent one gets ``cached_tokens`` and a quicker first token, which told a probing
key another's templated secret at one request per guess.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: Tokens per prefill block: the unit of reuse (at most B - 1 tokens of a cached prompt are evaluated again)
#: and the batch every prefill decodes. Small enough to lose little of a prefix, large enough that a block is
#: one efficient batch; at most llama.cpp's n_ubatch (512), so a block is one compute graph.
BLOCK_TOKENS = 64


def blocks(start: int, end: int, block: int = BLOCK_TOKENS) -> list[tuple[int, int]]:
    """The aligned blocks that evaluate positions [start, end): ``start`` is a block boundary."""
    return [(b, min(b + block, end)) for b in range(start, end, block)]


def shared_blocks(cached: Sequence[int], tokens: Sequence[int], limit: int, block: int = BLOCK_TOKENS) -> int:
    """How many leading tokens of ``tokens`` (a whole number of blocks, at most ``limit``) ``cached`` (whole
    blocks of an earlier prompt) holds."""
    n = min(len(cached), limit)
    n -= n % block
    same = 0
    while same < n and cached[same:same + block] == tokens[same:same + block]:
        same += block
    return same


def common_prefix(held: Sequence[int], n: int, tokens: Sequence[int]) -> int:
    """How many leading tokens of ``tokens`` equal the first ``n`` of ``held`` (any length, not whole blocks)."""
    n = min(n, len(held), len(tokens))
    same = 0
    while same < n and held[same] == tokens[same]:
        same += 1
    return same


def reusable(tokens: Sequence[int], block: int = BLOCK_TOKENS) -> int:
    """The most leading tokens of a prompt a cache may supply: whole blocks, leaving at least one token to
    evaluate (the logits of the last prompt token start the answer)."""
    return (len(tokens) - 1) // block * block if tokens else 0


def whole_blocks(tokens: Sequence[int], block: int = BLOCK_TOKENS) -> int:
    """The tokens of a prompt that its prefill leaves in whole blocks (those worth keeping)."""
    return len(tokens) // block * block


@dataclass(frozen=True, slots=True)
class CachedPrompt:
    tokens: tuple[int, ...]  # whole blocks of prefilled prompt tokens (a batched turn: its prompt and answer)
    state: bytes  # llama.cpp's state of one sequence holding exactly their KV
    scope: str = ""  # whose prompts may reuse it (the module doc)


class PromptCache:
    """LRU of prompt KV states within ``budget_bytes`` (0: none kept). Not thread-safe: the engine's
    context lock guards it."""

    def __init__(self, budget_bytes: int, block: int = BLOCK_TOKENS) -> None:
        self.budget_bytes = budget_bytes
        self.block = block
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], CachedPrompt] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def best(self, tokens: Sequence[int], limit: int, scope: str = "") -> tuple[CachedPrompt | None, int]:
        """The entry of ``scope`` sharing the most whole blocks with ``tokens`` (at most ``limit``), and how many
        tokens."""
        key = tuple(tokens)  # a tuple slice never equals a list slice
        return self._most(scope, lambda entry: shared_blocks(entry.tokens, key, limit, self.block))

    def longest(self, tokens: Sequence[int], limit: int, scope: str = "") -> tuple[CachedPrompt | None, int]:
        """The entry of ``scope`` whose tokens begin ``tokens`` the furthest, token by token (at most ``limit``),
        and how many tokens: the batched engine's reuse (generator.engines.batch), which is not exact anyway."""
        return self._most(scope, lambda entry: common_prefix(entry.tokens, limit, tokens))

    def _most(self, scope: str, shared: Callable[[CachedPrompt], int]) -> tuple[CachedPrompt | None, int]:
        """The entry of ``scope`` that ``shared`` counts the most tokens of (now the most recently used)."""
        found: CachedPrompt | None = None
        most = 0
        for entry in self._entries.values():
            if entry.scope == scope:
                n = shared(entry)
                if n > most:
                    found, most = entry, n
        if found is not None:
            self._entries.move_to_end((scope, found.tokens))
        return found, most

    def holds(self, tokens: Sequence[int], scope: str = "") -> bool:
        """Whether an entry of ``scope`` already covers every block of ``tokens``."""
        key = tuple(tokens)
        return any(entry.scope == scope and entry.tokens[:len(key)] == key for entry in self._entries.values())

    def put(self, tokens: Sequence[int], state: bytes, scope: str = "") -> None:
        key = tuple(tokens)
        if not key or len(state) > self.budget_bytes or self.holds(key, scope):
            return
        # Entries of the scope that are prefixes of this one are covered by it now.
        for other in [k for k in self._entries if k[0] == scope and key[:len(k[1])] == k[1]]:
            self._drop(other)
        self._entries[(scope, key)] = CachedPrompt(key, state, scope)
        self.bytes += len(state)
        while self.bytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[str, tuple[int, ...]]) -> None:
        self.bytes -= len(self._entries.pop(key).state)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
