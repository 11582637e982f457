"""The chat page at ``/`` in a real browser: Debian's chromium driven by Playwright, against real
redis-server, `rsb generator` and `rsb consumer` processes. What the page shows is compared with what the
stream holds, read over HTTP with the strict SSE parser of tests/helpers.py.

Playwright never downloads a browser here: it launches the system chromium (``RSB_CHROMIUM`` or
``chromium`` on PATH). Screenshots land in ``artifacts/web/`` at the repository root."""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from helpers import assert_english, create, read_sse, wait_status
from servers import CHROMIUM, Stack, StackFactory, needs_chromium

from broker.redis.server import RedisServer
from generator.engines.default_model import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts" / "web"

if CHROMIUM is not None:
    from playwright.sync_api import Browser, Locator, Page, expect
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

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


@needs_chromium
def test_markdown_renders_the_subset_and_escapes_html(stack_factory: StackFactory, redis_server: RedisServer, new_page: PageFactory) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    page = new_page()
    page.goto(f"{s.base_url}/healthz")
    text = ("# Title\nSome **bold**, *italic* and `a<b>&c` here.\n2 * 3 * 4 stays.\n\n"
            "- one\n- two <img src=x onerror=alert(1)>\n\n1. first\n2. second\n\n"
            "```py\nif a < b:\n\n    print('x')\n```\nafter <script>alert(1)</script>\n\nunfinished *tail")
    out = page.evaluate(
        """async ([text, cuts]) => {
            const md = await import('/static/markdown.js');
            const blocks = document.createElement('div');
            const tail = document.createElement('span');
            const inc = new md.IncrementalMarkdown(blocks, tail);
            const tails = [];
            for (const cut of [...cuts, text.length]) {
                inc.update(text.slice(0, cut));
                tails.push(tail.textContent);
            }
            const streamed = blocks.innerHTML;
            inc.update(text, true);
            const t = document.createElement('template');
            t.innerHTML = md.renderMarkdown(text);
            return { streamed, final: blocks.innerHTML, whole: t.innerHTML, tails,
                     tailAfter: tail.textContent };
        }""", [text, sorted(random.Random(1).sample(range(1, len(text)), 40))])
    whole = out["whole"]
    assert out["final"] == whole
    assert whole.startswith("<h1>Title</h1><p>Some <strong>bold</strong>, <em>italic</em> and "
                            "<code>a&lt;b&gt;&amp;c</code> here.<br>2 * 3 * 4 stays.</p>")
    assert "<ul><li>one</li><li>two &lt;img src=x onerror=alert(1)&gt;</li></ul>" in whole
    assert "<ol><li>first</li><li>second</li></ol>" in whole
    assert '<pre><code class="language-py">if a &lt; b:\n\n    print(\'x\')</code></pre>' in whole
    assert "<p>after &lt;script&gt;alert(1)&lt;/script&gt;</p>" in whole
    assert whole.endswith("<p>unfinished *tail</p>")
    assert "<img" not in whole and "<script" not in whole
    # While streaming, the last unfinished paragraph is plain text, never half-parsed Markdown.
    assert out["tails"][-1] == "unfinished *tail" and out["tailAfter"] == ""
    assert out["streamed"] + "<p>unfinished *tail</p>" == whole


def test_the_page_and_client_module_are_served(stack_factory: StackFactory, redis_server: RedisServer) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    with s.client() as c:
        page = c.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert '<script type="module" src="/static/app.js">' in page.text
        for asset, kind in [("rsb-client.js", "text/javascript"), ("app.js", "text/javascript"),
                            ("markdown.js", "text/javascript"), ("style.css", "text/css")]:
            r = c.get(f"/static/{asset}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind), asset
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
        assert server.events[1].event == "started" and server.events[1].data == {"model": DEFAULT_MODEL_NAME}
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
    assert re.search(r"<ol>(<li>[^<]+</li>){3}</ol>", listing), listing
    assert '<pre><code class="language-python">def ' in code and "[::-1]" in code, code
    assert "<code>" in code  # prose after the block quotes code inline
