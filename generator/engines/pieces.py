"""What a generation yields, token by token, and what a continued one is told about the answer so far.

A generation's pieces are each token's text as a bare ``str`` (no object per token: the cost of a plain
answer stays one string per token), and markers, which are no token: they switch the kind of the text that
follows. When one token's text spans two kinds (the end of a call's arguments and the text after it), the
part after the marker is an ``Extra``: text with no token of its own, so the token is counted once.

A generation starts in ``TEXT`` (the answer); ``REASONING`` switches to the model's reasoning;
``ToolCallStart`` begins a tool call, and the text after it is that call's arguments (JSON text), until the
next marker. The token pump (generator.generation) turns each run of one kind into one event: ``delta``,
``reasoning``, ``tool_call`` then ``tool_args``.

A generation continued after a crash (``PartialAnswer``) starts in the kind the stored answer ended in (the
arguments of its last call, say), so it resumes without a marker and nothing is announced twice.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Channel:
    """A kind of text: the pieces after it are of this kind."""

    name: str


TEXT = Channel("text")
REASONING = Channel("reasoning")


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    """Tool call ``index`` begins (id and name known); the pieces after it are its arguments."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log-probability of the text token before it, and of the likeliest tokens in its place."""

    token: str
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[tuple[str, float, tuple[int, ...]], ...] = ()

    def as_json(self) -> dict[str, object]:
        return {"token": self.token, "logprob": self.logprob, "bytes": list(self.bytes),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)} for t, lp, b in self.top]}


class Extra(str):
    """Text that belongs to the token before it (see the module doc); rare, so the object it costs is too."""

    __slots__ = ()


Marker = Channel | ToolCallStart | TokenLogprob
#: ``type(piece) is str``: one token's text; anything else (a marker, an Extra) is no token.
Piece = str | Marker


@dataclass(frozen=True, slots=True)
class PartialCall:
    index: int
    id: str
    name: str
    arguments: str  # so far


@dataclass(frozen=True, slots=True)
class PartialAnswer:
    """What earlier attempts appended besides the answer text (``prefix_text``): the reasoning, the calls
    begun, and the kind the last piece was of (``TEXT``, ``REASONING``, or the index of the call whose
    arguments it belongs to)."""

    reasoning: str = ""
    calls: tuple[PartialCall, ...] = ()
    ends_in: Channel | int = TEXT

    @property
    def typed(self) -> bool:
        """Anything but text."""
        return bool(self.reasoning or self.calls)


NOTHING = PartialAnswer()
