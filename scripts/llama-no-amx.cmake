# No AMX kernels in a llama.cpp build on x86 (included by scripts/llama-core.cmake for the engine, and used
# alone as the project include of bench/llama_server.py's llama-server build).
#
# GGML_NATIVE=ON (the default) compiles with -march=native, which on Sapphire Rapids and later turns
# on ggml's AMX kernels; they segfault at the first matmul of a quantized model on some machines/kernels
# (ldtilecfg in a worker thread: ggml-org/llama.cpp#20824, fix pending in #26954). GCC and Clang honour
# an explicit -mno-* over -march=native whatever the order; AVX-512/AVX2 kernels are used instead.
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
