"""broker.streams.turns: a turn read off its stream's events (text, reasoning, tool calls in pieces, the terminal
event), its stored record, and what it puts in front of later turns."""

from __future__ import annotations

import uuid

from broker.events import Event, EventType, encode_data
from broker.request.generation import GenerationRequest, Message, ToolCall
from broker.request.history import History
from broker.streams.turns import ITEMS, Output, Turn, finished_turn, history_messages, items_turn, output_of


def _ev(i: int, etype: str, **data: object) -> Event:
    return Event(f"1-{i}", etype, encode_data(data))


EVENTS = [
    _ev(0, EventType.QUEUED, position=1, eta_s=None),
    _ev(1, EventType.STARTED, model="m1"),
    _ev(2, "reasoning", text="Let me "),
    _ev(3, "reasoning", text="think."),
    _ev(4, EventType.DELTA, text="Looking "),
    _ev(5, EventType.DELTA, text="it up."),
    _ev(6, "tool_call", index=0, id="call_1", name="get_weather"),
    _ev(7, "tool_args", index=0, text='{"city": '),
    _ev(8, "tool_call", index=1, id="call_2", name="get_time"),
    _ev(9, "tool_args", index=0, text='"Paris"}'),
    _ev(10, "tool_args", index=1, text="{}"),
    _ev(11, EventType.DONE, finish_reason="tool_calls", usage={"prompt_tokens": 5, "completion_tokens": 9}),
]


def test_the_output_is_read_off_the_events() -> None:
    output, terminal, model = output_of(EVENTS)
    assert output == Output("Looking it up.", (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),
                                               ToolCall("call_2", "get_time", "{}")), "Let me think.")
    assert terminal is EVENTS[-1] and model == "m1"
    assert output_of(EVENTS[:-1])[1] is None  # not ended


def test_a_finished_turn_holds_what_its_request_sent_new_and_round_trips() -> None:
    history = History(lead=1, start=3, conversation="c", tenant="k", turn=1, message_ids=("u9",))
    request = GenerationRequest((Message("system", "sys"), Message("user", "old"), Message("assistant", "was"),
                                 Message("user", "weather?")), None, None, 32, 0.8, 0.95, None, (), False,
                                history=history)
    sid = uuid.uuid4()
    turn = finished_turn(sid, request, 12.5, EVENTS)
    assert turn is not None
    assert turn.input == ({"role": "user", "content": "weather?"},) and turn.input_ids == ("u9",)
    assert turn.status == "done" and turn.finish_reason == "tool_calls" and turn.model == "m1"
    assert Turn.from_json(turn.to_json()) == turn
    assert turn.message_id(0) == "u9" and turn.message_id(1) == f"{sid.hex}-1"
    assert turn.prompt() == [{"role": "user", "content": "weather?"},
                             {"role": "assistant", "content": "Looking it up.",
                              "tool_calls": [["call_1", "get_weather", '{"city": "Paris"}'], ["call_2", "get_time", "{}"]]}]
    assert finished_turn(sid, request, 0, EVENTS[:-1]) is None


def test_a_turn_without_an_answer_puts_nothing_in_later_prompts() -> None:
    failed = Turn(uuid.uuid4(), EventType.ERROR, ({"role": "user", "content": "q"},),
                  error={"code": "engine", "message": "boom"})
    answered = Turn(uuid.uuid4(), EventType.CANCELLED, ({"role": "user", "content": "r"},), output=Output("part"))
    items = items_turn((Message("system", "be brief"),), 1.0)
    assert items.status == ITEMS and not items.has_stream
    assert history_messages([items, failed, answered]) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "r"},
        {"role": "assistant", "content": "part"}]
