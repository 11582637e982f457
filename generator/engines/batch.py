"""Continuous batching for the in-process llama.cpp engine (``--parallel N``): one llama.cpp context holds N
sequences, and one thread, the batcher, decodes them together in steps.

A step is one ``llama_decode`` of one batch: the next token of every sequence that is answering, and up to
``PREFILL_STEP_TOKENS`` tokens of the prompts still being prefilled, in order of arrival. On this CPU a step of
four answers costs about 2.5 times a step of one (the default model: ~9 ms for one, ~22 ms for four;
docs/benchmarks.md), so N answers advance at once where a context decoding one sequence at a time makes
the Nth chat wait for N-1 whole answers. A new prompt enters the running batch in chunks, so the answers
already running are never held up by more than a chunk's prefill per step (~0.25 s for 64 tokens of the default
model) however long the prompt, and a sequence that ends (its last token, a cancel, its reader gone) leaves at
the step it ends in: its place goes to the next prompt at once.

Each sequence has a stream of ``n_ctx`` cells of its own (as llama-server's slots: ``kv_unified`` off), so a
token's attention reads its own sequence's cells only, however long the others' histories. llama.cpp cuts a
batch over such streams into passes over the weights by sequence id (see ``Batcher``): the batch's rows go in
order of sequence id and a sequence takes the lowest free id, so the answers of a full batch are one pass.

The prompt cache (generator.engines.prompt_cache) works here within the same scope, finer than with one
sequence: a new prompt starts from the longest prefix, token by token, that a running sequence holds, whose
stream is copied (``llama_memory_seq_cp``: a memory copy, nothing prefilled again), or that an entry of the LRU
holds, loaded into its own cells (``llama_state_seq_*``: a few ms for a thousand tokens). A
sequence that leaves puts its whole turn, prompt and answer, into the LRU. So twenty chats with one system
prompt prefill it once, and a chat's next turn evaluates only its new message, as a llama-server slot reuses its
last prompt and answer. After a chat's answer the batch also prepares the chat's next turn (``prepare``: the
whole blocks of its history, the answer and the next user message's opening, prefilled into the LRU) while no
generation runs or waits; a generation that comes meanwhile pauses the preparation, or takes its place.

What is not exact. llama.cpp computes a token's logits the same way whatever else is in its batch only as far
as its kernels are batch-invariant; how often a seeded answer run inside a batch equals the same request run
alone is measured in docs/benchmarks.md. ``--parallel 1`` does not use this module: it keeps the exactness the
prompt cache promises (a seeded answer is the same text whatever the cache held).

Threads: generations submit from their own inference threads and read their pieces from a queue
(``BatchedSequence.out``); only the batcher touches the context, the samplers of running sequences and the
prompt cache.
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import llama_cpp

from generator.engines.base import EngineError, Generation, StepObserver
from generator.engines.batch_plan import PREFILL_STEP_TOKENS, plan_step
from generator.engines.decoding import SequenceDecoder
from generator.engines.kv_state import load_sequence_state, sequence_state
from generator.engines.llama import PROGRESS_CHUNK_TOKENS, PROGRESS_MIN_TOKENS
from generator.engines.pieces import Piece
from generator.engines.prompt_cache import PromptCache, common_prefix, whole_blocks
from generator.engines.sampler import Sampler

log = logging.getLogger("rsb.generator")


# What the batcher puts on a sequence's queue: pieces, then None at the end, or the error it ended with.
Outcome = list[Piece] | BaseException | None


class Prefilled:
    """What a sequence of the batch (a generation, or a preparation) has prefilled of its ``tokens``."""

    __slots__ = ()
    tokens: list[int]
    pos: int  # positions its KV holds

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.tokens)


@dataclass(eq=False, slots=True)
class Preparation(Prefilled):
    """A chat's next turn being prefilled into the cache: whole blocks only, never sampled."""

    tokens: list[int]
    scope: str
    seq_id: int = -1
    pos: int = 0
    begun: bool = False

    def held(self) -> list[int]:
        return self.tokens[:self.pos]


@dataclass(eq=False, slots=True)
class BatchedSequence(Prefilled):
    """One generation inside the batch. The submitting thread reads ``out`` until None (or an error) and sets
    ``abandoned`` if it stops reading first; everything else is the batcher's."""

    tokens: list[int]
    scope: str
    generation: Generation
    stop: threading.Event
    sampler: Sampler
    decoder: SequenceDecoder
    out: queue.SimpleQueue[Outcome] = field(default_factory=queue.SimpleQueue)
    abandoned: bool = False
    seq_id: int = -1
    pos: int = 0  # positions its KV holds
    begun: bool = False  # its cached prefix was chosen
    answer: list[int] = field(default_factory=list)  # the answer's tokens decoded so far (their KV is held)

    def held(self) -> list[int]:
        """The tokens whose KV it holds, positions 0 .. pos-1."""
        return (self.tokens + self.answer)[:self.pos]

    def pieces(self) -> list[Piece] | None:
        """The next pieces, blocking; None at the end. Raises the error the sequence ended with."""
        item = self.out.get()
        if isinstance(item, BaseException):
            raise item
        return item


class Batcher:
    """The context of ``sequences`` sequences of ``n_ctx`` tokens each over ``model``, and the thread that
    decodes them. ``cache``: the prompt cache (None: every prompt prefilled in full)."""

    def __init__(self, llm: llama_cpp.Llama, *, sequences: int, n_ctx: int, cache: PromptCache | None,
                 on_step: StepObserver | None = None) -> None:
        # The one-sequence context's own settings (threads, rope) but for the sequences and the attention below.
        params = llama_cpp.llama_context_params.from_buffer_copy(llm.context_params)
        params.n_ctx = n_ctx * sequences
        params.n_batch = max(512, PREFILL_STEP_TOKENS + sequences)
        params.n_ubatch = params.n_batch
        params.n_seq_max = sequences
        # A stream of cells per sequence, as llama-server's slots (-np N sets no --kv-unified): one pool for all
        # made each token's attention walk every sequence's cells (a step of four grew from 26 to 42 ms as twenty
        # users' histories grew; docs/benchmarks.md). Over streams llama.cpp cuts a batch into ubatches of
        # sequences whose ids follow each other in row order (split_equal, sequential): _step orders the rows by
        # id and _admit gives the lowest free id, so a full batch's answers are one pass over the weights.
        params.kv_unified = False
        # Flash attention as llama.cpp chooses it (on, on a CPU), as llama-server's default: 12% quicker than the
        # plain kernel in `bench users` (docs/benchmarks.md); the one-sequence context has it too (LlamaEngine).
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
        ctx = llama_cpp.llama_init_from_model(llm.model, params)
        if not ctx:
            raise EngineError(f"llama.cpp could not create a context of {sequences} sequences x {n_ctx} tokens")
        self.ctx: llama_cpp.llama_context_p = ctx
        self.sequences = sequences
        self.n_ctx = llama_cpp.llama_n_ctx(ctx) // sequences
        self._mem = llama_cpp.llama_get_memory(ctx)
        self._batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)
        self._cache = cache
        self.on_step = on_step
        self._cond = threading.Condition()
        self._pending: deque[BatchedSequence] = deque()
        self._running: list[BatchedSequence] = []
        # Next turns to prepare, the latest kept (a hint each: one that falls out costs only its next turn's
        # prefill), and those holding a sequence id.
        self._to_prepare: deque[Preparation] = deque(maxlen=sequences)
        self._preparing: list[Preparation] = []
        self._free_ids = list(range(sequences))  # a heap: the lowest free id first (see the streams above)
        self._closed = False
        # A daemon: idle, it waits on a condition, and must not keep a process from exiting. close() joins it.
        self._thread = threading.Thread(target=self._loop, name="rsb-batcher", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        return len(self._running)

    def submit(self, seq: BatchedSequence) -> None:
        """Queue ``seq``: it joins the batch at the next step a sequence is free. The batcher owns its sampler
        from here (and closes it when the sequence leaves)."""
        with self._cond:
            if self._closed:
                seq.sampler.close()
                raise RuntimeError("engine is closed")
            self._pending.append(seq)
            self._cond.notify()

    def prepare(self, tokens: list[int], scope: str) -> None:
        """Prefill the whole blocks of ``tokens`` (a chat's next turn's opening) into the cache, in ``scope``,
        when the batch is idle."""
        tokens = tokens[:whole_blocks(tokens)]
        if self._cache is None or not self._cache.budget_bytes or not tokens or len(tokens) > self.n_ctx:
            return
        with self._cond:
            if not self._closed:
                self._to_prepare.append(Preparation(tokens, scope))
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify()
        self._thread.join()
        llama_cpp.llama_batch_free(self._batch)
        llama_cpp.llama_free(self.ctx)

    # -- the batcher thread ----------------------------------------------------------------------------

    def _loop(self) -> None:
        # The first decode allocates compute buffers: paid here, before the first request's step, and on this
        # thread, the only one that decodes in this context (an OpenMP llama.cpp decodes slower for every
        # thread that has decoded and lives on: generator.engines.llama.on_a_thread_that_ends).
        self._add(0, 0, 0, 0, True)
        self._batch.n_tokens = 1
        llama_cpp.llama_decode(self.ctx, self._batch)
        llama_cpp.llama_memory_seq_rm(self._mem, 0, -1, -1)
        while True:
            with self._cond:
                while not (self._closed or self._pending or self._running or self._to_prepare or self._preparing):
                    self._cond.wait()
                if self._closed:
                    break
                self._admit()
                waiting = bool(self._pending)
            if waiting and self._preparing:
                # A generation waits for a sequence id: the preparations give theirs up (what they prefilled so
                # far goes to the cache), and the next round admits it.
                for prep in list(self._preparing):
                    self._release(prep)
                continue
            try:
                self._step()
            except Exception as e:  # llama.cpp failed under every running sequence: each ends with the error
                log.exception("a batched decoding step failed")
                for seq in list(self._running):
                    self._leave(seq, error=e, keep=False)  # what the failed step wrote is no KV to keep
                for prep in list(self._preparing):
                    self._release(prep, keep=False)
        closed = RuntimeError("engine is closed")
        with self._cond:
            pending, self._pending = list(self._pending), deque()
        for seq in pending + list(self._running):
            self._leave(seq, error=closed)
        for prep in list(self._preparing):
            self._release(prep, keep=False)

    def _admit(self) -> None:
        """Under the lock: waiting sequences cancelled meanwhile end now; the others take free sequence ids, and
        with none running or waiting, the next turns to prepare."""
        kept: deque[BatchedSequence] = deque()
        for seq in self._pending:
            if seq.abandoned or seq.stop.is_set():
                self._end(seq)
            elif self._free_ids:
                seq.seq_id = heapq.heappop(self._free_ids)
                self._running.append(seq)
            else:
                kept.append(seq)
        self._pending = kept
        while self._to_prepare and self._free_ids and not self._running and not self._pending:
            prep = self._to_prepare.popleft()
            prep.seq_id = heapq.heappop(self._free_ids)
            self._preparing.append(prep)

    def _add(self, i: int, token: int, pos: int, seq_id: int, logits: bool = False) -> None:
        b = self._batch
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq_id
        b.logits[i] = logits

    def _step(self) -> None:
        for seq in list(self._running):
            if seq.abandoned:
                self._leave(seq)
            elif seq.stop.is_set():
                # Stopped while answering: what its decoder holds still goes out (the one-sequence engine's
                # order); stopped in its prefill: nothing was made.
                self._leave(seq, None if seq.prefilling else seq.decoder.end())
        plan = plan_step(self._running, self._preparing, begin=self._begin, begin_preparation=self._begin_preparation)
        rows: list[tuple[int, int, int, bool]] = []  # (sequence id, token, position, sampled)
        for seq in plan.answering:
            rows.append((seq.seq_id, seq.decoder.last, seq.pos, True))
            seq.answer.append(seq.decoder.last)
            seq.pos += 1
        for chunk in plan.prefills:
            seq = chunk.of
            last = len(seq.tokens) - 1
            rows += ((seq.seq_id, seq.tokens[pos], pos, pos == last) for pos in range(chunk.start, chunk.end))
            seq.pos = chunk.end
        for prep_chunk in plan.preparations:
            prep = prep_chunk.of
            rows += ((prep.seq_id, prep.tokens[pos], pos, False) for pos in range(prep_chunk.start, prep_chunk.end))
            prep.pos = prep_chunk.end
        n = len(rows)
        rows.sort(key=lambda row: row[0])  # in order of id (see __init__); stable: a prompt's rows stay in order
        sampled_row: dict[int, int] = {}  # a sequence's one sampled row, by sequence id
        for i, (seq_id, token, pos, sample) in enumerate(rows):
            self._add(i, token, pos, seq_id, sample)
            if sample:
                sampled_row[seq_id] = i
        if n == 0:
            # Nothing to decode: each of these preparations was found whole in the cache or in a running sequence,
            # so it adds nothing to keep; and a stream copied from a running one is only made at the next decode.
            for prep in plan.prepared:
                self._release(prep, keep=False)
            return
        self._batch.n_tokens = n
        t0 = time.perf_counter()
        ret = llama_cpp.llama_decode(self.ctx, self._batch)
        if ret != 0:
            raise EngineError(f"llama_decode failed ({ret}) on a batch of {n} tokens")
        for prep in plan.prepared:
            self._release(prep)
        if self.on_step is not None and self._running:  # a preparation's step is no generation's
            self.on_step(len(self._running), plan.prefill_tokens, time.perf_counter() - t0)
        for chunk in plan.prefills:
            seq = chunk.of
            on_progress = seq.generation.on_progress
            total = len(seq.tokens)
            if on_progress is not None and total > PROGRESS_MIN_TOKENS and seq.prefilling \
                    and seq.pos % PROGRESS_CHUNK_TOKENS == 0:
                on_progress(seq.pos, total)
        for _, seq in plan.sampled:
            seq.sampler.idx = sampled_row[seq.seq_id]
            try:
                pieces = seq.decoder.take(seq.sampler.sample())
            except Exception as e:  # this sequence's grammar failed (or cost too much): it alone ends
                self._leave(seq, error=e)
                continue
            if seq.decoder.ended:
                self._leave(seq, pieces)
            elif pieces:
                seq.out.put(pieces)

    def _begin(self, seq: BatchedSequence) -> None:
        seq.begun = True
        # At least the last prompt token is decoded here: its logits start the answer.
        seq.pos = seq.generation.cached_tokens = self._copy_prefix(seq.seq_id, seq.tokens, len(seq.tokens) - 1,
                                                                   seq.scope)

    def _begin_preparation(self, prep: Preparation) -> None:
        prep.begun = True
        prep.pos = self._copy_prefix(prep.seq_id, prep.tokens, len(prep.tokens), prep.scope)

    def _copy_prefix(self, seq_id: int, tokens: list[int], live_limit: int, scope: str) -> int:
        """The longest prefix of ``tokens`` (at most ``live_limit``, token by token) that a sequence in the batch
        or an entry of the cache holds in ``scope``, given to ``seq_id``: how many tokens.

        From a sequence of the batch its stream is copied (``llama_memory_seq_cp`` across streams copies a whole
        stream, a memory copy), so twenty chats with one system prompt prefill it once. From the cache (a
        finished turn's prompt and answer, or a prepared turn's blocks) the state is loaded into the sequence's
        own cells (a few ms for a thousand tokens). Either way what it holds past the prefix is dropped, and the
        prefix's KV is that of its tokens alone, up to how the batch it was computed in rounded."""
        cache = self._cache
        if cache is None or not cache.budget_bytes:  # --prompt-cache-mib 0: every prompt evaluated in full
            return 0
        source: BatchedSequence | Preparation | None = None
        from_live = 0
        others: list[BatchedSequence | Preparation] = [*self._running, *self._preparing]
        for other in others:
            if other.seq_id != seq_id and other.scope == scope and other.seq_id >= 0 and other.begun:
                n = common_prefix(other.tokens, min(other.pos, len(other.tokens), live_limit), tokens)
                if n > from_live:
                    source, from_live = other, n
        entry, from_entry = cache.longest(tokens, live_limit, scope)
        if entry is not None and from_entry > from_live:
            if not self._load(seq_id, entry.state):
                return 0
            llama_cpp.llama_memory_seq_rm(self._mem, seq_id, from_entry, -1)
            return from_entry
        if source is not None:
            llama_cpp.llama_memory_seq_cp(self._mem, source.seq_id, seq_id, -1, -1)  # whole streams only
            llama_cpp.llama_memory_seq_rm(self._mem, seq_id, from_live, -1)
            return from_live
        return 0

    def _load(self, seq_id: int, state: bytes) -> bool:
        if load_sequence_state(self.ctx, seq_id, state):
            return True
        llama_cpp.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
        return False

    def _leave(self, seq: BatchedSequence, pieces: list[Piece] | None = None,
               error: BaseException | None = None, *, keep: bool = True) -> None:
        """``seq`` leaves the batch: its whole turn, prompt and answer, into the cache (``keep``), its cells and id
        freed."""
        if seq in self._running:
            self._running.remove(seq)
        self._free(seq, keep=keep)
        if pieces and not seq.abandoned:
            seq.out.put(pieces)
        self._end(seq, error)

    def _release(self, prep: Preparation, *, keep: bool = True) -> None:
        """A preparation ends (done, or giving way): what it prefilled into the cache, its id freed."""
        self._preparing.remove(prep)
        self._free(prep, keep=keep)

    def _free(self, seq: BatchedSequence | Preparation, *, keep: bool = True) -> None:
        """``seq``'s id and cells freed, what they held first copied into the cache (``keep``)."""
        sid = seq.seq_id
        if sid < 0:
            return
        cache = self._cache
        if keep and cache is not None and cache.budget_bytes:
            held = seq.held()
            if held and not cache.holds(held, seq.scope):
                state = sequence_state(self.ctx, sid)  # the whole turn: its prompt and what it answered
                if state is not None:
                    cache.put(held, state, seq.scope)
        llama_cpp.llama_memory_seq_rm(self._mem, sid, -1, -1)
        seq.seq_id = -1
        with self._cond:
            heapq.heappush(self._free_ids, sid)

    def _end(self, seq: BatchedSequence, error: BaseException | None = None) -> None:
        seq.sampler.close()
        seq.out.put(error)
