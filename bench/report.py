"""Result tables on stdout and JSON files under bench/results/."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def fmt(v: Any) -> str:
    """A short human form of a number (or anything)."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.3g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def table(title: str, header: list[str], rows: list[list[Any]]) -> str:
    """A fixed-width text table."""
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    line = "  ".join("-" * w for w in widths)
    out = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)), line]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(out)


def goal_row(name: str, value: float, goal: str, met: bool, unit: str = "") -> list[Any]:
    """One row of a goals table."""
    return [name, f"{fmt(value)}{unit}", goal, "MET" if met else "MISSED"]


def print_goals(scenario: str, rows: list[list[Any]]) -> None:
    print(table(f"\n== {scenario}: goals", ["measure", "value", "goal", "verdict"], rows), flush=True)


def machine() -> dict[str, Any]:
    """What the numbers were measured on (the load average says how noisy the machine was)."""
    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                            "platform": platform.platform(), "loadavg": os.getloadavg()}
    try:
        import psutil

        info["mem_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    return info


def write_json(scenario: str, data: dict[str, Any]) -> Path:
    """Write ``bench/results/<scenario>.json`` and return its path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{scenario}.json"
    doc = {"scenario": scenario, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(), **data}
    path.write_text(json.dumps(doc, indent=2, default=_default) + "\n")
    print(f"-> {path.relative_to(RESULTS_DIR.parent.parent)}", flush=True)
    return path


def _default(o: Any) -> Any:
    if isinstance(o, float) and math.isnan(o):
        return None
    return str(o)
