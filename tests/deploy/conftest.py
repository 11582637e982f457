"""Fixtures of the deployment checks: what rsb's command line accepts (see deploy/cli_settings.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from deploy.cli_settings import Command, parse_help, run_help


@pytest.fixture(scope="session")
def rsb_cli() -> Callable[[str], Command]:
    """``rsb_cli("consumer")``: the settings `rsb consumer --help` lists (cached per command)."""
    cache: dict[str, Command] = {}

    def get(command: str) -> Command:
        if command not in cache:
            cache[command] = parse_help(command, run_help(command))
        return cache[command]

    return get
