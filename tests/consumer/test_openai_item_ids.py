"""The ids of the Responses and Conversations items (consumer.views.openai.item_ids): a conversation's ids are
unique and each parses back to its item, input and output apart; the ids a response's output shows are the ids its
conversation lists; ids rsb wrote before input and output were apart still name their item where they named one."""

from __future__ import annotations

import uuid
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.events import Event, EventType
from broker.request.generation import Message, ToolCall
from broker.streams.conversations import Conversation
from broker.streams.records import StreamStatus
from broker.streams.turns import ITEMS, Output, Turn
from consumer.views.openai.conversations import _canonical, all_items, turn_items
from consumer.views.openai.item_ids import (
    FUNCTION_CALL,
    FUNCTION_CALL_OUTPUT,
    INPUT_KINDS,
    MESSAGE,
    OUTPUT_KINDS,
    REASONING,
    ItemId,
)
from consumer.views.openai.response_view import ResponseView

TEXT = st.text(max_size=5)
CALL = st.builds(ToolCall, st.text(min_size=1, max_size=4), st.sampled_from(["f", "g"]), st.just("{}"))
MESSAGES = st.one_of(
    st.builds(Message, st.sampled_from(["system", "user"]), TEXT),
    st.builds(lambda text, calls: Message("assistant", text, tuple(calls)), TEXT, st.lists(CALL, max_size=3)),
    st.builds(lambda text, call: Message("tool", text, (), call), TEXT, st.text(min_size=1, max_size=4)),
)
OUTPUTS = st.builds(lambda text, calls, reasoning: Output(text, tuple(calls), reasoning), TEXT,
                    st.lists(CALL, max_size=3), TEXT)


@st.composite
def turns(draw: st.DrawFn) -> Turn:
    messages = draw(st.lists(MESSAGES, min_size=1, max_size=5))
    status = draw(st.sampled_from(["done", "cancelled", ITEMS]))
    output = Output() if status == ITEMS else draw(OUTPUTS)
    return Turn(uuid.UUID(int=draw(st.integers(0, 2**128 - 1))), status, tuple(m.stored() for m in messages),
                output=output, finish_reason="stop")


def _input_count(turn: Turn) -> int:
    """How many of the turn's items come from its input (the rest are its answer's)."""
    count = 0
    for stored in turn.input:
        m = Message.from_stored(stored)
        count += 1 if m.role == "tool" else int(bool(m.content) or not m.tool_calls) + len(m.tool_calls)
    return count


@pytest.mark.slow  # hundreds of examples: seconds
@settings(max_examples=300, deadline=None)
@given(st.lists(turns(), max_size=4, unique_by=lambda t: t.id))  # a turn is its stream: ids differ
def test_a_conversations_item_ids_are_unique_and_each_parses_back_to_its_item(conversation: list[Turn]) -> None:
    conv = Conversation("k", "c", 0.0, len(conversation), len(conversation), 0, None, {}, tuple(conversation))
    ids = [item["id"] for item in all_items(conv)]
    assert len(ids) == len(set(ids)), ids
    for turn in conversation:
        items = turn_items(turn)
        inputs = _input_count(turn)
        for n, item in enumerate(items):
            parsed = ItemId.parse(item["id"])
            assert parsed is not None and str(parsed) == item["id"], item
            assert (parsed.stream, parsed.kind, parsed.output) == (turn.id, item["type"], n >= inputs), item
            assert _canonical(item["id"]) == item["id"]
        outputs = [ItemId.parse(i["id"]) for i in items[inputs:]]
        assert [o.index for o in outputs if o is not None] == list(range(len(outputs)))


IDS = st.one_of(
    st.builds(ItemId.of_output, st.sampled_from(sorted(OUTPUT_KINDS)), st.uuids(), st.integers(0, 999_999)),
    st.builds(ItemId.of_input, st.sampled_from([MESSAGE, FUNCTION_CALL_OUTPUT]), st.uuids(), st.integers(0, 999_999)),
    st.builds(ItemId.of_input, st.just(FUNCTION_CALL), st.uuids(), st.integers(0, 999_999), st.integers(0, 999_999)),
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(IDS, IDS)
def test_every_item_id_round_trips_and_two_items_never_share_an_id(a: ItemId, b: ItemId) -> None:
    assert ItemId.parse(str(a)) == a and (a.kind in OUTPUT_KINDS if a.output else a.kind in INPUT_KINDS)
    assert (str(a) == str(b)) == (a == b)


def _event(n: int, etype: str, **data: Any) -> Event:
    return Event(f"{n}-0", etype, orjson.dumps(data))


def test_the_issues_turn_lists_its_input_and_its_answer_apart() -> None:
    """Issue 45: a turn whose input has two messages and whose answer is [reasoning, message] listed ``msg_<hex>_1``
    twice (the answer could not be fetched by its id; a reference to the input message named the output)."""
    sid = uuid.uuid4()
    turn = Turn(sid, "done", (Message("system", "be brief").stored(), Message("user", "hi").stored()),
                output=Output("hello", (ToolCall("c1", "f", "{}"),), "thinking"), finish_reason="stop")
    items = turn_items(turn)
    assert [i["id"] for i in items] == [f"msg_{sid.hex}_in0", f"msg_{sid.hex}_in1", f"rs_{sid.hex}",
                                        f"msg_{sid.hex}_1", f"fc_{sid.hex}_2"]
    # The answer's ids are the ones its Response object gives (the events in the order the model answered).
    view = ResponseView(sid, StreamStatus("done", "m", 0.0, None, None, False, 16, ""), None)
    for ev in (_event(1, EventType.STARTED, model="m"), _event(2, EventType.REASONING, text="thinking"),
               _event(3, EventType.DELTA, text="hello"), _event(4, EventType.TOOL_CALL, index=0, id="c1", name="f"),
               _event(5, EventType.TOOL_ARGS, index=0, text="{}"),
               _event(6, EventType.DONE, finish_reason="tool_calls", usage={})):
        view.feed(ev)
    assert [item["id"] for item in view.response()["output"]] == [i["id"] for i in items[2:]]


def test_ids_rsb_wrote_before_still_name_their_item_where_they_named_one() -> None:
    sid = uuid.uuid4()
    h = sid.hex
    assert ItemId.parse(f"msg_{h}_0") == ItemId.of_input(MESSAGE, sid, 0)  # never an output id
    assert ItemId.parse(f"fco_{h}_3") == ItemId.of_input(FUNCTION_CALL_OUTPUT, sid, 3)
    assert ItemId.parse(f"fc_{h}_2_1") == ItemId.of_input(FUNCTION_CALL, sid, 2, 1)
    assert ItemId.parse(f"msg_{h}_1") == ItemId.of_output(MESSAGE, sid, 1)  # the output's, as the Response says
    assert ItemId.parse(f"rs_{h}") == ItemId.of_output(REASONING, sid, 0)
    for bad in (f"rs_{h}_in0", f"fc_{h}_in1", f"msg_{h}_in1_2", f"fco_{h}", f"msg_{h}_01", f"msg_{h.upper()}",
                f"rs_{h}_0", "msg_nope", f"msg_{h}_1234567", None, 7):
        assert ItemId.parse(bad) is None, bad
