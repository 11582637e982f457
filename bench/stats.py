"""Percentiles and summaries of samples."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0-100) by the nearest-rank method; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])


def summarize(values: Sequence[float]) -> dict[str, float]:
    """n, mean, p50, p90, p99, max of ``values`` (one sort)."""
    if not values:
        return {"n": 0, "mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan, "max": math.nan}
    ordered = sorted(values)
    n = len(ordered)

    def rank(p: float) -> float:
        return float(ordered[min(n, max(1, math.ceil(p / 100.0 * n))) - 1])

    return {"n": n, "mean": sum(ordered) / n, "p50": rank(50), "p90": rank(90), "p99": rank(99),
            "max": float(ordered[-1])}


def ratio(a: float | None, b: float | None) -> float:
    """a / b, NaN when b is zero or either is NaN."""
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b
