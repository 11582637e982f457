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

# 2. GGML_NATIVE=ON (the default) compiles with -march=native, which on Sapphire Rapids and later turns
#    on ggml's AMX kernels; they segfault at the first matmul of a quantized model on some machines/kernels
#    (ldtilecfg in a worker thread: ggml-org/llama.cpp#20824, fix pending in #26954). GCC and Clang honour
#    an explicit -mno-* over -march=native whatever the order; AVX-512/AVX2 kernels are used instead.
if (CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64|i[3-6]86|x86)$" AND CMAKE_C_COMPILER_ID MATCHES "GNU|Clang")
    include(CheckCCompilerFlag)
    foreach(flag -mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
        string(MAKE_C_IDENTIFIER "RSB_HAVE${flag}" var)
        check_c_compiler_flag(${flag} ${var})
        if (${var})
            add_compile_options(${flag})
        endif()
    endforeach()
endif()
