"""What rsb's command line really accepts, read from ``rsb <command> --help`` at test time: the deployment files
(Kubernetes manifests, docker-compose.yml) are checked against it, not against a list kept by hand.

Imported as ``deploy.cli_settings`` (tests/ is on the path, as for ``helpers``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The CLI module: `rsb.cli` once the packages move under `rsb`, `broker.cli` before.
CLI_MODULES = ("rsb.cli", "broker.cli")


@dataclass(frozen=True)
class Setting:
    flag: str  # --shutdown-grace-s
    env: str  # RSB_SHUTDOWN_GRACE_S
    default: str | None  # as --help shows it ("5.0"), None when it shows none


@dataclass(frozen=True)
class Command:
    name: str
    settings: dict[str, Setting]  # by env name

    @property
    def flags(self) -> set[str]:
        return {s.flag for s in self.settings.values()}

    def value(self, env: dict[str, str], name: str) -> str:
        """The value a process gets for setting ``name`` (an RSB_* name) from ``env``, else its default."""
        if name in env:
            return env[name]
        default = self.settings[name].default
        assert default is not None, f"{name} has no default in `rsb {self.name} --help`"
        return default

    def number(self, env: dict[str, str], name: str) -> float:
        return float(self.value(env, name))

    def effective(self, env: dict[str, str], args: list[str], name: str) -> str:
        """The value from a command line's flags (they win over the variables), else from ``env``, else the default."""
        flags = flag_values(args)
        flag = self.settings[name].flag
        return flags[flag] if flag in flags else self.value(env, name)


def flag_values(args: list[str]) -> dict[str, str]:
    """``--port 8000`` / ``--port=8000`` / ``--log-content`` (a switch: "true") from a command line."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        assert arg.startswith("--"), f"unexpected argument {arg!r} in {args}"
        if "=" in arg:
            name, value = arg.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            name, value = arg, args[i + 1]
            i += 1
        else:
            name, value = arg, "true"
        out[name] = value
        i += 1
    return out


def run_help(command: str) -> str:
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith("RSB_")}
    failures = []
    for module in CLI_MODULES:
        proc = subprocess.run([sys.executable, "-m", module, command, "--help"], capture_output=True, text=True,
                              cwd=ROOT, env=clean_env, timeout=60)
        if proc.returncode == 0 and "[env RSB_" in " ".join(proc.stdout.split()):
            return proc.stdout
        failures.append(f"python -m {module} {command} --help: rc {proc.returncode}\n{proc.stderr[-2000:]}")
    raise AssertionError("no rsb command line answered --help:\n" + "\n".join(failures))


def parse_help(command: str, text: str) -> Command:
    """Every option of ``rsb <command> --help`` with its ``[env RSB_...]`` twin and shown default."""
    entries: list[tuple[str, list[str]]] = []  # (flag, help lines), one per option
    for line in text.split("options:", 1)[-1].splitlines():
        start = re.match(r"^ {2}(?:-\w, )?(--[a-z][a-z0-9-]*)", line)
        if start:
            entries.append((start.group(1), [line]))
        elif entries:
            entries[-1][1].append(line)  # argparse wraps an option's help over several lines
    settings: dict[str, Setting] = {}
    for flag, lines in entries:
        body = " ".join(" ".join(lines).split())
        env = re.search(r"\[env (RSB_[A-Z0-9_]+)\]", body)
        if env is None:
            assert flag == "--help", f"rsb {command} --help: {flag} has no [env RSB_...] twin"
            continue
        defaults = re.findall(r"\(default: ([^)]*)\)", body)
        settings[env.group(1)] = Setting(flag, env.group(1), defaults[-1].strip() if defaults else None)
    assert settings, f"rsb {command} --help lists no [env RSB_...] settings"
    return Command(command, settings)
