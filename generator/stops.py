"""Stop sequences over streamed text: text that may be the start of a stop sequence is held back until
the next pieces show whether it is one, so no reader ever sees part of a stop sequence."""

from __future__ import annotations


class StopFilter:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._held = ""
        self.stopped = False
        #: The stop sequence that appeared (the first in the text; of two at one place, the first given).
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Text safe to emit now. Sets ``stopped`` and ``matched`` when a stop sequence appeared (it is not
        emitted)."""
        if not self._stops:
            return text
        buf = self._held + text
        found = [(i, n) for n, i in enumerate(buf.find(s) for s in self._stops) if i >= 0]
        if found:
            cut, n = min(found)
            self._held = ""
            self.stopped = True
            self.matched = self._stops[n]
            return buf[:cut]
        hold = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
