// The chat page. A chat is an rsb conversation named by a UUID chosen here, and the page's address names it
// (/?chat=<uuid>): opened on any device, it shows the whole conversation (GET /v1/conversations/{id}/turns),
// follows a running turn and goes on from there. Every answer is an rsb stream named by a UUID chosen here; a
// send carries only the new message (the server puts the history in front). This page's copy of the chat
// (stream ids and prompts) and each stream's progress (its answer's events so far + the id of the last event
// it includes) live in localStorage, so a reload shows the answer at once and resumes from the last event id:
// nothing is lost, nothing is shown twice. A `reset` (a Redis failover lost events the page had) takes back
// what came after the event it names, on screen and in storage (rsb-client.js's Answer). /?stream=<uuid>
// opens any existing stream (another tab, another device).

import {
  Answer, answerOf, cancelStream, conversationTurns, createStream, modelCatalog, RsbStream, streamStatus,
  TERMINAL_EVENTS, usageReport, uuid4,
} from "./rsb-client.js";
import { IncrementalMarkdown } from "./markdown.js";

// {conversation: uuid, turns: [{id, prompt, body, createdAt}], legacy?: true (turns kept from before chats were
// conversations: the next send carries them as messages, so the server's history starts with them)}
const CHAT_KEY = "rsb.chat.v1";
const SETTINGS_KEY = "rsb.settings.v1"; // {maxTokens, apiKey, temperature, model, serviceTier}
const USAGE_DAYS = 7; // what the Usage panel shows
const streamKey = (id) => `rsb.stream.v1.${id}`; // a Snapshot, see Turn.snapshot()
const UUID_RE = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;
const TERMINAL_STATUSES = TERMINAL_EVENTS; // a stream's final status is the type of its terminal event
// Writing the whole answer to localStorage per token would cost more than rendering it; a snapshot is
// always self-consistent (text and last event id together), so a lost write only means a longer replay.
const PERSIST_EVERY_MS = 400;
// A (re)connection first replays stored events in a burst: that is not generation speed.
const RATE_SETTLE_MS = 250;
const RATE_WINDOW_MS = 2000;
// While no generator has loaded its model yet (rsb up just started), ask again this often.
const MODELS_RETRY_MS = 3000;

const $ = (sel, root = document) => root.querySelector(sel);

// --- storage (never fatal: private mode, quota, disabled storage) ----------------------------------

function load(key) {
  try {
    const raw = localStorage.getItem(key);
    return raw ? JSON.parse(raw) : null;
  } catch {
    return null;
  }
}

function save(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
    return true;
  } catch {
    return false;
  }
}

function remove(key) {
  try {
    localStorage.removeItem(key);
  } catch {
    // nothing to do
  }
}

const settings = { maxTokens: 256, apiKey: "", temperature: null, model: null, serviceTier: null,
  ...(load(SETTINGS_KEY) || {}) };

// --- one answer --------------------------------------------------------------------------------------

class Turn {
  constructor({ id, prompt = null, body = null, createdAt = null, server = null }, container) {
    this.id = id;
    this.prompt = prompt;
    this.body = body; // the create request, kept so a reload before its answer can retry it as is
    this.createdAt = createdAt; // Date.now() at send, for the client-side time to first token
    this.sentHere = false; // sent from this page (not restored by a reload or another tab)
    // Not stored here, but finished on the server: the conversation's copy of its answer (no stream read).
    const saved = load(streamKey(id)) || (server?.output ? serverSnapshot(server) : {});
    this.lastEventId = saved.lastEventId || null;
    this.status = saved.status || (body ? "creating" : "connecting");
    const restored = restoreAnswer(saved, TERMINAL_STATUSES.has(this.status));
    this.answer = restored ?? new Answer();
    if (!restored) this.lastEventId = null; // nothing usable stored: read the stream from its start
    this.model = saved.model || null;
    this.queued = saved.queued || null;
    this.usage = saved.usage || null;
    this.detail = saved.detail || null; // finish_reason, cancel reason or error message
    this.ttftMs = saved.ttftMs ?? null;
    // The snapshot must not claim events past its last event id: if the two disagree, replay everything.
    if (!this.lastEventId && this.answer.log.length) this.answer = new Answer();
    this.reader = null;
    this.rate = null;
    this.rateSamples = [];
    this.countFrom = Infinity;
    this.persistTimer = null;
    this.frame = null;
    this.el = $("#turn-template").content.firstElementChild.cloneNode(true);
    this.el.dataset.streamId = id;
    const userEl = $(".user", this.el);
    if (prompt === null) {
      userEl.classList.add("shared");
      userEl.textContent = `Stream ${id}`;
    } else {
      userEl.textContent = prompt;
    }
    $(".share", this.el).href = `/?stream=${encodeURIComponent(id)}`;
    this.md = new IncrementalMarkdown($(".blocks", this.el), $(".tail", this.el));
    this.reasoningShown = ""; // what the reasoning panel shows
    this.callEls = new Map(); // tool call index -> {el, name, args, shownArgs}
    container.appendChild(this.el);
    this.render();
  }

  get live() {
    return !TERMINAL_STATUSES.has(this.status);
  }

  get text() {
    return this.answer.text;
  }

  get deltas() {
    return this.answer.deltas;
  }

  snapshot() {
    return {
      answer: this.answer.toJSON(), lastEventId: this.lastEventId, status: this.status, model: this.model,
      queued: this.queued, usage: this.usage, detail: this.detail, ttftMs: this.ttftMs,
    };
  }

  persist(now = false) {
    if (now) {
      clearTimeout(this.persistTimer);
      this.persistTimer = null;
      if (!save(streamKey(this.id), this.snapshot())) {
        // Over quota: keep what a resume needs, a replay from the start brings the text back.
        save(streamKey(this.id), { ...this.snapshot(), answer: { log: [] }, lastEventId: null });
      }
      return;
    }
    if (this.persistTimer === null) this.persistTimer = setTimeout(() => this.persist(true), PERSIST_EVERY_MS);
  }

  async start() {
    if (!this.live) return;
    const opts = { baseUrl: "", apiKey: settings.apiKey || null };
    if (this.status === "creating") {
      try {
        // Same id and body on every retry (and after a reload): at most one generation, ever.
        this.createAbort = new AbortController();
        await createStream(this.body, { ...opts, signal: this.createAbort.signal });
      } catch (e) {
        if (e.name === "AbortError") return;
        if (e.status === 409 && e.code === "conflict") {
          app.lostRace(this); // another device's turn runs in this chat: show that one instead
          return;
        }
        this.fail(e);
        return;
      } finally {
        this.createAbort = null;
      }
      this.status = "queued";
      this.persist(true);
      this.render();
    }
    this.reader = new RsbStream(this.id, {
      ...opts,
      lastEventId: this.lastEventId,
      onEvent: (e) => this.onEvent(e),
      onState: (state, info) => this.onState(state, info),
    });
    try {
      const end = await this.reader.done;
      if (end.type === "ended" && this.live) {
        // 204: our last event was already the terminal one; the snapshot lagged. Ask for the status.
        const st = await streamStatus(this.id, opts).catch(() => null);
        if (st) this.finish(st.status, st.usage || null, null);
      }
    } catch (e) {
      this.fail(e);
    }
  }

  onEvent(e) {
    const d = e.data || {};
    // First, so that every snapshot written from here on (finish() writes one) includes this event.
    this.lastEventId = e.id || this.lastEventId;
    switch (e.type) {
      case "queued":
        this.status = "queued";
        this.queued = { position: d.position, eta_s: d.eta_s ?? null };
        break;
      case "started":
        this.status = "running";
        this.model = d.model || null;
        this.queued = null;
        if (this.model) app.showModel([this.model]);
        break;
      case "delta":
      case "reasoning":
      case "tool_call":
      case "tool_args":
        // Only the tab that sent the prompt saw the wait live; a reload's replay says nothing about it.
        if (!this.answer.log.length && this.sentHere && this.ttftMs === null) this.ttftMs = Date.now() - this.createdAt;
        this.status = "running";
        this.answer.feed(e);
        break;
      case "reset":
        // A failover lost what came after e.id: take it back, and store the corrected answer at once.
        if (this.answer.feed(e)) {
          this.rateSamples = [];
          this.persist(true);
        }
        break;
      case "done":
        this.answer.feed(e);
        this.finish("done", d.usage, d.finish_reason);
        break;
      case "cancelled":
        this.answer.feed(e);
        this.finish("cancelled", d.usage, d.reason);
        break;
      case "error":
        this.answer.feed(e);
        this.finish("error", d.usage, d.message || d.code);
        break;
      default:
        break; // a newer server's event type: nothing to show, but it moved the resume point
    }
    if (!TERMINAL_EVENTS.has(e.type)) {
      this.persist();
      this.schedule();
    }
  }

  onState(state, info) {
    if (state === "open") this.countFrom = performance.now() + RATE_SETTLE_MS;
    app.connection(state, info);
  }

  finish(status, usage, detail) {
    this.status = status;
    this.usage = usage || this.usage;
    this.detail = detail || null;
    this.queued = null;
    this.persist(true);
    this.render(true);
    app.update();
  }

  fail(error) {
    this.status = "error";
    this.detail = error.message || String(error);
    if (error.status === 401) this.detail += " (set the API key in Settings)";
    this.persist(true);
    this.render(true);
    app.update();
  }

  async stop() {
    if (!this.live) return;
    this.el.dataset.stopping = "1";
    this.render();
    if (this.createAbort) this.createAbort.abort();
    try {
      if (this.reader) {
        await this.reader.cancel(); // the reader reads on to the `cancelled` event
      } else {
        await cancelStream(this.id, { apiKey: settings.apiKey || null });
        this.start();
      }
    } catch (e) {
      if (e.status === 404 && !this.reader) {
        this.finish("cancelled", null, "client"); // stopped before the server ever saw it
      } else {
        app.notice(`Stop failed: ${e.message}`);
      }
    } finally {
      delete this.el.dataset.stopping;
    }
  }

  close() {
    this.reader?.close();
    this.createAbort?.abort();
    if (this.persistTimer !== null) this.persist(true);
  }

  // Batches every event of a frame into one DOM update. Hidden tabs get no animation frames; a timer
  // keeps their snapshot and text moving (slowly) so switching back shows no stale answer.
  schedule() {
    if (this.frame !== null) return;
    if (document.visibilityState === "hidden") {
      this.frame = setTimeout(() => {
        this.frame = null;
        this.render();
      }, 500);
    } else {
      this.frame = requestAnimationFrame(() => {
        this.frame = null;
        this.render();
      });
    }
  }

  measureRate() {
    const now = performance.now();
    if (now < this.countFrom || this.status !== "running") {
      this.rateSamples = [];
      return;
    }
    this.rateSamples.push([now, this.deltas]);
    while (this.rateSamples.length > 2 && now - this.rateSamples[0][0] > RATE_WINDOW_MS) this.rateSamples.shift();
    const [t0, n0] = this.rateSamples[0];
    if (now - t0 >= 300) this.rate = ((this.deltas - n0) * 1000) / (now - t0);
  }

  render(final = false) {
    const stickToBottom = app.nearBottom();
    const finished = !this.live;
    this.md.update(this.text, finished);
    this.renderReasoning();
    this.renderToolCalls();
    this.el.dataset.status = this.status;
    this.el.dataset.deltas = String(this.deltas);
    this.el.classList.toggle("finished", finished);
    const set = (sel, text) => {
      const node = $(sel, this.el);
      node.hidden = text === null;
      if (text !== null && node.textContent !== text) node.textContent = text;
    };
    set(".status", this.statusText());
    set(".model", this.model ? `model ${this.model}` : null);
    $(".demo-note", this.el).hidden = !(this.model && /demo/i.test(this.model));
    // What the user waited (queue included) when this page saw it; else the server's own measure.
    const ttft = this.ttftMs ?? this.usage?.ttft_ms ?? null;
    set(".ttft", ttft !== null ? `TTFT ${formatMs(ttft)}` : null);
    $(".ttft", this.el).title = this.ttftMs !== null ? "from Send to the first token, as seen by this page"
      : "time to first token, measured by the server";
    if (!finished) this.measureRate();
    let rate = null;
    if (finished && this.usage?.tpot_ms > 0) rate = `${(1000 / this.usage.tpot_ms).toFixed(1)} tok/s`;
    else if (!finished && this.rate !== null && this.status === "running") rate = `${this.rate.toFixed(1)} tok/s`;
    set(".rate", rate);
    const tokens = this.usage?.completion_tokens ?? (this.deltas || null);
    set(".tokens", tokens !== null ? `${tokens} tokens` : null);
    if (finished || final) {
      const pre = $(".raw pre", this.el);
      if (pre.textContent !== this.text) pre.textContent = this.text;
    }
    if (stickToBottom) app.scrollToBottom();
  }

  // The reasoning, apart from the answer and collapsed (a <details> the user opens), as plain text.
  renderReasoning() {
    const text = this.answer.reasoning;
    if (text === this.reasoningShown) return;
    const panel = $(".reasoning", this.el);
    panel.hidden = text === "";
    const body = $(".reasoning-text", panel);
    appendOrReplace(body, this.reasoningShown, text);
    this.reasoningShown = text;
  }

  // Each tool call: its name, then its arguments as the model writes them (plain text: model output).
  renderToolCalls() {
    const calls = this.answer.toolCalls;
    const box = $(".tool-calls", this.el);
    box.hidden = calls.length === 0;
    const live = new Set(calls.map((c) => c.index));
    for (const [index, view] of this.callEls) {
      if (!live.has(index)) {
        view.el.remove(); // taken back by a reset
        this.callEls.delete(index);
      }
    }
    for (const call of calls) {
      let view = this.callEls.get(call.index);
      if (!view) {
        const el = $("#tool-call-template").content.firstElementChild.cloneNode(true);
        el.dataset.index = String(call.index);
        view = { el, name: $(".tool-name", el), id: $(".tool-id", el), args: $(".tool-args", el), shownArgs: "" };
        box.appendChild(el);
        this.callEls.set(call.index, view);
      }
      if (view.name.textContent !== call.name) view.name.textContent = call.name;
      if (view.id.textContent !== call.id) view.id.textContent = call.id;
      appendOrReplace(view.args, view.shownArgs, call.arguments);
      view.shownArgs = call.arguments;
    }
  }

  statusText() {
    if (this.el.dataset.stopping) return "stopping…";
    switch (this.status) {
      case "creating":
        return "sending…";
      case "connecting":
        return "connecting…";
      case "queued": {
        if (!this.queued) return "queued";
        const eta = this.queued.eta_s == null ? "ETA unknown" : `ETA ~${formatSeconds(this.queued.eta_s)}`;
        return `queued: position ${this.queued.position}, ${eta}`;
      }
      case "running":
        return "generating…";
      case "done":
        if (this.detail === "length") return "done (max tokens reached)";
        return this.detail === "tool_calls" ? "done (tool calls)" : "done";
      case "cancelled":
        return `cancelled${this.detail ? ` (${this.detail})` : ""}`;
      case "error":
        return `error: ${this.detail || "unknown"}`;
      default:
        return this.status;
    }
  }
}

// A finished turn of the conversation (GET .../turns) as a snapshot: its answer as the server keeps it.
function serverSnapshot(t) {
  return {
    answer: answerOf(t.output).toJSON(), lastEventId: "0-0", status: t.status, model: t.model || null,
    usage: t.usage || null, detail: t.error?.message || t.finish_reason || null,
  };
}

// What a turn of the conversation asked, as the page shows it: its user messages' text.
function promptOf(t) {
  const texts = (t.messages || []).filter((m) => m.role === "user").map((m) => m.content || "");
  return texts.length ? texts.join("\n\n") : (t.messages || []).map((m) => m.role).join(", ");
}

// A snapshot's answer, or null: read the stream again from its start. Snapshots of before the answer's events
// were stored hold only text: a finished one keeps it (nothing more will be read), an unfinished one is read
// again (a reset could not be applied to text whose events are unknown), and so is a damaged one.
function restoreAnswer(saved, finished) {
  let answer = null;
  if (saved.answer?.log) {
    try {
      answer = new Answer(saved.answer.log);
    } catch {
      return null;
    }
  } else if (finished && saved.text) {
    answer = new Answer([[saved.lastEventId || "0-1", "delta", { text: saved.text }]]);
  }
  if (answer) answer.ended = finished;
  return answer;
}

// Shows `text` in `el` (plain text), appending when it only grew since `shown`: cheaper than replacing it all.
function appendOrReplace(el, shown, text) {
  if (text === shown) return;
  const node = el.firstChild;
  if (node && shown && text.startsWith(shown)) node.appendData(text.slice(shown.length));
  else el.textContent = text;
}

function formatMs(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(1)} s`;
}

function formatSeconds(s) {
  if (s < 60) return `${Math.max(1, Math.round(s))} s`;
  return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

// --- the page ----------------------------------------------------------------------------------------

const app = {
  turns: [],
  shared: null, // the stream id of a /?stream= view
  chatId: null, // the conversation this page shows (/?chat=<uuid>)
  legacy: false,

  init() {
    const params = new URLSearchParams(location.search);
    const shared = params.get("stream");
    const wanted = params.get("chat");
    $("#max-tokens").value = settings.maxTokens;
    $("#api-key").value = settings.apiKey;
    $("#temperature").value = settings.temperature ?? "";
    this.loadModels();
    if (shared !== null) {
      if (!UUID_RE.test(shared)) {
        this.notice("That link's stream id is not a UUID.");
        return;
      }
      this.shared = shared.toLowerCase();
      document.body.classList.add("shared-view");
      $("#back").hidden = false;
      $("#new-chat").hidden = true;
      $("#composer").hidden = true;
      this.addTurn({ id: this.shared }).start();
    } else {
      if (wanted !== null && !UUID_RE.test(wanted)) this.notice("That link's chat id is not a UUID: a new chat.");
      this.openChat(wanted !== null && UUID_RE.test(wanted) ? wanted.toLowerCase() : null);
    }
    this.bind();
    this.update();
    this.scrollToBottom();
  },

  // Shows the chat `chatId` (null: this page's own, else a new one): this page's copy at once, then the
  // server's (every turn, from any device), following a running turn.
  openChat(chatId) {
    let chat = load(CHAT_KEY);
    // A chat kept from before chats were conversations: a new conversation, empty on the server until it sends.
    if (chat && !chat.conversation) chat = { conversation: uuid4(), turns: chat.turns || [], legacy: true, fresh: true };
    if (!chat || (chatId && chat.conversation !== chatId)) {
      if (chat) for (const t of chat.turns || []) remove(streamKey(t.id)); // another chat's copy: the server has it
      // A chat named here has nothing on the server until its first send (`fresh`: no need to ask).
      chat = { conversation: chatId || uuid4(), turns: [], fresh: !chatId };
    }
    save(CHAT_KEY, chat);
    this.chatId = chat.conversation;
    this.legacy = Boolean(chat.legacy);
    history.replaceState(null, "", `/?chat=${this.chatId}`);
    for (const t of chat.turns) this.addTurn(t).start();
    if (!chat.fresh) this.sync();
  },

  // The server's copy of the chat, merged into the page's: turns this page lacks are added (finished ones as
  // the conversation keeps them, a running one read from its stream), in the server's order.
  async sync() {
    const chatId = this.chatId;
    let history;
    try {
      history = await conversationTurns(chatId, { apiKey: settings.apiKey || null });
    } catch (e) {
      this.notice(`Could not load this chat from the server: ${e.message}`);
      return;
    }
    if (chatId !== this.chatId || !history) return; // another chat meanwhile, or none on the server yet
    const known = new Map(this.turns.map((t) => [t.id, t]));
    const ordered = [];
    for (const t of history.turns) {
      let turn = known.get(t.id);
      if (turn) {
        known.delete(t.id); // shown and read already
      } else {
        turn = this.addTurn({ id: t.id, prompt: promptOf(t), server: t });
        turn.start();
      }
      ordered.push(turn);
    }
    // Turns the server does not list: finished ones are older (kept from before chats were conversations),
    // live ones are being sent from here (last).
    const localOnly = this.turns.filter((t) => known.has(t.id));
    this.turns = [...localOnly.filter((t) => !t.live), ...ordered, ...localOnly.filter((t) => t.live)];
    for (const t of this.turns) $("#conversation").appendChild(t.el);
    const chat = load(CHAT_KEY) || { conversation: chatId, turns: [] };
    const records = new Map((chat.turns || []).map((r) => [r.id, r]));
    chat.turns = this.turns.map((t) => records.get(t.id) ?? { id: t.id, prompt: t.prompt, body: null, createdAt: null });
    if (history.turns.length) delete chat.legacy;
    this.legacy = Boolean(chat.legacy);
    save(CHAT_KEY, chat);
    this.update();
    this.scrollToBottom();
  },

  // A send refused because another turn of the chat runs (another device's): this one never existed; show
  // the chat as the server has it, that turn included, and follow it.
  lostRace(turn) {
    turn.close();
    turn.el.remove();
    remove(streamKey(turn.id));
    this.turns = this.turns.filter((t) => t !== turn);
    const chat = load(CHAT_KEY);
    if (chat) {
      chat.turns = chat.turns.filter((r) => r.id !== turn.id);
      save(CHAT_KEY, chat);
    }
    $("#prompt").value = $("#prompt").value || turn.prompt || "";
    this.notice("Another device is answering in this chat: its turn is shown here. Send again once it is done.");
    this.update();
    this.sync();
  },

  bind() {
    $("#composer").addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.send();
    });
    $("#prompt").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
        ev.preventDefault();
        this.send();
      }
    });
    $("#stop").addEventListener("click", () => this.current()?.stop());
    $("#new-chat").addEventListener("click", () => this.newChat());
    $("#usage").addEventListener("toggle", (ev) => { if (ev.target.open) this.loadUsage(); });
    $("#max-tokens").addEventListener("change", (ev) => {
      const n = Number(ev.target.value);
      if (Number.isInteger(n) && n > 0) settings.maxTokens = n;
      save(SETTINGS_KEY, settings);
    });
    $("#api-key").addEventListener("change", (ev) => {
      settings.apiKey = ev.target.value.trim();
      save(SETTINGS_KEY, settings);
      this.loadModels();
    });
    $("#model").addEventListener("change", (ev) => {
      settings.model = ev.target.value || null;
      save(SETTINGS_KEY, settings);
    });
    $("#service-tier").addEventListener("change", (ev) => {
      settings.serviceTier = ev.target.value || null;
      save(SETTINGS_KEY, settings);
    });
    $("#temperature").addEventListener("change", (ev) => {
      const raw = ev.target.value.trim();
      const t = Number(raw);
      settings.temperature = raw !== "" && Number.isFinite(t) && t >= 0 && t <= 2 ? t : null;
      save(SETTINGS_KEY, settings);
    });
    // Leaving or hiding the page: write the latest snapshot now, the timer may never fire.
    addEventListener("pagehide", () => this.turns.forEach((t) => t.persist(true)));
    document.addEventListener("visibilitychange", () => {
      if (document.visibilityState === "hidden") this.turns.forEach((t) => t.persist(true));
    });
    // Another tab of this chat sent a prompt: show and follow it here too.
    addEventListener("storage", (ev) => {
      if (ev.key !== CHAT_KEY || this.shared) return;
      const known = new Set(this.turns.map((t) => t.id));
      const chat = load(CHAT_KEY);
      const turns = chat?.conversation === this.chatId ? chat.turns || [] : [];
      if (!turns.length) return;
      for (const t of turns) if (!known.has(t.id)) this.addTurn({ ...t, createdAt: null }).start();
      this.update();
    });
  },

  addTurn(record) {
    $("#empty").hidden = true;
    const turn = new Turn(record, $("#conversation"));
    this.turns.push(turn);
    return turn;
  },

  current() {
    return this.turns.find((t) => t.live) || null;
  },

  messages(prompt) {
    const messages = [];
    for (const t of this.turns) {
      if (t.prompt === null) continue;
      messages.push({ role: "user", content: t.prompt });
      if (t.text) messages.push({ role: "assistant", content: t.text });
    }
    messages.push({ role: "user", content: prompt });
    return messages;
  },

  send() {
    const prompt = $("#prompt").value.trim();
    if (!prompt || this.current() || this.shared) return;
    const maxTokens = Number($("#max-tokens").value);
    if (Number.isInteger(maxTokens) && maxTokens > 0) settings.maxTokens = maxTokens;
    save(SETTINGS_KEY, settings);
    const id = uuid4();
    // Only the new message: the server puts the conversation's history in front (a chat kept from before
    // chats were conversations sends its turns once, so that the server's history starts with them).
    const messages = this.legacy ? this.messages(prompt) : [{ role: "user", content: prompt }];
    const body = { id, conversation: this.chatId, messages, max_tokens: settings.maxTokens };
    if (settings.temperature !== null) body.temperature = settings.temperature;
    const picked = $("#model");
    if (!picked.hidden && !picked.disabled && picked.value) body.model = picked.value;
    if (!$("#tier-choice").hidden && settings.serviceTier) body.service_tier = settings.serviceTier;
    const record = { id, prompt, createdAt: Date.now(), body };
    // Recorded before the request leaves: a reload mid-request retries it with the same id.
    const chat = load(CHAT_KEY) || { conversation: this.chatId, turns: [] };
    chat.turns.push(record);
    delete chat.legacy;
    delete chat.fresh;
    this.legacy = false;
    save(CHAT_KEY, chat);
    $("#prompt").value = "";
    const turn = this.addTurn(record);
    turn.sentHere = true;
    turn.persist(true);
    turn.start();
    this.update();
    this.scrollToBottom();
  },

  newChat() {
    if (this.current()) return;
    for (const t of this.turns) {
      t.close();
      t.el.remove();
      remove(streamKey(t.id));
    }
    this.turns = [];
    remove(CHAT_KEY);
    $("#empty").hidden = false;
    this.openChat(null);
    this.update();
  },

  update() {
    const live = this.current();
    $("#stop").hidden = !live;
    $("#send").disabled = Boolean(live);
    $("#new-chat").disabled = Boolean(live);
    if (!live) this.connection("idle", {});
  },

  // The Usage panel: this key's generations of the last days, one row a day (read when the panel opens).
  async loadUsage() {
    const body = $("#usage-table tbody");
    const note = $("#usage-note");
    let report;
    try {
      const since = Math.floor(Date.now() / 1000) - USAGE_DAYS * 86400;
      report = await usageReport({ apiKey: settings.apiKey || null, groupBy: "day", since });
    } catch (e) {
      note.textContent = `Usage unavailable: ${e.message || e}`;
      note.hidden = false;
      return;
    }
    const priced = "cost_usd" in report.total;
    document.querySelectorAll("#usage-table .cost").forEach((el) => { el.hidden = !priced; });
    const rows = [...report.rows, { day: "total", ...report.total }];
    body.replaceChildren(...rows.map((r) => {
      const tr = document.createElement("tr");
      const cells = [r.day, r.streams, r.prompt_tokens, r.completion_tokens];
      if (priced) cells.push(r.cost_usd.toFixed(4));
      for (const v of cells) {
        const td = document.createElement("td");
        td.textContent = String(v);
        tr.append(td);
      }
      return tr;
    }));
    note.textContent = report.rows.length ? "" : "No answers in these days yet.";
    note.hidden = Boolean(report.rows.length);
  },

  // The model picker in the header: the models the server lists (GET /v1/models), the one picked before if it is
  // still served, else the server's default; and, in Settings, the tiers this key may choose between. Without a
  // list (an API key missing, an old server) the picker shows what the last `started` event named, unpickable.
  async loadModels() {
    clearTimeout(this.modelsTimer);
    let catalog = null;
    try {
      catalog = await modelCatalog({ apiKey: settings.apiKey || null });
    } catch {
      return;
    }
    if (catalog.models.length) this.showModels(catalog);
    else this.modelsTimer = setTimeout(() => this.loadModels(), MODELS_RETRY_MS);
    this.showTiers(catalog.serviceTiers);
  },

  showModels({ models, defaultModel }) {
    const el = $("#model");
    const chosen = models.includes(settings.model) ? settings.model
      : models.includes(defaultModel) ? defaultModel : models[0];
    el.replaceChildren(...models.map((name) => new Option(name, name, false, name === chosen)));
    el.value = chosen;
    el.disabled = models.length < 2;
    el.dataset.listed = "1";
    el.hidden = false;
  },

  showModel(names) {
    const el = $("#model");
    if (el.dataset.listed === "1") return;
    el.replaceChildren(...names.map((name) => new Option(name, name)));
    el.disabled = true;
    el.hidden = false;
  },

  showTiers(tiers) {
    const el = $("#service-tier");
    el.replaceChildren(new Option("auto (this key's own)", ""), ...tiers.map((t) => new Option(t, t)));
    el.value = tiers.includes(settings.serviceTier) ? settings.serviceTier : "";
    $("#tier-choice").hidden = tiers.length < 2;
  },

  connection(state, info) {
    const el = $("#connection");
    const labels = {
      idle: "idle", connecting: "connecting…", open: "live", ended: "idle", failed: "failed",
      retrying: `reconnecting in ${((info?.delayMs || 0) / 1000).toFixed(1)} s`,
    };
    el.dataset.state = state;
    $(".conn-label", el).textContent = labels[state] || state;
    if (state === "retrying" && info?.error) el.title = String(info.error.message || info.error);
  },

  notice(text) {
    const el = $("#notice");
    el.textContent = text;
    el.hidden = false;
    clearTimeout(this.noticeTimer);
    this.noticeTimer = setTimeout(() => {
      el.hidden = true;
    }, 8000);
  },

  nearBottom() {
    const s = document.scrollingElement;
    return s.scrollHeight - s.scrollTop - s.clientHeight < 80;
  },

  scrollToBottom() {
    const s = document.scrollingElement;
    s.scrollTop = s.scrollHeight;
  },
};

window.rsbPage = app; // for the console and for tests
app.init();
