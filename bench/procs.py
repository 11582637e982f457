"""Starting and stopping the processes a scenario needs, each on a free port, and running load processes.

Every rsb part is a real process started the way an operator would (``python3 -m rsb ...``); the
load runs in its own process (``python3 -m bench.loadproc``) so it never shares a CPU budget or an event
loop with the process under test.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import httpx

from broker.redis.server import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent
LOG_DIR = Path(tempfile.gettempdir()) / "rsb-bench-logs"


def raise_nofile(target: int = 20000) -> int:
    """Raise this process's open-file limit (inherited by every child started after) as far as allowed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(target, hard) if hard != resource.RLIM_INFINITY else target
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class Proc:
    """A child process whose output goes to a log file (``log_path``, else one under ``LOG_DIR``). The
    benchmarks and the test fixtures start every process with it."""

    def __init__(self, argv: list[str], name: str, *, env: dict[str, str] | None = None,
                 cwd: Path = ROOT, log_path: Path | None = None) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.argv = argv
        self.name = name
        self.log_path = log_path or LOG_DIR / f"{name}-{os.getpid()}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "ab")
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd, env=full_env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def wait_for_line(self, needle: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while needle not in self.output():
            if not self.alive():
                raise RuntimeError(f"{self.name} exited:\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no {needle!r} within {timeout_s}s:\n{self.output()[-3000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def wait_serving(url: str, alive: Callable[[], bool], describe: Callable[[], str], timeout_s: float) -> None:
    """Poll ``url`` until it answers 200, failing at once (with ``describe()``) if the process died."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if not alive():
            raise RuntimeError(f"the server died:\n{describe()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up in {timeout_s:g}s:\n{describe()[-3000:]}")
        time.sleep(0.05)


def wait_http(url: str, proc: Proc, timeout_s: float = 30.0) -> None:
    wait_serving(url, proc.alive, proc.output, timeout_s)


# A load process drives the pod from one address (127.0.0.1) at rates and counts no single client reaches:
# with the per-caller defaults (unfinished generations, create rate, open streams per address) and the
# queue's bounds, a scenario would measure refusals, not the broker. Scenarios lift them; the capacity
# scenario keeps the defaults for its readers (it spreads them over addresses) and lifts only the creates.
UNLIMITED_CREATES = ("--max-active", "0", "--create-burst", "0", "--max-queue", "0", "--max-queue-wait-s", "0")
UNLIMITED_LOAD = (*UNLIMITED_CREATES, "--max-streams-per-ip", "0")


def start_consumer(redis_url: str, *extra: str, lifted: tuple[str, ...] = UNLIMITED_LOAD,
                   port: int | None = None) -> tuple[Proc, str]:
    """``rsb consumer`` on ``port`` (default: a free one), with the ``lifted`` limits off (flags in ``extra``
    win); returns it and its base URL once /healthz answers."""
    port = port or free_port()
    p = Proc(python_module("rsb", "consumer", "--redis-url", redis_url, "--port", str(port),
                           "--log-level", "warning", *lifted, *extra), "consumer")
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/healthz", p)
    return p, url


def start_paced_generator(redis_url: str, *, workers: int, tokens_per_s: float, extra: tuple[str, ...] = ()) -> Proc:
    """``bench.paced_generator``: ``workers`` rsb Workers over the deterministic paced engine, one process."""
    p = Proc(python_module("bench.paced_generator", "--redis-url", redis_url, "--workers", str(workers),
                           "--tokens-per-s", str(tokens_per_s), *extra), "paced-generator")
    p.wait_for_line("paced generator ready")
    return p


def start_llama_generator(redis_url: str, model: str, *extra: str) -> Proc:
    """``rsb generator`` over llama.cpp (the real engine)."""
    p = Proc(python_module("rsb", "generator", "--redis-url", redis_url, "--model", model,
                           "--log-level", "info", *extra), "generator")
    p.wait_for_line("generator ready")
    return p


@contextlib.contextmanager
def rsb_up(*flags: str, name: str = "rsb-up") -> Iterator[str]:
    """``rsb up --generators 1 FLAGS`` (no load limits) on a free port, once its generator is ready: its URL.
    Stopped on leaving."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    up = Proc(python_module("rsb", "up", "--generators", "1", "--port", str(port), "--log-level", "info",
                            *UNLIMITED_LOAD, *flags), name)
    try:
        wait_http(f"{url}/healthz", up, 120)
        up.wait_for_line("generator ready", 120)
        yield url
    finally:
        up.stop(30)


def start_direct(tokens_per_s: float, *extra: str) -> tuple[Proc, str]:
    """``bench.direct_app``: the naive design (engine in the HTTP process, SSE straight out, no Redis)."""
    port = free_port()
    p = Proc(python_module("bench.direct_app", "--port", str(port), "--tokens-per-s", str(tokens_per_s), *extra),
             "direct")
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/healthz", p)
    return p, url


# -- nginx in front of consumers ----------------------------------------------------------------------

NGINX_CONF = ROOT / "deploy" / "nginx.conf"


def render_nginx_conf(listen_port: int, upstream_ports: list[int], tmp: Path) -> str:
    """deploy/nginx.conf (the one compose mounts), with the upstream `server` lines and the `listen` port
    for this machine, and logs/temp files under ``tmp``. Every SSE setting is the file's own."""
    text = NGINX_CONF.read_text()
    servers = "\n".join(f"        server 127.0.0.1:{p} max_fails=0;" for p in upstream_ports)
    text, n = re.subn(r"^\s*server consumer:8000[^;]*;", servers, text, flags=re.M)
    assert n == 1, "deploy/nginx.conf: expected one `server consumer:8000 ...;` line in the upstream"
    text, n = re.subn(r"listen 8080;", f"listen 127.0.0.1:{listen_port};", text)
    assert n == 1, "deploy/nginx.conf: expected one `listen 8080;`"
    local = (f"    access_log {tmp}/access.log;\n    client_body_temp_path {tmp}/body;\n"
             f"    proxy_temp_path {tmp}/proxy;\n")
    text, n = re.subn(r"^http \{\n", "http {\n" + local, text, flags=re.M)
    assert n == 1
    return text


class Nginx:
    """A real nginx running deploy/nginx.conf in front of the given consumer ports (the tests' fixture and the
    benchmarks' balancer)."""

    def __init__(self, upstream_ports: list[int], tmp: Path) -> None:
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        assert Path(binary).exists(), "nginx is needed (Debian package nginx; scripts/test.sh installs it)"
        self.port = free_port()
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        conf = tmp / "nginx.conf"
        conf.write_text(render_nginx_conf(self.port, upstream_ports, tmp))
        argv = [binary, "-p", str(tmp), "-c", str(conf), "-e", str(tmp / "error.log"),
                "-g", f"daemon off; pid {tmp}/nginx.pid; user root;"]
        check = subprocess.run([*argv[:-2], "-t"], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        self.proc = Proc(argv, "nginx", log_path=tmp / "nginx-stdout.log")
        self.url = f"http://127.0.0.1:{self.port}"
        wait_serving(f"{self.url}/healthz", self.proc.alive, (tmp / "error.log").read_text, 10)

    def stop(self) -> None:
        self.proc.stop(5)


@contextlib.contextmanager
def nginx(upstream_ports: list[int]) -> Iterator[Nginx]:
    """nginx (deploy/nginx.conf) in front of these consumer ports, in a temporary directory, stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="rsb-bench-nginx-") as tmp:
        n = Nginx(upstream_ports, Path(tmp))
        try:
            yield n
        finally:
            n.stop()


@contextlib.contextmanager
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.cleanup()


@contextlib.contextmanager
def procs() -> Iterator[list[Proc]]:
    """A list to put started processes in; all are stopped (in reverse order) on exit."""
    started: list[Proc] = []
    try:
        yield started
    finally:
        for p in reversed(started):
            p.stop()


class Load:
    """A load process: ``python3 -m bench.loadproc MODULE:FUNCTION`` with JSON keyword arguments.

    It talks in JSON lines: it prints ``{"mark": name, ...}`` at each phase and, where the function asks,
    waits for a line on stdin (``go()``); its last line is ``{"result": ...}``."""

    def __init__(self, target: str, kwargs: dict[str, Any], name: str = "load") -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.err_path = LOG_DIR / f"{name}-{os.getpid()}-{time.monotonic_ns()}.err"
        self._err = open(self.err_path, "wb")
        self.proc = subprocess.Popen(
            python_module("bench.loadproc", target, json.dumps(kwargs)), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._err, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        self.marks: dict[str, dict[str, Any]] = {}
        self.result: Any = None
        self._buf = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _line(self, timeout_s: float) -> dict[str, Any] | None:
        """The next JSON line (our own buffer: select() cannot see data already in a file object's buffer)."""
        out: IO[bytes] = self.proc.stdout  # type: ignore[assignment]
        while b"\n" not in self._buf:
            ready, _, _ = select.select([out], [], [], timeout_s)
            if not ready:
                raise TimeoutError(f"{self.name}: no output within {timeout_s}s")
            chunk = os.read(out.fileno(), 1 << 16)
            if not chunk:
                self.proc.wait()
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.stderr()[-4000:]}")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\n", 1)
        msg: dict[str, Any] = json.loads(raw)
        if "mark" in msg:
            self.marks[msg["mark"]] = msg
        if "result" in msg:
            self.result = msg["result"]
        return msg

    def wait_mark(self, name: str, timeout_s: float = 300.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while name not in self.marks:
            self._line(max(0.1, deadline - time.monotonic()))
        return self.marks[name]

    def go(self) -> None:
        stdin: IO[bytes] = self.proc.stdin  # type: ignore[assignment]
        stdin.write(b"go\n")
        stdin.flush()

    def finish(self, timeout_s: float = 300.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while self.result is None:
            self._line(max(0.1, deadline - time.monotonic()))
        self.proc.wait(timeout_s)
        self._err.close()
        return self.result

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_load_measuring_cpu(target: str, kwargs: dict[str, Any], pids: list[int], timeout_s: float) -> Any:
    """Run a load process to the end, measuring the CPU of ``pids`` from its "start" mark to its result;
    returns the result with ``consumer_cores`` added."""
    from bench.sampling import CpuWindow

    load = Load(target, kwargs)
    try:
        load.wait_mark("start", 60)
        cpu = CpuWindow(pids).start()
        result = load.finish(timeout_s)
        cpu.stop()
    finally:
        load.kill()
    result["consumer_cores"] = cpu.cores
    return result


def run_load(target: str, kwargs: dict[str, Any], timeout_s: float = 600.0) -> Any:
    """Run a load function in its own process to the end and return its result."""
    load = Load(target, kwargs)
    try:
        return load.finish(timeout_s)
    finally:
        load.kill()
