"""docs/configuration.md is generated from the CLI's own parser, so it cannot drift from the flags.

    python3 -m broker.cli_docs > docs/configuration.md

The test suite checks that the file matches what this prints."""

from __future__ import annotations

import argparse

from broker.cli import build_parser

HEADER = """# Configuration reference

Generated from the `rsb` command line (`python3 -m broker.cli_docs > docs/configuration.md`); a test
keeps it in sync. Every flag has an environment twin, `RSB_` + the flag in upper case with `_` for `-`
(`--heartbeat-s` is `RSB_HEARTBEAT_S`); the flag wins over the variable.
"""


def _rows(parser: argparse.ArgumentParser) -> list[str]:
    out = ["| flag | default | env | what it does |", "| --- | --- | --- | --- |"]
    for action in parser._actions:
        if action.dest == "help" or not action.option_strings:
            continue
        flag = action.option_strings[-1]
        text = (action.help or "").split(" [env ")[0].replace("|", "\\|")
        if " (default: " in text:
            text = text.split(" (default: ")[0]
        empty = action.default is None or action.default == "" or action.default is False
        default = "" if empty else f"`{action.default}`"
        if action.required:
            default = "required"
        env = "RSB_" + flag.lstrip("-").upper().replace("-", "_")
        out.append(f"| `{flag}` | {default} | `{env}` | {text} |")
    return out


def render() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parts = [HEADER]
    for name, p in sub.choices.items():
        parts.append(f"## `rsb {name}`\n\n{p.description or ''}\n")
        parts.append("\n".join(_rows(p)) + "\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
