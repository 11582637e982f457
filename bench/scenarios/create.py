"""create: TODO."""

import argparse
from typing import Any


def add_args(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> dict[str, Any]:
    return {}
