"""``python3 -m bench SCENARIO [options]`` runs one scenario (or ``all``) and writes bench/results/<name>.json."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time
import traceback
from typing import Any

from bench.procs import raise_nofile
from bench.report import write_json
from bench.scenarios import SCENARIOS
from broker import runtime


def module(name: str) -> Any:
    return importlib.import_module(f"bench.scenarios.{name.replace('-', '_')}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m bench", description=__doc__)
    sub = p.add_subparsers(dest="scenario", required=True, metavar="SCENARIO")
    for name in SCENARIOS:
        mod = module(name)
        sp = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0],
                            description=mod.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_args(sp)
        sp.add_argument("--tag", default="", help="suffix of the result file: bench/results/<scenario>-<tag>.json")
    all_p = sub.add_parser("all", help="every scenario with its (short) defaults")
    all_p.add_argument("--skip", default="", help="comma-separated scenarios to leave out")
    return p


def run_one(name: str, args: argparse.Namespace) -> bool:
    mod = module(name)
    t0 = time.monotonic()
    load_before = os.getloadavg()[0]
    print(f"\n##### {name} (stack {runtime.stack()}, load average {load_before:.1f})", flush=True)
    try:
        result = mod.run(args)
    except Exception:
        traceback.print_exc()
        return False
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result["command"] = "python3 -m bench " + " ".join(sys.argv[1:])
    # The machine is shared: the load around a run says how much to trust its ratios.
    result["machine"] = {"stack": runtime.stack(), "load_before": round(load_before, 2),
                         "load_after": round(os.getloadavg()[0], 2)}
    tag = getattr(args, "tag", "")
    write_json(f"{name}-{tag}" if tag else name, result)
    return True


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # so every started process and Redis server is stopped on the way out


def main() -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    raise_nofile()
    args = build_parser().parse_args()
    if args.scenario != "all":
        return 0 if run_one(args.scenario, args) else 1
    skip = {s for s in args.skip.split(",") if s}
    failed = []
    for name in SCENARIOS:
        if name in skip:
            continue
        sub = build_parser().parse_args([name])
        if not run_one(name, sub):
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
