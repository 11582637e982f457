"""The ``rsb`` command line: one console script, a subcommand per role. With the modules it dispatches to (rsb.up,
rsb.commands, rsb.docs: the entry points tests/test_code_quality.py names), the only code allowed to import every
layer (the roles' settings and entry points), and it does so only to dispatch.

Every flag comes from a settings class (broker.settings explains how): ``rsb consumer`` has the
consumer's, ``rsb generator`` the generator's, ``rsb up`` both, the client commands their own. Each flag
has an ``RSB_*`` environment twin; the flag wins.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from broker.logs import setup_logging
from broker.redis.eviction import EvictionPolicyRefused
from broker.settings import Settings
from broker.telemetry import TelemetryMissing
from consumer.settings import ConsumerSettings
from generator.settings import GeneratorSettings
from rsb import commands
from rsb.up import UpSettings


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    help: str
    description: str
    settings: type[Settings]
    run: Callable[[argparse.Namespace], int]
    required: frozenset[str] = frozenset()
    positionals: tuple[tuple[str, str], ...] = ()  # (name, help)


def _run_consumer(args: argparse.Namespace) -> int:
    from consumer.server import run_consumer
    from consumer.streaming.webhooks import WebhookRefused

    settings = ConsumerSettings.from_namespace(args)
    setup_logging(settings.log.log_level)
    try:
        run_consumer(settings)
    except (EvictionPolicyRefused, WebhookRefused, TelemetryMissing) as e:
        print(f"rsb consumer: {e}", file=sys.stderr)
        return 2
    return 0


def _run_generator(args: argparse.Namespace) -> int:
    from generator.engines import EngineUnavailable
    from generator.main import run_generator

    settings = GeneratorSettings.from_namespace(args)
    setup_logging(settings.log.log_level)
    try:
        run_generator(settings)
    except (EngineUnavailable, EvictionPolicyRefused, TelemetryMissing) as e:
        print(f"rsb generator: {e}", file=sys.stderr)
        return 2
    return 0


def _run_up(args: argparse.Namespace) -> int:
    from rsb.up import proxies_configured, run_stack, trusting_no_proxy

    settings = UpSettings.from_namespace(args)
    configured = proxies_configured(args.argv, os.environ)
    return run_stack(dataclasses.replace(settings, consumer=trusting_no_proxy(settings.consumer, configured)))


COMMANDS = (
    Command("up", "run the whole stack on this machine (private Redis, a generator, the API)",
            "Run everything on one machine. Without --redis-url a private Redis server is started and stopped "
            "with rsb; without --model the default model is served.", UpSettings, _run_up),
    Command("consumer", "the stateless HTTP/SSE API", "Serve the HTTP/SSE API (uvicorn).", ConsumerSettings,
            _run_consumer, required=frozenset({"redis-url"})),
    Command("generator", "one generator worker process",
            "Claim generation jobs from Redis and append their events.", GeneratorSettings, _run_generator,
            required=frozenset({"redis-url"})),
    Command("report", "what generations cost: the aborted ones (cancelled, abandoned, failed), or all (--usage)",
            "Aggregate the aborted-generation records, or with --usage the usage ledger (per key, model, day, "
            "status, reason, tier), over a time range.", commands.ReportSettings,
            commands.report, required=frozenset({"redis-url"})),
    Command("chat", "start a generation and stream its answer to the terminal",
            "Create a stream from PROMPT and print its answer as it is generated. The stream id goes to stderr: "
            "if the connection or this command stops, 'rsb tail ID' picks the answer up again (the generation "
            "goes on without a reader). Ctrl-C detaches; it does not cancel.", commands.ChatSettings,
            commands.chat, positionals=(("prompt", "the user message ('-' reads it from standard input)"),)),
    Command("tail", "print a stream's answer so far and follow it to its end",
            "Print the answer of stream ID from the start (or after --from) and follow it live until it ends, "
            "reconnecting across dropped connections.", commands.TailSettings, commands.tail,
            positionals=(("id", "the stream id"),)),
    Command("status", "print a stream's status as JSON", "Print GET /v1/streams/ID as JSON.",
            commands.ClientSettings, commands.status, positionals=(("id", "the stream id"),)),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rsb", description="rsb: resumable streams for LLM generation "
                                     "(Redis Streams + SSE).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.description)
        for name, help_text in cmd.positionals:
            p.add_argument(name, help=help_text)
        cmd.settings.add_arguments(p, required=cmd.required)
        p.set_defaults(run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    rc: int = args.run(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
