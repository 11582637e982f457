"""The event loop every rsb process runs on: uvloop when it is installed (the ``uvicorn[standard]`` stack
production deployments use; it is a dependency on CPython/POSIX), asyncio's own loop otherwise. One place
decides, so the consumer, the generator and the benchmarks say the same thing about what ran."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def has_uvloop() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def has_httptools() -> bool:
    return importlib.util.find_spec("httptools") is not None


def stack() -> str:
    """What an rsb server runs on, e.g. ``uvloop+httptools`` or ``asyncio+h11`` (logged at start-up and
    recorded by the benchmarks). uvicorn's ``auto`` loop and HTTP settings pick the same."""
    return f"{'uvloop' if has_uvloop() else 'asyncio'}+{'httptools' if has_httptools() else 'h11'}"


# CPython collects its youngest generation every 700 net allocations. A replay allocates a list and an event
# per entry (hundreds of thousands a second): at the default, collections were a fifth of the consumer's CPU
# in the throughput benchmark, and each older-generation pass walks every reader's objects. Few of rsb's
# objects form cycles; reference counting frees them. A larger young generation keeps cyclic garbage a
# little longer (bounded by the threshold), and the objects alive at start-up are frozen out of every pass.
GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc() -> None:
    """Call once start-up is done (modules imported, settings parsed)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop when it is installed."""
    if has_uvloop():
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
