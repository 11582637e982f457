"""``rsb up``: the whole stack on one machine, every part a real process.

A private Redis server (unless ``--redis-url``), generator worker processes, and the consumer API in
this process. Ctrl-C or SIGTERM stops the API, then the generators, then the Redis server.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys

from broker.redis_server import RedisServer
from broker.settings import redact_url

log = logging.getLogger("rsb.up")


def _generator_argv(args: argparse.Namespace, redis_url: str, model: str, index: int) -> list[str]:
    engine = ["--model", model]
    if args.upstream:
        engine = ["--upstream", args.upstream, "--upstream-timeout-s", str(args.upstream_timeout_s),
                  "--concurrency", str(args.concurrency)]
        for flag in ("upstream_api", "upstream_model"):  # the key goes by environment: argv is public
            if getattr(args, flag):
                engine += ["--" + flag.replace("_", "-"), getattr(args, flag)]
    argv = [sys.executable, "-m", "broker.cli", "generator", "--redis-url", redis_url, *engine,
            "--partitions", str(args.partitions), "--lease-s", str(args.lease_s),
            "--max-attempts", str(args.max_attempts), "--max-generation-s", str(args.max_generation_s),
            "--n-ctx", str(args.n_ctx), "--log-level", args.log_level,
            "--generator-grace-s", str(args.generator_grace_s), "--disconnect-grace-s", str(args.disconnect_grace_s)]
    if args.n_threads:
        argv += ["--n-threads", str(args.n_threads)]
    if args.ignore_eos:
        argv.append("--ignore-eos")
    if args.redis_cluster:
        argv.append("--redis-cluster")
    return argv


def run_stack(args: argparse.Namespace) -> int:
    from broker.cli import consumer_settings
    from consumer.server import build_server

    server: RedisServer | None = None
    generators: list[subprocess.Popen[bytes]] = []
    try:
        redis_url = args.redis_url
        if not redis_url:
            server = RedisServer(appendonly=True).start()
            redis_url = server.url
            log.info("started a private redis server", extra={"binary": server.binary, "port": server.port,
                                                               "data_dir": str(server.data_dir)})
        model = args.model
        default_model = "default"
        if args.upstream:
            default_model = args.upstream_model or "upstream"
        elif not model:
            from generator.demo_model import DEMO_MODEL_NAME, ensure_demo_model

            model = str(ensure_demo_model())
            default_model = DEMO_MODEL_NAME
            log.info("no --model: using the demo model (random weights; its text is gibberish)",
                     extra={"model": DEMO_MODEL_NAME, "path": model})
        for i in range(max(1, args.generators)):
            env = os.environ.copy()
            if args.upstream_api_key:
                env["RSB_UPSTREAM_API_KEY"] = args.upstream_api_key
            generators.append(subprocess.Popen(_generator_argv(args, redis_url, model, i), env=env))
        settings = consumer_settings(args, redis_url, default_model=default_model)
        api = build_server(settings)
        url = f"http://{settings.host}:{settings.port}"
        shown_model = model if args.model else default_model
        print(f"rsb is up: {url}  (redis: {redact_url(redis_url)}, model: {shown_model})", flush=True)
        api.run()
        return 0
    finally:
        for g in generators:
            if g.poll() is None:
                g.send_signal(signal.SIGTERM)
        for g in generators:
            try:
                g.wait(timeout=15)
            except subprocess.TimeoutExpired:
                g.kill()
        if server is not None:
            server.stop()
