"""consumer.views.aisdk.history: how the body ``useChat`` sends lines up with a chat's turns (what is new, what
repeats a turn, where a regenerate or an edit branches), and the turns as UIMessages."""

from __future__ import annotations

import uuid

from broker.streams.turns import Output, Turn
from consumer.views.aisdk.history import plan_turn, ui_messages
from consumer.views.aisdk.request import UIMessageRef as M


def _turn(uid: str, question: str, answer: str) -> Turn:
    return Turn(uuid.uuid4(), "done", ({"role": "user", "content": question},), (uid,), Output(answer), model="m",
                finish_reason="stop", usage={"prompt_tokens": 1, "completion_tokens": 2})


T1, T2 = _turn("u1", "one", "1"), _turn("u2", "two", "2")
HISTORY = [M("u1", "user", "one"), M(str(T1.id), "assistant", "1"), M("u2", "user", "two"),
           M(str(T2.id), "assistant", "2")]


def test_a_send_adds_what_follows_the_history() -> None:
    body = [*HISTORY, M("u3", "user", "three")]
    plan = plan_turn([T1, T2], body, plain_send=True, regenerate=False)
    assert (plan.keep, plan.start, plan.repeat) == (2, 4, None)
    # The client's copy of an answer may be partial (it stopped reading): the answer's id is what matches.
    partial = [M("u1", "user", "one"), M(str(T1.id), "assistant", ""), M("u3", "user", "three")]
    assert plan_turn([T1], partial, plain_send=True, regenerate=False).keep == 1


def test_the_same_send_again_repeats_the_last_turn() -> None:
    body = [M("u1", "user", "one"), M(str(T1.id), "assistant", "1"), M("u2", "user", "two")]
    plan = plan_turn([T1, T2], body, plain_send=True, regenerate=False)
    assert plan.repeat is T2


def test_a_regenerate_redoes_the_last_turn_and_an_edit_branches_before_the_edited_message() -> None:
    body = [M("u1", "user", "one"), M(str(T1.id), "assistant", "1"), M("u2", "user", "two")]
    plan = plan_turn([T1, T2], body, plain_send=False, regenerate=True)
    assert (plan.keep, plan.start, plan.repeat) == (1, 2, None)
    edited = [M("u1", "user", "one"), M(str(T1.id), "assistant", "1"), M("u2", "user", "two, edited")]
    plan = plan_turn([T1, T2], edited, plain_send=False, regenerate=False)
    assert (plan.keep, plan.start) == (1, 2)
    # A history this chat never had (another client's) replaces it.
    plan = plan_turn([T1, T2], [M("x", "user", "other")], plain_send=True, regenerate=False)
    assert (plan.keep, plan.start) == (0, 0)


def test_the_turns_as_ui_messages() -> None:
    running = Turn(uuid.uuid4(), "running", ({"role": "user", "content": "three"},), ("u3",))
    msgs = ui_messages([T1, T2], running)
    assert [(m["id"], m["role"]) for m in msgs] == [("u1", "user"), (str(T1.id), "assistant"), ("u2", "user"),
                                                    (str(T2.id), "assistant"), ("u3", "user")]
    assert msgs[1]["parts"] == [{"type": "step-start"}, {"type": "text", "text": "1", "state": "done"}]
    assert msgs[1]["metadata"]["usage"] == {"inputTokens": 1, "outputTokens": 2, "totalTokens": 3}
    # Sent back as they are, they are the history: only the new message is new.
    refs = [M(m["id"], m["role"], m["parts"][-1]["text"]) for m in msgs[:4]] + [M("u4", "user", "four")]
    assert plan_turn([T1, T2], refs, plain_send=True, regenerate=False).start == 4
