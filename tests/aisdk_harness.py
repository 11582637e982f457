"""The AI SDK harness (tests/aisdk/harness: the real `ai` package, ai@5, ai@6 and ai@7) run on one named scenario at
a time, in the background, so a test can act on rsb while the page runs (write a turn's events, wait for readers,
kill a connection): what tests/consumer/test_late_joiners.py and test_sending_again.py do."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

HARNESS = Path(__file__).resolve().parent / "aisdk" / "harness"
#: Node 22 for ai@7 (which needs it): the npm package `node`, a dev dependency of the harness.
NODE22 = HARNESS / "node_modules" / ".bin" / "node"
NODE = shutil.which("node")
MAJORS = ("ai5", "ai6", "ai7")


def require_harness() -> None:
    missing = [m for m in MAJORS if not (HARNESS / "node_modules" / m / "package.json").exists()]
    missing += [] if NODE22.exists() else ["node (Node 22)"]
    missing += [] if NODE else ["node (Node 20, on PATH)"]
    assert not missing, (f"the AI SDK harness is not installed ({', '.join(missing)}): run scripts/test.sh, or "
                         "`npm ci --prefix tests/aisdk/harness`")


def start_scenario(major: str, url: str, keys: tuple[str, str], scenario: str, out: Path,
                   params: dict[str, Any] | None = None, **env: str) -> subprocess.Popen[str]:
    """``node run.mjs`` on one scenario (of scenarios.mjs or joiners.mjs) against ``url``, API keys A and B."""
    node = str(NODE22) if major == "ai7" else NODE
    assert node is not None
    environ = {**os.environ, "RSB_URL": url, "RSB_KEY_A": keys[0], "RSB_KEY_B": keys[1], "RSB_SCENARIOS": scenario,
               "RSB_PARAMS": json.dumps(params or {}), **env}
    return subprocess.Popen([node, "run.mjs", major, str(out)], cwd=HARNESS, env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def scenario_result(run: subprocess.Popen[str], out: Path, scenario: str, timeout_s: float = 180) -> dict[str, Any]:
    """What the scenario returned (an exception in it fails the test with its stack)."""
    output, _ = run.communicate(timeout=timeout_s)
    assert run.returncode == 0, output
    result: dict[str, Any] = json.loads(out.read_text())["results"][scenario]
    assert "exception" not in result, result["exception"]
    return result
