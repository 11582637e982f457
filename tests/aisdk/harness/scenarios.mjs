// The scenarios the harness runs against a real rsb, unchanged in Node (run.mjs) and in Chromium
// (browser/page.html): each drives the SDK's own AbstractChat + DefaultChatTransport (chat.mjs) and returns
// what a user would notice (the messages, their text, the chat's status, the requests sent and their
// answers). tests/consumer/test_aisdk.py asserts on the results and compares every answer with its rsb
// stream, read natively (the assistant message's id is the stream id).
import { createChat, messageText, waitFor, interruptionsAreNotDisconnects } from './chat.mjs';
import { JOINER_SCENARIOS } from './joiners.mjs';

// Characters of an answer on screen before a scenario interrupts it: well inside a long answer.
const MID_CHARS = 40;
const midAnswer = (h) => messageText(h.lastAssistant()).length >= MID_CHARS;
// Mid the answer of a chat that started from `before` messages (a page with history): its own new answer, not
// the history's last one, which is already long enough for midAnswer.
const midNewAnswer = (h, before) => h.messages.length > before + 1 && h.messages.at(-1).role === 'assistant'
  && midAnswer(h);

/** What the chat shows, for the assertions (the partial state included). */
export function summary(h) {
  const a = h.lastAssistant();
  return {
    status: h.status,
    error: h.error ? String(h.error.message) : null,
    roles: h.messages.map((m) => m.role),
    assistants: h.assistantMessages().length,
    messageId: a?.id ?? null,
    text: messageText(a),
    textParts: (a?.parts ?? []).filter((p) => p.type === 'text').length,
    partTypes: (a?.parts ?? []).map((p) => p.type),
    metadata: a?.metadata ?? null,
    finishes: h.events.finishes.map(({ message, ...f }) => f),
    data: h.events.data.map((d) => d.type),
    requests: h.requests.map(({ method, url, status }) => ({ method, path: new URL(url).pathname, status })),
  };
}

/** The chunks of a UI message stream body (data: lines; [DONE] kept as the string). */
export function chunksOf(body) {
  return body.split(/\r?\n/).filter((l) => l.startsWith('data: ')).map((l) => l.slice(6))
    .map((d) => (d === '[DONE]' ? d : JSON.parse(d)));
}

export const SCENARIOS = {
  // Send and read to the end.
  async send(ctx) {
    const h = ctx.chat({ maxTokens: ctx.short });
    await h.send('hello');
    return { chat: summary(h), body: h.requests[0].body };
  },

  // stop() (aborts the fetch: the turn goes on), then resumeStream(): the turn from its start, one copy.
  async abortResume(ctx) {
    const h = ctx.chat();
    await h.sendAndStopWhen('tell me a story', midAnswer);
    const partial = summary(h);
    await h.resume();
    return { partial, final: summary(h) };
  },

  // A reloaded page: a new Chat with the persisted partial messages resumes the running turn.
  async reloadWhileActive(ctx) {
    const before = ctx.chat();
    await before.sendAndStopWhen('reload me', midAnswer);
    const after = ctx.chat({ chatId: before.id, messages: structuredClone(before.messages) });
    await after.resume();
    return { partial: summary(before), reloaded: summary(after) };
  },

  // A reloaded page after the turn ended: 204, nothing added, with or without persisted messages.
  async reloadAfterFinish(ctx) {
    const first = ctx.chat({ maxTokens: ctx.short });
    await first.send('finish first');
    const persisted = ctx.chat({ chatId: first.id, messages: structuredClone(first.messages) });
    await persisted.resume();
    const empty = ctx.chat({ chatId: first.id });
    await empty.resume();
    return {
      first: summary(first), persisted: summary(persisted), empty: summary(empty),
      unchanged: JSON.stringify(first.messages) === JSON.stringify(persisted.messages),
    };
  },

  // The connection drops mid-answer (TypeError 'network error', what Chromium throws), then
  // resumeStream(), as useChat does on visibilitychange.
  async networkDrop(ctx) {
    const h = ctx.chat();
    await h.sendAndDisconnectAfter('drop me', 12);
    const dropped = summary(h);
    await h.resume();
    return { dropped, final: summary(h) };
  },

  // The same drop with the ai@5 workaround (the page's fetch turns the drop into a plain error).
  async networkDropWorkaround(ctx) {
    const h = ctx.chat({ wrapFetch: (f) => interruptionsAreNotDisconnects(f) });
    await h.sendAndDisconnectAfter('drop me too', 12);
    const dropped = summary(h);
    await h.resume();
    return { dropped, final: summary(h) };
  },

  // rsb's stop endpoint mid-answer: the open stream ends by itself (abort), the turn is cancelled. A longer
  // answer, so that it is still running when the stop arrives on a loaded machine.
  async stopEndpoint(ctx) {
    const h = ctx.chat({ maxTokens: 5 * ctx.long });
    const sending = h.send('stop me');
    await waitFor(() => midAnswer(h), 60000);
    const stop = await ctx.api('POST', `/api/chat/${encodeURIComponent(h.id)}/stop`);
    await sending;
    const stopped = summary(h);
    const again = await ctx.api('POST', `/api/chat/${encodeURIComponent(h.id)}/stop`);
    await h.resume();
    return { stop, again, chat: stopped, afterResume: summary(h) };
  },

  // stop() alone with cancel_on_disconnect (the transport's body option): the generation stops too, once
  // no reader is back within the generator's grace (so a longer answer, to be sure it is still running).
  async stopCancelOnDisconnect(ctx) {
    const h = ctx.chat({ maxTokens: 5 * ctx.long, body: { cancel_on_disconnect: true } });
    await h.sendAndStopWhen('abandon me', midAnswer);
    const stopped = summary(h);
    let native;
    await waitFor(async () => {
      native = await ctx.api('GET', `/v1/streams/${stopped.messageId}`);
      return ['done', 'cancelled', 'error'].includes(native.json?.status);
    }, 60000, 100);
    await h.resume();
    return { chat: stopped, native, afterResume: summary(h) };
  },

  // Two chats at once.
  async parallel(ctx) {
    const a = ctx.chat({ maxTokens: ctx.short });
    const b = ctx.chat({ maxTokens: ctx.short });
    await Promise.all([a.send('alpha'), b.send('beta')]);
    return { a: summary(a), b: summary(b) };
  },

  // Another API key, same chat id: no turn, no stop, no stream; its own turn if it sends.
  async tenantIsolation(ctx) {
    const owner = ctx.chat();
    const sending = owner.send('secret');
    await waitFor(() => midAnswer(owner), 60000);
    const messageId = owner.lastAssistant().id;
    const other = ctx.chat({ apiKey: ctx.keyB, chatId: owner.id, maxTokens: ctx.short });
    await other.resume();
    const otherResume = summary(other);
    const path = encodeURIComponent(owner.id);
    const otherStop = await ctx.api('POST', `/api/chat/${path}/stop`, { key: ctx.keyB });
    const otherStatus = await ctx.api('GET', `/v1/streams/${messageId}`, { key: ctx.keyB });
    const otherEvents = await ctx.api('GET', `/v1/streams/${messageId}/events`, { key: ctx.keyB });
    const stranger = ctx.chat({ apiKey: 'nobody.secret', chatId: owner.id });
    await stranger.resume();
    await sending;
    await other.send('mine');
    return {
      owner: summary(owner), otherResume, otherStop, otherStatus, otherEvents,
      stranger: summary(stranger), otherSend: summary(other),
    };
  },

  // The same POST again (a retry) while the turn runs: the same turn, no second generation.
  async repost(ctx) {
    const h = ctx.chat();
    const sending = h.send('once');
    await waitFor(() => midAnswer(h), 60000);
    const again = await ctx.api('POST', '/api/chat', { body: h.requests[0].body, text: true });
    await sending;
    const chunks = chunksOf(again.text);
    const text = chunks.filter((c) => c.type === 'text-delta').map((c) => c.delta).join('');
    return {
      chat: summary(h),
      again: { status: again.status, messageId: chunks[0]?.messageId, text, last: chunks.slice(-3).map((c) => c.type ?? c) },
    };
  },

  // regenerate() twice (identical bodies): two new turns, one assistant message on screen.
  async regenerate(ctx) {
    const h = ctx.chat({ maxTokens: ctx.short });
    await h.send('again');
    const ids = [h.lastAssistant().id];
    const texts = [messageText(h.lastAssistant())];
    for (let i = 0; i < 2; i++) {
      await h.regenerate();
      ids.push(h.lastAssistant().id);
      texts.push(messageText(h.lastAssistant()));
    }
    return { chat: summary(h), ids, texts, bodies: h.requests.map((r) => r.body) };
  },

  // A second device opens the chat from its messages (GET /api/chat/{id}/messages) while a turn runs, follows
  // that turn (resumeStream) and continues the chat; the first device, reloaded from the same route, sees the
  // second's turn; then both send at once: one turn, one 409 (and the winner stopped).
  async secondDevice(ctx) {
    const a = ctx.chat();
    const sending = a.send('from the phone');
    await waitFor(() => midAnswer(a), 60000);
    const path = `/api/chat/${encodeURIComponent(a.id)}/messages`;
    const whileRunning = await ctx.api('GET', path);
    const b = ctx.chat({ chatId: a.id, messages: whileRunning.json.messages, maxTokens: ctx.short });
    await b.resume();
    await sending;
    const followed = summary(b);
    await b.send('from the laptop');
    const sent = summary(b);
    const afterB = await ctx.api('GET', path);
    // Both devices at once, each asking a long answer: the winner's turn still runs when the loser's request
    // lands (however late a busy machine delivers it), and is stopped once the loser has its 409 and the winner
    // some text of its new answer (a stop before its first token leaves the turn no answer to show), so the race
    // never depends on how fast a short turn ends or how late the winner's first token comes.
    const reloaded = ctx.chat({ chatId: a.id, messages: afterB.json.messages, maxTokens: 5 * ctx.long });
    const laptop = ctx.chat({ chatId: a.id, messages: afterB.json.messages, maxTokens: 5 * ctx.long });
    const reloadedRoles = reloaded.messages.map((m) => m.role);
    const racing = Promise.all([reloaded.send('phone, at once'), laptop.send('laptop, at once')]);
    const winner = () => (reloaded.status === 'error' ? laptop : laptop.status === 'error' ? reloaded : null);
    const history = afterB.json.messages.length;
    await waitFor(() => winner() !== null && midNewAnswer(winner(), history), 60000);
    const stop = await ctx.api('POST', `/api/chat/${encodeURIComponent(a.id)}/stop`);
    await racing;
    const final = await ctx.api('GET', path);
    const other = await ctx.api('GET', path, { key: ctx.keyB });
    return {
      a: summary(a), whileRunning: whileRunning.json, followed, sent, b: summary(b),
      bBodies: b.requests.filter((r) => r.body).map((r) => r.body),
      afterB: afterB.json, reloadedRoles, reloaded: summary(reloaded), laptop: summary(laptop), stop, final: final.json,
      other,
    };
  },

  // A second tab opens the chat mid-answer: the same turn, the same message, the same text.
  async multiTab(ctx) {
    const first = ctx.chat();
    const sending = first.send('two tabs');
    await waitFor(() => midAnswer(first), 60000);
    const second = ctx.chat({ chatId: first.id });
    await second.resume();
    await sending;
    return { first: summary(first), second: summary(second) };
  },
};

// -- a client-side tool loop (rsb on an upstream that calls tools: tests/consumer/test_aisdk.py scripts it) --

/** The tool the page offers (OpenAI's shape, through the transport's `body`), and the page's answer to it. */
export const WEATHER_TOOL = {
  type: 'function',
  function: {
    name: 'get_weather', description: 'The weather in a city',
    parameters: { type: 'object', properties: { city: { type: 'string' }, unit: { type: 'string' } }, required: ['city'] },
  },
};
const weatherOf = (input) => ({ city: input?.city, temperature: 18, unit: input?.unit ?? 'celsius' });

/** What a user sees of an assistant message with tools: its parts, each with what it shows. */
export function partsOf(m) {
  return (m?.parts ?? []).map((p) => {
    if (p.type === 'text' || p.type === 'reasoning') return { type: p.type, text: p.text, state: p.state };
    if (p.type === 'dynamic-tool' || p.type.startsWith('tool-')) {
      return { type: p.type, toolCallId: p.toolCallId, state: p.state, input: p.input ?? null,
        output: p.output ?? null, errorText: p.errorText ?? null };
    }
    return { type: p.type };
  });
}

function toolSummary(h, calls) {
  return { chat: summary(h), parts: partsOf(h.lastAssistant()), calls, bodies: h.requests.map((r) => r.body ?? null) };
}

const toolPart = (m) => (m?.parts ?? []).find((p) => p.type.startsWith('tool-'));
// Mid tool call: the call's input has begun streaming (a partial input shows), the call is not complete.
const midToolCall = (h) => {
  const p = toolPart(h.lastAssistant());
  return p?.state === 'input-streaming' && typeof p.input?.city === 'string';
};

export const TOOL_SCENARIOS = {
  // The model calls get_weather; onToolCall answers with addToolOutput; sendAutomaticallyWhen
  // (lastAssistantMessageIsCompleteWithToolCalls) sends the result; the model's answer is the same
  // message's next step.
  async toolLoop(ctx) {
    const calls = [];
    const h = ctx.toolChat(calls);
    await h.send('What is the weather in Paris?');
    return toolSummary(h, calls);
  },

  // The page goes away in the middle of the call's arguments (stop() aborts the fetch: the turn goes on);
  // a reloaded page (a new Chat with the persisted partial message) resumes the turn from its start: the
  // call completes, onToolCall runs once, and the loop goes on to the answer.
  async toolResume(ctx) {
    const before = ctx.toolChat([]);
    await before.sendAndStopWhen('What is the weather in Paris? (slowly)', midToolCall, { timeoutMs: 60000 });
    const partial = { chat: summary(before), parts: partsOf(before.lastAssistant()) };
    const calls = [];
    const after = ctx.toolChat(calls, { chatId: before.id, messages: structuredClone(before.messages) });
    await after.resume();
    return { partial, ...toolSummary(after, calls) };
  },

  // A second page opens the chat while the answer after the tool result streams (the continuation of the
  // message): the resume shows the whole message, the call and its result included, once.
  async toolContinuationResume(ctx) {
    const calls = [];
    const first = ctx.toolChat(calls);
    const sending = first.send('What is the weather in Paris? (answer slowly)');
    await waitFor(() => partsOf(first.lastAssistant()).some((p) => p.type === 'text' && p.text.length > 0), 60000);
    const reopenedCalls = [];
    const reopened = ctx.toolChat(reopenedCalls, { chatId: first.id });
    await reopened.resume();
    await sending;
    return { first: toolSummary(first, calls), reopened: toolSummary(reopened, reopenedCalls) };
  },
};

/**
 * Run the scenarios (all of SCENARIOS, or `only`, which may name TOOL_SCENARIOS and JOINER_SCENARIOS too) one
 * after the other against `baseUrl`; each result is what the scenario returned or `{ exception }`. `params`: what
 * the test gives the scenarios it names (e.g. a chat id it prepared).
 */
export async function runScenarios({ ai, major, baseUrl, keyA, keyB, long, short, only, params = {} }) {
  let n = 0;
  const ctx = {
    ai, major, baseUrl, keyB, long, short, params,
    chat: ({ apiKey = keyA, maxTokens = long, body = {}, chatId, ...o } = {}) => createChat({
      ai, baseUrl, apiKey, chatId: chatId ?? `${major}-${Date.now()}-${++n}`,
      transport: { body: { max_tokens: maxTokens, ...body } }, ...o,
    }),
    // A chat with a client-side tool: `calls` collects every onToolCall, each answered with addToolOutput.
    toolChat(calls, { chatId, messages = [] } = {}) {
      const h = createChat({
        ai, baseUrl, apiKey: keyA, chatId: chatId ?? `${major}-tools-${Date.now()}-${++n}`, messages,
        transport: { body: { max_tokens: 200, tools: [WEATHER_TOOL], tool_choice: 'auto' } },
        chat: {
          sendAutomaticallyWhen: ai.lastAssistantMessageIsCompleteWithToolCalls,
          onToolCall: ({ toolCall }) => {
            calls.push({ toolCallId: toolCall.toolCallId, toolName: toolCall.toolName, input: toolCall.input });
            // Not awaited: the SDK's own advice (awaiting it inside onToolCall would wait for itself).
            void h.chat.addToolOutput({ tool: toolCall.toolName, toolCallId: toolCall.toolCallId,
              output: weatherOf(toolCall.input) });
          },
        },
      });
      return h;
    },
    async api(method, path, { key = keyA, body, text = false } = {}) {
      const headers = { authorization: `Bearer ${key}` };
      if (body) headers['content-type'] = 'application/json';
      const r = await fetch(baseUrl + path, { method, headers, body: body ? JSON.stringify(body) : undefined });
      const raw = await r.text();
      let json = null;
      try { json = raw ? JSON.parse(raw) : null; } catch { /* an SSE body */ }
      return text ? { status: r.status, text: raw } : { status: r.status, json };
    },
  };
  const results = {};
  const all = { ...SCENARIOS, ...TOOL_SCENARIOS, ...JOINER_SCENARIOS };
  for (const name of only ?? Object.keys(SCENARIOS)) {
    const t0 = Date.now();
    try {
      results[name] = await all[name](ctx);
    } catch (e) {
      results[name] = { exception: String(e?.stack ?? e) };
    }
    results[name].ms = Date.now() - t0;
  }
  return results;
}
