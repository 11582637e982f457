// Verifies every major imports as ESM in this Node and exports what the harness needs (ai7 needs Node 22:
// run this with node_modules/.bin/node to check it too).
const need = ['AbstractChat', 'DefaultChatTransport', 'HttpChatTransport', 'TextStreamChatTransport', 'readUIMessageStream',
  'uiMessageChunkSchema', 'lastAssistantMessageIsCompleteWithToolCalls'];
const majors = Number(process.versions.node.split('.')[0]) >= 22 ? ['ai5', 'ai6', 'ai7'] : ['ai5', 'ai6'];
for (const name of majors) {
  const m = await import(name);
  const pkg = (await import(`${name}/package.json`, { with: { type: 'json' } })).default;
  const res = Object.fromEntries(need.map(k => [k, typeof m[k]]));
  console.log(name, pkg.version, JSON.stringify(res));
  if (typeof m.AbstractChat !== 'function' || typeof m.DefaultChatTransport !== 'function') process.exit(1);
}
console.log('node', process.version, 'OK');
