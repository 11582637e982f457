"""The id of every item the Responses and Conversations views show: one grammar, formatted and parsed here only.

An item belongs to one stream (a response, or the turn of a conversation it was: named by the stream's UUID, or
for a turn of items alone by the turn's own) and to one of two spaces, which never share an id:

- **output**, the answer's items in the order the Response object lists them: ``<prefix>_<hex>`` for the first
  (output index 0), ``<prefix>_<hex>_<index>`` after it, the prefix by kind: ``msg`` a message, ``rs`` a
  reasoning item, ``fc`` a function call. The ids the Responses view has always given (clients hold them and
  send them back as ``item_reference`` s).
- **input**, a conversation turn's input items, by the index of the message they come from in the turn's input:
  ``msg_<hex>_in<i>`` a message, ``fco_<hex>_in<i>`` a tool result (``function_call_output``), and
  ``fc_<hex>_in<i>_<j>`` the ``j``-th call of an assistant message.

Parsing also reads what rsb wrote before the two spaces were apart, where it names one item: ``fco_<hex>_<i>``,
``fc_<hex>_<i>_<j>`` and ``msg_<hex>_0`` (never an output id) name input items. ``msg_<hex>_<i>`` for ``i`` of 1
or more is the output id: as a conversation's input message it named two items at once.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

MESSAGE, REASONING, FUNCTION_CALL, FUNCTION_CALL_OUTPUT = "message", "reasoning", "function_call", \
    "function_call_output"
#: The id prefix of each kind of item (OpenAI's msg_, rs_, fc_; fco_ for a tool result, rsb's).
PREFIX = {MESSAGE: "msg", REASONING: "rs", FUNCTION_CALL: "fc", FUNCTION_CALL_OUTPUT: "fco"}
_KIND = {prefix: kind for kind, prefix in PREFIX.items()}
#: The kinds each space holds.
OUTPUT_KINDS = frozenset({MESSAGE, REASONING, FUNCTION_CALL})
INPUT_KINDS = frozenset({MESSAGE, FUNCTION_CALL, FUNCTION_CALL_OUTPUT})
#: Indexes are written in canonical decimal (no leading zero), at most this many digits.
_NUMBER = r"(0|[1-9][0-9]{0,5})"
_ID = re.compile(rf"\A(msg|rs|fc|fco)_([0-9a-f]{{32}})(?:_(in)?{_NUMBER}(?:_{_NUMBER})?)?\Z")


@dataclass(frozen=True, slots=True)
class ItemId:
    """One item's place: its ``kind``, its ``stream``, its space (``output``), its ``index`` there (the output index;
    in the input, the index of the message it comes from) and, for a call of an input message, which (``call``)."""

    kind: str
    stream: uuid.UUID
    output: bool
    index: int
    call: int | None = None

    @classmethod
    def of_output(cls, kind: str, stream: uuid.UUID, index: int) -> ItemId:
        return cls(kind, stream, True, index)

    @classmethod
    def of_input(cls, kind: str, stream: uuid.UUID, message: int, call: int | None = None) -> ItemId:
        """An input item: message ``message`` of the turn's input (a message or a tool result), or its ``call``-th
        call (a function call)."""
        return cls(kind, stream, False, message, call)

    def __str__(self) -> str:
        head = f"{PREFIX[self.kind]}_{self.stream.hex}"
        if self.output:
            return head if self.index == 0 else f"{head}_{self.index}"
        return f"{head}_in{self.index}" if self.call is None else f"{head}_in{self.index}_{self.call}"

    @classmethod
    def parse(cls, raw: object) -> ItemId | None:
        """The item ``raw`` names (None: no item of rsb's could have this id)."""
        m = _ID.match(raw) if isinstance(raw, str) else None
        if m is None:
            return None
        prefix, hexid, marked, first, second = m.groups()
        kind, stream = _KIND[prefix], uuid.UUID(hex=hexid)
        if marked:  # the input space
            call = None if second is None else int(second)
            if (kind == FUNCTION_CALL) != (call is not None) or kind not in INPUT_KINDS:
                return None
            return cls.of_input(kind, stream, int(first), call)
        if second is not None:  # fc_<hex>_<i>_<j>: a call of an input message, as rsb wrote it before
            return cls.of_input(kind, stream, int(first), int(second)) if kind == FUNCTION_CALL else None
        if kind == FUNCTION_CALL_OUTPUT:  # fco_<hex>_<i>, as rsb wrote it before
            return None if first is None else cls.of_input(kind, stream, int(first))
        if first is None:
            return cls.of_output(kind, stream, 0)
        if first == "0":  # never an output id: msg_<hex>_0 was an input message's
            return cls.of_input(kind, stream, 0) if kind == MESSAGE else None
        return cls.of_output(kind, stream, int(first))
