// node run.mjs <rsb base url> <scenario>: runs one framework scenario against rsb's OpenAI views, unchanged, and
// prints {"ok": true, ...what it saw} or {"ok": false, "error": ...} as one line of JSON. The scripted upstream behind
// rsb (tests/scripted_upstream.py) decides what the model answers; tests/consumer/test_frameworks_js.py checks.
import { generateText, Output, stepCountIs, tool } from 'ai';
import { createOpenAI } from '@ai-sdk/openai';
import { createOpenAICompatible } from '@ai-sdk/openai-compatible';
import { Agent, run, setDefaultOpenAIClient, setOpenAIAPI, setTracingDisabled, tool as agentTool } from '@openai/agents';
import OpenAI from 'openai';
import { z } from 'zod';

const [base, scenario] = process.argv.slice(2);
const MODEL = 'scripted-model';

const weather = () => tool({
  description: 'The weather in a city',
  inputSchema: z.object({ city: z.string() }),
  execute: async ({ city }) => `18 C in ${city}`,
});

const scenarios = {
  // The AI SDK on the chat completions API: a tool loop of two steps.
  async compatibleTools() {
    const provider = createOpenAICompatible({ name: 'rsb', baseURL: `${base}/v1`, apiKey: 'unused' });
    const r = await generateText({ model: provider(MODEL), tools: { get_weather: weather() }, stopWhen: stepCountIs(3),
      prompt: 'Weather in Paris?' });
    return { text: r.text, steps: r.steps.length };
  },
  // The AI SDK's Responses provider (store: true by default): its second step sends the first step's call as an
  // item_reference.
  async responsesTools() {
    const sent = [];
    const recording = async (url, init) => {
      if (init?.body) sent.push(JSON.parse(init.body));
      return fetch(url, init);
    };
    const provider = createOpenAI({ baseURL: `${base}/v1`, apiKey: 'unused', fetch: recording });
    const model = provider.responses(MODEL);
    const ask = { role: 'user', content: 'Weather in Paris?' };
    const r = await generateText({ model, tools: { get_weather: weather() }, stopWhen: stepCountIs(3),
      messages: [ask] });
    // The next turn sends the answer so far back: its text by reference (the item's id), as store: true has it.
    const next = await generateText({ model, tools: { get_weather: weather() },
      messages: [ask, ...r.response.messages, { role: 'user', content: 'And tomorrow?' }] });
    const references = sent.flatMap((b) => (Array.isArray(b.input) ? b.input : []))
      .filter((item) => item.type === 'item_reference').length;
    return { text: r.text, steps: r.steps.length, references, next: next.text, inputs: sent.map((b) => b.input) };
  },
  // Structured output with zod's integers (±9007199254740991 in the JSON Schema) on both APIs.
  async structured() {
    const schema = z.object({ city: z.string(), population: z.number().int().nonnegative() });
    const compatible = createOpenAICompatible({ name: 'rsb', baseURL: `${base}/v1`, apiKey: 'unused',
      supportsStructuredOutputs: true });
    const a = await generateText({ model: compatible(MODEL), output: Output.object({ schema }), prompt: 'Oslo?' });
    const responses = createOpenAI({ baseURL: `${base}/v1`, apiKey: 'unused' });
    const b = await generateText({ model: responses.responses(MODEL), output: Output.object({ schema }),
      prompt: 'Oslo?' });
    return { chat: a.output, responses: b.output };
  },
  // @openai/agents on the Responses API, then continuing its run by previousResponseId and by conversationId.
  async agents() {
    setTracingDisabled(true);
    const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: 'unused', maxRetries: 0 });
    setDefaultOpenAIClient(client);
    setOpenAIAPI('responses');
    const getWeather = agentTool({ name: 'get_weather', description: 'The weather in a city',
      parameters: z.object({ city: z.string() }), execute: async ({ city }) => `18 C in ${city}` });
    const agent = new Agent({ name: 'weather', instructions: 'Answer with the weather.', tools: [getWeather],
      model: MODEL });
    const first = await run(agent, 'Weather in Paris?');
    const second = await run(agent, 'And in Rome?', { previousResponseId: first.lastResponseId });
    const conversation = await client.conversations.create({});
    const third = await run(agent, 'And in Oslo?', { conversationId: conversation.id });
    return { outputs: [first.finalOutput, second.finalOutput, third.finalOutput] };
  },
};

try {
  const out = await scenarios[scenario]();
  console.log(JSON.stringify({ ok: true, ...out }));
} catch (e) {
  console.log(JSON.stringify({ ok: false, error: String(e?.stack ?? e), body: e?.responseBody ?? null }));
}
