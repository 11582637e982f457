"""The configuration reference is the CLI's own flags: regenerate it when a flag changes."""

from __future__ import annotations

from pathlib import Path

from broker.cli_docs import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_reference_matches_the_cli(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import os

    for name in list(os.environ):
        if name.startswith("RSB_"):
            monkeypatch.delenv(name)  # defaults as documented, not as this shell sets them
    assert DOC.read_text() == render(), "run: python3 -m broker.cli_docs > docs/configuration.md"
