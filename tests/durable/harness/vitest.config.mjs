import { defineConfig } from "vitest/config"

// Keep vitest's default timeouts (testTimeout 5000 ms): that is what the
// suite's own CLI runs with. Tests that need more pass their own timeout.
// Consequence: the server's long-poll timeout must be well under 5 s for the
// two "offset=now with long-poll" tests (upstream CI uses 500 ms).
export default defineConfig({
  test: {
    include: ["conformance.test.mjs"],
  },
})
