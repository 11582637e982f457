"""A run's state machine (generator.lease.Run): which ending wins when several reach it, and that every ending
stops the engine."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from types import SimpleNamespace
from typing import cast

import pytest

from broker.errors import StoreFull, StoreUnavailable
from broker.streams.job_store import JobStore
from broker.streams.records import AppendResult, Claim
from generator import lease
from generator.lease import Ending, Run


def new_run() -> Run:
    return Run(cast(Claim, SimpleNamespace(stream_id=uuid.uuid4())))


def reach(run: Run, ending: Ending) -> None:
    {
        Ending.DEADLINE: run.hit_deadline,
        Ending.CANCELLED: lambda: run.cancel("client"),
        Ending.FAILED: lambda: run.fail(RuntimeError("WRONGTYPE")),
        Ending.HANDED_OVER: run.hand_over,
        Ending.FENCED_OUT: run.fence_out,
    }[ending]()


def test_a_run_goes_on_until_it_reaches_an_ending() -> None:
    run = new_run()
    run.cancel("")  # RENEW and APPEND reply "" when the stream is not cancelled
    assert run.ending is None and not run.stopping and not run.stop.is_set()


@pytest.mark.parametrize(("first", "second"), list(itertools.permutations(Ending, 2)))
def test_the_higher_ending_wins_in_either_order_and_each_stops_the_engine(first: Ending, second: Ending) -> None:
    run = new_run()
    reach(run, first)
    assert run.stopping and run.stop.is_set() and run.ending is first
    reach(run, second)
    # fenced out > handed over > failed > cancelled > deadline: what the worker then writes to the stream
    assert run.ending is max(first, second)


def test_the_first_cancel_reason_and_failure_are_kept() -> None:
    run = new_run()
    run.cancel("disconnect")
    run.cancel("client")
    first = RuntimeError("first")
    run.fail(first)
    run.fail(RuntimeError("second"))
    assert (run.ending, run.cancel_reason, run.failure) == (Ending.FAILED, "disconnect", first)


def test_a_parked_run_resumes_with_a_new_stop_signal_and_an_ended_one_never_does() -> None:
    run = new_run()
    parked = run.stop
    parked.set()  # the parked segment stopped its engine
    run.resume()
    assert run.stop is not parked and not run.stop.is_set()
    run.hand_over()
    with pytest.raises(AssertionError):
        run.resume()


def test_a_lost_generation_is_handed_over_and_other_engine_errors_are_the_streams() -> None:
    from generator.engines import GenerationLost, UpstreamError

    run = new_run()
    error = UpstreamError("upstream answered HTTP 400")
    assert run.engine_ended(error) is error and run.ending is None  # the stream ends with it (error upstream)
    lost = GenerationLost("upstream died mid-answer; another is up")
    assert run.engine_ended(lost) is lost and run.ending is Ending.HANDED_OVER  # continued by the next claim


async def test_a_renewal_that_met_a_passing_fault_is_asked_again_soon_not_a_whole_interval_later(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Three missed renewals lose the lease: a busy cluster client failing a few in a row (another shard down)
    # must not add up to that while Redis answers. The waits are recorded, not slept.
    run = new_run()
    replies: list[object] = [StoreUnavailable("refreshing"), StoreUnavailable("refreshing"),
                             AppendResult(True, ""), StoreFull("OOM"), AppendResult(True, "")]
    waits: list[float] = []

    class FakeStore:
        async def renew(self, claim: Claim, disconnect_grace_s: float, lease_s: float) -> AppendResult:
            reply = replies.pop(0)
            if not replies:
                run.end_generation()
            if isinstance(reply, Exception):
                raise reply
            assert isinstance(reply, AppendResult)
            return reply

    real_sleep = asyncio.sleep

    async def recorded(delay: float) -> None:
        waits.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", recorded)
    await lease.keep_lease(run, cast(JobStore, FakeStore()), 30.0, 5.0)
    retry = lease.RENEW_RETRY_S
    assert waits == [10.0, retry, retry, 10.0, retry]
    assert run.ending is None
