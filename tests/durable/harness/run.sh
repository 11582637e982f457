#!/usr/bin/env bash
# Run the Durable Streams conformance suite against a running server and summarize.
#
#   DS_BASE_URL=http://127.0.0.1:8000 DS_LONG_POLL_TIMEOUT_MS=500 ./run.sh rsb
#
# Writes results/<label>.json (vitest JSON) and results/<label>.log, prints the counts and
# the failing/skipped test names, and compares with the reference server's baseline
# (baseline/reference-0.3.7-lp500ms.tsv): any test the reference passes that does not pass
# here is listed as NOT PASSING and makes the exit status 1.
#
# The server's long-poll timeout must be well under 5 s (vitest's default per-test timeout,
# which the suite keeps for the two "offset=now with long-poll" tests); upstream uses 500 ms.
set -euo pipefail
cd "$(dirname "$0")"
label="${1:-run}"
: "${DS_BASE_URL:?set DS_BASE_URL, e.g. http://127.0.0.1:8000}"
mkdir -p results
set +e
npx vitest run --reporter=dot --reporter=json --outputFile="results/${label}.json" >"results/${label}.log" 2>&1
set -e
node summarize.mjs "results/${label}.json" --compare "${DS_BASELINE:-baseline/reference-0.3.7-lp500ms.tsv}"
