// A minimal HTTP front for Vercel's resumable-stream, so the Python load process drives it exactly as it
// drives rsb (HTTP in, SSE-formatted text out). Run: REDIS_URL=redis://... node server.mjs PORT
//   GET /produce?id=ID&chunks=N   start stream ID in THIS process: N chunks at once, then the stream is held
//                                 open (a generation still running); answers when all N are buffered.
//   GET /resume?id=ID&skip=CHARS  resumeExistingStream(ID, CHARS): 404 unknown, 204 finished, 504 + the
//                                 error when the producer does not answer, else the text as it arrives.
import http from "node:http";
import { createResumableStreamContext } from "resumable-stream/redis";

const port = Number(process.argv[2]);
const ctx = createResumableStreamContext({ waitUntil: () => {}, keyPrefix: "bench-peer" });
const chunk = (i) => `data: {"text":" tok${i}"}\n\n`;

async function produce(id, n, res) {
  const makeStream = () =>
    new ReadableStream({
      start(c) {
        for (let i = 0; i < n; i++) c.enqueue(chunk(i));
        // never closed: the generation is still running
      },
    });
  const stream = await ctx.createNewResumableStream(id, makeStream);
  const reader = stream.getReader();
  let got = 0;
  let chars = 0;
  while (got < n) {
    const { value, done } = await reader.read();
    if (done) break;
    got += 1;
    chars += value.length;
  }
  res.writeHead(200, { "content-type": "application/json" });
  res.end(JSON.stringify({ chunks: got, chars, pid: process.pid }));
}

async function resume(id, skip, req, res) {
  let stream;
  try {
    stream = await ctx.resumeExistingStream(id, skip);
  } catch (e) {
    res.writeHead(504, { "content-type": "text/plain" });
    res.end(String(e));
    return;
  }
  if (stream === undefined) {
    res.writeHead(404);
    res.end();
    return;
  }
  if (stream === null) {
    res.writeHead(204);
    res.end();
    return;
  }
  res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" });
  const reader = stream.getReader();
  req.on("close", () => reader.cancel().catch(() => {}));
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      res.write(value);
    }
  } catch (e) {
    res.write(`event: error\ndata: ${JSON.stringify(String(e))}\n\n`);
  }
  res.end();
}

http
  .createServer((req, res) => {
    const url = new URL(req.url, "http://x");
    const id = url.searchParams.get("id");
    const run =
      url.pathname === "/produce"
        ? produce(id, Number(url.searchParams.get("chunks")), res)
        : url.pathname === "/resume"
          ? resume(id, Number(url.searchParams.get("skip") || 0), req, res)
          : Promise.resolve(res.writeHead(url.pathname === "/healthz" ? 200 : 404) && res.end());
    run.catch((e) => {
      try {
        res.writeHead(500);
      } catch {}
      res.end(String(e));
    });
  })
  .listen(port, "127.0.0.1", () => console.log(`peer server ready on ${port}`));
