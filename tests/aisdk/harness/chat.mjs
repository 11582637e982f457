// Minimal, React-free driver for the real Vercel AI SDK chat client.
//
// Given the `ai` module of either major (v5 or v6 — `await import('ai5')` /
// `await import('ai6')`) and a base URL, builds a Chat = subclass of the SDK's own
// AbstractChat with an in-memory ChatState, talking through the SDK's own
// DefaultChatTransport. Nothing of the protocol is reimplemented here.
//
// ChatState interface (identical in ai@5.0.277 and ai@6.0.333, see dist/index.d.ts):
//   { status, error, messages, pushMessage(m), popMessage(), replaceMessage(i, m), snapshot(x) }
// The state below mirrors @ai-sdk/react's ReactChatState: pushMessage stores the object
// as given (the SDK keeps mutating it while streaming), replaceMessage stores a snapshot,
// the `messages` setter copies the array. snapshot = structuredClone (what
// @ai-sdk/react@2 does; @ai-sdk/react@3 uses a shallow per-part copy; equivalent here).

export class MemoryChatState {
  constructor(initialMessages = []) {
    this._messages = [...initialMessages];
    this.status = 'ready';
    this.error = undefined;
    this.statusHistory = ['ready'];
  }
  get messages() { return this._messages; }
  set messages(ms) { this._messages = [...ms]; }
  pushMessage = (m) => { this._messages = this._messages.concat(m); };
  popMessage = () => { this._messages = this._messages.slice(0, -1); };
  replaceMessage = (i, m) => {
    this._messages = [...this._messages.slice(0, i), this.snapshot(m), ...this._messages.slice(i + 1)];
  };
  snapshot = (x) => structuredClone(x);
}

/** Text of a UI message: its text parts joined (no separator). */
export function messageText(m) {
  return (m?.parts ?? []).filter((p) => p.type === 'text').map((p) => p.text).join('');
}

/**
 * Wrap a fetch so that every request the SDK transport makes is recorded
 * (method, url, headers, parsed JSON body) and, optionally, so that a response body
 * breaks after `n` SSE events with `new TypeError('network error')` — which is what
 * Chromium throws when a connection drops mid-body, and what AbstractChat classifies
 * as a *disconnect* (`isDisconnect`, keeps `resumableStreamState`). Node's own undici
 * error for a dropped socket is `TypeError: terminated`, which the SDK does NOT treat
 * as a disconnect.
 */
export function recordingFetch(log = [], baseFetch = (...a) => globalThis.fetch(...a)) {
  const ctl = { breakAfterEvents: null, breakError: () => new TypeError('network error'), log };
  const f = async (url, init = {}) => {
    const headers = Object.fromEntries(new Headers(init.headers ?? {}).entries());
    let body;
    try { body = init.body ? JSON.parse(init.body) : undefined; } catch { body = init.body; }
    const entry = { method: init.method ?? 'GET', url: String(url), headers, body, credentials: init.credentials };
    log.push(entry);
    const res = await baseFetch(url, init);
    entry.status = res.status;
    const n = ctl.breakAfterEvents;
    if (n == null || !res.body || res.status !== 200) return res;
    ctl.breakAfterEvents = null; // one-shot
    const reader = res.body.getReader();
    const dec = new TextDecoder();
    let seen = 0, buf = '';
    const broken = new ReadableStream({
      async pull(c) {
        for (;;) {
          if (seen >= n) {
            await reader.cancel().catch(() => {}); // really drop the connection
            c.error(ctl.breakError());
            return;
          }
          const { done, value } = await reader.read();
          if (done) { c.close(); return; }
          buf += dec.decode(value, { stream: true });
          // forward whole SSE events only, counting those that carry a data: line
          let out = '';
          let idx;
          while (seen < n && (idx = buf.indexOf('\n\n')) !== -1) {
            const ev = buf.slice(0, idx + 2);
            buf = buf.slice(idx + 2);
            out += ev;
            if (/^data:/m.test(ev)) seen++;
          }
          if (out) { c.enqueue(new TextEncoder().encode(out)); return; }
        }
      },
      cancel(r) { return reader.cancel(r); },
    });
    return new Response(broken, { status: res.status, statusText: res.statusText, headers: res.headers });
  };
  f.ctl = ctl;
  return f;
}

/**
 * Build a chat driver.
 * @param {object} o
 * @param {object} o.ai              the imported `ai` module (v5 or v6)
 * @param {string} o.baseUrl         e.g. http://127.0.0.1:8080  (api = baseUrl + apiPath)
 * @param {string} [o.apiPath]       default '/api/chat'
 * @param {string} [o.apiKey]        sent as `Authorization: Bearer <key>` on POST and resume GET
 * @param {string} [o.chatId]
 * @param {Array}  [o.messages]      initial UI messages (e.g. what a reloaded page had persisted)
 * @param {object} [o.transport]     extra DefaultChatTransport options (prepareSendMessagesRequest, ...)
 * @param {object} [o.chat]          extra ChatInit options (onData, messageMetadataSchema, ...)
 * @param {Function} [o.baseFetch]   fetch to wrap (default globalThis.fetch)
 * @param {Function} [o.wrapFetch]   applied on top of the recording fetch, e.g. interruptionsAreNotDisconnects:
 *                                   what the page would give the transport as its `fetch`
 */
export function createChat({ ai, baseUrl, apiPath = '/api/chat', apiKey, chatId, messages = [], transport = {}, chat: chatInit = {}, baseFetch, wrapFetch }) {
  const { AbstractChat, DefaultChatTransport } = ai;
  const requests = [];
  const fetch = recordingFetch(requests, baseFetch ?? ((...a) => globalThis.fetch(...a)));
  const events = { errors: [], finishes: [], data: [] };

  class Chat extends AbstractChat {
    constructor(init) {
      const state = new MemoryChatState(init.messages);
      super({ ...init, state });
      this.memState = state;
    }
  }

  const t = new DefaultChatTransport({
    api: baseUrl.replace(/\/$/, '') + apiPath,
    headers: apiKey ? { Authorization: `Bearer ${apiKey}` } : undefined,
    fetch: wrapFetch ? wrapFetch(fetch) : fetch,
    ...transport,
  });

  const chat = new Chat({
    id: chatId,
    messages,
    transport: t,
    onError: (e) => events.errors.push(e),
    onFinish: (f) => events.finishes.push({
      isAbort: f.isAbort, isDisconnect: f.isDisconnect, isError: f.isError,
      finishReason: f.finishReason, message: structuredClone(f.message),
    }),
    onData: (d) => events.data.push(d),
    ...chatInit,
  });

  const h = {
    chat, transport: t, requests, events, fetch,
    get id() { return chat.id; },
    get status() { return chat.status; },
    get error() { return chat.error; },
    get messages() { return chat.messages; },
    assistantMessages() { return chat.messages.filter((m) => m.role === 'assistant'); },
    lastAssistant() { return h.assistantMessages().at(-1); },
    lastAssistantText() { return messageText(h.lastAssistant()); },

    /** sendMessage({text}) and resolve when the request pipeline has finished (any outcome). */
    send(text, options) { return chat.sendMessage({ text }, options); },

    /** Start sendMessage, wait until pred(h) holds (polling), then chat.stop() (aborts the fetch). */
    async sendAndStopWhen(text, pred, { timeoutMs = 10000 } = {}) {
      const p = chat.sendMessage({ text });
      await waitFor(() => pred(h), timeoutMs);
      await chat.stop();
      await p;
    },

    /** Start sendMessage and make the response body fail after n SSE events, by default with
     *  TypeError('network error') (Chromium's error for a dropped connection). */
    async sendAndDisconnectAfter(text, nEvents, errorFactory) {
      fetch.ctl.breakAfterEvents = nEvents;
      fetch.ctl.breakError = errorFactory ?? (() => new TypeError('network error'));
      await chat.sendMessage({ text });
    },

    resume(options) { return chat.resumeStream(options); },
    regenerate(options) { return chat.regenerate(options); },
    stop() { return chat.stop(); },
  };
  return h;
}

export async function waitFor(pred, timeoutMs = 10000, stepMs = 5) {
  const t0 = Date.now();
  while (!(await pred())) {
    if (Date.now() - t0 > timeoutMs) throw new Error('waitFor: timeout');
    await new Promise((r) => setTimeout(r, stepMs));
  }
}

/**
 * ai@5 workaround (not needed for ai@6): a fetch wrapper that turns a network TypeError raised
 * while reading a response body into a plain Error. AbstractChat then does not classify it as
 * a disconnect, keeps no `resumableStreamState`, and a later resumeStream() starts from a fresh
 * message state, so rsb's replay-from-start lands exactly once (ai@5 would otherwise append the
 * replay to the kept partial message: the text twice). Aborts (DOMException AbortError) pass
 * through unchanged. Cost: useChat's automatic resume on `visibilitychange` (which only fires
 * for kept disconnect state) no longer triggers; call resumeStream() yourself (e.g. onError).
 */
export function interruptionsAreNotDisconnects(fetchImpl = (...a) => globalThis.fetch(...a)) {
  return async (input, init) => {
    const res = await fetchImpl(input, init);
    if (!res.body) return res;
    const reader = res.body.getReader();
    const body = new ReadableStream({
      async pull(c) {
        try {
          const { done, value } = await reader.read();
          if (done) c.close(); else c.enqueue(value);
        } catch (e) {
          c.error(e instanceof TypeError ? new Error(`stream interrupted: ${e.message}`) : e);
        }
      },
      cancel(r) { return reader.cancel(r); },
    });
    return new Response(body, { status: res.status, statusText: res.statusText, headers: res.headers });
  };
}
