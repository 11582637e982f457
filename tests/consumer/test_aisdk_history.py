"""consumer.views.aisdk.history: how the body ``useChat`` sends lines up with a chat's turns (what is new, what
repeats a turn, where a regenerate or an edit branches, a continuation after a tool result), and the turns as
UIMessages (steps and tool parts included)."""

from __future__ import annotations

import uuid

from broker.request.generation import Message, ToolCall
from broker.streams.turns import Output, Turn
from consumer.views.aisdk.history import plan_turn, ui_messages


def _turn(uid: str, question: str, answer: str) -> Turn:
    return Turn(uuid.uuid4(), "done", (Message("user", question).stored(),), (uid,), Output(answer), model="m",
                finish_reason="stop", usage={"prompt_tokens": 1, "completion_tokens": 2})


T1, T2 = _turn("u1", "one", "1"), _turn("u2", "two", "2")
HISTORY = [("u1", Message("user", "one")), (str(T1.id), Message("assistant", "1")), ("u2", Message("user", "two")),
           (str(T2.id), Message("assistant", "2"))]


def _plan(turns: list[Turn], body: list[tuple[str, Message]], *, plain_send: bool = True,
          regenerate: bool = False) -> tuple[int, int, Turn | None]:
    plan = plan_turn(turns, [i for i, _ in body], [m for _, m in body], plain_send=plain_send,
                     regenerate=regenerate)
    return plan.keep, plan.start, plan.repeat


def test_a_send_adds_what_follows_the_history() -> None:
    assert _plan([T1, T2], [*HISTORY, ("u3", Message("user", "three"))]) == (2, 4, None)
    # The client's copy of an answer may be partial (it stopped reading): the answer's id is what matches.
    partial = [("u1", Message("user", "one")), (str(T1.id), Message("assistant", "")), ("u3", Message("user", "3"))]
    assert _plan([T1], partial)[:2] == (1, 2)


def test_the_same_send_again_repeats_the_last_turn() -> None:
    assert _plan([T1, T2], HISTORY[:3])[2] is T2


def test_a_regenerate_redoes_the_last_turn_and_an_edit_branches_before_the_edited_message() -> None:
    assert _plan([T1, T2], HISTORY[:3], plain_send=False, regenerate=True) == (1, 2, None)
    edited = [*HISTORY[:2], ("u2", Message("user", "two, edited"))]
    assert _plan([T1, T2], edited, plain_send=False) == (1, 2, None)
    # A history this chat never had (another client's) replaces it.
    assert _plan([T1, T2], [("x", Message("user", "other"))]) == (0, 0, None)


CALL = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
ASKED = Turn(uuid.uuid4(), "done", (Message("user", "weather?").stored(),), ("u1",),
             Output("Looking.", (CALL,)), finish_reason="tool_calls")


def test_a_tool_result_continues_the_message_of_the_call() -> None:
    """The SDK sends the assistant message with its call's result: the result is the new turn's input."""
    mid = str(ASKED.id)
    body = [("u1", Message("user", "weather?")), (mid, Message("assistant", "Looking.", (CALL,))),
            (mid, Message("tool", "sunny", tool_call_id="call_1"))]
    assert _plan([ASKED], body) == (1, 2, None)
    # The continuation answered (in the same message): the next send finds both turns whole.
    answered = Turn(uuid.uuid4(), "done", (Message("tool", "sunny", tool_call_id="call_1").stored(),), (mid,),
                    Output("It is sunny."), answer_id=mid)
    later = [*body, (mid, Message("assistant", "It is sunny.")), ("u2", Message("user", "thanks"))]
    assert _plan([ASKED, answered], later) == (2, 4, None)
    msgs = ui_messages([ASKED, answered])
    assert [(m["id"], m["role"]) for m in msgs] == [("u1", "user"), (mid, "assistant")]
    assert msgs[1]["parts"] == [
        {"type": "step-start"}, {"type": "text", "text": "Looking.", "state": "done"},
        {"type": "tool-get_weather", "toolCallId": "call_1", "state": "output-available", "input": {"city": "Paris"},
         "output": "sunny"},
        {"type": "step-start"}, {"type": "text", "text": "It is sunny.", "state": "done"}]


def test_the_turns_as_ui_messages() -> None:
    running = Turn(uuid.uuid4(), "running", (Message("user", "three").stored(),), ("u3",))
    msgs = ui_messages([T1, T2], running)
    assert [(m["id"], m["role"]) for m in msgs] == [("u1", "user"), (str(T1.id), "assistant"), ("u2", "user"),
                                                    (str(T2.id), "assistant"), ("u3", "user")]
    assert msgs[1]["parts"] == [{"type": "step-start"}, {"type": "text", "text": "1", "state": "done"}]
    assert msgs[1]["metadata"]["usage"] == {"inputTokens": 1, "outputTokens": 2, "totalTokens": 3}
