#!/usr/bin/env bash
# Time "clean venv -> served answer" for rsb's first command, once, the way a new user meets it:
# a copy of the checkout, a new venv, an EMPTY pip cache (a private PIP_CACHE_DIR: the machine's shared
# cache is neither used nor purged), then ./scripts/up.sh, then one chat answer over the HTTP API.
#   usage: scripts/e2e_timing.sh [REPO=this checkout] [PORT=8765] [extra `rsb up` options...]
# Prints: install (llama.cpp build shown separately), time to /readyz, time to the answer's `done` event.
# Note: this machine's pip config (local mirrors in find-links/extra-index-url) still applies; to go to
# PyPI only, run it under `env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null`.
set -euo pipefail
repo=${1:-$(cd "$(dirname "$0")/.." && pwd)}; port=${2:-8765}; shift $(( $# < 2 ? $# : 2 ))
work=$(mktemp -d /tmp/rsb-e2e.XXXXXX)
mkdir "$work/src"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar cf -) | tar xf - -C "$work/src"
export PIP_CACHE_DIR=$work/pip-cache RSB_VENV=$work/venv
now() { date +%s.%N; }
stamp() { while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N)" "$line"; done; }

t0=$(now)
( cd "$work/src" && exec ./scripts/up.sh --port "$port" "$@" ) > >(stamp > "$work/up.log") 2>&1 &
pid=$!
cleanup() { kill -INT "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; }
trap cleanup EXIT

until curl -sf "http://127.0.0.1:$port/readyz" >/dev/null 2>&1; do
  kill -0 "$pid" 2>/dev/null || { echo "up.sh exited before serving; log: $work/up.log" >&2; tail -n 30 "$work/up.log" >&2; exit 1; }
  sleep 0.5
done
t_ready=$(now)

id=$(python3 -c 'import uuid; print(uuid.uuid4())')
curl -sf "http://127.0.0.1:$port/v1/streams" -H 'content-type: application/json' \
  -d "{\"id\": \"$id\", \"messages\": [{\"role\": \"user\", \"content\": \"What is a resumable stream?\"}], \"max_tokens\": 128}" >/dev/null
curl -sN --max-time 300 "http://127.0.0.1:$port/v1/streams/$id/events" > "$work/answer.sse"
t_done=$(now)
grep -q '^event: done' "$work/answer.sse" || { echo "no done event; see $work/answer.sse" >&2; exit 1; }

first_ts() { grep -m1 -E "$1" "$work/up.log" | cut -d' ' -f1; }
b0=$(first_ts 'Building wheel for llama-cpp-python.*started')
b1=$(first_ts 'Building wheel for llama-cpp-python.*finished')
t_up=$(first_ts 'rsb is up: ')
python3 - "$t0" "$t_ready" "$t_done" "${b0:-0}" "${b1:-0}" "${t_up:-0}" "$work" <<'PY'
import json, sys
t0, ready, done, b0, b1, up = map(float, sys.argv[1:7]); work = sys.argv[7]
text = "".join(json.loads(l[6:]).get("text", "") for l in open(f"{work}/answer.sse") if l.startswith("data: {") and '"text"' in l)
build = b1 - b0 if b0 and b1 else float("nan")
print(f"llama.cpp build (pip 'Building wheel' started->finished): {build:7.1f} s")
print(f"clean venv -> /readyz:                                     {ready - t0:7.1f} s")
print(f"clean venv -> 'rsb is up' (model loaded, page answering):  {up - t0 if up else float('nan'):7.1f} s")
print(f"clean venv -> answer complete (done event):                {done - t0:7.1f} s")
print(f"everything but the llama.cpp build:                        {done - t0 - build:7.1f} s  (goal: <= 60 s)")
print(f"answer: {text[:300]!r}")
print(f"logs: {work}/up.log (timestamped), {work}/answer.sse")
PY
