#!/usr/bin/env bash
# Install everything the tests need on a fresh machine, then run them. `.ci/run` runs this script.
#  - system packages: redis-server (tests start their own on free ports) and the real tools some tests
#    drive (see SYSTEM_PACKAGES); installed with apt-get when missing and we are root.
#  - Python packages: rsb itself with its [test] extra. llama-cpp-python compiles llama.cpp from source;
#    the CMake options skip what rsb does not use, and pip's wheel cache keeps later installs fast.
#  - Node packages (`npm ci`, when npm is there): the Durable Streams conformance harness (tests/durable/harness).
set -euo pipefail
cd "$(dirname "$0")/.."

SYSTEM_PACKAGES=(redis-server chromium redis-tools nginx)
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

export CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
python3 -m pip install -q -e '.[test]'
# Node harnesses, each pinned by its package-lock.json (node_modules is git-ignored). Without node the tests
# that need it skip and say why; with node they need these installs.
if command -v npm >/dev/null 2>&1; then
  (cd tests/durable/harness && npm ci --no-audit --no-fund --loglevel=error)
fi
exec python3 -m pytest "$@"
