// Runs the official Durable Streams server conformance suite
// (@durable-streams/server-conformance-tests, pinned in package.json)
// against an already-running server.
//
//   DS_BASE_URL=http://127.0.0.1:8000 npx vitest run
//
// The suite builds its URLs as `${baseUrl}/v1/stream/<unique-name>`, so
// DS_BASE_URL is the server origin (no /v1/stream suffix).
//
// Optional:
//   DS_LONG_POLL_TIMEOUT_MS  server's long-poll timeout, used by the suite to
//                            size per-test timeouts (suite default 20000)
//   DS_SUBSCRIPTIONS=1       also run the optional subscription/webhook tests
//                            (off by default, as in the published CLI)
import { describe } from "vitest"
import { runConformanceTests } from "@durable-streams/server-conformance-tests"

const baseUrl = process.env.DS_BASE_URL
if (!baseUrl) {
  throw new Error("DS_BASE_URL is required, e.g. DS_BASE_URL=http://127.0.0.1:8000")
}

const options = { baseUrl: baseUrl.replace(/\/+$/, "") }
if (process.env.DS_LONG_POLL_TIMEOUT_MS) {
  options.longPollTimeoutMs = Number(process.env.DS_LONG_POLL_TIMEOUT_MS)
}
if (process.env.DS_SUBSCRIPTIONS === "1") options.subscriptions = true

describe("Durable Streams conformance", () => {
  runConformanceTests(options)
})
