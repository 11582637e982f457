"""One job, from its claim to its terminal event: the token pump.

The engine runs in a thread (ctypes releases the GIL) and hands one text piece per token to the event
loop through a bounded queue (generator.handoff). The loop appends whatever has accumulated as one
``delta`` while the previous append was in flight, so the append rate adapts to Redis latency and the cost
per token stays flat; typed pieces (reasoning, a tool call and its arguments) become their own events the
same way (generator.answer). A job continued after a crash starts from the answer already appended (its
text, reasoning and tool calls, rebuilt from the stream), with the tokens already counted taken off its
budget, so readers see one seamless answer.

A job leaves its queue only with its terminal event (the same script), so a worker never holds the only copy of
anything: if it dies, its lease lapses and the next claim, any worker's, takes the job over.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from broker.errors import StoreTransient
from broker.events import EventType, encode_data
from broker.streams.conversations import ConversationStore
from broker.streams.job_store import JobStore, started_event
from broker.streams.records import AppendResult, Claim
from broker.streams.stream_store import StreamStore
from generator.answer import AnswerEvents, AnswerSoFar
from generator.engines import Engine, Generation
from generator.engines.pieces import PartialAnswer
from generator.handoff import TokenHandoff, produce
from generator.lease import Ending, Run, keep_lease
from generator.metrics import GeneratorMetrics
from generator.outcome import (
    INTERNAL,
    AnswerEnd,
    Cancelled,
    Failed,
    FencedOut,
    HandOver,
    Outcome,
    decide_outcome,
    describe,
)
from generator.retry import until_done
from generator.settings import GeneratorSettings
from generator.slots import Seat, Slots, StallWatch
from generator.telemetry import GenerationTrace, attempt

log = logging.getLogger("rsb.generator")

# How long a worker stays the one a chat's next turn waits for (chat-affine claiming) after its last turn
# began: past it, its prompt cache has likely moved on.
AFFINITY_TTL_S = 1800
# How long a finished generation waits for its lease renewer to stop (it is mid-command at worst).
RENEWER_STOP_S = 1.0
# The endings after which another worker writes the stream's terminal event.
_UNWRITTEN = (Ending.FENCED_OUT, Ending.HANDED_OVER)


class Appender(Protocol):
    """JobStore.append, or an AppendBatcher that shares pipelines between concurrent generations."""

    async def append(self, claim: Claim, seq_before: int, seq_after: int,
                     events: Sequence[tuple[str, bytes]]) -> AppendResult: ...


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    t_start: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    cached_tokens: int = 0  # of prompt_tokens, served from the engine's prompt cache

    def as_dict(self) -> dict[str, Any]:
        first, last = self.first_token_at, self.last_token_at
        ttft_ms = None if first is None or self.t_start is None else round((first - self.t_start) * 1000, 3)
        tpot_ms = None
        if first is not None and last is not None and self.completion_tokens > 1 and last > first:
            tpot_ms = round((last - first) * 1000 / (self.completion_tokens - 1), 3)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens, "ttft_ms": ttft_ms, "tpot_ms": tpot_ms}


@dataclass(slots=True)
class _Progress:
    """A generation's progress across its segments (one, unless it parked: generator.slots)."""

    seq: int  # tokens counted in Redis
    t_start: float
    tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int = 0  # of prompt_tokens, served from the engine's prompt cache
    compute_s: float = 0.0  # engine time, parked time left out
    error: BaseException | None = None
    stopped: bool = False  # a stop sequence ended it (or a call past max_tool_calls: capped)
    stop_sequence: str | None = None  # the one that did
    capped: bool = False
    undeclared: str | None = None  # a call of a tool the request did not offer began
    finish_reason: str | None = None
    lost_runs: int = 0  # earlier attempts that had started the generation and were lost (a crash, a lost lease)
    claimed_seq: int = 0  # tokens the stream held when this attempt claimed it

    def answer_end(self) -> AnswerEnd:
        return AnswerEnd(self.stopped, self.stop_sequence, self.capped, self.undeclared, self.error,
                         self.finish_reason)

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens or 0, self.tokens, self.t_start, self.first_token_at, self.last_token_at,
                     self.cached_tokens)

    def wasted(self) -> int:
        """What the lost attempts computed that is not kept, as this attempt knows it: each one's prefill of the
        prompt (this attempt prefilled the prompt and the answer it continues from; less that answer, the prompt's
        part). The answer tokens a lost attempt decoded and never appended are its own to report (JobStore.add_wasted:
        a worker fenced out, or handing over) or, SIGKILLed, unknown: at most one append's worth."""
        return self.lost_runs * max(0, (self.prompt_tokens or 0) - self.claimed_seq)


def _past(progress: _Progress, deadline_s: float) -> bool:
    return deadline_s > 0 and time.monotonic() - progress.t_start >= deadline_s


class JobRunner:
    """Runs claimed jobs for one worker. ``running`` maps the stream id of each generation in flight to its
    Run (the worker's cancel listener and hand-over reach them there)."""

    def __init__(self, settings: GeneratorSettings, engine: Engine, store: JobStore, appender: Appender,
                 metrics: GeneratorMetrics, worker_id: str) -> None:
        self.settings = settings
        self.engine = engine
        self.store = store
        self.appender = appender
        self.metrics = metrics
        self.worker_id = worker_id
        self.running: dict[uuid.UUID, Run] = {}
        # Folding a finished turn into its conversation starts the next held one: the consumer's side of a stream.
        self.conversations = ConversationStore(StreamStore.beside(store))
        # Parking (generator.slots) helps only where one stream's writes can stall while others' go through: a
        # replica gate, or a cluster's shards. None: a stalled write keeps its slot.
        parks = (store.gate is not None or store.cluster) and settings.max_parked > 0
        self.park_after_s: float | None = settings.park_after_s if parks else None

    async def run(self, claim: Claim, seat: Seat | None = None) -> None:
        """Run the claimed job in ``seat`` (its worker slot: given back while a write stalls, when the worker parks:
        see generator.slots), inside its spans when tracing is on (generator.telemetry)."""
        seat = seat or Seat(Slots(1, 0))
        trace = GenerationTrace.start(claim, self.engine.name, self.worker_id, upstream=self.engine.on_loop)
        run = Run(claim, watch=StallWatch(seat, self.park_after_s), trace=trace)
        # Ended without a terminal event of its own: the stream went to another worker (its span says which way).
        with attempt(trace, lambda: run.ending.name.lower() if run.ending in _UNWRITTEN else None):
            await self._run(run, seat)

    async def _run(self, run: Run, seat: Seat) -> None:
        claim = run.claim
        log.info("claimed", extra={"stream_id": str(claim.stream_id), "attempt": claim.attempts})
        self.metrics.claimed(claim.model, claim.tier, claim.attempts, claim.waited_s)
        if self.engine.caches_prompts:
            try:  # a hint for the next turn's routing: never worth delaying or failing this one
                await self.store.affinity.note(claim.request.affinity(claim.tenant), self.worker_id, AFFINITY_TTL_S)
            except StoreTransient as e:  # Redis away or full: the turn runs anyway
                log.warning("could not note the chat's worker: %s", type(e).__name__)
            except Exception:  # a bug, logged as one: the turn runs anyway
                log.exception("noting the chat's worker failed")
        nothing = Usage(0, claim.seq)
        if claim.attempts > self.settings.max_attempts:
            await self._finish_error(run, "worker_lost", f"gave up after {claim.attempts - 1} attempts", nothing)
        elif claim.cancel_reason:
            await self._finish_cancelled(run, claim.cancel_reason, nothing, 0.0)
        else:
            self.running[claim.stream_id] = run
            self.metrics.running.inc()
            try:
                await self._generate(run, seat)
            except Exception as e:  # a bug of the store (a failing script, WRONGTYPE): not retried, surfaced
                log.error("generation failed: %s", type(e).__name__, exc_info=e,
                          extra={"stream_id": str(claim.stream_id)})
                await self._finish_error(run, INTERNAL, describe(e), Usage(0, claim.seq))
            finally:
                del self.running[claim.stream_id]
                self.metrics.running.dec()

    async def _answer_so_far(self, claim: Claim) -> AnswerSoFar:
        """The answer an earlier attempt appended (text, reasoning, tool calls), and whether it sent
        ``started``."""
        so_far = AnswerSoFar()
        after: str | None = None
        while True:
            events = await self.store.read(claim.stream_id, after, count=1024, visible_only=False)
            if not events:
                return so_far
            so_far.add_all((ev.type, ev.data) for ev in events)
            after = events[-1].id

    async def _generate(self, run: Run, seat: Seat) -> None:
        """Generate until the terminal event: one segment, or several when the generation parks (generator.slots)
        and continues, each from what the stream holds; the lease is kept all along."""
        s = self.settings
        progress = _Progress(seq=run.claim.seq, t_start=time.monotonic(), tokens=run.claim.seq,
                             claimed_seq=run.claim.seq)
        renewer = asyncio.create_task(keep_lease(run, self.store, s.lease_s, s.disconnect_grace_s))
        try:
            while await self._segment(run, progress):
                # Parked, and the write it waited for has landed: go on, unless the stream ended meanwhile.
                if _past(progress, s.max_generation_s):
                    run.hit_deadline()
                if run.stopping:
                    break
                await seat.resume()
                if run.stopping:  # handed over (a shutdown) while it waited for a slot
                    break
                log.info("resuming after a parked write", extra={"stream_id": str(run.claim.stream_id),
                                                                   "seq": progress.seq})
                run.resume()
        finally:
            run.end_generation()
            renewer.cancel()
            await asyncio.wait({renewer}, timeout=RENEWER_STOP_S)
        await self._write(run, progress, decide_outcome(run.ending, progress.answer_end(), failure=run.failure,
                                                        cancel_reason=run.cancel_reason,
                                                        deadline_s=s.max_generation_s))

    async def _write(self, run: Run, progress: _Progress, outcome: Outcome) -> None:
        """Carry out what generator.outcome decided."""
        sid = str(run.claim.stream_id)
        if isinstance(outcome, (FencedOut, HandOver)):
            await self._report_wasted(run, progress.tokens - progress.seq)
            if isinstance(outcome, FencedOut):
                log.warning("lost the lease; another worker owns the stream", extra={"stream_id": sid})
            else:
                await self._hand_over(run)
            return
        wasted, compute_s, usage = progress.wasted(), progress.compute_s, progress.usage()
        if isinstance(outcome, Cancelled):
            await self._finish_cancelled(run, outcome.reason, usage, compute_s, wasted)
        elif isinstance(outcome, Failed):
            if outcome.engine:
                log.error("engine failed: %s", type(progress.error).__name__, extra={"stream_id": sid})
            await self._finish_error(run, outcome.code, outcome.message, usage, compute_s, wasted)
        else:
            u = usage.as_dict()
            done: dict[str, object] = {"finish_reason": outcome.finish_reason, "usage": u}
            if outcome.stop_sequence is not None:
                done["stop_sequence"] = outcome.stop_sequence
            await self._finish(run, EventType.DONE, done, "done", u, outcome.finish_reason, compute_s, wasted)

    async def _segment(self, run: Run, progress: _Progress) -> bool:
        """Run the engine from what the stream holds until the generation ends, or parks: True when it parked
        its engine (its last write has landed since) and must go on in a new segment."""
        claim = run.claim
        req = claim.request
        watch = run.watch
        so_far = await until_done(lambda: self._answer_so_far(claim))
        prefix, started, partial = so_far.text, so_far.started, so_far.partial
        if started and progress.prompt_tokens is None:
            progress.lost_runs = run.claim.attempts - 1  # each claimed it before and started (or was going to)
        if not started:
            with watch:  # stalled: nothing runs yet, so the slot goes back at once
                started_ev = started_event(self.engine.name, run.claim.tier)
                if not await self._append(run, progress.seq, progress.seq, [started_ev]):
                    return False
            if watch.seat.parked:
                return not run.stopping
        loop = asyncio.get_running_loop()
        handoff = TokenHandoff(loop, self.settings.handoff_tokens)
        remaining = max(0, req.max_tokens - progress.seq)
        t_segment = time.monotonic()
        gen_holder: list[Generation] = []
        producer = produce(self.engine, req, handoff, prefix_text=prefix, max_tokens=remaining, stop=run.stop,
                           on_start=gen_holder.append, partial=partial if partial.typed else None,
                           cache_scope=self.settings.engine.cache_scope(claim.tenant), tier=claim.tier)
        offered = frozenset(t.name for t in req.tools) if req.offers_tools else frozenset()
        answer = AnswerEvents(req.stop, partial if partial.typed else PartialAnswer(), req.sampling.max_calls, offered)
        seq = tokens = progress.seq  # tokens counted in Redis (all attempts); tokens generated (all attempts)
        deadline = self.settings.max_generation_s
        parked = closed = False

        def park() -> asyncio.Future[None] | None:
            """The write in flight stalled: stop the engine (the future: its end), unless it has ended anyway."""
            nonlocal parked
            if closed or run.stop.is_set():
                return None  # only its last writes are left, which need no slot
            parked = True
            run.stop.set()
            handoff.abandon()  # what it made past the stalled write is dropped: the next segment makes it again
            log.info("parked: a write waits (no replica acknowledged it, or its shard is down)",
                     extra={"stream_id": str(claim.stream_id), "seq": seq})
            return producer

        watch.on_park = park
        try:
            while True:
                timeout = None
                if deadline > 0:
                    timeout = max(0.0, progress.t_start + deadline - time.monotonic())
                batch = await handoff.get(timeout_s=timeout if timeout is not None else 1.0)
                now = time.monotonic()
                if batch.progress is not None and not batch.pieces and run.ending is not Ending.FENCED_OUT:
                    processed, total = batch.progress
                    note = [(EventType.PROGRESS, encode_data({"processed": processed, "prompt_tokens": total}))]
                    with watch:
                        if not await self._append(run, seq, seq, note) or parked:
                            break
                if batch.last_at is not None:
                    if progress.first_token_at is None:
                        progress.first_token_at = batch.first_at
                        if run.trace is not None:
                            run.trace.first_token()
                    progress.last_token_at = batch.last_at
                tokens += batch.tokens
                events = answer.feed(batch.pieces, batch.markers)
                if answer.stopped:
                    run.stop.set()
                if batch.closed:
                    closed = True
                    watch.seat.finish()  # the engine is done: its slot goes to the next job during the last writes
                    progress.error = run.engine_ended(batch.error)
                    if batch.error is None and not run.stop.is_set():
                        events += answer.flush()
                if events and run.ending is not Ending.FENCED_OUT:
                    with watch:
                        if not await self._append(run, seq, tokens, events):
                            break
                    seq = tokens
                    if parked:
                        break
                if deadline > 0 and now - progress.t_start >= deadline and not batch.closed:
                    run.hit_deadline()
                if batch.closed:
                    break
        finally:
            watch.on_park = None
            handoff.abandon()
            if self.engine.on_loop:
                producer.cancel()  # a loop producer may be asleep until its next token
            await asyncio.gather(producer, return_exceptions=True)
            progress.seq = seq
            progress.compute_s += time.monotonic() - t_segment
        if gen_holder and progress.prompt_tokens is None:
            progress.prompt_tokens = gen_holder[0].prompt_tokens  # the prompt's, not a continuation's
            progress.cached_tokens = gen_holder[0].cached_tokens
        if gen_holder:
            progress.finish_reason = gen_holder[0].finish_reason
        progress.stopped = answer.stopped
        engine_stop = gen_holder[0].stop_sequence if gen_holder else None
        progress.stop_sequence = answer.stop_sequence or (engine_stop if engine_stop in req.stop else None)
        progress.capped = answer.capped
        progress.undeclared = answer.undeclared
        progress.tokens = tokens
        return parked and not run.stopping

    async def _hand_over(self, run: Run) -> None:
        released = await until_done(lambda: self.store.release(run.claim), "release failed")
        log.info("handed the job over", extra={"stream_id": str(run.claim.stream_id), "released": released})
        if run.trace is not None:
            run.trace.handed_over()  # (its span's error.type: the fence below would say fenced_out)
        run.fence_out()  # not ours any more: the next owner ends it

    async def _append(self, run: Run, seq_before: int, seq_after: int,
                      events: Sequence[tuple[str, bytes]]) -> bool:
        """Append, surviving Redis outages. False when this worker no longer owns the stream."""
        def op() -> Awaitable[AppendResult]:
            return self.appender.append(run.claim, seq_before, seq_after, events)

        t0 = time.monotonic() if run.trace is not None else 0.0
        try:  # once directly (the path of every token), then by the retry policy, which logs and classifies
            res = await op()
        except Exception:  # an append is safe to make twice (its seq check answers a landed one)
            # Redis away or full: the generation pauses here (its lease kept by the renewer, its readers sent
            # heartbeats), and goes on where it stopped once Redis takes writes again.
            res = await until_done(op, "append failed")
        if run.trace is not None:
            run.trace.appended(time.monotonic() - t0, events)
        if res.ok:
            run.cancel(res.cancel_reason)
            return True
        if res.seq is not None and res.seq == seq_after:
            return True  # an earlier try landed; its reply was lost
        if res.seq is not None and res.seq < seq_before:
            # Still ours, but the stream has fewer tokens than we appended: a Redis failover lost its last
            # appends (durability local). Our text went past the stream's: hand the job over at once, and
            # whoever claims it (this worker too) continues from what the stream has.
            log.warning("the stream lost its last appends (a Redis failover): handing the job over",
                        extra={"stream_id": str(run.claim.stream_id), "seq": res.seq, "expected": seq_before})
            run.hand_over()
            return False
        run.fence_out()
        return False

    # -- terminal events -----------------------------------------------------------------------

    async def _finish(self, run: Run, etype: str, data: dict[str, Any], status: str, usage: dict[str, Any],
                      reason: str = "", compute_s: float = 0.0, wasted: int = 0) -> None:
        with run.watch:  # stalled (no replica, its shard down): it needs no slot meanwhile
            eid = await until_done(lambda: self.store.finish(
                run.claim, etype, data, status=status, usage=usage, model=self.engine.name, reason=reason,
                compute_s=compute_s, wasted_tokens=wasted), "finish failed")
        if eid is None:
            run.fence_out()
        else:
            self.metrics.finished(status, usage, max(0, int(usage.get("completion_tokens") or 0) - run.claim.seq))
            self.metrics.served(run.claim, self.engine.name, status, reason, usage, time.monotonic() - run.started_at)
            if run.trace is not None:
                await run.trace.finished(status, reason, usage, lambda: self._answer_so_far(run.claim))
            await self._fold(run)
        log.info("finished", extra={"stream_id": str(run.claim.stream_id), "status": status,
                                    "completion_tokens": usage.get("completion_tokens")})

    async def _fold(self, run: Run) -> None:
        """A conversation's turn goes into its conversation as soon as it ended (broker.streams.conversations):
        within the stream's retention, whether or not anyone reads the conversation. If this worker dies
        first, the next read or create of the conversation folds it."""
        history = run.claim.request.history
        if history is None or history.conversation is None:
            return
        try:
            await until_done(lambda: self.conversations.fold(run.claim.stream_id), "fold failed")
        except Exception:  # the stream is finished and safe: a bug here must not keep the job from its ack
            log.exception("folding the turn into its conversation failed",
                          extra={"stream_id": str(run.claim.stream_id)})

    async def _finish_cancelled(self, run: Run, reason: str, usage: Usage, compute_s: float, wasted: int = 0) -> None:
        u = usage.as_dict()
        await self._finish(run, EventType.CANCELLED, {"reason": reason, "usage": u}, "cancelled", u, reason,
                           compute_s, wasted)

    async def _finish_error(self, run: Run, code: str, message: str, usage: Usage, compute_s: float = 0.0,
                            wasted: int = 0) -> None:
        u = usage.as_dict()
        await self._finish(run, EventType.ERROR, {"code": code, "message": message, "usage": u}, "error", u,
                           code, compute_s, wasted)

    async def _report_wasted(self, run: Run, tokens: int) -> None:
        """Tokens this attempt computed that the stream will not hold (it lost its lease, or hands the job over):
        the usage record's ``wasted_tokens``, once the stream ends. Best effort: Redis away, they go unreported."""
        if tokens <= 0:
            return
        try:
            await self.store.add_wasted(run.claim, tokens)
        except StoreTransient:
            pass
        except Exception:
            log.exception("reporting wasted tokens failed")
