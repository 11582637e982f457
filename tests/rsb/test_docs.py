"""The configuration reference is the CLI's own flags: regenerate it when a flag changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from rsb.docs import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_reference_matches_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("RSB_"):
            monkeypatch.delenv(name)  # defaults as documented, not as this shell sets them
    assert DOC.read_text() == render(), "run: python3 -m rsb.docs > docs/configuration.md"
