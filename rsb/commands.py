"""The commands a person types against a running rsb: ``rsb chat``, ``rsb tail`` and ``rsb status`` (over the
public client), and ``rsb report`` (straight from Redis). Their flags, like every other, are settings."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TextIO

import orjson

from broker.errors import RsbError
from broker.redis.connection import connect
from broker.settings import BrokerSettings, Settings, setting
from broker.streams import usage_report as ledger
from broker.streams.report import GROUP_BYS, aborted_report
from broker.streams.usage import RETENTION_DAYS, RETENTION_HELP, Prices
from rsb import DEFAULT_URL, Answer, Client, Event, RetryPolicy, RsbClientError, StreamInterrupted, UnavailableError
from rsb._terminal import TerminalText, escape_c1, json_line, strip_controls

# Exit statuses: the answer ended with `done` (0), with `error`/`cancelled` (1), the API refused the call
# (2), the server stayed unreachable (3), the user interrupted (130, the shell's Ctrl-C convention).
EXIT_FAILED, EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 1, 2, 3, 130


@dataclass(frozen=True, slots=True)
class ClientSettings(Settings):
    title: ClassVar[str] = "Client"

    url: str = setting(DEFAULT_URL, "base URL of the rsb API (rsb up / rsb consumer)")
    api_key: str | None = setting(
        None, "API key, sent as 'Authorization: Bearer KEY' (needed when the server has --api-keys)", secret=True)
    max_retries: int = setting(8, "reconnect attempts in a row (exponential backoff with jitter) before giving up")

    def client(self) -> Client:
        return Client(self.url, api_key=self.api_key, retry=RetryPolicy(max_retries=max(0, self.max_retries)))


@dataclass(frozen=True, slots=True)
class TailSettings(Settings):
    client: ClientSettings = field(default_factory=ClientSettings)
    start_after: str | None = setting(
        None, "resume after this event id (as printed by --json) instead of from the start", flag="from")
    json: bool = setting(False, "print every event as one JSON line ({id, type, data}) instead of the answer text")


@dataclass(frozen=True, slots=True)
class ChatSettings(Settings):
    client: ClientSettings = field(default_factory=ClientSettings)
    id: str | None = setting(
        None, "stream id (a UUID; default: a new one). Re-running with the same id and prompt replays the same "
        "stream instead of starting a second generation")
    max_tokens: int | None = setting(None, "most tokens to generate (default: the server's)")
    system: str | None = setting(None, "a system message sent before the prompt")
    temperature: float | None = setting(None, "sampling temperature (0 = greedy; default: the server's)")
    seed: int | None = setting(None, "sampling seed, for a repeatable answer")
    raw: bool = setting(False, "send PROMPT as a plain completion prompt, not a chat message")
    json: bool = setting(False, "print every event as one JSON line ({id, type, data}) instead of the answer text")


@dataclass(frozen=True, slots=True)
class ReportSettings(Settings):
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    since: str | None = setting(None, "start of the range: unix seconds or ISO-8601 (UTC if no zone)")
    until: str | None = setting(None, "end of the range: unix seconds or ISO-8601 (UTC if no zone)")
    usage: bool = setting(False, "the usage ledger (every generation that ended, per key) instead of the aborted "
                          "generations")
    group_by: str | None = setting(
        None, f"what a row is: one of {', '.join(GROUP_BYS)} (default reason); with --usage a comma-separated list of "
        f"{', '.join(ledger.GROUP_BYS)} (default key)")
    key: str | None = setting(None, "with --usage: only this API key's records ('' for those made without keys)")
    prices_file: str | None = setting(None, "with --usage: JSON file of prices per model (as the API's --prices): "
                                      "rows then carry cost_usd", flag="prices")
    usage_retention_days: int = setting(RETENTION_DAYS, RETENTION_HELP)
    json: bool = setting(False, "print JSON instead of a table")
    csv: bool = setting(False, "print CSV instead of a table")


def _fail(command: str, err: RsbClientError) -> int:
    print(f"rsb {command}: {strip_controls(err.message)}", file=sys.stderr)  # the message may quote the server
    if isinstance(err, StreamInterrupted) and err.last_event_id:
        print(f"rsb {command}: resume after event {err.last_event_id} with --from", file=sys.stderr)
    return EXIT_UNREACHABLE if isinstance(err, UnavailableError) or err.status_code is None else EXIT_REFUSED


def _interruptible(run: Callable[[], int]) -> int:
    try:
        return run()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def chat(args: argparse.Namespace) -> int:
    s = ChatSettings.from_namespace(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    messages: list[dict[str, str]] | None = None
    if not s.raw:
        messages = [{"role": "system", "content": s.system}] if s.system else []
        messages.append({"role": "user", "content": prompt})
    with s.client.client() as client:
        def run() -> int:
            try:
                info = client.create(messages=messages, prompt=prompt if s.raw else None, id=s.id,
                                     max_tokens=s.max_tokens, temperature=s.temperature, seed=s.seed)
            except RsbClientError as e:
                return _fail("chat", e)
            # Printed before any text, so the user can always pick the answer up again.
            print(f"rsb: stream {info.id} (resume with: rsb tail {info.id})", file=sys.stderr, flush=True)
            return _follow(client, info.id, None, s.json, command="chat")

        return _interruptible(run)


def tail(args: argparse.Namespace) -> int:
    s = TailSettings.from_namespace(args)
    with s.client.client() as client:
        return _interruptible(lambda: _follow(client, args.id, s.start_after, s.json))


def status(args: argparse.Namespace) -> int:
    s = ClientSettings.from_namespace(args)
    with s.client() as client:
        try:
            st = client.status(args.id)
        except RsbClientError as e:
            return _fail("status", e)
    print(escape_c1(json.dumps(st.raw, indent=2, ensure_ascii=False)))
    return 0


def _follow(client: Client, stream_id: str, last_event_id: str | None, as_json: bool, command: str = "tail") -> int:
    """Prints the stream as it comes: the answer's text, or (``as_json``) every event, the ``reset`` ones included
    (a consumer of the lines applies them). Model text never reaches the terminal raw (rsb._terminal)."""
    out: TextIO = sys.stdout
    end: Event | None = None
    wrote_text = False
    answer = Answer()  # the answer so far, with resets applied: the truth the printed text follows
    printed = 0  # how much of answer.text is on the screen
    safe = TerminalText()
    try:
        for event in client.stream(stream_id, last_event_id):
            if as_json:
                out.write(json_line({"id": event.id, "type": event.type, "data": event.data}) + "\n")
            elif event.type == "reset":
                answer.feed(event)
                if len(answer.text) < printed:  # a failover took back text that is on the screen: say so, show the rest
                    safe.reset()
                    out.write("\n")
                    out.flush()
                    print(f"rsb: the server lost the end of this answer (a Redis failover); it goes on from "
                          f"event {strip_controls(event.id)}, the answer so far again:", file=sys.stderr, flush=True)
                    out.write(safe.feed(answer.text))
                    printed = len(answer.text)
            elif event.text:
                answer.feed(event)
                out.write(safe.feed(event.text))
                printed += len(event.text)
                wrote_text = True
            out.flush()  # the point is to watch the answer appear
            if event.terminal:
                end = event
    except KeyboardInterrupt:
        if wrote_text:
            out.write("\n")
        print(f"rsb: detached; the generation goes on (rsb tail {stream_id})", file=sys.stderr)
        return EXIT_INTERRUPTED
    except RsbClientError as e:
        if wrote_text:
            out.write("\n")
        return _fail(command, e)
    if wrote_text:
        out.write("\n")
        out.flush()
    if end is None or end.type == "done":  # None: resumed at the terminal event (204), already complete
        return 0
    data = end.data if isinstance(end.data, dict) else {}
    if end.type == "cancelled":
        print(f"rsb {command}: stream cancelled ({strip_controls(str(data.get('reason', 'unknown reason')))})",
              file=sys.stderr)
    else:
        print(f"rsb {command}: stream failed: {strip_controls(str(data.get('code', 'error')))}: "
              f"{strip_controls(str(data.get('message', '')))}", file=sys.stderr)
    return EXIT_FAILED


def report(args: argparse.Namespace) -> int:
    s = ReportSettings.from_namespace(args)

    async def run() -> dict[str, Any]:
        since, until = ledger.parse_time(s.since, "since"), ledger.parse_time(s.until, "until")
        redis = connect(s.broker.url, cluster=s.broker.cluster)
        try:
            if s.usage:
                prices = Prices.load(s.prices_file) if s.prices_file else None
                return await ledger.usage_report(redis, s.broker.partitions, since=since, until=until,
                                                group_by=ledger.parse_group_by(s.group_by), key_id=s.key,
                                                prices=prices, retention_s=s.usage_retention_days * 86_400)
            return await aborted_report(redis, s.broker.partitions, since=since, until=until,
                                        group_by=s.group_by or "reason", retention_s=s.usage_retention_days * 86_400)
        finally:
            await redis.aclose()

    try:
        result = asyncio.run(run())
    except (RsbError, ValueError, OSError) as e:
        print(f"rsb report: {e.message if isinstance(e, RsbError) else e}", file=sys.stderr)
        return 2
    if s.json:
        print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    elif s.csv:
        print(ledger.render_csv(result), end="")
    else:
        print(ledger.render_table(result))
    return 0
