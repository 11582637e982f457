// Runs the scenarios (scenarios.mjs) with one major of the `ai` package against a running rsb and writes
// the results as JSON. tests/consumer/test_aisdk.py starts rsb and runs this; by hand:
//   RSB_URL=http://127.0.0.1:8000 RSB_KEY_A=a.secret RSB_KEY_B=b.secret node run.mjs ai6 results.json
// ai7 needs Node 22: node_modules/.bin/node run.mjs ai7 results.json (the npm package `node`, pinned here).
// Optional: RSB_SCENARIOS=send,abortResume (the tool scenarios, toolLoop and toolResume, run only when named:
// they need rsb on an upstream that calls tools)  RSB_LONG_TOKENS (default 600)  RSB_SHORT_TOKENS (default 30)
// RSB_PARAMS (JSON: what the named scenarios take, e.g. a chat id the test prepared: joiners.mjs).
import { writeFileSync } from 'node:fs';
import { runScenarios } from './scenarios.mjs';

const [major, out] = process.argv.slice(2);
if (!['ai5', 'ai6', 'ai7'].includes(major) || !out) {
  console.error('usage: node run.mjs ai5|ai6|ai7 RESULTS.json');
  process.exit(2);
}
const env = process.env;
const ai = await import(major);
const pkg = (await import(`${major}/package.json`, { with: { type: 'json' } })).default;
const results = await runScenarios({
  ai, major, baseUrl: env.RSB_URL, keyA: env.RSB_KEY_A, keyB: env.RSB_KEY_B,
  long: Number(env.RSB_LONG_TOKENS ?? 600), short: Number(env.RSB_SHORT_TOKENS ?? 30),
  only: env.RSB_SCENARIOS ? env.RSB_SCENARIOS.split(',') : undefined,
  params: env.RSB_PARAMS ? JSON.parse(env.RSB_PARAMS) : {},
});
writeFileSync(out, JSON.stringify({ major, version: pkg.version, node: process.version, results }, null, 1));
