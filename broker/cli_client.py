"""The client side of the ``rsb`` command line: ``rsb chat``, ``rsb tail`` and ``rsb status`` (over
``broker.sdk``), and the ``--upstream-*`` flags of ``rsb generator``. ``broker.cli`` calls ``register``
from ``build_parser`` and ``dispatch`` from ``main``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from broker.sdk import DEFAULT_URL, Client, Event, RsbClientError, StreamInterrupted, UnavailableError

CLIENT_COMMANDS = frozenset({"chat", "tail", "status"})

# Exit statuses: the answer ended with `done` (0), with `error`/`cancelled` (1), the API refused the call
# (2), the server stayed unreachable (3), the user interrupted (130, the shell's Ctrl-C convention).
EXIT_FAILED, EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 1, 2, 3, 130


def _flag(p: argparse.ArgumentParser, name: str, **kw: Any) -> None:
    # Imported here: broker.cli imports this module while it is being built.
    from broker.cli import _flag as cli_flag

    cli_flag(p, name, **kw)


def _add_client_flags(p: argparse.ArgumentParser) -> None:
    _flag(p, "url", default=DEFAULT_URL, help="base URL of the rsb API (rsb up / rsb consumer)")
    _flag(p, "api-key", help="API key, sent as 'Authorization: Bearer KEY' (needed when the server has --api-keys)")
    _flag(p, "max-retries", type=int, default=8,
          help="reconnect attempts in a row (exponential backoff with jitter) before giving up")
    _flag(p, "log-level", default="warning", help="debug, info, warning or error")


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    _flag(p, "json", action="store_true",
          help="print every event as one JSON line ({id, type, data}) instead of the answer text")


def _add_upstream_flags(p: argparse.ArgumentParser) -> None:
    _flag(p, "upstream-api", help="protocol of --upstream: 'openai' (/v1/chat/completions, /v1/completions: "
          "vLLM, llama.cpp server, Ollama's /v1) or 'ollama' (native /api/chat, /api/generate); default: "
          "ollama when the URL ends in /api, else openai")
    _flag(p, "upstream-model", help="model name sent upstream (default: the first one the server lists)")
    _flag(p, "upstream-api-key", help="bearer key sent to the --upstream server")
    _flag(p, "upstream-timeout-s", type=float, default=600.0,
          help="longest silence from the upstream (waiting in its queue included) before the stream "
          "ends with error upstream")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``chat``, ``tail`` and ``status`` to ``rsb``, and the upstream flags to ``rsb generator``/``up``."""
    for name in ("generator", "up"):
        if name in sub.choices:
            _add_upstream_flags(sub.choices[name])

    chat = sub.add_parser(
        "chat", help="start a generation and stream its answer to the terminal",
        description="Create a stream from PROMPT and print its answer as it is generated. The stream id goes "
        "to stderr: if the connection or this command stops, 'rsb tail ID' picks the answer up again (the "
        "generation goes on without a reader). Ctrl-C detaches; it does not cancel.")
    chat.add_argument("prompt", help="the user message ('-' reads it from standard input)")
    _add_client_flags(chat)
    _flag(chat, "id", help="stream id (a UUID; default: a new one). Re-running with the same id and prompt "
          "replays the same stream instead of starting a second generation")
    _flag(chat, "max-tokens", type=int, help="most tokens to generate (default: the server's)")
    _flag(chat, "system", help="a system message sent before the prompt")
    _flag(chat, "temperature", type=float, help="sampling temperature (0 = greedy; default: the server's)")
    _flag(chat, "seed", type=int, help="sampling seed, for a repeatable answer")
    _flag(chat, "raw", action="store_true", help="send PROMPT as a plain completion prompt, not a chat message")
    _add_output_flags(chat)

    tail = sub.add_parser(
        "tail", help="print a stream's answer so far and follow it to its end",
        description="Print the answer of stream ID from the start (or after --from) and follow it live "
        "until it ends, reconnecting across dropped connections.")
    tail.add_argument("id", help="the stream id")
    _add_client_flags(tail)
    _flag(tail, "from", help="resume after this event id (as printed by --json) instead of from the start")
    _add_output_flags(tail)

    status = sub.add_parser("status", help="print a stream's status as JSON",
                            description="Print GET /v1/streams/ID as JSON.")
    status.add_argument("id", help="the stream id")
    _add_client_flags(status)


def dispatch(args: argparse.Namespace) -> int | None:
    """Run the command if it is one of this module's (None: not ours, broker.cli goes on)."""
    if args.command not in CLIENT_COMMANDS:
        return None
    from broker.sdk import RetryPolicy

    client = Client(args.url, api_key=args.api_key, retry=RetryPolicy(max_retries=max(0, args.max_retries)))
    try:
        if args.command == "chat":
            return _chat(client, args)
        if args.command == "tail":
            return _follow(client, args.id, getattr(args, "from"), args.json)
        return _status(client, args.id)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        client.close()


def _fail(command: str, err: RsbClientError) -> int:
    print(f"rsb {command}: {err.message}", file=sys.stderr)
    if isinstance(err, StreamInterrupted) and err.last_event_id:
        print(f"rsb {command}: resume after event {err.last_event_id} with --from", file=sys.stderr)
    return EXIT_UNREACHABLE if isinstance(err, UnavailableError) or err.status_code is None else EXIT_REFUSED


def _chat(client: Client, args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    messages: list[dict[str, str]] | None = None
    if not args.raw:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": prompt})
    try:
        info = client.create(messages=messages, prompt=prompt if args.raw else None, id=args.id,
                             max_tokens=args.max_tokens, temperature=args.temperature,
                             seed=args.seed)
    except RsbClientError as e:
        return _fail("chat", e)
    # Printed before any text, so the user can always pick the answer up again.
    print(f"rsb: stream {info.id} (resume with: rsb tail {info.id})", file=sys.stderr, flush=True)
    return _follow(client, info.id, None, args.json, command="chat")


def _follow(client: Client, stream_id: str, last_event_id: str | None, as_json: bool,
            command: str = "tail") -> int:
    out: TextIO = sys.stdout
    end: Event | None = None
    wrote_text = False
    try:
        for event in client.stream(stream_id, last_event_id):
            if as_json:
                out.write(json.dumps({"id": event.id, "type": event.type, "data": event.data},
                                     ensure_ascii=False) + "\n")
            elif event.text:
                out.write(event.text)
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
    if end is None:  # resumed at the terminal event (204): the answer was already complete
        return 0
    if end.type == "done":
        return 0
    data = end.data if isinstance(end.data, dict) else {}
    if end.type == "cancelled":
        print(f"rsb {command}: stream cancelled ({data.get('reason', 'unknown reason')})", file=sys.stderr)
    else:
        print(f"rsb {command}: stream failed: {data.get('code', 'error')}: {data.get('message', '')}",
              file=sys.stderr)
    return EXIT_FAILED


def _status(client: Client, stream_id: str) -> int:
    try:
        st = client.status(stream_id)
    except RsbClientError as e:
        return _fail("status", e)
    print(json.dumps(st.raw, indent=2, ensure_ascii=False))
    return 0
