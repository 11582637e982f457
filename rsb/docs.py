"""docs/configuration.md is generated from the settings classes behind the command line, so it cannot drift
from the flags.

    python3 -m rsb.docs > docs/configuration.md

The test suite checks that the file matches what this prints."""

from __future__ import annotations

from broker.settings import Option
from rsb.cli import COMMANDS

HEADER = """# Configuration reference

Generated from the settings behind the `rsb` command line (`python3 -m rsb.docs > docs/configuration.md`); a
test keeps it in sync. Every flag has an environment twin, `RSB_` + the flag in upper case with `_` for `-`
(`--heartbeat-s` is `RSB_HEARTBEAT_S`); the flag wins over the variable. Switches (`--ignore-eos`) also
take a `--no-` form, and their variable takes `true`/`false`.

OpenTelemetry (traces and GenAI metrics) has no flag: every process reads the SDK's own `OTEL_*` variables
(`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SDK_DISABLED`, ...), off unless an exporter is configured: see
docs/operations.md, "Traces and GenAI metrics".
"""


def _row(opt: Option, required: bool) -> str:
    text = opt.spec.help.replace("|", "\\|")
    if opt.spec.choices:
        text += f" (one of: {', '.join(opt.spec.choices)})"
    empty = opt.default is None or opt.default in ("", False, ())
    default = "required" if required else ("" if empty or opt.spec.secret else f"`{opt.render(opt.default)}`")
    return f"| `--{opt.flag}` | {default} | `{opt.env}` | {text} |"


def render() -> str:
    parts = [HEADER]
    for cmd in COMMANDS:
        parts.append(f"## `rsb {cmd.name}`\n\n{cmd.description}\n")
        rows = ["| flag | default | env | what it does |", "| --- | --- | --- | --- |"]
        seen: set[str] = set()
        for opt in cmd.settings.options():
            if opt.flag not in seen:
                seen.add(opt.flag)
                rows.append(_row(opt, opt.flag in cmd.required))
        parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
