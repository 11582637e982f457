// Verifies both majors import as ESM in this Node and export what the harness needs.
const need = ['AbstractChat', 'DefaultChatTransport', 'HttpChatTransport', 'TextStreamChatTransport', 'readUIMessageStream', 'uiMessageChunkSchema'];
for (const name of ['ai5', 'ai6']) {
  const m = await import(name);
  const pkg = (await import(`${name}/package.json`, { with: { type: 'json' } })).default;
  const res = Object.fromEntries(need.map(k => [k, typeof m[k]]));
  console.log(name, pkg.version, JSON.stringify(res));
  if (typeof m.AbstractChat !== 'function' || typeof m.DefaultChatTransport !== 'function') process.exit(1);
}
console.log('node', process.version, 'OK');
