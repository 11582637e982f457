"""What a conversation's turn does when it is created while another turn of the conversation runs (a user who
sends again before the answer is in: "double texting"), named by the create's ``on_busy`` or the API key's.

- ``reject``: the create is refused, ``409 conflict`` naming the running turn (the default);
- ``interrupt``: the running turn is cancelled for real (its worker stops; its answer so far stays in the
  history) and the new turn runs next, with that partial answer in its prompt;
- ``enqueue``: the new turn waits, and runs once the turns before it have ended, their answers in its prompt.

broker.streams.conversations keeps the turns that wait and says how each choice stays atomic.
"""

from __future__ import annotations

from broker.errors import InvalidRequest

REJECT, INTERRUPT, ENQUEUE = "reject", "interrupt", "enqueue"
ON_BUSY = (REJECT, INTERRUPT, ENQUEUE)


def parse_on_busy(raw: object) -> str | None:
    """A create's ``on_busy`` (None: not given, the key's default applies)."""
    if raw is None:
        return None
    if not isinstance(raw, str) or raw not in ON_BUSY:
        raise InvalidRequest.at(("on_busy",), f" must be one of {', '.join(ON_BUSY)}")
    return raw
