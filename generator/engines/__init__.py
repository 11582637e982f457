"""Inference engines: in-process llama.cpp (``llama``, an optional extra: ``pip install 'rsb[llama]'``: one
generation at a time, ``one_sequence``, or ``--parallel N`` in one batch, ``batch_engine``)
and remote servers (``upstream``). ``build_engine`` picks one from the settings; the worker only knows
``Engine`` (``generator.engines.base``)."""

from __future__ import annotations

import logging

from generator.engines.base import (
    Engine,
    EngineError,
    Generation,
    GenerationLost,
    PromptTooLong,
    UpstreamError,
    error_code,
)
from generator.settings import EngineSettings

log = logging.getLogger("rsb.generator")

__all__ = ["Engine", "EngineError", "EngineUnavailable", "Generation", "GenerationLost", "PromptTooLong",
           "UpstreamError", "build_engine", "error_code"]


class EngineUnavailable(Exception):
    """The configured engine cannot start (its package is not installed, its model is missing)."""


def build_engine(settings: EngineSettings) -> Engine:
    if settings.upstream_urls:
        from generator.engines.upstream import UpstreamEngine

        return UpstreamEngine(settings.upstream_urls, api=settings.upstream_api, model=settings.upstream_model,
                              api_key=settings.upstream_api_key, timeout_s=settings.upstream_timeout_s,
                              ignore_eos=settings.ignore_eos, keep_alive=settings.upstream_keep_alive)
    try:
        from generator.engines.batch_engine import BatchedEngine
        from generator.engines.one_sequence import OneSequenceEngine
    except ImportError as e:
        raise EngineUnavailable(f"in-process llama.cpp needs llama-cpp-python ({e}): pip install 'rsb[llama]', "
                                "or drive a server with --upstream URL") from None
    from generator.engines.default_model import ModelNotFound, resolve_model

    try:
        model = resolve_model(settings.model_path, settings.model_name)
    except ModelNotFound as e:
        raise EngineUnavailable(str(e)) from None
    if settings.model_path is None:
        log.info("no --model: using the default model", extra={"model": model.name, "model_path": str(model.path)})
    try:
        if settings.parallel > 1:
            return BatchedEngine(str(model.path), parallel=settings.parallel, n_threads=settings.n_threads,
                                 n_ctx=settings.n_ctx, ignore_eos=settings.ignore_eos, name=model.name,
                                 prompt_cache_mib=settings.prompt_cache_mib)
        return OneSequenceEngine(str(model.path), n_threads=settings.n_threads, n_ctx=settings.n_ctx,
                                 ignore_eos=settings.ignore_eos, name=model.name,
                                 prompt_cache_mib=settings.prompt_cache_mib)
    except ValueError as e:  # llama-cpp-python's "Failed to load model from file" (a corrupt or unsupported GGUF)
        raise EngineUnavailable(f"llama.cpp cannot load {model.path}: {e}") from None
    except EngineError as e:  # no context of --parallel sequences (too many, or no memory for their KV)
        raise EngineUnavailable(f"llama.cpp cannot run {model.path}: {e}") from None
