"""Entry point of load processes: ``python3 -m bench.loadproc MODULE:FUNCTION '<json kwargs>'``.

The function is an ``async def`` taking the keyword arguments plus ``ctl`` (a ``Control``); what it
returns is printed as the last JSON line ``{"result": ...}``.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
from typing import Any

import orjson

from bench.procs import raise_nofile


class Control:
    """Phase marks to the parent (stdout) and go-signals from it (stdin)."""

    def mark(self, name: str, **info: Any) -> None:
        sys.stdout.buffer.write(orjson.dumps({"mark": name, **info}) + b"\n")
        sys.stdout.buffer.flush()

    async def wait_go(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


def main() -> None:
    raise_nofile()
    target, raw = sys.argv[1], sys.argv[2]
    module, func = target.split(":")
    fn = getattr(importlib.import_module(module), func)
    result = asyncio.run(fn(ctl=Control(), **orjson.loads(raw)))
    sys.stdout.buffer.write(orjson.dumps({"result": result}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    main()
