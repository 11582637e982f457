// Scenarios of late joiners, resets and sending again, run only when named (RSB_SCENARIOS) on a chat the test
// prepared (RSB_PARAMS: its chat id, and files to coordinate through): the test writes the turn's events itself
// (tests/typed_streams.py), so it knows every piece, and checks what each chat shows against the stream.
// tests/consumer/test_late_joiners.py runs them.
import { messageText, waitFor } from './chat.mjs';
import { partsOf, summary } from './scenarios.mjs';

/** A fetch that keeps every response body's text as it passes (`bodies`, in request order). */
function teeFetch(bodies) {
  return (fetchImpl) => async (input, init) => {
    const res = await fetchImpl(input, init);
    const entry = { url: String(input), status: res.status, text: '' };
    bodies.push(entry);
    if (!res.body) return res;
    const dec = new TextDecoder();
    const reader = res.body.getReader();
    const body = new ReadableStream({
      async pull(c) {
        const { done, value } = await reader.read();
        if (done) { c.close(); return; }
        entry.text += dec.decode(value, { stream: true });
        c.enqueue(value);
      },
      cancel(r) { return reader.cancel(r); },
    });
    return new Response(body, { status: res.status, statusText: res.statusText, headers: res.headers });
  };
}

/** The resume URL from the latest (what a page that only wants the answer as it stands sets). */
function fromLatest(ctx, query = 'from=latest') {
  return ({ id, headers }) => ({ api: `${ctx.baseUrl}/api/chat/${encodeURIComponent(id)}/stream?${query}`, headers });
}

function result(h, bodies) {
  return { chat: summary(h), parts: partsOf(h.lastAssistant()), bodies };
}

export const JOINER_SCENARIOS = {
  // The chat's running turn, read three ways at once: a page that resumes it (from its start), a page that resumes
  // it from the latest (the message so far, then the tail) and the raw body of that read. The test finishes the
  // turn once all three are reading; both pages must end with the same message.
  async lateJoin(ctx) {
    const chatId = ctx.params.chatId;
    const fullBodies = [], joinerBodies = [];
    const full = ctx.chat({ chatId, wrapFetch: teeFetch(fullBodies) });
    const joiner = ctx.chat({ chatId, wrapFetch: teeFetch(joinerBodies),
      transport: { prepareReconnectToStreamRequest: fromLatest(ctx) } });
    const [, , raw] = await Promise.all([
      full.resume(), joiner.resume(),
      ctx.api('GET', `/api/chat/${encodeURIComponent(chatId)}/stream?from=latest`, { text: true }),
    ]);
    return { full: result(full, fullBodies), joiner: result(joiner, joinerBodies), raw };
  },

  // ai >= 7.0.70: a page reading with ?reset_step=1 when a failover takes back text it was shown. It tells the test
  // (params.readyFile) once it shows `params.readyText`; the test then loses the stream's last events, writes
  // others, and makes the pod resync; the page's message must end as the stream's, with no text twice.
  async resetStep(ctx) {
    const chatId = ctx.params.chatId;
    const bodies = [];
    const h = ctx.chat({ chatId, wrapFetch: teeFetch(bodies),
      transport: { api: `${ctx.baseUrl}/api/chat?reset_step=1` } });
    const resuming = h.resume();
    await waitFor(() => messageText(h.lastAssistant()) === ctx.params.readyText, 60000);
    const { writeFileSync } = await import('node:fs'); // Node only: this scenario does not run in a page
    writeFileSync(ctx.params.readyFile, 'ready');
    await resuming;
    return result(h, bodies);
  },

  // A page stops reading its answer (stop(): the turn goes on) and sends again with on_busy 'interrupt': the running
  // answer stops for real, and the new turn's answer comes into a new message.
  async interruptSend(ctx) {
    const h = ctx.chat({ maxTokens: 5 * ctx.long });
    await h.sendAndStopWhen('tell me a long story', (x) => messageText(x.lastAssistant()).length >= 40,
      { timeoutMs: 60000 });
    const partial = summary(h);
    await h.chat.sendMessage({ text: 'stop, say hi' }, { body: { on_busy: 'interrupt', max_tokens: ctx.short } });
    return { partial, final: summary(h), messages: h.messages.map((m) => ({ id: m.id, role: m.role, text: messageText(m) })) };
  },

  // While a page's answer runs, a second device opens the chat (GET /api/chat/{id}/messages) and sends with on_busy
  // 'enqueue': its turn waits for the running answer, then runs on a history that holds it.
  async enqueueSecondDevice(ctx) {
    const first = ctx.chat({ maxTokens: ctx.long });
    const sending = first.send('first question');
    await waitFor(() => messageText(first.lastAssistant()).length >= 20, 60000);
    const loaded = await ctx.api('GET', `/api/chat/${encodeURIComponent(first.id)}/messages`);
    const second = ctx.chat({ chatId: first.id, messages: loaded.json.messages, maxTokens: ctx.short });
    await second.chat.sendMessage({ text: 'second question' }, { body: { on_busy: 'enqueue' } });
    await sending;
    return { first: summary(first), second: summary(second), loaded: loaded.json };
  },
};
