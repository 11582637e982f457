"""Prometheus text exposition for the consumer: a few counters and gauges, no per-token labels."""

from __future__ import annotations

from collections.abc import Callable


class Metrics:
    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.gauges: dict[str, Callable[[], float]] = {}
        self.help: dict[str, str] = {}

    def inc(self, name: str, value: float = 1) -> None:
        self.counters[name] = self.counters.get(name, 0.0) + value

    def gauge(self, name: str, fn: Callable[[], float], help_text: str) -> None:
        self.gauges[name] = fn
        self.help[name] = help_text

    def render(self) -> str:
        lines: list[str] = []
        for name in sorted(self.counters):
            base = name.split("{", 1)[0]
            lines.append(f"# TYPE {base} counter")
            lines.append(f"{name} {self.counters[name]:g}")
        for name, fn in sorted(self.gauges.items()):
            lines.append(f"# HELP {name} {self.help[name]}")
            lines.append(f"# TYPE {name} gauge")
            lines.append(f"{name} {fn():g}")
        return "\n".join(lines) + "\n"
