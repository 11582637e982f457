# Sourced by scripts/up.sh and scripts/test.sh: the one definition of how rsb builds llama.cpp through
# llama-cpp-python. CMAKE_ARGS is the only channel that reaches a *dependency's* build (pip's -C options
# stop at the requirements named on the command line). The options:
#  - LLAVA_BUILD=OFF: no mtmd/llava (51 compile units rsb never loads);
#  - LLAMA_ALL_WARNINGS=OFF: a readable build log (0 warnings instead of ~2,500);
#  - scripts/llama-core.cmake (an absolute path: CMake runs in a temporary directory): no libllama-common
#    nor cpp-httplib, and no AMX kernels (they crash on quantized models on some x86 machines; see the file).
# A CMAKE_ARGS already set by the caller (e.g. -DGGML_CUDA=on) is kept and comes last, so it wins.
# Caveat: pip's wheel cache ignores build options; scripts/test.sh checks the installed build (AMX off).
rsb_scripts_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_ALL_WARNINGS=OFF -DCMAKE_PROJECT_llama.cpp_INCLUDE=$rsb_scripts_dir/llama-core.cmake${CMAKE_ARGS:+ $CMAKE_ARGS}"
unset rsb_scripts_dir

# pip's wheel cache ignores CMAKE_ARGS: a llama_cpp wheel cached from another build may hold ggml's AMX
# kernels, which crash on quantized models (the default model) on AMX machines. Rebuild it once if so.
#   usage: rsb_rebuild_llama_if_amx PYTHON [pip options...]
rsb_rebuild_llama_if_amx() {
  local py=$1; shift
  if "$py" -c 'import llama_cpp, sys; sys.exit(b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info())'; then
    return 0
  fi
  echo "rsb: the installed llama_cpp has AMX kernels (a wheel built without scripts/llama-core.cmake); rebuilding it"
  local version
  version=$("$py" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))')
  "$py" -m pip cache remove llama_cpp_python >/dev/null 2>&1 || true
  "$py" -m pip install --force-reinstall --no-deps "$@" "llama-cpp-python==$version"
}
