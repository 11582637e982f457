"""Engines that drive a remote inference server (``rsb generator --upstream URL``)."""

from generator.engines.upstream.engine import PROTOCOLS, UpstreamEngine, detect_api

__all__ = ["PROTOCOLS", "UpstreamEngine", "detect_api"]
