"""The chat page at ``/`` in a real browser: Debian's chromium driven by Playwright, against real
redis-server, `rsb generator` and `rsb consumer` processes. What the page shows is compared with what the
stream holds, read over HTTP with the strict SSE parser of tests/helpers.py.

Playwright never downloads a browser here: it launches the system chromium (``RSB_CHROMIUM`` or
``chromium`` on PATH). Screenshots land in ``artifacts/web/`` at the repository root."""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import orjson
import pytest
import redis
from helpers import assert_english, create, eventually, read_sse, wait_status
from servers import CHROMIUM, Stack, StackFactory, needs_chromium
from typed_streams import StandInGenerator

from broker.redis.server import RedisServer, free_port
from broker.streams.keys import StreamKeys, served_models_key
from generator.engines.default_model import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts" / "web"

if CHROMIUM is not None:
    from playwright.sync_api import Browser, Locator, Page, expect
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

# markdown-it 15.0.3's dist/browser/markdown-it.esm.min.mjs (consumer/static/vendor/README.md).
MARKDOWN_IT_SHA256 = "d5432491790141da046b1197353705db03264f40b5727f3b4b591f5aba193e30"

# Long enough that a reload, a second tab or a Stop lands mid-answer on the slow model (~700 tokens/s on
# an idle core; a few times slower on a busy 2-core machine), short enough to keep these tests quick.
LONG_ANSWER = 1000


# The new_page fixture: each call opens a page in a fresh browser context.
PageFactory = Callable[[], Page]


@pytest.fixture
def new_page(browser: Browser) -> Iterator[PageFactory]:
    """Pages in fresh browser contexts (own localStorage, like separate devices), closed at teardown."""
    contexts = []

    def make() -> Page:
        ctx = browser.new_context(viewport={"width": 1000, "height": 760})
        ctx.set_default_timeout(60_000)
        contexts.append(ctx)
        page = ctx.new_page()
        # A page error (an exception, a CSP violation) fails the test: the page must work, not just look so.
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        # (The browser's own favicon probe of a non-HTML page, /healthz, is no error of the page.)
        page.on("console", lambda m: errors.append(f"{m.text} {m.location.get('url')}")
                if m.type == "error" and not m.location.get("url", "").endswith("/favicon.ico") else None)
        cast(Any, page).errors = errors  # an attribute of our own on the Page, read back at teardown
        return page

    yield make
    for ctx in contexts:
        for page in ctx.pages:
            assert not cast(Any, page).errors, f"errors in the page: {cast(Any, page).errors}"
        ctx.close()


def _send(page: Page, prompt: str, max_tokens: int) -> str:
    """Type a prompt with max_tokens set in the Settings panel; the id of the new stream."""
    page.click("#settings > summary")
    page.fill("#max-tokens", str(max_tokens))
    page.click("#settings > summary")
    page.fill("#prompt", prompt)
    before = page.locator(".turn").count()
    page.click("#send")
    turn = page.locator(".turn").nth(before)
    sid = turn.get_attribute("data-stream-id")
    assert sid
    return sid


def _turn(page: Page, sid: str) -> Locator:
    return page.locator(f'.turn[data-stream-id="{sid}"]')


def _diagnose(page: Page, sid: str) -> str:
    """What the page shows of a stream, for a failed wait's message."""
    return str(page.evaluate(
        "(sid) => document.querySelector(`.turn[data-stream-id='${sid}']`)?.querySelector('.meta')?.innerText"
        " + ' | deltas=' + document.querySelector(`.turn[data-stream-id='${sid}']`)?.dataset.deltas"
        " + ' | connection: ' + document.querySelector('#connection').innerText", sid))


def _wait_deltas(page: Page, sid: str, at_least: int) -> None:
    try:
        page.wait_for_function(
            "([sid, n]) => Number(document.querySelector(`.turn[data-stream-id='${sid}']`)?.dataset.deltas) >= n",
            arg=[sid, at_least], timeout=30_000)
    except PlaywrightTimeout:
        raise AssertionError(f"never {at_least} deltas on the page: {_diagnose(page, sid)}") from None


def _wait_status(page: Page, sid: str, status: str) -> None:
    try:
        page.wait_for_selector(f'.turn[data-stream-id="{sid}"][data-status="{status}"]', state="attached",
                               timeout=60_000)
    except PlaywrightTimeout:
        raise AssertionError(f"the page never showed {status}: {_diagnose(page, sid)}") from None


def _page_text(page: Page, sid: str) -> str:
    """The answer's Markdown source, as the page shows it under "Markdown source" once finished."""
    return str(_turn(page, sid).locator(".raw pre").text_content())


def _check_rendering(page: Page, sid: str) -> None:
    """Rendered block by block while streaming = the whole final text rendered at once."""
    incremental, whole = page.evaluate(
        """async ([sid]) => {
            const md = await import('/static/markdown.js');
            const turn = document.querySelector(`.turn[data-stream-id='${sid}']`);
            const t = document.createElement('template');
            t.innerHTML = md.renderMarkdown(turn.querySelector('.raw pre').textContent);
            return [turn.querySelector('.blocks').innerHTML, t.innerHTML];
        }""", [sid])
    assert incremental == whole


def _screenshot(page: Page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path))
    return path


def _slow_stack(stack_factory: StackFactory, redis_url: str, slow_model: Path) -> Stack:
    s = stack_factory(redis_url)
    s.consumer()
    s.generator(model=slow_model)
    return s


@needs_chromium
def test_reload_mid_stream_resumes_and_shows_the_answer_exactly_once(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path, new_page: PageFactory) -> None:
    s = _slow_stack(stack_factory, redis_server.url, slow_model)
    page = new_page()
    page.goto(f"{s.base_url}/")
    expect(page.locator("#empty")).to_be_visible()
    sid = _send(page, "Tell me a story", LONG_ANSWER)
    _wait_deltas(page, sid, 100)

    resumes: list[str | None] = []
    page.on("request", lambda r: resumes.append(r.headers.get("last-event-id"))
            if r.url.endswith(f"/v1/streams/{sid}/events") else None)
    page.reload()
    # The text read before the reload is back at once, from localStorage, before any network read.
    expect(_turn(page, sid).locator(".user")).to_have_text("Tell me a story")
    assert int(_turn(page, sid).get_attribute("data-deltas") or 0) >= 100
    _wait_status(page, sid, "done")

    with s.client() as c:
        server = read_sse(c, f"/v1/streams/{sid}/events")
        assert wait_status(c, sid, {"done"})["usage"]["completion_tokens"] == LONG_ANSWER
    # One read after the reload, resuming mid-answer from the last event id the page had stored.
    assert len(resumes) == 1 and resumes[0] in server.ids[:-1]
    assert resumes[0] != server.ids[-2], "the reload did not land mid-answer"
    assert _page_text(page, sid) == server.text
    _check_rendering(page, sid)
    turn = _turn(page, sid)
    model = server.events[1].data["model"]
    assert "demo" in model
    expect(turn.locator(".model")).to_have_text(f"model {model}")
    expect(turn.locator(".demo-note")).to_be_visible()
    expect(turn.locator(".status")).to_have_text("done (max tokens reached)")
    expect(turn.locator(".tokens")).to_have_text(f"{LONG_ANSWER} tokens")
    expect(turn.locator(".ttft")).to_contain_text("TTFT")
    expect(turn.locator(".rate")).to_contain_text("tok/s")
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stop")).to_be_hidden()
    assert _screenshot(page, "reload-done.png").stat().st_size > 10_000

    # A second reload after the end reads nothing more: the page knows the stream is finished.
    page.reload()
    expect(_turn(page, sid)).to_have_attribute("data-status", "done")
    assert _page_text(page, sid) == server.text and len(resumes) == 1


@needs_chromium
def test_queue_position_then_stop_cancels_the_generation(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path, new_page: PageFactory) -> None:
    s = _slow_stack(stack_factory, redis_server.url, slow_model)
    page = new_page()
    page.goto(f"{s.base_url}/")
    with s.client() as c:
        blocker = create(c, max_tokens=LONG_ANSWER).json()["id"]
        wait_status(c, blocker, {"running"})
        sid = _send(page, "Stop me", LONG_ANSWER)
        turn = _turn(page, sid)
        # The one worker is busy: the page shows where it waits (no finished job yet, so no ETA).
        expect(turn.locator(".status")).to_have_text("queued: position 1, ETA unknown")
        expect(page.locator("#stop")).to_be_visible()
        assert c.post(f"/v1/streams/{blocker}/cancel").status_code == 202
        _wait_deltas(page, sid, 100)
        expect(turn.locator(".status")).to_have_text("generating…")
        expect(turn.locator(".rate")).to_contain_text("tok/s")
        page.click("#stop")
        _wait_status(page, sid, "cancelled")
        server = read_sse(c, f"/v1/streams/{sid}/events")
    last = server.events[-1]
    assert last.event == "cancelled" and last.data["reason"] == "client"
    assert last.data["usage"]["completion_tokens"] < LONG_ANSWER  # it stopped generating
    expect(turn.locator(".status")).to_have_text("cancelled (client)")
    # Tokens generated while the cancel travelled are read on to the end: page and stream agree.
    assert _page_text(page, sid) == server.text
    expect(page.locator("#stop")).to_be_hidden()
    _screenshot(page, "stopped.png")


@needs_chromium
def test_two_tabs_on_one_stream_show_the_same_answer(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path, new_page: PageFactory) -> None:
    s = _slow_stack(stack_factory, redis_server.url, slow_model)
    first, second = new_page(), new_page()
    first.goto(f"{s.base_url}/")
    sid = _send(first, "Write a list", 500)
    _wait_deltas(first, sid, 50)
    # Another device opens the stream's link mid-answer: it replays, then tails live.
    second.goto(f"{s.base_url}/?stream={sid}")
    expect(_turn(second, sid).locator(".user")).to_have_text(f"Stream {sid}")
    expect(second.locator("#composer")).to_be_hidden()
    _wait_status(first, sid, "done")
    _wait_status(second, sid, "done")
    with s.client() as c:
        server = read_sse(c, f"/v1/streams/{sid}/events")
    assert _page_text(first, sid) == _page_text(second, sid) == server.text
    assert _turn(first, sid).locator(".blocks").inner_html() == _turn(second, sid).locator(".blocks").inner_html()
    _check_rendering(second, sid)
    _screenshot(second, "second-tab-done.png")


def _sse(eid: str, kind: str, data: str, eol: str) -> str:
    return f"id: {eid}{eol}event: {kind}{eol}data: {data}{eol}{eol}"


def _split(raw: bytes, rng: random.Random) -> list[list[int]]:
    """Cut ``raw`` at random points, always including some inside multi-byte characters."""
    cuts = {i for i in range(1, len(raw)) if (raw[i] & 0xC0) == 0x80}  # every continuation byte
    cuts = set(rng.sample(sorted(cuts), min(len(cuts), 12))) | {rng.randrange(1, len(raw)) for _ in range(20)}
    edges = [0, *sorted(cuts), len(raw)]
    return [list(raw[a:b]) for a, b in itertools.pairwise(edges) if b > a]


@needs_chromium
def test_client_reassembles_events_split_anywhere_and_resumes_after_drops(
        stack_factory: StackFactory, redis_server: RedisServer, new_page: PageFactory) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    page = new_page()
    page.goto(f"{s.base_url}/healthz")  # any page of the origin can import the client module
    rng = random.Random(5)
    texts = ["Hé", "llo ", "世界", " 🦀", "\u00a0ok", "\n\n", "**bold** ", "`<b>`", " 你好"]
    ids = [f"{1000 + i}-0" for i in range(len(texts) + 3)]

    events = [(ids[0], "queued", {"position": 1, "eta_s": None}), (ids[1], "started", {"model": "m"})]
    events += [(ids[i + 2], "delta", {"text": t}) for i, t in enumerate(texts)]
    events.append((ids[-1], "done", {"finish_reason": "stop", "usage": {"completion_tokens": len(texts)}}))
    eols = ["\r\n", "\n", "\r"]
    blocks = [_sse(eid, kind, json.dumps(data, ensure_ascii=False), eols[i % 3])
              for i, (eid, kind, data) in enumerate(events)]
    # First response: a retry line, a heartbeat comment, then six events byte by byte, then half of the
    # seventh: the connection drops mid-event. The second attempt fails outright (network error); the
    # third replays from the sixth event's id, split at random places (inside characters, CR|LF, lines).
    first = ("retry: 20\n: heartbeat\n\n" + "".join(blocks[:6]) + blocks[6][:len(blocks[6]) // 2]).encode()
    third = (": hb\r\n\r\n" + "".join(blocks[6:])).encode()
    result = page.evaluate(
        """async ([first, third]) => {
            const { RsbStream } = await import('/static/rsb-client.js');
            const body = (chunks) => new ReadableStream({
                async pull(ctrl) {
                    await new Promise((r) => setTimeout(r, 0));
                    const c = chunks.shift();
                    if (c) ctrl.enqueue(new Uint8Array(c)); else ctrl.close();
                },
            });
            const sse = { status: 200, headers: { 'Content-Type': 'text/event-stream' } };
            const calls = [];
            const fetch = async (url, init) => {
                calls.push([url, init.headers['Last-Event-ID'] ?? null]);
                if (calls.length === 1) return new Response(body(first), sse);
                if (calls.length === 2) throw new TypeError('Failed to fetch');
                if (calls.length === 3) return new Response(body(third), sse);
                return new Response(null, { status: 204 });
            };
            const got = [];
            const states = [];
            const s = new RsbStream('abc', { fetch, onEvent: (e) => got.push(e),
                                             onState: (st) => states.push(st), initialMs: 1000 });
            const end = await s.done;
            // Resuming at the terminal event answers 204: the client stops, it does not reconnect.
            const after = new RsbStream('abc', { fetch, lastEventId: end.id });
            const ended = await after.done;
            return { got, calls, states, end, ended, retryMs: s.retryMs };
        }""", [[list(first[i:i + 1]) for i in range(len(first))], _split(third, rng)])
    got = [(e["id"], e["type"], e["data"]) for e in result["got"]]
    assert got == [(eid, kind, data) for eid, kind, data in events]
    assert "".join(e["data"]["text"] for e in result["got"] if e["type"] == "delta") == "".join(texts)
    assert result["calls"] == [["/v1/streams/abc/events", None], ["/v1/streams/abc/events", ids[5]],
                               ["/v1/streams/abc/events", ids[5]], ["/v1/streams/abc/events", ids[-1]]]
    assert result["retryMs"] == 20  # the server's retry: line sets the backoff base (not 1000 ms)
    assert result["states"].count("retrying") == 2 and result["states"][-1] == "ended"
    assert result["end"]["type"] == "done" and result["ended"] == {"type": "ended"}


# Lines to build Markdown documents from: every kind of block, and the lines that end, continue or turn one
# block into another (a setext underline, a lazy continuation, a table's delimiter row, an indented item).
_MD_LINES = ["# Title", "Some **bold** and *it* and `a<b>`", "- item", "  continued", "1. one", "2) two", "> quote",
             "lazy", "```js", "```", "~~~", "    code", "---", "***", "| a | b |", "|---|---|", "| 1 | 2 |", "a|b",
             "-|-", "", "", "", "Foo", "===", "text [link](https://x.org) <b>x</b>", "[bad](javascript:alert(1))",
             "<http://a.b>", "  - nested", "   ", "\t- tab", "+ plus", "* star", "10. ten", "-", "1.", "para\r",
             "x\r\ny", "*", "<div>", "[ref]: http://r", "[ref]", "2 * 3 * 4"]


@needs_chromium
def test_markdown_renders_block_by_block_exactly_as_the_whole_answer(
        stack_factory: StackFactory, redis_server: RedisServer, new_page: PageFactory) -> None:
    """markdown-it (vendored) renders each finished block once while the answer streams; the unfinished last
    block is plain text. What ends up on screen is exactly the whole answer rendered at once, for a fixed
    document and for 400 random ones cut at random points (every kind of block, and the lines that change the
    block before them)."""
    s = stack_factory(redis_server.url)
    s.consumer()
    page = new_page()
    page.goto(f"{s.base_url}/healthz")
    text = ("# Title\nSome **bold**, *italic* and `a<b>&c` here.\n2 * 3 * 4 stays.\n\n"
            "- one\n- two <img src=x onerror=alert(1)>\n\n1. first\n2. second\n\n"
            "```py\nif a < b:\n\n    print('x')\n```\nafter <script>alert(1)</script>\n\n"
            "| a | b |\n|---|---|\n| 1 | [x](https://example.org) |\n\n> quoted\n\nunfinished *tail")
    rng = random.Random(1)
    docs = ["".join(rng.choice(_MD_LINES) + ("\n" if rng.random() < 0.9 else "") for _ in range(rng.randint(1, 14)))
            for _ in range(400)]
    out = page.evaluate(
        """async ([text, cuts, docs, seed]) => {
            const md = await import('/static/markdown.js');
            const stream = (doc, points) => {
                const blocks = document.createElement('div');
                const tail = document.createElement('span');
                const inc = new md.IncrementalMarkdown(blocks, tail);
                const tails = [];
                for (const cut of points) {
                    inc.update(doc.slice(0, cut));
                    tails.push(tail.textContent);
                }
                const streamed = blocks.innerHTML;
                inc.update(doc, true);
                return { streamed, final: blocks.innerHTML, tails, tailAfter: tail.textContent };
            };
            const whole = (doc) => {
                const t = document.createElement('template');
                t.innerHTML = md.renderMarkdown(doc);
                return t.innerHTML;
            };
            let r = seed;
            const random = () => (r = (r * 1103515245 + 12345) % 2147483648) / 2147483648;
            const differ = [];
            for (const doc of docs) {
                const points = [];
                for (let p = 0; p < doc.length; p += 1 + Math.floor(random() * 6)) points.push(p);
                const got = stream(doc, points);
                if (got.final !== whole(doc)) differ.push([doc, got.final, whole(doc)]);
            }
            return { ...stream(text, [...cuts, text.length]), whole: whole(text), differ };
        }""", [text, sorted(random.Random(1).sample(range(1, len(text)), 40)), docs, 5])
    assert out["differ"] == []
    whole = out["whole"]
    assert out["final"] == whole
    assert whole.startswith("<h1>Title</h1>\n<p>Some <strong>bold</strong>, <em>italic</em> and "
                            "<code>a&lt;b&gt;&amp;c</code> here.\n2 * 3 * 4 stays.</p>")
    assert "<ul>\n<li>one</li>\n<li>two &lt;img src=x onerror=alert(1)&gt;</li>\n</ul>" in whole
    assert "<ol>\n<li>first</li>\n<li>second</li>\n</ol>" in whole
    assert '<pre><code class="language-py">if a &lt; b:\n\n    print(\'x\')\n</code></pre>' in whole
    assert "<p>after &lt;script&gt;alert(1)&lt;/script&gt;</p>" in whole
    assert ('<td><a href="https://example.org" target="_blank" rel="noopener noreferrer nofollow">x</a></td>'
            in whole)
    assert "<blockquote>\n<p>quoted</p>\n</blockquote>" in whole
    assert whole.endswith("<p>unfinished *tail</p>\n")
    assert "<img" not in whole and "<script" not in whole
    # While streaming, the last block (until a complete line begins the next one) is plain text, never
    # half-parsed Markdown.
    assert out["tails"][-1] == "> quoted\n\nunfinished *tail" and out["tailAfter"] == ""
    assert out["streamed"] + "<blockquote>\n<p>quoted</p>\n</blockquote>\n<p>unfinished *tail</p>\n" == whole


def test_the_page_and_client_module_are_served(stack_factory: StackFactory, redis_server: RedisServer) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    with s.client() as c:
        page = c.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert '<script type="module" src="/static/app.js">' in page.text
        for asset, kind in [("rsb-client.js", "text/javascript"), ("app.js", "text/javascript"),
                            ("markdown.js", "text/javascript"), ("partial-json.js", "text/javascript"),
                            ("vendor/markdown-it.min.js", "text/javascript"), ("style.css", "text/css")]:
            r = c.get(f"/static/{asset}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind), asset
        # The vendored markdown-it is the pinned release, byte for byte (consumer/static/vendor/README.md).
        vendored = c.get("/static/vendor/markdown-it.min.js").content
        assert hashlib.sha256(vendored).hexdigest() == MARKDOWN_IT_SHA256
        assert MARKDOWN_IT_SHA256 in (ROOT / "consumer" / "static" / "vendor" / "README.md").read_text()
        missing = c.get("/static/nope.js")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


# -- the real model --------------------------------------------------------------------------------------

# (prompt, max_tokens): what SmolLM2 writes for each at temperature 0 (greedy) on this build of llama.cpp is
# plain paragraphs, a numbered list, and a fenced Python block followed by prose.
REAL_PROMPTS = [("What is a resumable stream?", 64), ("List three uses of Redis.", 96),
                ("Write a Python function that reverses a string.", 64)]


@needs_chromium
def test_the_real_model_answers_in_english_rendered_as_markdown(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, default_gguf: Path,
        new_page: PageFactory) -> None:
    s = stack_factory(redis_server.url)
    s.generator(model=default_gguf, ignore_eos=False)
    s.consumer()
    page = new_page()
    page.goto(f"{s.base_url}/")
    # The header names the model the generators serve (GET /v1/models), before anything is sent.
    expect(page.locator("#model")).to_have_text(DEFAULT_MODEL_NAME)
    page.click("#settings > summary")
    page.fill("#temperature", "0")
    page.click("#settings > summary")
    html: list[str] = []
    for i, (prompt, max_tokens) in enumerate(REAL_PROMPTS):
        if i:
            page.click("#new-chat")  # one question per conversation: each answer is the model's first
        sid = _send(page, prompt, max_tokens)
        _wait_status(page, sid, "done")
        with s.client() as c:
            server = read_sse(c, f"/v1/streams/{sid}/events")
        assert server.events[1].event == "started"
        assert server.events[1].data == {"model": DEFAULT_MODEL_NAME, "service_tier": "default"}
        assert _page_text(page, sid) == server.text
        _check_rendering(page, sid)
        turn = _turn(page, sid)
        expect(turn.locator(".model")).to_have_text(f"model {DEFAULT_MODEL_NAME}")
        expect(turn.locator(".demo-note")).to_be_hidden()
        expect(turn.locator(".status")).to_contain_text("done")
        expect(turn.locator(".ttft")).to_contain_text("TTFT")
        expect(turn.locator(".rate")).to_contain_text("tok/s")
        html.append(turn.locator(".blocks").inner_html())
        _screenshot(page, f"real-model-{i + 1}.png")
        if i < 2:
            assert_english(server.text)
    answer, listing, code = html
    assert answer.startswith("<p>") and "stream" in answer.lower()
    # The greedy answer's own shape is the model's (and moves with llama.cpp's rounding): a list of three, rendered.
    assert re.search(r"<(ol|ul)>\s*<li>[^<]+</li>", listing) and listing.count("<li>") >= 3, listing
    assert '<pre><code class="language-python">def ' in code and "[::-1]" in code, code
    assert "<code>" in code  # prose after the block quotes code inline


# -- typed output and resets: the stand-in for the generator (tests/typed_streams.py) writes the stream -------


def _answer(page: Page, sid: str) -> dict[str, Any]:
    """What the page holds of a stream's answer (its Answer, the one it renders and stores)."""
    return cast(dict[str, Any], page.evaluate(
        """(sid) => {
            const a = window.rsbPage.turns.find((t) => t.id === sid).answer;
            return { text: a.text, reasoning: a.reasoning, deltas: a.deltas,
                     toolCalls: a.toolCalls.map((c) => ({ index: c.index, id: c.id, name: c.name,
                                                           arguments: c.arguments })) };
        }""", sid))


def _saved(page: Page, sid: str) -> dict[str, Any]:
    """The stream's snapshot in localStorage, with the text and reasoning its stored events add up to."""
    raw = page.evaluate("(sid) => localStorage.getItem(`rsb.stream.v1.${sid}`)", sid)
    snap = json.loads(raw)
    log = snap.get("answer", {}).get("log", [])
    snap.setdefault("text", "".join(d["text"] for _, kind, d in log if kind == "delta"))
    snap["reasoning"] = "".join(d["text"] for _, kind, d in log if kind == "reasoning")
    return cast(dict[str, Any], snap)


def _shown(page: Page, sid: str) -> str:
    """The answer's text as the page shows it while it streams (rendered blocks, then the plain tail), without
    whitespace (the blocks' markup puts line breaks of its own between them)."""
    return "".join(str(_turn(page, sid).locator(".answer").text_content()).split())


def _wait_answer(page: Page, sid: str, check: str, what: str) -> None:
    """Wait until ``check`` (a JS expression over the stream's Answer ``a``) holds."""
    try:
        page.wait_for_function(
            f"(sid) => {{ const t = window.rsbPage?.turns.find((t) => t.id === sid); const a = t?.answer;"
            f" return Boolean(a && ({check})); }}", arg=sid, timeout=30_000)
    except PlaywrightTimeout:
        raise AssertionError(f"the page never had {what}: {_answer(page, sid)} | {_diagnose(page, sid)}") from None


def _wait_saved(page: Page, sid: str, last_id: str) -> None:
    page.wait_for_function(
        "([sid, id]) => JSON.parse(localStorage.getItem(`rsb.stream.v1.${sid}`) || '{}').lastEventId === id",
        arg=[sid, last_id], timeout=10_000)


@needs_chromium
def test_a_reset_takes_back_what_a_failover_lost_on_screen_and_in_storage(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
        new_page: PageFactory) -> None:
    """Issue 20, bug 4. A failover at durability local: the consumer the page reads from goes down, and the
    stream loses its last three events (XDEL, what the promoted replica lacks). The generation goes on from what
    the stream has. The page reconnects from its last event id, the new consumer answers ``reset``, and the page
    takes back the lost text: it shows, and stores, exactly the stream's text. The stream is written by the
    stand-in for the generator (tests/typed_streams.py) so that the loss lands where the test says."""
    s = stack_factory(redis_server.url)
    port = free_port()
    consumer, url = s.consumer(port=port)
    page = new_page()
    resumes: list[str | None] = []
    page.on("request", lambda r: resumes.append(r.headers.get("last-event-id")) if "/events" in r.url else None)
    page.goto(f"{url}/")
    sid = _send(page, "Tell me about Redis", 64)
    _wait_status(page, sid, "queued")
    gen = StandInGenerator(redis_server.url, sid)
    gen.start()
    kept, lost = ["Redis is ", "an in-memory ", "data store.\n\n"], ["It was written ", "in C by ", "Salvatore."]
    gen.append(*[("delta", {"text": t}) for t in kept + lost])
    _wait_deltas(page, sid, 6)
    last = gen.ids()[-1]
    _wait_saved(page, sid, last)
    assert _shown(page, sid) == "Redisisanin-memorydatastore.ItwaswritteninCbySalvatore."

    consumer.signal(signal.SIGKILL)
    consumer.wait(5)
    gen.lose_tail(gen.ids()[-3:])
    gen.append(("delta", {"text": "It is "}), ("delta", {"text": "fast."}))
    s.consumer(port=port)
    expect(_turn(page, sid).locator(".answer")).to_contain_text("fast.")
    # (The browser's network errors while no consumer answered are what a failover looks like, not a bug.)
    errors = cast(Any, page).errors
    errors[:] = [e for e in errors if "net::ERR_" not in e
                 or not (e.endswith(f"/v1/streams/{sid}/events") or e.endswith("/v1/models"))]
    assert _shown(page, sid) == "Redisisanin-memorydatastore.Itisfast."  # the lost text is gone
    assert last in resumes  # it resumed from the lost event: the server said reset
    with s.client() as c:
        assert read_sse(c, f"/v1/streams/{sid}/events", headers={"Last-Event-ID": last},
                        stop_after=1).events[0].event == "reset"

    gen.append(("delta", {"text": " The end."}))
    gen.finish(completion_tokens=6)
    _wait_status(page, sid, "done")
    with s.client() as c:
        server = read_sse(c, f"/v1/streams/{sid}/events")
    assert server.text == "Redis is an in-memory data store.\n\nIt is fast. The end."
    assert _page_text(page, sid) == server.text
    _check_rendering(page, sid)
    saved = _saved(page, sid)
    assert saved["text"] == server.text and saved["lastEventId"] == server.ids[-1] and saved["status"] == "done"
    # A reload shows the corrected answer, from storage, and reads nothing more.
    n = len(resumes)
    page.reload()
    _wait_status(page, sid, "done")
    assert _page_text(page, sid) == server.text and len(resumes) == n
    _check_rendering(page, sid)


@needs_chromium
def test_reasoning_and_tool_calls_show_as_they_stream_and_after_a_reload(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
        new_page: PageFactory) -> None:
    """The page shows the reasoning apart (collapsed) and each tool call (its name, then its arguments as they
    stream), from storage at once after a reload, and goes on from there; a reset takes back reasoning and tool
    calls too. Model text is shown as text. The stream is written by the stand-in for the generator
    (tests/typed_streams.py): no engine in this tree emits these events yet."""
    s = stack_factory(redis_server.url)
    s.consumer()
    page = new_page()
    page.goto(f"{s.base_url}/")
    sid = _send(page, "What is the weather in Zürich?", 64)
    _wait_status(page, sid, "queued")
    gen = StandInGenerator(redis_server.url, sid)
    gen.start()
    turn = _turn(page, sid)
    reasoning, calls = turn.locator(".reasoning"), turn.locator(".tool-call")
    expect(reasoning).to_be_hidden()
    thought = "The user asks about the weather <b>now</b>; I should call get_weather."
    gen.append(("reasoning", {"text": thought[:20]}), ("reasoning", {"text": thought[20:]}))
    expect(reasoning.locator("summary")).to_be_visible()
    assert reasoning.get_attribute("open") is None  # collapsed: the answer comes first
    expect(reasoning.locator(".reasoning-text")).to_have_text(thought)  # tags and all, as text
    assert reasoning.locator("b").count() == 0
    reasoning.locator("summary").click()
    expect(reasoning.locator(".reasoning-text")).to_be_visible()

    args = json.dumps({"city": "Zürich", "days": 3, "units": "metric"}, ensure_ascii=False)
    gen.append(("delta", {"text": "Let me look that up."}),
               ("tool_call", {"index": 0, "id": "call_1", "name": "get_weather"}),
               ("tool_args", {"index": 0, "text": args[:9]}))
    first = calls.nth(0)
    expect(first.locator(".tool-name")).to_have_text("get_weather")
    expect(first.locator(".tool-args")).to_have_text(args[:9])
    gen.append(("tool_args", {"index": 0, "text": args[9:25]}))
    expect(first.locator(".tool-args")).to_have_text(args[:25])  # the arguments grow as they come
    _wait_saved(page, sid, gen.ids()[-1])

    # A reload in the middle of the call: everything is back from storage, then it goes on.
    page.reload()
    turn = _turn(page, sid)
    reasoning, calls = turn.locator(".reasoning"), turn.locator(".tool-call")
    expect(calls.nth(0).locator(".tool-args")).to_have_text(args[:25])
    expect(reasoning.locator(".reasoning-text")).to_have_text(thought)
    gen.append(("tool_args", {"index": 0, "text": args[25:]}),
               ("reasoning", {"text": " And the time."}),
               ("tool_call", {"index": 1, "id": "call_lost", "name": "get_date"}),
               ("tool_args", {"index": 1, "text": '{"tz": "Europe/Ber'}))
    expect(calls.nth(1).locator(".tool-args")).to_have_text('{"tz": "Europe/Ber')
    expect(reasoning.locator(".reasoning-text")).to_have_text(thought + " And the time.")
    _wait_saved(page, sid, gen.ids()[-1])

    # The page goes away; a failover loses the stream's last three events (the reasoning's end, the second call);
    # the generation goes on from what the stream has. The page comes back and resumes from the lost event: the
    # server says reset, and the page takes back the reasoning and the call it had, on screen and in storage.
    page.goto("about:blank")
    gen.lose_tail(gen.ids()[-3:])
    gen.append(("tool_call", {"index": 1, "id": "call_2", "name": "get_time"}),
               ("tool_args", {"index": 1, "text": '{"tz": "Europe/Zurich"}'}))
    gen.finish("tool_calls", completion_tokens=30)
    page.goto(f"{s.base_url}/")
    turn = _turn(page, sid)
    reasoning, calls = turn.locator(".reasoning"), turn.locator(".tool-call")
    _wait_status(page, sid, "done")
    expect(turn.locator(".status")).to_have_text("done (tool calls)")
    expect(calls).to_have_count(2)
    shown = [(c.locator(".tool-name").text_content(), c.locator(".tool-id").text_content(),
              c.locator(".tool-args").text_content()) for c in calls.all()]
    assert shown == [("get_weather", "call_1", args), ("get_time", "call_2", '{"tz": "Europe/Zurich"}')]
    assert _page_text(page, sid) == "Let me look that up."
    expect(reasoning.locator(".reasoning-text")).to_have_text(thought)
    saved = _saved(page, sid)
    assert saved["reasoning"] == thought and saved["text"] == "Let me look that up."
    assert [d["id"] for _, kind, d in saved["answer"]["log"] if kind == "tool_call"] == ["call_1", "call_2"]
    _screenshot(page, "tool-calls.png")


# Model output written by a prompt injection, and the Markdown the page must still render.
UNTRUSTED = """# Report
<img src=x onerror="window.__ran = 'img'">
<script>window.__ran = 'script'</script>
<iframe src="javascript:window.__ran='iframe'"></iframe>

Click [here](javascript:window.__ran='link'), [there](JAVASCRIPT:alert(1)), [b64](data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==), [vb](vbscript:msgbox), <javascript:alert(1)>, [rel](/v1/streams), [ent](&#106;avascript:alert(1)), [pct](%6Aavascript:alert(1)), ![beacon](https://example.org/b.png?q=secret).

| name | where |
|---|---|
| rsb | [docs](https://example.org/docs) |
| mail | <ops@example.org> |

> A quote with **bold** and `<code>`.

<a href="javascript:alert(1)">raw anchor</a> <svg onload="window.__ran='svg'"></svg> <b onmouseover="window.__ran='b'">hover</b>

[ok](http://example.org/a "title") and <https://example.org/b>.
"""
SAFE_HREFS = ["https://example.org/b.png?q=secret", "https://example.org/docs", "mailto:ops@example.org",
              "http://example.org/a", "https://example.org/b"]

# Every element, attribute and link the rendered answer holds, and whether any script ran.
_INSPECT = """(root) => ({
    tags: [...new Set([...root.querySelectorAll('*')].map((e) => e.tagName.toLowerCase()))].sort(),
    handlers: [...root.querySelectorAll('*')].flatMap((e) => [...e.attributes].map((a) => a.name))
        .filter((n) => n.startsWith('on') || n === 'src' || n === 'style'),
    hrefs: [...root.querySelectorAll('a')].map((a) => a.getAttribute('href')),
    targets: [...root.querySelectorAll('a')].map((a) => `${a.target} ${a.rel}`),
    ran: window.__ran ?? null,
})"""


def _check_untrusted(seen: dict[str, Any]) -> None:
    assert seen["ran"] is None
    assert set(seen["tags"]) <= {"a", "blockquote", "code", "h1", "p", "strong", "table", "tbody", "td", "th",
                                 "thead", "tr"}, seen["tags"]
    assert {"a", "table", "blockquote", "strong", "h1"} <= set(seen["tags"])
    assert seen["handlers"] == []
    assert seen["hrefs"] == SAFE_HREFS
    assert set(seen["targets"]) == {"_blank noopener noreferrer nofollow"}


@needs_chromium
def test_untrusted_markdown_runs_nothing_and_links_only_to_http_and_mailto(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
        new_page: PageFactory) -> None:
    """Raw HTML, script, event handlers, `javascript:` / `data:` / `vbscript:` / relative links and images in a
    model's answer: the page shows them as text, and renders the tables, quotes and http(s)/mailto links. First in
    the real page (its Content-Security-Policy on: a violation would be a console error, which fails the test),
    with the answer streamed in small pieces by the stand-in for the generator (tests/typed_streams.py); then the
    renderer alone on a page without that policy, where a control shows that such HTML would run."""
    s = stack_factory(redis_server.url)
    s.consumer()
    page = new_page()
    with s.client() as c:
        sid = create(c, prompt="Summarize this web page", max_tokens=64).json()["id"]
    gen = StandInGenerator(redis_server.url, sid)
    gen.start()
    page.goto(f"{s.base_url}/?stream={sid}")
    rng = random.Random(7)
    cuts = sorted(rng.sample(range(1, len(UNTRUSTED)), 60))
    gen.append(*[("delta", {"text": UNTRUSTED[a:b]})
                 for a, b in itertools.pairwise([0, *cuts, len(UNTRUSTED)])])
    gen.finish(completion_tokens=61)
    _wait_status(page, sid, "done")
    page.wait_for_timeout(300)  # time for anything that would run (an image's onerror) to run
    answer = _turn(page, sid).locator(".answer")
    _check_untrusted(cast(dict[str, Any], answer.locator(".blocks").evaluate(_INSPECT)))
    assert _page_text(page, sid) == UNTRUSTED
    _check_rendering(page, sid)
    expect(answer).to_contain_text("<script>window.__ran = 'script'</script>")  # shown, as text
    expect(answer.locator("table tr")).to_have_count(3)
    expect(answer.locator("blockquote code")).to_have_text("<code>")
    _screenshot(page, "untrusted.png")

    # The renderer on a page with no policy: what it makes would run here if it let anything through.
    bare = new_page()
    bare.goto(f"{s.base_url}/healthz")
    seen = bare.evaluate(
        """async ([text, cuts, inspect]) => {
            const md = await import('/static/markdown.js');
            const control = document.createElement('div');
            control.innerHTML = '<img src="data:," onerror="window.__control = 1">';
            document.body.append(control);
            const whole = document.createElement('div');
            whole.innerHTML = md.renderMarkdown(text);
            const blocks = document.createElement('div');
            const tail = document.createElement('span');
            const streamed = document.createElement('div');
            streamed.append(blocks, tail);
            document.body.append(whole, streamed);
            const inc = new md.IncrementalMarkdown(blocks, tail);
            for (const cut of cuts) inc.update(text.slice(0, cut));
            inc.update(text, true);
            await new Promise((r) => setTimeout(r, 300));
            return { whole: eval(inspect)(whole), streamed: eval(inspect)(blocks), control: window.__control ?? null,
                     same: blocks.innerHTML === whole.innerHTML };
        }""", [UNTRUSTED, cuts, _INSPECT])
    assert seen["control"] == 1  # such HTML does run on this page
    _check_untrusted(seen["whole"])
    _check_untrusted(seen["streamed"])
    assert seen["same"]


@needs_chromium
def test_snapshots_stored_before_the_answer_events_open_as_they_should(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
        new_page: PageFactory) -> None:
    """A page stored only the text of its answers before (no events: a reset could not be applied to it). A
    finished one still shows its stored text; an unfinished one is read again from the start, so that what it
    shows is the stream's text, not the old text plus what follows the old id. The streams are written by the
    stand-in for the generator (tests/typed_streams.py)."""
    s = stack_factory(redis_server.url)
    s.consumer()
    with s.client() as c:
        done_id, live_id = (create(c, prompt=p, max_tokens=16).json()["id"] for p in ("one", "two"))
    finished, running = StandInGenerator(redis_server.url, done_id), StandInGenerator(redis_server.url, live_id)
    finished.start()
    finished.append(("delta", {"text": "Stored text."}))
    finished.finish()
    running.start()
    running.append(("delta", {"text": "Half "}), ("delta", {"text": "an answer"}))
    page = new_page()
    page.goto(f"{s.base_url}/healthz")
    turns = [{"id": done_id, "prompt": "one", "body": None, "createdAt": None},
             {"id": live_id, "prompt": "two", "body": None, "createdAt": None}]
    page.evaluate(
        """([turns, done, live]) => {
            localStorage.setItem('rsb.chat.v1', JSON.stringify({ turns }));
            localStorage.setItem(`rsb.stream.v1.${turns[0].id}`, JSON.stringify(done));
            localStorage.setItem(`rsb.stream.v1.${turns[1].id}`, JSON.stringify(live));
        }""", [turns, {"text": "Stored text.", "lastEventId": finished.ids()[-1], "status": "done", "deltas": 1},
               {"text": "Half an old", "lastEventId": running.ids()[-1], "status": "running", "deltas": 2}])
    page.goto(f"{s.base_url}/")
    _wait_status(page, done_id, "done")
    assert _page_text(page, done_id) == "Stored text."
    running.append(("delta", {"text": " that ends."}))
    running.finish()
    _wait_status(page, live_id, "done")
    assert _page_text(page, live_id) == "Half an answer that ends."
    assert _saved(page, live_id)["text"] == "Half an answer that ends."


def _chat_id(page: Page) -> str:
    m = re.search(r"[?&]chat=([0-9a-f-]{36})", page.url)
    assert m, page.url
    return m.group(1)


def _engine_messages(redis_url: str, sid: str) -> list[dict[str, Any]]:
    """What the engine was given for a stream: its request as stored at create."""
    r = redis.Redis.from_url(redis_url)
    try:
        raw = r.hget(StreamKeys.of(uuid.UUID(sid), 1).meta, "req")
    finally:
        r.close()
    assert isinstance(raw, bytes)
    return list(orjson.loads(raw)["messages"])


@needs_chromium
def test_a_chat_opened_by_its_address_on_another_device_follows_and_continues_there(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path,
        new_page: PageFactory) -> None:
    """Two browser contexts are two devices: the chat's address (/?chat=<uuid>) opens it on the second one,
    which shows the running answer live and continues the chat; the first shows that turn after a reload; both
    sending at once make one turn and a notice on the other."""
    s = _slow_stack(stack_factory, redis_server.url, slow_model)
    phone, laptop = new_page(), new_page()
    phone.goto(f"{s.base_url}/")
    chat = _chat_id(phone)  # the page names its chat in its address
    first = _send(phone, "Tell me a story", LONG_ANSWER)
    _wait_deltas(phone, first, 50)

    # The other device opens the address mid-answer: the question, and the answer followed live.
    laptop.goto(f"{s.base_url}/?chat={chat}")
    expect(_turn(laptop, first).locator(".user")).to_have_text("Tell me a story")
    _wait_status(phone, first, "done")
    _wait_status(laptop, first, "done")
    with s.client() as c:
        story = read_sse(c, f"/v1/streams/{first}/events").text
    assert _page_text(laptop, first) == _page_text(phone, first) == story

    # It continues the chat there: only the new message is sent, the engine gets the whole history.
    sent: list[Any] = []
    laptop.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/streams") else None)
    second = _send(laptop, "And then?", 40)
    _wait_status(laptop, second, "done")
    assert sent[0]["conversation"] == chat and sent[0]["messages"] == [{"role": "user", "content": "And then?"}]
    assert _engine_messages(s.redis_url, second) == [
        {"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": story},
        {"role": "user", "content": "And then?"}]

    # The first device, reloaded, shows the turn made on the other (the conversation's copy of its answer).
    phone.reload()
    _wait_status(phone, second, "done")
    expect(phone.locator(".turn")).to_have_count(2)
    assert [t.get_attribute("data-stream-id") for t in phone.locator(".turn").all()] == [first, second]
    with s.client() as c:
        assert _page_text(phone, second) == read_sse(c, f"/v1/streams/{second}/events").text

    # Both send at once: one turn; the other page says so, and shows and follows that turn.
    for page, text in ((phone, "phone, at once"), (laptop, "laptop, at once")):
        page.click("#settings > summary")
        page.fill("#max-tokens", "300")
        page.click("#settings > summary")
        page.fill("#prompt", text)
    phone.evaluate("() => document.querySelector('#send').click()")
    laptop.evaluate("() => document.querySelector('#send').click()")
    with s.client() as c:

        def a_third_turn() -> str | None:
            turns = c.get(f"/v1/conversations/{chat}/turns").json()["turns"]
            return None if turns[-1]["id"] == second else str(turns[-1]["id"])

        third = eventually(a_third_turn, 30, "a third turn")
    for page in (phone, laptop):  # the loser's own turn is gone, the winner's shown in its place
        page.wait_for_function("(sid) => [...document.querySelectorAll('.turn')].map((t) => t.dataset.streamId)"
                               ".join(',').endsWith(sid) && document.querySelectorAll('.turn').length === 3",
                               arg=third, timeout=30_000)
    notices = [page.locator("#notice") for page in (phone, laptop)]
    shown = [n for n in notices if n.is_visible()]
    assert len(shown) == 1 and "Another device is answering" in (shown[0].text_content() or "")
    _wait_status(phone, third, "done")
    _wait_status(laptop, third, "done")
    # The browser logs the refused create (409) of the page that lost: expected, once, there only.
    refused = [[e for e in cast(Any, page).errors if "status of 409" in e and e.endswith("/v1/streams")]
               for page in (phone, laptop)]
    assert sorted(len(r) for r in refused) == [0, 1]
    for page in (phone, laptop):
        cast(Any, page).errors[:] = [e for e in cast(Any, page).errors if not e.endswith("/v1/streams")]
    with s.client() as c:
        turns = c.get(f"/v1/conversations/{chat}/turns").json()["turns"]
    assert [t["id"] for t in turns] == [first, second, third]
    _screenshot(laptop, "second-device.png")


@needs_chromium
def test_the_usage_panel_shows_the_keys_answers_of_the_last_days(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path,
        new_page: PageFactory) -> None:
    """Issue 32: the page's Usage panel is this key's GET /v1/reports/usage by day, priced with --prices."""
    s = stack_factory(redis_server.url)
    prices = tmp_path / "prices.json"
    s.generator()
    names = eventually(lambda: cast("list[bytes]", redis_client.zrange(served_models_key(), 0, -1)), 30,
                       "the generator announcing its model")
    prices.write_bytes(orjson.dumps({n.decode(): {"input_per_mtok": 1000.0, "output_per_mtok": 2000.0}
                                     for n in names}))
    s.consumer("--prices", str(prices))
    with s.client() as c:
        usages = []
        for n in (3, 5):
            sid = create(c, max_tokens=n).json()["id"]
            usages.append(wait_status(c, sid, {"done"})["usage"])
    page = new_page()
    page.goto(f"{s.base_url}/")
    page.click("#usage > summary")
    today = time.strftime("%Y-%m-%d", time.gmtime())
    row = page.locator("#usage-table tbody tr").first
    expect(row).to_contain_text(today)
    cells = row.locator("td").all_inner_texts()
    prompt = sum(u["prompt_tokens"] for u in usages)
    assert cells[:4] == [today, "2", str(prompt), "8"], cells
    assert float(cells[4]) == pytest.approx((prompt * 1000 + 8 * 2000) / 1e6, abs=1e-4)
    expect(page.locator("#usage-table tbody tr").last).to_contain_text("total")


def _one_line_header(page: Page) -> dict[str, Any]:
    """The header's layout: whether it overflows, and how far apart vertically its visible items are."""
    return cast(dict[str, Any], page.evaluate(
        """() => {
            const bar = document.querySelector('.bar');
            const items = [...bar.querySelectorAll('.brand > *, .bar-right > *')].filter((el) => {
                const r = el.getBoundingClientRect();
                return r.width > 0 && r.height > 0;
            });
            const tops = items.map((el) => el.getBoundingClientRect().top);
            return { overflow: bar.scrollWidth - bar.clientWidth, spread: Math.max(...tops) - Math.min(...tops),
                     height: bar.getBoundingClientRect().height, items: items.length,
                     right: Math.max(...items.map((el) => el.getBoundingClientRect().right)),
                     width: document.documentElement.clientWidth };
        }"""))


@needs_chromium
def test_the_model_picker_the_tier_where_a_key_may_choose_and_a_header_that_fits_a_phone(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path,
        tmp_path: Path, browser: Browser) -> None:
    """Two served models: the header's picker lists both (GET /v1/models) with the default chosen, and a send runs
    on the one picked; a key whose service_tiers offer a choice gets a tier picker in Settings (another key does
    not); on a 390 px wide phone the header stays on one line, nothing past the screen's edge."""
    from consumer.edge.auth import new_key

    choosy, choosy_entry = new_key("choosy")
    plain, plain_entry = new_key("plain")
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [{**choosy_entry, "service_tiers": ["default", "priority"]}, plain_entry]}))
    s = stack_factory(redis_server.url)
    s.generator("--model-name", "alpha")
    s.generator("--model-name", "beta", model=slow_model)
    s.consumer("--api-keys", str(keys), "--default-model", "alpha", test_default=False)
    eventually(lambda: len(cast("list[bytes]", redis_client.zrange(served_models_key(), 0, -1))) == 2, 30,
               "both generators announcing their models")
    errors: list[str] = []
    for width, height in ((390, 844), (1000, 760)):
        ctx = browser.new_context(viewport={"width": width, "height": height}, is_mobile=width < 500,
                                  has_touch=width < 500)
        ctx.set_default_timeout(60_000)
        try:
            page = ctx.new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.add_init_script(  # the key, as the Settings panel keeps it (once: a reload keeps what is there)
                f"if (!localStorage.getItem('rsb.settings.v1')) localStorage.setItem('rsb.settings.v1', "
                f"JSON.stringify({{apiKey: {json.dumps(choosy)}}}))")
            page.goto(f"{s.base_url}/")
            picker = page.locator("#model")
            expect(picker).to_be_visible()
            expect(picker.locator("option")).to_have_count(2)
            assert sorted(picker.locator("option").all_inner_texts()) == ["alpha", "beta"]
            assert picker.input_value() == "alpha"  # the server's default
            layout = _one_line_header(page)
            assert layout["overflow"] <= 0 and layout["right"] <= layout["width"], layout
            assert layout["spread"] < 12 and layout["height"] < 64, layout  # one row of items
            _screenshot(page, f"header-{width}.png")
            if width > 500:
                continue
            # The tier picker: this key may choose.
            page.click("#settings > summary")
            expect(page.locator("#tier-choice")).to_be_visible()
            assert page.locator("#service-tier option").all_inner_texts()[1:] == ["priority", "default"]
            page.select_option("#service-tier", "priority")
            page.fill("#max-tokens", "4")
            page.click("#settings > summary")
            picker.select_option("beta")
            page.fill("#prompt", "Which model are you?")
            before = page.locator(".turn").count()
            page.click("#send")
            sid = page.locator(".turn").nth(before).get_attribute("data-stream-id")
            assert sid
            _wait_status(page, sid, "done")
            with s.client() as c:
                started = read_sse(c, f"/v1/streams/{sid}/events",
                                   headers={"Authorization": f"Bearer {choosy}"}).events[1]
            assert started.event == "started" and started.data == {"model": "beta", "service_tier": "priority"}
            page.reload()  # the choice is kept
            expect(page.locator("#model")).to_have_value("beta")
            assert _one_line_header(page)["spread"] < 12
            # A key with no choice of tier gets no tier picker.
            page.evaluate(f"localStorage.setItem('rsb.settings.v1', JSON.stringify({{apiKey: {json.dumps(plain)}}}))")
            page.reload()
            expect(page.locator("#model option")).to_have_count(2)
            page.click("#settings > summary")
            expect(page.locator("#tier-choice")).to_be_hidden()
        finally:
            ctx.close()
    assert not errors, errors
