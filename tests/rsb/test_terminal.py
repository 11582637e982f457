"""`rsb chat` and `rsb tail` print model text safely: escape sequences and control characters never reach the
terminal (a real stack whose engine, a scripted OpenAI-compatible upstream, answers them), and a ``reset`` takes
back on screen what a failover took back in the stream."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis
from scripted_upstream import Reply, ScriptedUpstream, text
from servers import ROOT, StackFactory

from broker.redis.server import RedisServer
from rsb import Event
from rsb import commands as rsb_commands
from rsb._terminal import TerminalText, json_line, strip_controls

# What a hostile answer may hold: a window title (OSC), colours and a screen clear (CSI), a carriage return that
# overwrites the line, a DCS string, C1 CSI (U+009B), BEL, backspaces and NUL; split over pieces mid-sequence.
HOSTILE = ["Hello \x1b]0;pwned", "\x07wor", "ld\x1b[3", "1m red\x1b[0m\r", "\x1b[2J over\x9b6n \x1bPq#0\x1b\\",
           "\tok\x08\x08\x00\x7f\n", "bye\x1b"]
SHOWN = "Hello world red over6n \tok\nbye"


def _rsb(*args: str) -> subprocess.CompletedProcess[bytes]:
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run([sys.executable, "-m", "rsb", *args], cwd=ROOT, env=env, capture_output=True, timeout=60)


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as up:
        yield up


def test_rsb_chat_and_tail_print_no_escape_sequences_or_controls(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
        upstream: ScriptedUpstream) -> None:
    s = stack_factory(redis_server.url)
    _, url = s.consumer()
    s.generator("--upstream", upstream.url, ignore_eos=False)
    upstream.script(Reply([text(piece) for piece in HOSTILE], delay_s=0.02))
    chat = _rsb("chat", "Say hello", "--url", url)
    assert chat.returncode == 0, chat.stderr.decode()
    assert chat.stdout.decode() == SHOWN + "\n"
    sid = chat.stderr.decode().split("rsb: stream ", 1)[1].split()[0]
    tail = _rsb("tail", sid, "--url", url)
    assert tail.stdout == chat.stdout
    lines = _rsb("tail", sid, "--url", url, "--json").stdout
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f]", lines.decode())
    events = [json.loads(line) for line in lines.splitlines()]
    assert "".join(e["data"]["text"] for e in events if e["type"] == "delta") == "".join(HOSTILE)  # kept, escaped


def test_the_terminal_filter_strips_sequences_split_anywhere() -> None:
    whole = "".join(HOSTILE)
    for cut in range(len(whole) + 1):
        t = TerminalText()
        assert t.feed(whole[:cut]) + t.feed(whole[cut:]) == SHOWN, cut
    assert strip_controls("a\x1b(Bb\x1bcc\x1b7d") == "abcd"
    assert json_line({"t": "\x1b\x9bé"}) == '{"t": "\\u001b\\u009bé"}'


class _Replaying:
    """A client whose stream is a fixed list of events (the reset's rendering is the command's, not the server's)."""

    def __init__(self, events: list[Event]) -> None:
        self.events = events

    def stream(self, stream_id: str, last_event_id: str | None) -> Iterator[Event]:
        yield from self.events


def test_a_reset_takes_back_the_printed_text_after_its_id(capsys: pytest.CaptureFixture[str]) -> None:
    events = [Event("1-0", "started", {"model": "m"}), Event("2-0", "delta", {"text": "The cat "}),
              Event("3-0", "delta", {"text": "sat on"}), Event("4-0", "delta", {"text": " a hat"}),
              Event("2-0", "reset", {"last_event_id": "2-0"}),  # 3-0 and 4-0 were lost by a failover
              Event("3-1", "delta", {"text": "slept."}), Event("5-0", "done", {"finish_reason": "stop", "usage": {}})]
    assert rsb_commands._follow(_Replaying(events), "sid", None, False) == 0  # type: ignore[arg-type]
    out, err = capsys.readouterr()
    # What was printed before the reset stays above a newline; what follows the note is the answer.
    assert out == "The cat sat on a hat\nThe cat slept.\n"
    assert "the server lost the end of this answer" in err and "event 2-0" in err
    # A reset that takes back nothing on screen (only events before the text) prints nothing.
    quiet = [Event("2-0", "delta", {"text": "Hi"}), Event("2-0", "reset", {"last_event_id": "2-0"}),
             Event("3-0", "delta", {"text": "!"}), Event("4-0", "done", {"finish_reason": "stop", "usage": {}})]
    assert rsb_commands._follow(_Replaying(quiet), "sid", None, False) == 0  # type: ignore[arg-type]
    out, err = capsys.readouterr()
    assert out == "Hi!\n" and err == ""
