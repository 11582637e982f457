// Runs the page's ES modules (consumer/static/partial-json.js, rsb-client.js's Answer) under Node for
// tests/consumer/test_static_js.py: one JSON request per line on stdin, one JSON answer per line on stdout.
// Nothing to install: the modules are dependency-free.
import { createInterface } from "node:readline";

const { PartialJSON } = await import(new URL("../../../consumer/static/partial-json.js", import.meta.url));
const { Answer } = await import(new URL("../../../consumer/static/rsb-client.js", import.meta.url));

// undefined (nothing yet) and null (a value) must stay apart on the way back; a copy, since the parser goes
// on mutating its value.
const shown = (started, value) => (started ? [true, JSON.parse(JSON.stringify(value))] : [false, null]);

function answerState(a) {
  let parsed;
  try {
    parsed = shown(a.parsed !== undefined, a.parsed);
  } catch (e) {
    parsed = { error: e.message };
  }
  return {
    text: a.text, reasoning: a.reasoning, deltas: a.deltas,
    toolCalls: a.toolCalls.map((c) => ({ index: c.index, id: c.id, name: c.name, arguments: c.arguments,
      parsedArguments: shown(c.parsedArguments !== undefined, c.parsedArguments) })),
    parsed,
  };
}

const ops = {
  // Feeds the pieces in order: the partial value after each, then after end().
  pieces({ pieces }) {
    const p = new PartialJSON();
    const after = [];
    try {
      for (const piece of pieces) {
        p.feed(piece);
        after.push(shown(p.started, p.value));
      }
      p.end();
    } catch (e) {
      return { after, error: e.message };
    }
    return { after, done: p.done, final: shown(p.started, p.value) };
  },
  // Feeds events to an Answer: its state after each, and that of an Answer rebuilt from its toJSON().
  answer({ events }) {
    const a = new Answer();
    const after = events.map(([id, type, data]) => {
      const changed = a.feed({ id, type, data });
      return { changed, ...answerState(a) };
    });
    const restored = new Answer(JSON.parse(JSON.stringify(a)).log);
    return { after, restored: answerState(restored) };
  },
};

for await (const line of createInterface({ input: process.stdin })) {
  const req = JSON.parse(line);
  let out;
  try {
    out = ops[req.op](req);
  } catch (e) {
    out = { crash: String(e.stack || e) };
  }
  process.stdout.write(JSON.stringify(out) + "\n");
}
