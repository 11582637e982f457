"""Which model file an in-process engine loads when none is named, and what a model file is called."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("rsb.generator")


@dataclass(frozen=True, slots=True)
class ModelFile:
    name: str  # as reported in `started` events, /v1/models and the page
    path: Path


def gguf_name(path: Path) -> str:
    """The model's own name (GGUF ``general.name``), else the file name without extension."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(path).get_field("general.name")
        if field is not None:
            return str(field.contents())
    except Exception:  # gguf not installed, or a file it cannot read: the file name will do
        pass
    return path.stem


def default_model() -> ModelFile:
    """The model served when none is named: the demo model (random weights), built locally."""
    from generator.engines.demo_model import DEMO_MODEL_NAME, ensure_demo_model

    return ModelFile(DEMO_MODEL_NAME, ensure_demo_model())


def resolve_model(path: str | None) -> ModelFile:
    if path is None:
        return default_model()
    p = Path(path)
    return ModelFile(gguf_name(p), p)
