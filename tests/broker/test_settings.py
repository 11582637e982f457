"""Settings are declared once: every flag has its RSB_* twin, the flag wins, and rendering a settings object
back to flags (what ``rsb up`` gives its generators) loses nothing."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from broker.settings import Option, Settings
from consumer.settings import ConsumerSettings
from generator.settings import GeneratorSettings
from rsb.cli import COMMANDS, build_parser
from rsb.up import UpSettings, generator_command


def _other_value(opt: Option) -> Any:
    """A valid value different from the option's default."""
    if opt.spec.choices:
        return next(c for c in opt.spec.choices if c != opt.default)
    if opt.kind is bool:
        return not opt.default
    if opt.kind is tuple:
        return ("https://a.example", "https://b.example")
    if opt.kind is int:
        return (opt.default or 0) + 7
    if opt.kind is float:
        return (opt.default or 0.0) + 2.5
    return f"value-of-{opt.flag}"


def _with(settings: Settings, opt: Option, value: Any) -> Any:
    def set_path(obj: Any, path: tuple[str, ...]) -> Any:
        if len(path) == 1:
            return dataclasses.replace(obj, **{path[0]: value})
        return dataclasses.replace(obj, **{path[0]: set_path(getattr(obj, path[0]), path[1:])})

    return set_path(settings, opt.path)


@pytest.mark.parametrize("cls", [ConsumerSettings, GeneratorSettings, UpSettings])
def test_every_setting_round_trips_through_flags_and_variables(cls: type[Settings]) -> None:
    base = cls.from_env({})
    options = cls.options()
    for opt in options:
        changed: Any = base
        for same in (o for o in options if o.flag == opt.flag):  # a shared flag (rsb up's --redis-url) sets all
            changed = _with(changed, same, _other_value(opt))
        # Flags (secrets go by environment, never on a command line).
        assert cls.from_argv(changed.argv(), changed.secret_env()) == changed, opt.flag
        assert all(opt.flag not in arg for arg in changed.argv()) or not opt.spec.secret
        # Variables alone.
        env = {o.env: o.render(v) for o, v in changed._values() if v is not None}
        assert cls.from_env(env) == changed, opt.env


def test_the_flag_wins_over_the_variable() -> None:
    s = ConsumerSettings.from_argv(["--heartbeat-s", "3"], {"RSB_HEARTBEAT_S": "9", "RSB_PORT": "9001"})
    assert (s.heartbeat_s, s.port) == (3.0, 9001)


def test_rsb_up_passes_every_generator_setting_to_its_generators() -> None:
    """The bug this design fixed: `rsb up --metrics-port/--metrics-host/--worker-id` were accepted and dropped."""
    base = UpSettings.from_env({})
    for opt in GeneratorSettings.options():
        value = _other_value(opt)
        up = dataclasses.replace(base, generator=_with(base.generator, opt, value))
        argv, env = generator_command(up.generator, 0)
        assert argv[1:4] == ["-m", "rsb", "generator"]
        child_env = {k: v for k, v in env.items() if k.startswith("RSB_")}
        assert GeneratorSettings.from_argv(argv[4:], child_env) == up.generator, opt.flag
    # Generator i of N gets its own worker id and metrics port.
    gen = dataclasses.replace(base.generator, worker_id="w", metrics_port=9100)
    argv, _ = generator_command(gen, 2)
    child = GeneratorSettings.from_argv(argv[4:], {})
    assert (child.worker_id, child.metrics_port) == ("w-2", 9102)


def test_a_flag_declared_twice_must_mean_the_same() -> None:
    """rsb up has the consumer's and the generator's flags: shared ones (--redis-url, --log-level) are one flag."""
    flags = [o.flag for o in UpSettings.options()]
    assert flags.count("redis-url") == 2 and flags.count("log-level") == 2
    build_parser()  # raises if two declarations of one flag differ


def test_every_command_lists_every_flag_with_its_variable() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for cmd in COMMANDS:
        text = sub.choices[cmd.name].format_help()
        for opt in cmd.settings.options():
            assert f"--{opt.flag}" in text and opt.env in text, (cmd.name, opt.flag)
            # argparse %-formats help: a "%" in a setting's help is shown as written (--parallel's "~10%").
            assert "%" not in opt.spec.help or "%" in text, (cmd.name, opt.flag)
