"""``rsb up``: the whole stack on one machine, every part a real process, supervised.

A private Redis server (unless ``--redis-url``), generator worker processes, and the consumer API in this
process. Generators get every generator setting of ``rsb up`` as flags derived from the settings object
(secrets by environment), so no flag is accepted here and dropped there. A generator that dies is started
again with a backoff; one that cannot start (it dies within seconds, again and again) stops the stack with
its reason and a non-zero status. "rsb is up" is printed once the page really answers. Ctrl-C or SIGTERM
stops the API, then the generators, then the Redis server.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import httpx

from broker.backoff import Backoff
from broker.redis_server import RedisServer, RedisServerError
from broker.settings import Settings, redact_url, setting
from consumer.settings import ConsumerSettings
from generator.settings import GeneratorSettings

log = logging.getLogger("rsb.up")

# A generator that exits sooner than this after its start did not start: after START_FAILURES of those in a
# row the stack gives up (a wrong model, a missing library), instead of restarting it forever.
START_WINDOW_S = 20.0
START_FAILURES = 3
RESTART_BACKOFF = Backoff(base_s=0.5, cap_s=10.0)
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True, slots=True)
class UpSettings(Settings):
    title: ClassVar[str] = "Stack"

    consumer: ConsumerSettings = field(default_factory=ConsumerSettings)
    generator: GeneratorSettings = field(default_factory=GeneratorSettings)
    generators: int = setting(1, "generator worker processes to start")


class StackError(Exception):
    """The stack cannot start or keep running; the message says why, in one line."""


def check_model(path: str) -> None:
    p = Path(path)
    if not p.is_file():
        raise StackError(f"--model {path}: no such file")
    with p.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise StackError(f"--model {path}: not a GGUF file (llama.cpp models are .gguf)")


def check_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise StackError(f"cannot listen on {host}:{port}: {e.strerror or e} (use --port)") from None


def generator_command(gen: GeneratorSettings, index: int) -> tuple[list[str], dict[str, str]]:
    """argv and environment of generator ``index``: every setting passed on, none dropped. The child's
    environment has no other setting's ``RSB_*`` variable, so what it runs with is exactly ``gen``."""
    if index:
        if gen.worker_id:
            gen = dataclasses.replace(gen, worker_id=f"{gen.worker_id}-{index}")
        if gen.metrics_port:
            gen = dataclasses.replace(gen, metrics_port=gen.metrics_port + index)
    settings_env = {opt.env for opt in GeneratorSettings.options()}
    env = {k: v for k, v in os.environ.items() if k not in settings_env}
    env.update(gen.secret_env())
    return [sys.executable, "-m", "rsb", "generator", *gen.argv()], env


class Supervisor:
    """Keeps the generator processes running; calls ``give_up`` with a reason when one cannot start."""

    def __init__(self, commands: list[tuple[list[str], dict[str, str]]], give_up: Callable[[str], None]) -> None:
        self.commands = commands
        self.give_up = give_up
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * len(commands)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rsb-up-supervisor", daemon=True)

    def start(self) -> None:
        for i in range(len(self.commands)):
            self._spawn(i)
        self._thread.start()

    def _spawn(self, i: int) -> None:
        argv, env = self.commands[i]
        self.procs[i] = subprocess.Popen(argv, env=env)

    def _watch(self) -> None:
        started = [time.monotonic()] * len(self.commands)
        failures = [0] * len(self.commands)
        while not self._stop.wait(0.2):
            for i, proc in enumerate(self.procs):
                if proc is None or proc.poll() is None:
                    continue
                if self._stop.is_set():
                    return
                quick = time.monotonic() - started[i] < START_WINDOW_S
                failures[i] = failures[i] + 1 if quick else 1
                if quick and failures[i] >= START_FAILURES:
                    self.give_up(f"generator {i} exited with status {proc.returncode} {failures[i]} times within "
                                 f"{START_WINDOW_S:g}s of its start (see its log above)")
                    return
                delay = RESTART_BACKOFF.delay(failures[i] - 1)
                log.warning("generator exited; restarting it", extra={"index": i, "status": proc.returncode,
                                                                      "restart_in_s": round(delay, 2)})
                if self._stop.wait(delay):
                    return
                self._spawn(i)
                started[i] = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        for p in live:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def _announce_when_ready(url: str, model: str, redis_url: str, stopping: threading.Event) -> None:
    """Print the banner once the page answers (not before: a port taken or a failed start says so instead)."""
    while not stopping.is_set():
        try:
            if httpx.get(url + "/", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        stopping.wait(0.1)
    else:
        return
    print(f"rsb is up: {url}  (model: {model}, redis: {redact_url(redis_url)})\n"
          f"  open {url} in a browser, or:\n"
          f"  curl -N {url}/v1/streams -H 'content-type: application/json' "
          "-d '{\"prompt\": \"Hello\", \"max_tokens\": 64}'   then GET its events_url\n"
          "  logs: this terminal (JSON lines); stop with Ctrl-C", flush=True)


def run_stack(settings: UpSettings) -> int:
    from broker.logs import setup_logging
    from consumer.server import build_server
    from generator.engines.models import resolve_model

    setup_logging(settings.consumer.log.log_level)
    api = settings.consumer
    server: RedisServer | None = None
    supervisor: Supervisor | None = None
    stopping = threading.Event()
    failure: list[str] = []
    try:
        check_port_free(api.host, api.port)
        gen = settings.generator
        engine = gen.engine
        model_name = engine.upstream_model or "upstream"
        if not engine.upstream_url:
            if engine.model_path:
                check_model(engine.model_path)
            model = resolve_model(engine.model_path)
            gen = dataclasses.replace(gen, engine=dataclasses.replace(engine, model_path=str(model.path)))
            model_name = model.name
            log.info("model", extra={"model": model.name, "path": str(model.path)})
        redis_url = gen.broker.redis_url
        if not redis_url:
            try:
                server = RedisServer(appendonly=True).start()
            except RedisServerError as e:
                raise StackError(f"cannot start a private Redis server: {e}") from None
            redis_url = server.url
            log.info("started a private redis server", extra={"binary": server.binary, "port": server.port,
                                                               "data_dir": str(server.data_dir)})
        broker = dataclasses.replace(gen.broker, redis_url=redis_url)
        gen = dataclasses.replace(gen, broker=broker)
        if not api.default_model:
            api = dataclasses.replace(api, default_model=model_name)
        api = dataclasses.replace(api, broker=broker)
        consumer_server = build_server(api)

        def give_up(reason: str) -> None:
            failure.append(reason)
            consumer_server.should_exit = True

        supervisor = Supervisor([generator_command(gen, i) for i in range(max(1, settings.generators))], give_up)
        supervisor.start()
        url = f"http://{api.host}:{api.port}"
        threading.Thread(target=_announce_when_ready, args=(url, model_name, redis_url, stopping),
                         daemon=True).start()
        consumer_server.run()
        if not consumer_server.started and not failure:
            failure.append(f"the API could not start on {api.host}:{api.port} (see the log above)")
    except StackError as e:
        failure.append(str(e))
    finally:
        stopping.set()
        if supervisor is not None:
            supervisor.stop()
        if server is not None:
            server.stop()
    if failure:
        print(f"rsb up: {failure[0]}", file=sys.stderr)
        return 1
    return 0
