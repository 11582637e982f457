"""A sequence's KV state in a llama.cpp context, for the prompt cache (generator.engines.prompt_cache): read out
(``llama_state_seq_get_data``), written into a sequence (``llama_state_seq_set_data``), and a leaving prompt's
whole prefill blocks kept in the cache. Both ways of decoding read and write states: the one-sequence context
(generator.engines.one_sequence, sequence 0, which keeps only a prompt's whole blocks: its cache is exact) and
the batch's (generator.engines.batch, one id per sequence, which keeps a leaving sequence's whole turn)."""

from __future__ import annotations

import ctypes

import llama_cpp

from generator.engines.prompt_cache import PromptCache


def sequence_state(ctx: llama_cpp.llama_context_p, seq_id: int) -> bytes | None:
    """Sequence ``seq_id``'s KV state, or None if llama.cpp gives none."""
    size = llama_cpp.llama_state_seq_get_size(ctx, seq_id)
    buf = (ctypes.c_uint8 * size)()
    n = llama_cpp.llama_state_seq_get_data(ctx, buf, size, seq_id)
    return bytes(memoryview(buf)[:n]) if 0 < n <= size else None


def load_sequence_state(ctx: llama_cpp.llama_context_p, seq_id: int, state: bytes) -> bool:
    """Write a state (``sequence_state``'s) into sequence ``seq_id``; False if llama.cpp refuses it (the caller
    empties what it may have written)."""
    buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
    return bool(llama_cpp.llama_state_seq_set_data(ctx, buf, len(state), seq_id) == len(state))


def keep_prompt_blocks(ctx: llama_cpp.llama_context_p, seq_id: int, cache: PromptCache, prefix: list[int],
                       scope: str) -> None:
    """Copy sequence ``seq_id``'s ``prefix`` (its prompt's whole prefilled blocks) into ``cache``, in ``scope``,
    unless the cache holds it or keeps nothing. What the sequence holds past the prefix (the rest of its prompt,
    its answer: never reused) is dropped first."""
    if not prefix or not cache.budget_bytes or cache.holds(prefix, scope):
        return
    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), seq_id, len(prefix), -1)
    state = sequence_state(ctx, seq_id)
    if state is not None:
        cache.put(prefix, state, scope)
