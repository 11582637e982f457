# CMake project include for llama-cpp-python 0.3.36 (rsb): build only what its ctypes bindings load,
# and never the AMX kernels.
#
# Used as  CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_ALL_WARNINGS=OFF -DCMAKE_PROJECT_llama.cpp_INCLUDE=/abs/path/llama-core.cmake"
# CMake includes this file at the end of vendor/llama.cpp's `project("llama.cpp" C CXX)` call, in that
# directory's scope, so what it sets applies to llama.cpp and ggml and nothing else.

# 1. llama-cpp-python's CMakeLists forces the cache entry LLAMA_BUILD_COMMON=ON (a -D cannot override
#    it); a normal variable in llama.cpp's scope shadows it (policies CMP0077/CMP0126 are NEW there), so
#    llama.cpp skips common/ (libllama-common) and vendor/cpp-httplib: 53 of 127 compile units, ~40% of the
#    CPU time, for a library llama-cpp-python never loads.
set(LLAMA_BUILD_COMMON OFF)

# 2. No AMX kernels (they crash on quantized models on some x86 machines): the one definition is in
#    llama-no-amx.cmake, which bench/llama_server.py's llama-server build includes alone.
include("${CMAKE_CURRENT_LIST_DIR}/llama-no-amx.cmake")
