"""generator.slots: a worker's slots, parked generations first when a slot frees, and the --max-parked bound."""

from __future__ import annotations

import asyncio

from helpers import until

from generator.slots import Slots, StallWatch


async def _settle() -> None:
    """A few turns of the loop: what the last step woke runs (no time passes; a test that asserts something did
    not happen needs them too)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_parked_generation_gives_its_slot_to_a_new_job_and_takes_one_back_before_any_new_job() -> None:
    slots = Slots(1, 4)
    await slots.take()
    first = slots.seat()
    second_job = asyncio.ensure_future(slots.take())
    await _settle()
    assert not second_job.done()  # one slot, taken
    assert first.park()
    await _settle()
    assert second_job.done() and slots.parked == 1
    second = slots.seat()
    # The parked generation's write landed: it wants its slot back, and a third job must not jump ahead of it.
    resumed = asyncio.ensure_future(first.resume())
    third_job = asyncio.ensure_future(slots.take())
    await _settle()
    assert not resumed.done() and not third_job.done() and slots.resume_wanted
    second.close()
    await _settle()
    assert resumed.done() and not third_job.done()
    assert slots.parked == 0 and first.holds_slot and not first.parked
    first.close()
    await _settle()
    assert third_job.done()
    slots.seat().close()
    assert slots.free == 1 and slots.parked == 0


async def test_past_max_parked_a_stalled_generation_keeps_its_slot() -> None:
    slots = Slots(3, 2)
    seats = []
    for _ in range(3):
        await slots.take()
        seats.append(slots.seat())
    assert seats[0].park() and seats[1].park()
    assert not seats[2].park() and seats[2].holds_slot and not seats[2].parked
    assert slots.free == 2 and slots.parked == 2
    for seat in seats:  # a parked job that ends without resuming leaves the parked count, gives back nothing twice
        seat.close()
        seat.close()
    assert slots.free == 3 and slots.parked == 0


async def test_the_slot_goes_back_only_once_the_engine_has_stopped() -> None:
    loop = asyncio.get_running_loop()
    slots = Slots(1, 1)
    await slots.take()
    seat = slots.seat()
    engine_done: asyncio.Future[None] = loop.create_future()
    assert seat.park(engine_done)
    assert slots.free == 0  # the engine (one llama.cpp context per worker) still runs
    engine_done.set_result(None)
    await _settle()
    assert slots.free == 1 and not seat.holds_slot
    seat.close()
    assert slots.free == 1 and slots.parked == 0


async def test_a_resume_before_the_engine_stopped_keeps_the_slot_it_never_gave_back() -> None:
    loop = asyncio.get_running_loop()
    slots = Slots(1, 1)
    await slots.take()
    seat = slots.seat()
    engine_done: asyncio.Future[None] = loop.create_future()
    seat.park(engine_done)
    await seat.resume()  # at once: it still holds its slot
    engine_done.set_result(None)
    await _settle()
    assert seat.holds_slot and slots.free == 0 and slots.parked == 0
    seat.close()
    assert slots.free == 1


async def test_a_stall_watch_parks_a_write_that_waits_too_long_and_not_one_that_lands() -> None:
    slots = Slots(1, 1)
    await slots.take()
    seat = slots.seat()
    watch = StallWatch(seat, 0.05)
    with watch:
        await asyncio.sleep(0.01)  # deliberate: a write that lands within the watch's 0.05 s
    await asyncio.sleep(0.1)  # deliberate: past the watch's time, in which nothing may happen
    assert not seat.parked  # the write landed in time: the timer went with it
    stopped: list[bool] = []

    def on_park() -> None:
        stopped.append(True)

    watch.on_park = on_park
    with watch:  # a write that lasts until the watch parks it
        await until(lambda: seat.parked, 5.0, interval_s=0.01)
    assert stopped == [True] and seat.parked and slots.free == 1
    seat.close()


async def test_at_the_bound_a_stall_watch_looks_again_and_parks_once_there_is_room() -> None:
    slots = Slots(2, 1)
    await slots.take()
    holder = slots.seat()
    await slots.take()
    seat = slots.seat()
    assert holder.park()
    watch = StallWatch(seat, 0.03)
    with watch:
        await asyncio.sleep(0.08)  # deliberate: past the watch's time, in which it may not park
        assert not seat.parked  # the one parked place is taken
        holder.close()
        await until(lambda: seat.parked, 5.0, interval_s=0.01)
    seat.close()
    assert slots.free == 2 and slots.parked == 0


def test_never_parks() -> None:
    watch = StallWatch.never()
    assert watch.after_s is None and not watch.seat.can_park


async def test_a_job_whose_engine_is_done_gives_its_slot_to_the_next_during_its_last_writes() -> None:
    slots = Slots(1, 0)
    await slots.take()
    first = slots.seat()
    second_job = asyncio.ensure_future(slots.take())
    await _settle()
    assert not second_job.done()
    first.finish()  # its engine is done; its terminal event is on its way to Redis
    await _settle()
    assert second_job.done() and not first.holds_slot
    first.finish()  # twice changes nothing
    second = slots.seat()
    first.close()
    second.close()
    assert slots.free == 1 and slots.finishing == 0


async def test_no_more_jobs_finish_at_once_than_there_are_slots() -> None:
    """A Redis slow to take the last writes slows the claims: finishing jobs do not pile up."""
    slots = Slots(1, 0)
    seats = []
    for _ in range(2):
        await slots.take()
        seat = slots.seat()
        seat.finish()
        seats.append(seat)
    third_job = asyncio.ensure_future(slots.take())
    await _settle()
    assert not third_job.done() and slots.free == 1 and slots.finishing == 2
    seats[0].close()  # one finishing job's writes landed
    await _settle()
    assert third_job.done()
    slots.seat().close()
    seats[1].close()
    assert slots.free == 1 and slots.finishing == 0


async def test_a_parked_job_is_not_finished_twice() -> None:
    slots = Slots(1, 1)
    await slots.take()
    seat = slots.seat()
    assert seat.park()
    seat.finish()  # parked: its slot was given back already
    seat.close()
    assert slots.free == 1 and slots.parked == 0 and slots.finishing == 0
