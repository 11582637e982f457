"""The ``rsb`` command line. Every flag has an ``RSB_*`` environment twin; the flag wins."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from broker.settings import DEFAULT_REDIS_URL, BrokerSettings, ConsumerSettings, GeneratorSettings, env


def _flag(p: argparse.ArgumentParser, name: str, *, type: Callable[[str], Any] = str, default: Any = None,
          help: str, required: bool = False, action: str | None = None) -> None:
    """Add ``--name`` whose default comes from ``RSB_NAME`` (then ``default``)."""
    env_name = "RSB_" + name.upper().replace("-", "_")
    raw = env(name)
    if action == "store_true":
        dflt = raw.lower() in ("1", "true", "yes", "on") if raw is not None else bool(default)
        p.add_argument(f"--{name}", action="store_true", default=dflt, help=f"{help} [env {env_name}]")
        return
    value = type(raw) if raw is not None else default
    shown = f" (default: {default})" if default is not None else ""
    p.add_argument(f"--{name}", type=type, default=value, required=required and value is None,
                   help=f"{help}{shown} [env {env_name}]")



def _add_broker_flags(p: argparse.ArgumentParser, *, redis_required: bool) -> None:
    _flag(p, "redis-url", required=redis_required,
          help="Redis URL, e.g. redis://host:6379/0 or rediss://user:pass@host:6380/0"
          + ("" if redis_required else "; without it a private Redis server is started and stopped by rsb"))
    _flag(p, "partitions", type=int, default=1,
          help="job/key partitions; fixed per deployment (1 = strict FIFO on one server; on a Redis Cluster "
          "a few per master: their hash slots are spread evenly over all masters)")
    _flag(p, "redis-cluster", action="store_true",
          help="--redis-url is one node of a Redis Cluster (same as a redis+cluster:// URL)")
    _flag(p, "log-level", default="info", help="debug, info, warning or error")


def _add_consumer_flags(p: argparse.ArgumentParser) -> None:
    _flag(p, "host", default="127.0.0.1", help="address to listen on")
    _flag(p, "port", type=int, default=8000, help="port to listen on")
    _flag(p, "heartbeat-s", type=float, default=15.0, help="idle seconds before an SSE comment heartbeat")
    _flag(p, "max-body-bytes", type=int, default=1024 * 1024, help="larger request bodies get 413")
    _flag(p, "max-queue", type=int, default=0, help="queued generations beyond which creates get 429 (0 = no bound)")
    _flag(p, "abandon-after-s", type=float, default=0.0,
          help="cancel generations nobody has read for this long (0 = off)")
    _flag(p, "retention-s", type=int, default=3600, help="how long a finished stream stays readable")
    _flag(p, "max-tokens-limit", type=int, default=32768, help="largest max_tokens a request may ask for")
    _flag(p, "send-timeout-s", type=float, default=30.0,
          help="a reader whose connection accepts no event for this long is dropped (it can resume)")
    _flag(p, "shutdown-grace-s", type=float, default=5.0, help="seconds to drain connections on SIGTERM")
    _flag(p, "api-keys", help="JSON file of API keys; when set, every /v1 route needs 'Authorization: Bearer'")
    _flag(p, "read-token-secret", help="secret signing read tokens (default: derived from the API keys file)")
    _flag(p, "read-token-ttl-s", type=int, default=900, help="lifetime of the read tokens issued at create")
    _flag(p, "max-messages", type=int, default=1024, help="most messages one request may carry")
    _flag(p, "max-prompt-chars", type=int, default=200_000, help="longest prompt (or messages' content in all)")
    _flag(p, "max-streams-per-ip", type=int, default=0,
          help="open SSE streams one client address may hold on this pod (0 = no limit)")
    _flag(p, "cors-origins", default="", help="comma-separated origins allowed by CORS (default: none; '*' for any)")
    _flag(p, "log-content", action="store_true", help="log prompts at create (off by default: users' data)")


def _add_generator_flags(p: argparse.ArgumentParser) -> None:
    _flag(p, "model", help="path to a GGUF model for in-process llama.cpp; without it (and without "
          "--upstream) the demo model is built locally (random weights)")
    _flag(p, "upstream", help="URL of an OpenAI-compatible or Ollama server to drive instead of a local model")
    _flag(p, "lease-s", type=float, default=10.0, help="seconds a job stays with a silent worker before takeover")
    _flag(p, "max-attempts", type=int, default=3, help="attempts before a stream ends with error worker_lost")
    _flag(p, "max-generation-s", type=float, default=0.0,
          help="generation deadline in seconds; past it the stream ends with error deadline (0 = none)")
    _flag(p, "n-threads", type=int, help="llama.cpp threads (default: physical cores)")
    _flag(p, "n-ctx", type=int, default=4096, help="llama.cpp context size in tokens")
    _flag(p, "worker-id", help="consumer-group name of this worker (default: host-pid-random)")
    _flag(p, "ignore-eos", action="store_true", help="never stop at end-of-sequence (benchmarks, tests)")
    _flag(p, "generator-grace-s", type=float, default=10.0,
          help="on SIGTERM, seconds to finish the job in flight before handing it over")
    _flag(p, "metrics-port", type=int, default=0, help="serve this worker's Prometheus /metrics on this port (0 = off)")
    _flag(p, "metrics-host", default="127.0.0.1", help="address of the worker's /metrics endpoint")
    _flag(p, "concurrency", type=int, default=1,
          help="generations one worker runs at once (in-process llama.cpp: 1; an --upstream server: more)")
    _flag(p, "disconnect-grace-s", type=float, default=5.0,
          help="cancel_on_disconnect streams are cancelled after this long without a reader")


def broker_settings(a: argparse.Namespace, redis_url: str | None = None) -> BrokerSettings:
    return BrokerSettings(redis_url=redis_url or a.redis_url or DEFAULT_REDIS_URL, partitions=a.partitions,
                          cluster=a.redis_cluster)


def consumer_settings(
    a: argparse.Namespace, redis_url: str | None = None, default_model: str = "default"
) -> ConsumerSettings:
    return ConsumerSettings(
        broker=broker_settings(a, redis_url), host=a.host, port=a.port, heartbeat_s=a.heartbeat_s,
        max_body_bytes=a.max_body_bytes, max_queue=a.max_queue, abandon_after_s=a.abandon_after_s,
        retention_s=a.retention_s, max_tokens_limit=a.max_tokens_limit, send_timeout_s=a.send_timeout_s,
        shutdown_grace_s=a.shutdown_grace_s, default_model=default_model, api_keys_file=a.api_keys,
        read_token_secret=a.read_token_secret, read_token_ttl_s=a.read_token_ttl_s, max_messages=a.max_messages,
        max_prompt_chars=a.max_prompt_chars, max_streams_per_ip=a.max_streams_per_ip,
        cors_origins=tuple(o.strip() for o in a.cors_origins.split(",") if o.strip()), log_content=a.log_content,
    )


def generator_settings(a: argparse.Namespace, redis_url: str | None = None) -> GeneratorSettings:
    return GeneratorSettings(
        broker=broker_settings(a, redis_url), model_path=a.model, upstream_url=a.upstream,
        worker_id=a.worker_id or "", lease_s=a.lease_s, max_attempts=a.max_attempts,
        max_generation_s=a.max_generation_s, n_threads=a.n_threads, n_ctx=a.n_ctx,
        shutdown_grace_s=a.generator_grace_s, disconnect_grace_s=a.disconnect_grace_s, concurrency=a.concurrency,
        upstream_api=a.upstream_api, upstream_model=a.upstream_model, upstream_api_key=a.upstream_api_key,
        upstream_timeout_s=a.upstream_timeout_s, metrics_port=a.metrics_port, metrics_host=a.metrics_host,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rsb", description="rsb: resumable streams for LLM generation (Redis Streams + SSE)."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="run the whole stack on this machine (private Redis, a generator, the API)",
                        description="Run everything on one machine. Without --redis-url a private Redis server "
                        "is started and stopped with rsb; without --model a demo model is built locally.")
    _add_broker_flags(up, redis_required=False)
    _add_consumer_flags(up)
    _add_generator_flags(up)
    _flag(up, "generators", type=int, default=1, help="generator worker processes to start")

    consumer = sub.add_parser("consumer", help="the stateless HTTP/SSE API",
                              description="Serve the HTTP/SSE API (uvicorn).")
    _add_broker_flags(consumer, redis_required=True)
    _add_consumer_flags(consumer)
    _flag(consumer, "default-model", default="default", help="model name recorded for requests without one")

    gen = sub.add_parser("generator", help="one generator worker process",
                         description="Claim generation jobs from Redis and append their events.")
    _add_broker_flags(gen, redis_required=True)
    _add_generator_flags(gen)

    report = sub.add_parser("report", help="what aborted generations cost (cancelled, abandoned, failed)",
                            description="Aggregate the aborted-generation records over a time range.")
    _add_broker_flags(report, redis_required=True)
    _flag(report, "since", help="start of the range: unix seconds or ISO-8601 (UTC if no zone)")
    _flag(report, "until", help="end of the range: unix seconds or ISO-8601 (UTC if no zone)")
    _flag(report, "group-by", default="reason", help="reason, model or day")
    _flag(report, "json", action="store_true", help="print JSON instead of a table")
    _flag(report, "csv", action="store_true", help="print CSV instead of a table")

    from broker.cli_client import register

    register(sub)  # rsb chat / tail / status, and rsb generator's --upstream-* flags
    return parser


def _report(args: argparse.Namespace) -> int:
    import asyncio

    import orjson

    from broker.client import connect
    from broker.errors import RsbError
    from broker.report import aborted_report, parse_time, render_csv, render_table

    async def run() -> dict[str, Any]:
        redis = connect(args.redis_url, cluster=args.redis_cluster)
        try:
            return await aborted_report(redis, args.partitions, since=parse_time(args.since, "since"),
                                        until=parse_time(args.until, "until"), group_by=args.group_by)
        finally:
            await redis.aclose()

    try:
        report = asyncio.run(run())
    except RsbError as e:
        print(f"rsb report: {e.message}", file=sys.stderr)
        return 2
    if args.json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    elif args.csv:
        print(render_csv(report), end="")
    else:
        print(render_table(report))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from broker.logs import setup_logging

    setup_logging(args.log_level)
    from broker.cli_client import dispatch

    rc = dispatch(args)  # the client commands
    if rc is not None:
        return rc
    if args.command == "consumer":
        from consumer.server import run_consumer

        run_consumer(consumer_settings(args, default_model=args.default_model))
        return 0
    if args.command == "generator":
        from generator.main import run_generator

        run_generator(generator_settings(args), ignore_eos=args.ignore_eos)
        return 0
    if args.command == "report":
        return _report(args)
    if args.command == "up":
        from broker.stack import run_stack

        return run_stack(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
