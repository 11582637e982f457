"""Text from a stream made safe for a terminal: what ``rsb chat`` and ``rsb tail`` print is the model's text, and a
model (or whoever wrote its prompt) can emit escape sequences that set the window title, rewrite the screen,
hide text, or (in some terminals) answer back as keystrokes. Every escape sequence (CSI, OSC, DCS and the
others, complete ones whole) and every other C0 or C1 control character is dropped; ``\\n`` and ``\\t`` are kept.

A sequence can arrive split over two deltas: ``TerminalText`` holds back an unfinished one at the end of a delta
(up to ``MAX_HELD`` characters) and strips it whole once the rest comes.
"""

from __future__ import annotations

import json
import re
from typing import Any

# ESC then: CSI (ESC [ params intermediates final), OSC (ESC ] ... BEL or ST), DCS/SOS/PM/APC (ESC P|X|^|_ ... ST),
# or a two-character (or nF) escape.
_SEQUENCE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[PX^_][^\x1b]*\x1b\\|[ -/]*[0-~])")
# An unfinished sequence at the very end of a text.
_UNFINISHED = re.compile(r"\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*\x1b?|[PX^_][^\x1b]*\x1b?|[ -/]*)\Z")
# C0 controls but \t and \n (\r included: it lets text overwrite what was shown), DEL, and the C1 controls.
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_C1 = re.compile(r"[\x7f-\x9f]")
MAX_HELD = 256


def strip_controls(text: str) -> str:
    """``text`` without escape sequences and control characters (but ``\\n`` and ``\\t``)."""
    return _CONTROLS.sub("", _SEQUENCE.sub("", text))


def escape_c1(json_text: str) -> str:
    """JSON text made safe for a terminal: json.dumps escapes C0 controls but not DEL and C1 (they can only be in
    strings, where ``\\u`` escapes mean the same)."""
    return _C1.sub(lambda m: f"\\u{ord(m.group()):04x}", json_text)


def json_line(value: Any) -> str:
    """``value`` as one line of JSON for a terminal: non-ASCII text stays readable, controls are escaped."""
    return escape_c1(json.dumps(value, ensure_ascii=False))


class TerminalText:
    """Deltas in, safe text out, with an unfinished escape sequence held back until the next delta completes it."""

    def __init__(self) -> None:
        self._held = ""

    def feed(self, text: str) -> str:
        text = self._held + text
        self._held = ""
        unfinished = _UNFINISHED.search(text)
        if unfinished is not None and len(text) - unfinished.start() <= MAX_HELD:
            self._held = text[unfinished.start():]
            text = text[:unfinished.start()]
        return strip_controls(text)

    def reset(self) -> None:
        """Forget a held-back sequence (the text it ended was taken back, or the answer ended)."""
        self._held = ""
