"""`rsb up` on the embedded default: its own Redis server, a generator, the API, the demo model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers import create, read_sse

from broker.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path_has_redis", [True, False], ids=["system-redis", "shipped-valkey"])
def test_rsb_up_runs_the_whole_stack_and_stops_everything(tmp_path: Path, path_has_redis: bool) -> None:
    port = free_port()
    env = dict(os.environ, RSB_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    if not path_has_redis:
        env["PATH"] = str(tmp_path)  # no redis-server: rsb must fall back to the wheel's valkey-server
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rsb", "up", "--port", str(port), "--ignore-eos"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while f"rsb is up: {url}" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        server_line = next(line for line in log.read_text().splitlines() if "private redis server" in line)
        assert ("valkey-server" in server_line) != path_has_redis
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.get("/readyz").status_code == 200
            r = create(c, max_tokens=12)
            assert r.status_code == 201
            full = read_sse(c, r.json()["events_url"])
            assert [e.event for e in full.events][-1] == "done"
            started = next(e for e in full.events if e.event == "started")
            assert "demo" in started.data["model"]
            status = c.get(f"/v1/streams/{r.json()['id']}").json()
            assert "demo" in status["model"] and status["usage"]["completion_tokens"] == 12
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    output = log.read_text()
    pid_lines = [line for line in output.splitlines() if "private redis server" in line]
    port_redis = int(pid_lines[0].split('"port":')[1].split(",")[0])
    with pytest.raises(httpx.HTTPError):
        httpx.get(url, timeout=1)
    import redis

    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port_redis, socket_connect_timeout=1).ping()


def test_every_subcommand_documents_every_flag() -> None:
    from rsb.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert isinstance(sub.choices, dict)  # the subparsers action: {command name: its parser}
    for name, p in sub.choices.items():
        for action in p._actions:
            if action.dest == "help":
                continue
            assert action.help and len(action.help) > 5, (name, action.dest)
            if action.option_strings:  # flags have environment twins; positionals (a prompt, an id) do not
                assert "[env RSB_" in action.help, (name, action.dest)
    out = subprocess.run([sys.executable, "-m", "rsb", "up", "--help"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    for flag in ["--host", "--port", "--redis-url", "--model", "--heartbeat-s", "--max-body-bytes", "--lease-s",
                 "--max-queue", "--retention-s", "--abandon-after-s"]:
        assert flag in out
