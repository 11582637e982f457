"""A run's state machine (generator.lease.Run): which ending wins when several reach it, and that every ending
stops the engine."""

from __future__ import annotations

import itertools
import uuid
from types import SimpleNamespace
from typing import cast

import pytest

from broker.streams.records import Claim
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
