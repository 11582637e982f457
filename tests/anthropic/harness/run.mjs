// node run.mjs <rsb base url> <api key> <scenario>: runs one Anthropic-protocol client scenario against rsb's Messages
// view, unchanged, and prints {"ok": true, ...what it saw} or {"ok": false, "error": ...} as one line of JSON. The
// scripted upstream behind rsb (tests/scripted_upstream.py) decides what the model answers;
// tests/consumer/test_anthropic_js.py checks.
import Anthropic from '@anthropic-ai/sdk';
import { createAnthropic } from '@ai-sdk/anthropic';
import { generateText, stepCountIs, streamText, tool } from 'ai';
import { z } from 'zod';

const [base, apiKey, scenario] = process.argv.slice(2);
const MODEL = 'm';
const WEATHER = {
  name: 'get_weather',
  description: 'The weather in a city',
  input_schema: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
};
const ASK = [{ role: 'user', content: 'Weather in Paris?' }];

// Every request body a client sends, to report what reached rsb.
const sent = [];
const recording = async (url, init) => {
  if (init?.body) sent.push({ url: String(url), headers: Object.fromEntries(new Headers(init.headers)), body: JSON.parse(init.body) });
  return fetch(url, init);
};

const scenarios = {
  // @anthropic-ai/sdk: messages.stream with a tool (its MessageStream accumulates the call's input_json_delta
  // pieces), then the result sent back as a tool_result and the answer by messages.create.
  async sdkToolLoop() {
    const client = new Anthropic({ baseURL: base, apiKey, maxRetries: 0, fetch: recording });
    const stream = client.messages.stream({ model: MODEL, max_tokens: 256, messages: ASK, tools: [WEATHER] });
    const partial = [];
    stream.on('inputJson', (piece) => partial.push(piece));
    const call = await stream.finalMessage();
    const [use] = call.content;
    const answer = await client.messages.create({ model: MODEL, max_tokens: 256, tools: [WEATHER], messages: [
      ...ASK, { role: 'assistant', content: call.content },
      { role: 'user', content: [{ type: 'tool_result', tool_use_id: use.id, content: '18 C' }] }] });
    return { partial: partial.join(''), call, answer, headers: sent[0].headers };
  },
  // @anthropic-ai/sdk: a streamed text answer (the text events and the final message) and errors as its classes.
  async sdkText() {
    const client = new Anthropic({ baseURL: base, apiKey, maxRetries: 0 });
    const stream = client.messages.stream({ model: MODEL, max_tokens: 64, system: 'Be brief.', messages: ASK });
    const texts = [];
    stream.on('text', (t) => texts.push(t));
    const message = await stream.finalMessage();
    let notFound = null;
    try {
      await client.messages.create({ model: 'claude-unknown', max_tokens: 8, messages: ASK });
    } catch (e) {
      notFound = { status: e.status, name: e.constructor.name, type: e.error?.error?.type };
    }
    return { text: texts.join(''), message, notFound };
  },
  // The AI SDK 7 with @ai-sdk/anthropic: a generateText tool loop of two steps, then streamText's text.
  async aiSdk() {
    const anthropic = createAnthropic({ baseURL: `${base}/v1`, apiKey, fetch: recording });
    const weather = tool({
      description: 'The weather in a city',
      inputSchema: z.object({ city: z.string() }),
      execute: async ({ city }) => `18 C in ${city}`,
    });
    const r = await generateText({ model: anthropic(MODEL), tools: { get_weather: weather }, stopWhen: stepCountIs(3),
      prompt: 'Weather in Paris?' });
    const s = streamText({ model: anthropic(MODEL), prompt: 'Say hello.' });
    let streamed = '';
    for await (const piece of s.textStream) streamed += piece;
    return { text: r.text, steps: r.steps.length, toolResults: r.steps[0].toolResults.map((t) => t.output),
      usage: r.steps[0].usage, finishReasons: r.steps.map((st) => st.finishReason), streamed,
      bodies: sent.map((x) => x.body), headers: sent[0].headers };
  },
};

try {
  const out = await scenarios[scenario]();
  console.log(JSON.stringify({ ok: true, ...out }));
} catch (e) {
  console.log(JSON.stringify({ ok: false, error: String(e?.stack ?? e) }));
  process.exitCode = 1;
}
