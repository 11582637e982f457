"""``python3 -m bench.llama_server``: build llama.cpp's own ``llama-server`` once, the benchmark peer of issue 43.

The reference is built, not guessed: the llama.cpp source is the one that ships inside llama-cpp-python's own
sdist (``vendor/llama.cpp``), at the version rsb's engine runs, so the peer and the engine are the same
llama.cpp commit. The build has the engine's options where they apply (scripts/llama-cmake-args.sh): no AMX
kernels (scripts/llama-no-amx.cmake, they crash on quantized models on some x86 machines), quiet warnings;
and what a server needs that the engine skips (libllama-common, cpp-httplib). No web UI, no OpenSSL: the
benchmark talks plain HTTP to 127.0.0.1. The binary is cached outside the repository
(``~/.cache/rsb-bench/llama-server-<version>``); it is a benchmark peer only, no test needs it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("RSB_BENCH_CACHE", Path.home() / ".cache" / "rsb-bench"))
NO_AMX = ROOT / "scripts" / "llama-no-amx.cmake"


def engine_version() -> str:
    """The llama-cpp-python the engine runs (the installed one; pyproject pins it)."""
    return importlib.metadata.version("llama_cpp_python")


def binary_path(version: str | None = None) -> Path:
    return CACHE / f"llama-server-{version or engine_version()}"


def cmake_args(src: Path, build: Path) -> list[str]:
    return [
        "cmake", "-S", str(src), "-B", str(build),
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",          # one self-contained binary to cache
        "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_COMMON=ON",
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
        "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",  # no web UI (nor its download)
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_ALL_WARNINGS=OFF",
        f"-DCMAKE_PROJECT_llama.cpp_INCLUDE={NO_AMX}",
    ]


def fetch_source(version: str) -> Path:
    """llama-cpp-python's sdist, downloaded once by pip and unpacked; returns its vendor/llama.cpp."""
    src_dir = CACHE / "src"
    unpacked = src_dir / f"llama_cpp_python-{version}"
    llama = unpacked / "vendor" / "llama.cpp"
    if (llama / "CMakeLists.txt").exists():
        return llama
    src_dir.mkdir(parents=True, exist_ok=True)
    sdist = src_dir / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={version}", "-d", str(src_dir)],
                       check=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(src_dir, filter="data")
    return llama


def build(version: str | None = None, *, jobs: int = 2, force: bool = False) -> Path:
    """The cached llama-server binary of ``version``, built first if missing (a few minutes on 2 cores)."""
    version = version or engine_version()
    out = binary_path(version)
    if out.exists() and not force:
        return out
    llama = fetch_source(version)
    build_dir = CACHE / f"build-llama-server-{version}"
    t0 = time.monotonic()
    subprocess.run(cmake_args(llama, build_dir), check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)], check=True)
    took = time.monotonic() - t0
    tmp = out.with_suffix(".tmp")
    shutil.copy2(build_dir / "bin" / "llama-server", tmp)
    tmp.replace(out)  # the cached binary appears whole or not at all
    print(f"llama-server {version} built in {took:.0f} s: {out}", flush=True)
    return out


def ensure() -> Path:
    """The binary for the benchmark scenarios: built on first use, with the time it took printed."""
    out = binary_path()
    if not out.exists():
        print(f"building llama-server {engine_version()} from llama-cpp-python's sdist "
              f"(once, cached in {CACHE}; several minutes)", flush=True)
    return build()


def default_parallel() -> int:
    """rsb's default ``--parallel``: the peer runs as many slots (``-np``)."""
    from generator.settings import EngineSettings

    return int(next(f.default for f in dataclasses.fields(EngineSettings) if f.name == "parallel"))


def default_n_ctx() -> int:
    """rsb's default ``--n-ctx`` (per sequence)."""
    from generator.settings import EngineSettings

    return int(next(f.default for f in dataclasses.fields(EngineSettings) if f.name == "n_ctx"))


ALIAS = "llama-server"


def argv(binary: Path, model: str, port: int, slots: int) -> list[str]:
    """llama-server as rsb's generator runs llama.cpp: the same model file, threads (physical cores, for prompts
    too) and context per sequence (llama-server's ``-c`` is split among its ``-np`` slots); its prompt cache as
    it ships (per-slot prompt reuse, ``cache_prompt`` on, ``--cache-ram`` at its default)."""
    from generator.engines.llama import physical_cores

    threads = str(physical_cores())
    return [str(binary), "--model", model, "--host", "127.0.0.1", "--port", str(port), "--threads", threads,
            "--threads-batch", threads, "--parallel", str(slots), "--ctx-size", str(slots * default_n_ctx()),
            "--alias", ALIAS]


@contextlib.contextmanager
def serving(slots: int) -> Iterator[tuple[str, list[str]]]:
    """llama-server ``-np slots`` on the default model and a free port, built first if need be; yields its base
    URL and command line, and stops it on exit."""
    from bench import procs
    from broker.redis.server import free_port
    from generator.engines.default_model import default_model_path

    binary = ensure()
    model = default_model_path()
    assert model is not None, "the default model is not installed"
    port = free_port()
    cmd = argv(binary, str(model), port, slots)
    server = procs.Proc(cmd, "llama-server")
    try:
        procs.wait_http(f"http://127.0.0.1:{port}/health", server, 300)
        yield f"http://127.0.0.1:{port}", cmd
    finally:
        server.stop(30)


def main() -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.llama_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", default=None, help="llama-cpp-python version (default: the installed one)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--force", action="store_true", help="rebuild even if the binary is cached")
    args = p.parse_args()
    out = binary_path(args.version)
    if out.exists() and not args.force:
        print(f"cached: {out}")
        return 0
    build(args.version, jobs=args.jobs, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
