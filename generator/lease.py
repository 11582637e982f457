"""Keeping a claimed job and hearing its cancel: the lease renewal loop of one run, and the control-channel
listener of the worker.

A run's job holds a lease in its queue; RENEW (every ``lease_s / 3``) moves its end on, so other workers' claims
only take over jobs whose owner went silent. RENEW's reply carries a pending cancel
(client, abandoned, disconnect), and a refused RENEW means the run was fenced out (another worker owns
the stream now): either way the run stops. Cancel notices also arrive at once over a control channel,
so a cancel is seen even during a long prefill, when nothing is appended.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from broker.backoff import Attempts
from broker.errors import StoreFull, StoreTransient, StoreUnavailable
from broker.redis.connection import RedisClient
from broker.redis.pubsub.channels import Channels
from broker.streams.job_store import JobStore
from broker.streams.keys import control_channel
from broker.streams.records import Claim
from generator.engines import GenerationLost
from generator.handoff import StopSignal
from generator.retry import OUT_OF_MEMORY
from generator.slots import StallWatch
from generator.telemetry import GenerationTrace

log = logging.getLogger("rsb.generator")

# How soon a renewal that met a transient Redis error is tried again (at most lease_s / 3, the usual interval).
RENEW_RETRY_S = 0.5


class Ending(enum.IntEnum):
    """Why a run makes no more tokens. A run reaches one, and a later one replaces it only if it ranks higher,
    in this order: fenced out beats everything (the stream is another worker's now), a hand-over what would end
    the stream (its next owner ends it), a bug a cancel, and a cancel the deadline."""

    DEADLINE = 1  # --max-generation-s passed: the stream ends with error `deadline`
    CANCELLED = 2  # the stream was cancelled (its client, abandoned, a disconnect): it ends `cancelled`
    FAILED = 3  # a bug met while keeping the lease: it ends with error `internal`
    HANDED_OVER = 4  # a shutdown past its grace, or the stream lost appends in a failover: released to the queue
    FENCED_OUT = 5  # another worker owns the stream: this one writes nothing more to it


@dataclass(slots=True)
class Run:
    """One job in flight, as a state machine: it generates (in segments: a parked one resumes with a new
    ``stop``) until it reaches an ``Ending`` or its answer ends by itself; then its generation is over (the
    renewer's signal to stop) and the worker writes what the ending says (generator.generation). Its state
    changes only through the methods below; each that ends the run sets ``stop``, which the inference thread
    reads."""

    claim: Claim
    #: Parks the run while one of its writes stalls (generator.slots); by default it never does.
    watch: StallWatch = field(default_factory=StallWatch.never)
    stop: StopSignal = field(default_factory=StopSignal)
    ending: Ending | None = None
    #: The stream's cancel reason, with CANCELLED (client, abandoned, disconnect).
    cancel_reason: str = ""
    #: The bug, with FAILED (a failing script, WRONGTYPE): the stream ends with ``error``, never a lease
    #: renewed by retrying the bug in silence.
    failure: BaseException | None = None
    #: The generation has ended, in whatever way: the lease renewer stops (cancelling it alone can be swallowed).
    generation_over: bool = False
    #: This attempt's spans (generator.telemetry; None: tracing off) and when it began (monotonic s).
    trace: GenerationTrace | None = None
    started_at: float = field(default_factory=time.monotonic)

    @property
    def stopping(self) -> bool:
        """Whatever the generation does next, it makes no more tokens."""
        return self.ending is not None

    def _reach(self, ending: Ending) -> None:
        if self.ending is None or ending > self.ending:
            self.ending = ending
        self.stop.set()

    def cancel(self, reason: str) -> None:
        """The stream was cancelled (what RENEW or APPEND replied; empty: it was not)."""
        if reason:
            self.cancel_reason = self.cancel_reason or reason
            self._reach(Ending.CANCELLED)

    def hit_deadline(self) -> None:
        self._reach(Ending.DEADLINE)

    def fail(self, error: BaseException) -> None:
        if self.failure is None:
            self.failure = error
            log.error("keeping the lease failed: %s", type(error).__name__, exc_info=error,
                      extra={"stream_id": str(self.claim.stream_id)})
        self._reach(Ending.FAILED)

    def hand_over(self) -> None:
        self._reach(Ending.HANDED_OVER)

    def fence_out(self) -> None:
        self._reach(Ending.FENCED_OUT)

    def engine_ended(self, error: BaseException | None) -> BaseException | None:
        """The engine's generation ended, with ``error`` (None: none). A lost generation (GenerationLost: its upstream
        died midway and another is up) is handed over: the next claim continues it, as a crashed worker's."""
        if isinstance(error, GenerationLost):
            self.hand_over()
        return error

    def resume(self) -> None:
        """A parked run goes on in a new segment: a new ``stop`` (the parked segment's was set to stop its
        engine)."""
        assert self.ending is None, "an ended run does not resume"
        self.stop = StopSignal()

    def end_generation(self) -> None:
        self.generation_over = True


async def keep_lease(run: Run, store: JobStore, lease_s: float, disconnect_grace_s: float) -> None:
    """Renew ``run``'s lease until its generation is over; stop it when cancelled or fenced out."""
    interval = max(0.05, lease_s / 3)
    # A renewal refused by a passing fault (a cluster client refreshing its slot map after another shard's
    # error, a busy Redis) is asked again soon, not a whole interval later: three missed renewals in a row lose
    # the lease, and a few failed tries must not add up to that while Redis answers most commands.
    retry_s = min(interval, RENEW_RETRY_S)
    wait_s = interval
    while not run.generation_over:
        await asyncio.sleep(wait_s)
        wait_s = retry_s
        try:
            res = await store.renew(run.claim, disconnect_grace_s, lease_s)
        except StoreUnavailable:
            # redis-py may turn our own cancellation mid-command into a connection error: a cancelled
            # renewer must stop, or the job waits on it forever (renewed, never finished).
            task = asyncio.current_task()
            if run.generation_over or (task is not None and task.cancelling()):
                raise asyncio.CancelledError from None
            continue
        except StoreFull:  # RENEW's write is one a full Redis allows (broker.streams.queue_scripts): rare, waited out
            OUT_OF_MEMORY.refused("lease renewal")
            continue
        except Exception as e:
            run.fail(e)  # a bug: retrying it would renew nothing, for ever
            return
        if not res.ok:
            run.fence_out()
            return
        wait_s = interval
        run.cancel(res.cancel_reason)


async def check_cancel(run: Run, store: JobStore, disconnect_grace_s: float, lease_s: float) -> None:
    """A cancel notice came for ``run``: ask RENEW, which says whether (and why) it is cancelled."""
    try:
        res = await store.renew(run.claim, disconnect_grace_s, lease_s)
    except StoreTransient:
        return  # the renewal loop asks again within lease_s / 3
    except Exception as e:
        run.fail(e)
        return
    run.cancel(res.cancel_reason)


async def listen_for_cancels(blocking: RedisClient, partitions: int,
                             on_notice: Callable[[uuid.UUID], None]) -> None:
    """Cancel notices arrive here at once, even while prefill runs and nothing is appended. One pub/sub
    connection (one per master on a cluster) carries the control channels of every partition; it
    reconnects by itself, and a notice lost meanwhile is still seen at the next lease renewal. Runs until
    cancelled."""

    def on_message(channel: bytes, data: bytes) -> None:
        with contextlib.suppress(ValueError):
            on_notice(uuid.UUID(data.decode()))

    channels = Channels(blocking, on_message=on_message, on_reset=lambda _: None)
    attempts = Attempts()
    try:
        await channels.start()
        for p in range(partitions):
            while True:
                try:
                    await channels.subscribe(control_channel(p, partitions).encode())
                    break
                except StoreUnavailable as e:  # e.g. no slot map yet: the cluster is unreachable
                    log.warning("cancel listener cannot subscribe yet: %s", e)
                    await attempts.sleep()
        await asyncio.Event().wait()  # until cancelled at shutdown; the shards run on their own
    finally:
        await channels.stop()

