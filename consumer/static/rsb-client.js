// rsb-client.js: a dependency-free ES module client for the rsb stream API (see the contract).
//
//   import { createStream, RsbStream } from "/static/rsb-client.js";
//   const { id } = await createStream({ prompt: "Hello", max_tokens: 64 });
//   const stream = new RsbStream(id, { onEvent: (e) => console.log(e.type, e.data) });
//   await stream.done;        // resolves after the terminal event (done, cancelled or error)
//   await stream.cancel();    // or stop it: aborts the read, POSTs /cancel, reads on to `cancelled`
//
//   const answer = new Answer(); // what the events add up to, `reset`s applied:
//   new RsbStream(id, { onEvent: (e) => answer.feed(e) });
//   answer.text; answer.reasoning; answer.toolCalls; answer.parsed  // (see Answer below)
//
// Reading uses fetch + ReadableStream + TextDecoder({stream: true}) and its own SSE parser rather than
// EventSource: it can send Authorization, it stops on a terminal event instead of reconnecting forever,
// and it owns the reconnect policy (exponential backoff with jitter, resuming from the last event id).

import { PartialJSON } from "./partial-json.js";

export { PartialJSON };

export const TERMINAL_EVENTS = new Set(["done", "cancelled", "error"]);

export class RsbError extends Error {
  constructor(status, code, message, retryAfterS = null) {
    super(message || code || `HTTP ${status}`);
    this.name = "RsbError";
    this.status = status;
    this.code = code;
    this.retryAfterS = retryAfterS;
  }
}

export function uuid4() {
  if (globalThis.crypto?.randomUUID) return crypto.randomUUID();
  // randomUUID needs a secure context (https or localhost); getRandomValues does not.
  const b = crypto.getRandomValues(new Uint8Array(16));
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  const h = [...b].map((x) => x.toString(16).padStart(2, "0")).join("");
  return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
}

// ---------------------------------------------------------------------------------------------------
// SSE parsing (the WHATWG "event stream interpretation"), fed decoded text in arbitrary pieces.

export class SSEParser {
  // onEvent({id, type, data}) per dispatched event; onRetry(ms) per valid retry line; onComment(text).
  constructor({ onEvent, onRetry = () => {}, onComment = () => {} }) {
    this.onEvent = onEvent;
    this.onRetry = onRetry;
    this.onComment = onComment;
    this.buffer = "";
    this.skipLF = false; // the last piece ended in "\r": a "\n" starting the next one is the same line end
    this.resetEvent();
    this.lastEventId = "";
  }

  resetEvent() {
    this.type = "";
    this.data = [];
    this.sawData = false;
  }

  // Feeds a piece of decoded text; complete lines are processed, a partial line waits for the rest.
  push(text) {
    if (this.skipLF && text.startsWith("\n")) text = text.slice(1);
    this.skipLF = false;
    this.buffer += text;
    let start = 0;
    const buf = this.buffer;
    for (;;) {
      const cr = buf.indexOf("\r", start);
      const lf = buf.indexOf("\n", start);
      if (cr < 0 && lf < 0) break;
      let end;
      let next;
      if (cr >= 0 && (lf < 0 || cr < lf)) {
        end = cr;
        if (cr + 1 === buf.length) {
          this.skipLF = true; // CRLF may be split across pieces
          next = cr + 1;
        } else {
          next = buf[cr + 1] === "\n" ? cr + 2 : cr + 1;
        }
      } else {
        end = lf;
        next = lf + 1;
      }
      this.line(buf.slice(start, end));
      start = next;
    }
    this.buffer = buf.slice(start);
  }

  // The stream ended: an event without its closing blank line is discarded, as the spec says.
  end() {
    this.buffer = "";
    this.resetEvent();
  }

  line(line) {
    if (line === "") {
      if (this.sawData) {
        this.onEvent({ id: this.lastEventId || null, type: this.type || "message", data: this.data.join("\n") });
      }
      this.resetEvent();
      return;
    }
    if (line[0] === ":") {
      this.onComment(line.slice(1).replace(/^ /, ""));
      return;
    }
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value[0] === " ") value = value.slice(1);
    if (field === "data") {
      this.data.push(value);
      this.sawData = true;
    } else if (field === "event") {
      this.type = value;
    } else if (field === "id") {
      if (!value.includes("\0")) this.lastEventId = value;
    } else if (field === "retry") {
      if (/^\d+$/.test(value)) this.onRetry(Number(value));
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// HTTP helpers

function joinUrl(baseUrl, path) {
  return (baseUrl || "").replace(/\/+$/, "") + path;
}

function authHeaders(apiKey) {
  return apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
}

async function errorFrom(response) {
  let code = `http_${response.status}`;
  let message = response.statusText;
  try {
    const body = await response.json();
    code = body?.error?.code ?? code;
    message = body?.error?.message ?? message;
  } catch {
    // Not our JSON error (a proxy's page): keep the status.
  }
  const ra = Number(response.headers.get("Retry-After"));
  return new RsbError(response.status, code, message, Number.isFinite(ra) && ra > 0 ? ra : null);
}

// Full jitter on an exponential schedule: reconnecting clients spread out instead of stampeding a pod
// that just came back. A server Retry-After is a floor.
export function backoffDelay(attempt, { initialMs = 500, maxMs = 15000, retryAfterS = null, random = Math.random } = {}) {
  const cap = Math.min(maxMs, initialMs * 2 ** Math.min(attempt, 20));
  const delay = cap / 2 + random() * (cap / 2);
  return retryAfterS ? Math.max(delay, retryAfterS * 1000) : delay;
}

function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason ?? new DOMException("aborted", "AbortError"));
    const done = () => {
      clearTimeout(timer);
      globalThis.removeEventListener?.("online", done);
      signal?.removeEventListener("abort", aborted);
      resolve();
    };
    const aborted = () => {
      clearTimeout(timer);
      globalThis.removeEventListener?.("online", done);
      reject(signal.reason ?? new DOMException("aborted", "AbortError"));
    };
    const timer = setTimeout(done, ms);
    // Coming back online is the best moment to retry: no point waiting out the backoff.
    globalThis.addEventListener?.("online", done, { once: true });
    signal?.addEventListener("abort", aborted, { once: true });
  });
}

const RETRYABLE_STATUS = new Set([408, 425, 429, 500, 502, 503, 504]);

function isAbort(err) {
  return err?.name === "AbortError";
}

// ---------------------------------------------------------------------------------------------------
// Create

// POST /v1/streams. The id is chosen here (or taken from body.id) before the first attempt, so every
// retry after a network error, a 429 or a 503 is the same request: the server answers 200 created:false
// for one that already got through, and never starts a second generation.
export async function createStream(body, { baseUrl = "", apiKey = null, signal = null, maxAttempts = 6,
  initialMs = 500, maxMs = 8000, fetch: fetchFn = globalThis.fetch.bind(globalThis) } = {}) {
  const request = { ...body, id: body.id ?? uuid4() };
  const payload = JSON.stringify(request);
  for (let attempt = 0; ; attempt++) {
    let err;
    try {
      const r = await fetchFn(joinUrl(baseUrl, "/v1/streams"), {
        method: "POST",
        headers: { "Content-Type": "application/json", ...authHeaders(apiKey) },
        body: payload,
        signal,
      });
      if (r.status === 200 || r.status === 201) return await r.json();
      err = await errorFrom(r);
      if (!RETRYABLE_STATUS.has(r.status)) throw err;
    } catch (e) {
      if (isAbort(e) || e instanceof RsbError && !RETRYABLE_STATUS.has(e.status)) throw e;
      err = e;
    }
    if (attempt + 1 >= maxAttempts) throw err;
    await sleep(backoffDelay(attempt, { initialMs, maxMs, retryAfterS: err.retryAfterS }), signal);
  }
}

export async function cancelStream(id, { baseUrl = "", apiKey = null, maxAttempts = 4,
  fetch: fetchFn = globalThis.fetch.bind(globalThis) } = {}) {
  for (let attempt = 0; ; attempt++) {
    let err;
    try {
      const r = await fetchFn(joinUrl(baseUrl, `/v1/streams/${encodeURIComponent(id)}/cancel`), {
        method: "POST",
        headers: authHeaders(apiKey),
        // A Stop clicked just before closing the tab should still reach the server.
        keepalive: true,
      });
      if (r.status === 202 || r.status === 200) return await r.json();
      err = await errorFrom(r);
      if (!RETRYABLE_STATUS.has(r.status)) throw err;
    } catch (e) {
      if (e instanceof RsbError && !RETRYABLE_STATUS.has(e.status)) throw e;
      err = e;
    }
    if (attempt + 1 >= maxAttempts) throw err;
    await sleep(backoffDelay(attempt, { retryAfterS: err.retryAfterS }));
  }
}

export async function streamStatus(id, { baseUrl = "", apiKey = null, fetch: fetchFn = globalThis.fetch.bind(globalThis) } = {}) {
  const r = await fetchFn(joinUrl(baseUrl, `/v1/streams/${encodeURIComponent(id)}`), { headers: authHeaders(apiKey) });
  if (r.status !== 200) throw await errorFrom(r);
  return await r.json();
}

// The names of the models the server's generators serve (GET /v1/models), the most recently seen first (not the
// aliases they answer to: an entry whose root is another model); empty while no generator has loaded its model.
export async function listModels(options = {}) {
  return (await modelCatalog(options)).models;
}

// What GET /v1/models says a page may pick: {models (as listModels), defaultModel (what a create naming none runs on;
// null: name one), serviceTiers (the tiers this API key may choose between; empty: no choice)}.
export async function modelCatalog({ baseUrl = "", apiKey = null, fetch: fetchFn = globalThis.fetch.bind(globalThis) } = {}) {
  const r = await fetchFn(joinUrl(baseUrl, "/v1/models"), { headers: authHeaders(apiKey) });
  if (r.status !== 200) throw await errorFrom(r);
  const body = await r.json();
  return {
    models: (body.data || []).filter((m) => !m.root || m.root === m.id).map((m) => m.id),
    defaultModel: body.default_model ?? null,
    serviceTiers: body.service_tiers || [],
  };
}

// The usage report (GET /v1/reports/usage): {group_by, rows: [{<group fields>, streams, prompt_tokens,
// cached_tokens, completion_tokens, wasted_tokens, compute_s, cost_usd?}], total}. `since`: Unix seconds.
export async function usageReport({ baseUrl = "", apiKey = null, groupBy = "day", since = null,
  fetch: fetchFn = globalThis.fetch.bind(globalThis) } = {}) {
  const q = new URLSearchParams({ group_by: groupBy });
  if (since !== null) q.set("since", String(since));
  const r = await fetchFn(joinUrl(baseUrl, `/v1/reports/usage?${q}`), { headers: authHeaders(apiKey) });
  if (r.status !== 200) throw await errorFrom(r);
  return await r.json();
}

// A conversation's history (GET /v1/conversations/{id}/turns): {id, created_at, turns: [{id, status, messages,
// output, finish_reason, usage, model, error?, events_url}]}, every finished turn, then a running one (its
// output null); null when the caller has no conversation of this id (yet).
export async function conversationTurns(id, { baseUrl = "", apiKey = null,
  fetch: fetchFn = globalThis.fetch.bind(globalThis) } = {}) {
  const r = await fetchFn(joinUrl(baseUrl, `/v1/conversations/${encodeURIComponent(id)}/turns`),
    { headers: authHeaders(apiKey) });
  if (r.status === 404) return null;
  if (r.status !== 200) throw await errorFrom(r);
  return await r.json();
}

// ---------------------------------------------------------------------------------------------------
// Read: replay, tail, resume

// One stream's events, from `lastEventId` (exclusive; null = from the start) to the terminal event.
//   onEvent({id, type, data})  data parsed from JSON; called in order, each event exactly once
//   onState(state, info)       "connecting" | "open" | "retrying" {delayMs, error} | "ended" {reason} |
//                              "failed" {error}
// `done` is a promise of the terminal event (or {type: "ended"} after a 204), rejected on a fatal error.
export class RsbStream {
  constructor(id, { baseUrl = "", apiKey = null, lastEventId = null, onEvent = () => {}, onState = () => {},
    initialMs = 500, maxMs = 15000, idleTimeoutMs = 45000, autoStart = true,
    fetch: fetchFn = globalThis.fetch.bind(globalThis) } = {}) {
    this.id = id;
    this.baseUrl = baseUrl;
    this.apiKey = apiKey;
    this.lastEventId = lastEventId || null;
    this.onEvent = onEvent;
    this.onState = onState;
    this.initialMs = initialMs;
    this.maxMs = maxMs;
    // Three missed heartbeats at the default --heartbeat-s: the connection is dead even if TCP says not.
    this.idleTimeoutMs = idleTimeoutMs;
    this.fetch = fetchFn;
    this.retryMs = null; // from the server's `retry:` lines
    this.terminal = null;
    this.closed = false;
    this.controller = null; // the current connection's
    this.lifetime = new AbortController(); // the whole reader's: close() also ends a backoff wait
    this.pendingCancel = null;
    this.attempts = 0; // consecutive failed connections
    this.done = new Promise((resolve, reject) => {
      this.resolveDone = resolve;
      this.rejectDone = reject;
    });
    this.done.catch(() => {}); // a caller that never awaits `done` must not get an unhandled rejection
    this.running = null;
    if (autoStart) this.start();
  }

  start() {
    if (!this.running) this.running = this.loop();
    return this.done;
  }

  // Stops reading (the generation goes on: another tab or a later visit can read it).
  close() {
    this.closed = true;
    this.lifetime.abort();
    this.controller?.abort();
  }

  // Stop: aborts the read at once, asks the server to cancel, then reads on from the last event id to
  // the terminal event, so the tokens generated before the cancel landed and the `cancelled` event
  // (with its usage) are still shown, exactly once.
  async cancel() {
    const posted = cancelStream(this.id, { baseUrl: this.baseUrl, apiKey: this.apiKey, fetch: this.fetch });
    // The read loop waits for this before reconnecting (no backoff: the abort was no network failure).
    this.pendingCancel = posted;
    this.controller?.abort();
    return await posted;
  }

  async loop() {
    while (!this.closed && !this.terminal) {
      let retryAfterS = null;
      let error = null;
      this.controller = new AbortController();
      try {
        await this.connect(this.controller.signal);
        if (this.terminal) return;
        error = new Error("the connection closed before the stream's terminal event");
      } catch (e) {
        if (this.closed) break;
        if (e instanceof RsbError && !RETRYABLE_STATUS.has(e.status)) {
          this.onState("failed", { error: e });
          this.rejectDone(e);
          return;
        }
        if (e instanceof RsbError) retryAfterS = e.retryAfterS;
        error = e;
      }
      const cancelling = this.pendingCancel;
      if (cancelling) {
        this.pendingCancel = null;
        await cancelling.catch(() => {}); // a failed cancel is the caller's to report; reading goes on
        this.attempts = 0;
        continue;
      }
      const delayMs = backoffDelay(this.attempts++, {
        initialMs: this.retryMs ?? this.initialMs, maxMs: this.maxMs, retryAfterS,
      });
      this.onState("retrying", { delayMs, error, attempt: this.attempts });
      try {
        await sleep(delayMs, this.lifetime.signal);
      } catch {
        break; // closed while waiting
      }
    }
    if (!this.terminal) {
      this.onState("ended", { reason: "closed" });
      this.resolveDone({ type: "closed" });
    }
  }

  // One connection, until its body ends or the terminal event; throws on network and HTTP errors.
  async connect(signal) {
    this.onState("connecting", { lastEventId: this.lastEventId, attempt: this.attempts });
    const headers = { Accept: "text/event-stream", ...authHeaders(this.apiKey) };
    if (this.lastEventId) headers["Last-Event-ID"] = this.lastEventId;
    const url = joinUrl(this.baseUrl, `/v1/streams/${encodeURIComponent(this.id)}/events`);
    let idleTimer = null;
    const armIdle = () => {
      clearTimeout(idleTimer);
      if (this.idleTimeoutMs > 0) idleTimer = setTimeout(() => this.controller?.abort(), this.idleTimeoutMs);
    };
    armIdle();
    try {
      const r = await this.fetch(url, { headers, signal, cache: "no-store" });
      if (r.status === 204) {
        // Our last event was the terminal one (a reload after the end): nothing more will ever come.
        this.onState("ended", { reason: "complete" });
        this.terminal = { type: "ended" };
        this.resolveDone(this.terminal);
        return;
      }
      if (r.status !== 200) throw await errorFrom(r);
      this.onState("open", { resumedFrom: this.lastEventId });
      const reader = r.body.getReader();
      const decoder = new TextDecoder("utf-8"); // one per connection: a new response starts clean
      const parser = new SSEParser({
        onEvent: (raw) => this.dispatch(raw),
        onRetry: (ms) => {
          this.retryMs = ms;
        },
      });
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        armIdle();
        // stream: true keeps a multi-byte character split across reads for the next read.
        parser.push(decoder.decode(value, { stream: true }));
        if (this.terminal) {
          reader.cancel().catch(() => {});
          break;
        }
      }
      parser.push(decoder.decode());
      parser.end();
    } finally {
      clearTimeout(idleTimer);
    }
  }

  dispatch(raw) {
    if (this.terminal || this.closed) return;
    let data;
    try {
      data = JSON.parse(raw.data);
    } catch {
      data = raw.data;
    }
    const event = { id: raw.id, type: raw.type, data };
    if (raw.id) this.lastEventId = raw.id;
    this.attempts = 0; // the connection works: the next failure starts the backoff afresh
    if (TERMINAL_EVENTS.has(event.type)) this.terminal = event;
    try {
      this.onEvent(event);
    } catch (e) {
      // A bug in a handler must not break the read: the event counts as delivered either way.
      console.error("rsb: onEvent handler failed", e);
    }
    if (this.terminal) {
      this.onState("ended", { reason: event.type });
      this.resolveDone(event);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// What a stream's events add up to

// The event types an answer is made of: the others (queued, started, progress, terminal) say how it goes.
const ANSWER_EVENTS = new Set(["delta", "reasoning", "tool_call", "tool_args"]);

// Event ids are "<ms>-<seq>"; a reset names one this server issued, so ordering ids is safe here (they stay
// opaque otherwise).
function idAfter(a, b) {
  const [am, as = 0] = String(a).split("-").map(Number);
  const [bm, bs = 0] = String(b).split("-").map(Number);
  return am > bm || (am === bm && as > bs);
}

// A JSON text that grows (a tool call's arguments, a structured answer) and its partial value, parsed only
// as far as it was read: each character once however often `parsed` is read.
class GrowingJSON {
  constructor() {
    this.text = "";
    this.parser = null; // made on the first read of `parsed`: plain text is never parsed
    this.unfed = []; // pieces appended since the parser last read (slicing `text` would copy all of it)
  }

  append(piece) {
    this.text += piece;
    if (this.parser) this.unfed.push(piece);
  }

  // The partial value (undefined before it begins); throws a SyntaxError when the text is not JSON.
  parsed(ended) {
    if (!this.parser) {
      this.parser = new PartialJSON();
      this.unfed = [this.text];
    }
    for (const piece of this.unfed) this.parser.feed(piece);
    this.unfed = [];
    if (ended && !this.parser.final) this.parser.end();
    return this.parser.value;
  }
}

export class ToolCall {
  constructor(answer, index, id = "", name = "") {
    this.answer = answer;
    this.index = index;
    this.id = id;
    this.name = name;
    this.args = new GrowingJSON();
  }

  // The arguments as the model wrote them so far: JSON text, complete once the stream ends.
  get arguments() {
    return this.args.text;
  }

  // The arguments parsed so far (strings grow, objects appear as they open; see partial-json.js).
  get parsedArguments() {
    return this.args.parsed(this.answer.ended);
  }

  toJSON() {
    return { index: this.index, id: this.id, name: this.name, arguments: this.arguments };
  }
}

// A stream's answer as its events come: the text (`delta`), the reasoning, the tool calls, and `reset`
// applied to all of them: a reset (a Redis failover lost events this reader had, docs/protocol.md) drops what
// came after the event it names, and what follows continues from there. `toJSON()` is what a page stores to
// resume later (new Answer(saved.log) rebuilds it): the answer's events, so that a reset after a reload
// still knows what to take back.
export class Answer {
  constructor(log = []) {
    this.log = [];
    this.ended = false;
    this.clear();
    for (const [id, type, data] of log) this.feed({ id, type, data });
  }

  clear() {
    this.body = new GrowingJSON(); // the text, and its partial value when it is JSON
    this.reasoning = "";
    this.calls = new Map(); // index -> ToolCall
    this.deltas = 0;
  }

  get text() {
    return this.body.text;
  }

  // The tool calls by index: {index, id, name, arguments, parsedArguments}.
  get toolCalls() {
    return [...this.calls.values()].sort((a, b) => a.index - b.index);
  }

  // The text parsed as JSON so far (a structured answer, response_format json_schema): undefined before it
  // begins; throws a SyntaxError when the text is not JSON.
  get parsed() {
    return this.body.parsed(this.ended);
  }

  // Applies one event; true when the answer changed. A `snapshot` (a read with ?from=latest) replaces the answer
  // with the one it holds, kept as the events it stands for (each with its id: a reset after it still applies).
  feed(event) {
    const { id, type, data } = event;
    if (type === "snapshot") {
      this.log = [];
      this.clear();
      this.feed({ id, type: "reasoning", data: { text: data?.reasoning ?? "" } });
      this.feed({ id, type: "delta", data: { text: data?.text ?? "" } });
      for (const c of data?.tool_calls ?? []) {
        this.feed({ id, type: "tool_call", data: { index: c.index, id: c.id, name: c.name } });
        this.feed({ id, type: "tool_args", data: { index: c.index, text: c.arguments } });
      }
      return true;
    }
    if (type === "reset") {
      let keep = this.log.length;
      while (keep > 0 && idAfter(this.log[keep - 1][0], id)) keep--;
      if (keep === this.log.length) return false;
      const kept = this.log.slice(0, keep);
      this.log = [];
      this.clear();
      for (const [eid, etype, edata] of kept) this.feed({ id: eid, type: etype, data: edata });
      return true;
    }
    if (TERMINAL_EVENTS.has(type)) {
      this.ended = true;
      return false;
    }
    if (!ANSWER_EVENTS.has(type) || !data || typeof data !== "object") return false;
    this.log.push([id, type, data]);
    if (type === "delta") {
      this.body.append(data.text ?? "");
      this.deltas += 1;
    } else if (type === "reasoning") {
      this.reasoning += data.text ?? "";
    } else {
      const index = Number(data.index ?? 0);
      let call = this.calls.get(index);
      if (!call) this.calls.set(index, (call = new ToolCall(this, index)));
      if (type === "tool_call") {
        call.id = data.id ?? call.id;
        call.name = data.name ?? call.name;
      } else {
        call.args.append(data.text ?? "");
      }
    }
    return true;
  }

  toJSON() {
    return { log: this.log };
  }
}

// A finished turn's answer as a conversation keeps it ({text, reasoning, tool_calls} in OpenAI's shape) as an
// Answer, the same as reading its stream would give (the stream itself may have passed its retention).
export function answerOf(output) {
  const log = [];
  let n = 0;
  const add = (type, data) => log.push([`0-${++n}`, type, data]);
  if (output?.reasoning) add("reasoning", { text: output.reasoning });
  if (output?.text) add("delta", { text: output.text });
  (output?.tool_calls || []).forEach((c, index) => {
    add("tool_call", { index, id: c.id, name: c.function?.name ?? "" });
    add("tool_args", { index, text: c.function?.arguments ?? "" });
  });
  const answer = new Answer(log);
  answer.ended = true;
  return answer;
}
