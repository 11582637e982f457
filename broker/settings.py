"""Settings, declared once. Each role's settings are a frozen dataclass whose fields carry their help text,
default and environment twin (``setting(...)``); the command line, the ``RSB_*`` variables,
docs/configuration.md and ``rsb up``'s pass-through to its child processes are all derived from them, so
a flag cannot exist in one place and be missing in another.

- The flag of field ``heartbeat_s`` is ``--heartbeat-s`` and its variable ``RSB_HEARTBEAT_S`` (a field may
  name another flag: ``model_path`` is ``--model``). The flag wins over the variable, the variable over the
  default.
- A field whose type is another settings class is a group of flags (every role has ``broker``).
- ``Settings.argv()`` renders the flags that differ from their defaults, and ``Settings.secret_env()`` the
  secrets (never put on a command line, which any local user can read); parsing them back gives an equal
  object. That round trip is how ``rsb up`` hands its settings to the processes it starts.

This module also holds ``BrokerSettings``, what every role needs to reach Redis.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self
from urllib.parse import quote, urlsplit, urlunsplit

_SPEC = "rsb.setting"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


@dataclass(frozen=True, slots=True)
class Spec:
    """What the command line and the environment need to know about one setting."""

    help: str
    flag: str | None  # None: derived from the field name
    secret: bool
    choices: tuple[str, ...] | None


def setting(default: Any, help: str, *, flag: str | None = None, secret: bool = False,
            choices: tuple[str, ...] | None = None) -> Any:
    """A settings field: its default, the help text its flag shows, and how it is named on the command line."""
    return field(default=default, metadata={_SPEC: Spec(help, flag, secret, choices)})


_INTEGER = re.compile(r"\A[+-]?[0-9]{1,18}\Z")
_NUMBER = re.compile(r"\A[+-]?([0-9]{1,18}(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]{1,3})?\Z")


def parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected true or false, got {raw!r}")


def parse_list(raw: str) -> tuple[str, ...]:
    """A comma-separated list; blanks around items and empty items are dropped."""
    return tuple(item.strip() for item in raw.split(",") if item.strip())


@dataclass(frozen=True, slots=True)
class Option:
    """One flag of a settings class, with where its value goes (``path``: field names from the root)."""

    path: tuple[str, ...]
    name: str  # the field's name
    flag: str  # without the leading dashes
    kind: type  # str, int, float, bool or tuple (a comma-separated list)
    optional: bool  # None is a valid value (no default)
    default: Any
    spec: Spec
    group: str  # the title of the settings class that declares it

    @property
    def metavar(self) -> str:
        if self.kind is int:
            return "N"
        if self.kind is float:
            return "S" if self.flag.endswith("-s") else "X"
        if self.kind is tuple:
            return "A,B"
        return self.flag.rsplit("-", 1)[-1].upper()

    @property
    def env(self) -> str:
        return "RSB_" + self.flag.upper().replace("-", "_")

    @property
    def dest(self) -> str:
        return self.flag.replace("-", "_")

    def parse(self, raw: str) -> Any:
        if self.kind is bool:
            return parse_bool(raw)
        if self.kind is tuple:
            return parse_list(raw)
        # ASCII only, and finite: int() and float() take other scripts' digits, float() "nan" and "inf".
        pattern = _INTEGER if self.kind is int else _NUMBER if self.kind is float else None
        if pattern is not None and not pattern.match(raw.strip()):
            raise ValueError(f"--{self.flag}: expected a{'n integer' if self.kind is int else ' number'}, got {raw!r}")
        value = self.kind(raw)
        if self.spec.choices is not None and value not in self.spec.choices:
            raise ValueError(f"{self.env}: expected one of {', '.join(self.spec.choices)}, got {raw!r}")
        return value

    def render(self, value: Any) -> str:
        if self.kind is tuple:
            return ",".join(value)
        if self.kind is bool:
            return "true" if value else "false"
        return str(value)


def _kind(annotation: Any) -> tuple[type, bool]:
    """(the value type, whether None is allowed) of a field annotation such as ``int | None``."""
    optional = False
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        if len(args) != 1:
            raise TypeError(f"unsupported settings type {annotation!r}")
        annotation = args[0]
    if typing.get_origin(annotation) is tuple:
        return tuple, optional
    if annotation in (str, int, float, bool):
        return annotation, optional
    raise TypeError(f"unsupported settings type {annotation!r}")


class Settings:
    """Base of the settings dataclasses (frozen, with ``setting`` fields or nested settings groups)."""

    __slots__ = ()
    #: Shown above the group's flags in ``--help``.
    title: ClassVar[str] = ""

    @classmethod
    def options(cls) -> list[Option]:
        return list(_options(cls, ()))

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, *, required: frozenset[str] = frozenset(),
                      seen: dict[str, Option] | None = None, environ: Mapping[str, str] | None = None) -> None:
        """Add a flag per setting; its default comes from its ``RSB_*`` variable, then the field default.
        ``required``: flags (without dashes) that must be given, by flag or variable. ``seen``: flags already
        added to this parser by another settings class (``rsb up`` has the consumer's and the generator's);
        a flag two classes declare must mean the same in both."""
        env = os.environ if environ is None else environ
        seen = {} if seen is None else seen
        groups: dict[str, Any] = {}
        for opt in cls.options():
            known = seen.get(opt.flag)
            if known is not None:
                if (known.kind, known.default, known.spec.help) != (opt.kind, opt.default, opt.spec.help):
                    raise ValueError(f"--{opt.flag} is declared twice with different meanings")
                continue
            seen[opt.flag] = opt
            if opt.group not in groups:
                groups[opt.group] = parser.add_argument_group(opt.group) if opt.group else parser
            group = groups[opt.group]
            raw = env.get(opt.env)
            try:
                default = opt.parse(raw) if raw is not None else opt.default
            except ValueError as e:
                parser.error(f"{opt.env}: {e}")
            help_text = opt.spec.help
            if opt.default not in (None, "", False, ()) and not opt.spec.secret:
                help_text += f" (default: {opt.render(opt.default)})"
            help_text += f" [env {opt.env}]"
            # argparse %-formats help (for its own "%(default)s"); a setting's help is plain text, "~10%" too.
            help_text = help_text.replace("%", "%%")
            if opt.kind is bool:
                group.add_argument(f"--{opt.flag}", dest=opt.dest, action=argparse.BooleanOptionalAction,
                                   default=default, help=help_text)
                continue
            must = opt.flag in required and default is None
            if opt.kind is tuple:  # a list: the flag may be repeated (--upstream A --upstream B), or comma-separated
                group.add_argument(f"--{opt.flag}", dest=opt.dest, type=opt.parse, default=default, required=must,
                                   action=_Repeatable, metavar=opt.metavar, help=help_text)
                continue
            group.add_argument(f"--{opt.flag}", dest=opt.dest, type=opt.parse, default=default, required=must,
                               choices=opt.spec.choices, metavar=opt.metavar, help=help_text)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> Self:
        return cls._build(lambda opt: getattr(ns, opt.dest))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        """Defaults and ``RSB_*`` variables only (embedding rsb in-process, tests)."""
        env = os.environ if environ is None else environ
        settings = cls._build(lambda opt: opt.parse(env[opt.env]) if opt.env in env else opt.default)
        return dataclasses.replace(settings, **overrides) if overrides else settings  # type: ignore[type-var]

    @classmethod
    def from_argv(cls, argv: list[str], environ: Mapping[str, str] | None = None) -> Self:
        parser = argparse.ArgumentParser(add_help=False)
        cls.add_arguments(parser, environ=environ if environ is not None else {})
        return cls.from_namespace(parser.parse_args(argv))

    @classmethod
    def _build(cls, value_of: Callable[[Option], Any]) -> Self:
        values = {opt.path: value_of(opt) for opt in cls.options()}
        return typing.cast(Self, _construct(cls, (), values))

    def _values(self) -> Iterator[tuple[Option, Any]]:
        for opt in self.options():
            value: Any = self
            for name in opt.path:
                value = getattr(value, name)
            yield opt, value

    def argv(self) -> list[str]:
        """The flags that reproduce this object (those differing from their defaults), secrets excepted."""
        out: list[str] = []
        for opt, value in self._values():
            if value == opt.default or opt.spec.secret:
                continue
            if opt.kind is bool:
                out.append(f"--{opt.flag}" if value else f"--no-{opt.flag}")
            elif value is not None:
                out += [f"--{opt.flag}", opt.render(value)]
        return out

    def secret_env(self) -> dict[str, str]:
        """The secrets that differ from their defaults, as ``RSB_*`` variables for a child process."""
        return {opt.env: opt.render(value) for opt, value in self._values()
                if opt.spec.secret and value != opt.default and value is not None}


class _Repeatable(argparse.Action):
    """A list flag given several times adds up: the first occurrence replaces the default (or its variable's
    value), each later one appends its items."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = f"_given_{self.dest}"
        before = getattr(namespace, self.dest) if getattr(namespace, given, False) else ()
        setattr(namespace, given, True)
        setattr(namespace, self.dest, (*before, *values))


def _options(cls: type, path: tuple[str, ...]) -> Iterator[Option]:
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and issubclass(hint, Settings):
            yield from _options(hint, (*path, f.name))
            continue
        spec = f.metadata.get(_SPEC)
        if spec is None:
            raise TypeError(f"{cls.__name__}.{f.name}: declare it with setting(...)")
        kind, optional = _kind(hint)
        flag = spec.flag or f.name.replace("_", "-")
        yield Option((*path, f.name), f.name, flag, kind, optional, f.default, spec, getattr(cls, "title", ""))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _construct(cls: type, path: tuple[str, ...], values: dict[tuple[str, ...], Any]) -> Any:
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and issubclass(hint, Settings):
            kwargs[f.name] = _construct(hint, (*path, f.name), values)
        else:
            kwargs[f.name] = values[(*path, f.name)]
    return cls(**kwargs)


# -- what every role needs to reach Redis ---------------------------------------------------------------

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DURABILITY_LEVELS = ("local", "replicated")


@dataclass(frozen=True, slots=True)
class BrokerSettings(Settings):
    title: ClassVar[str] = "Redis"

    redis_url: str | None = setting(
        None, "Redis URL: redis://host:6379/0, rediss://user:pass@host:6380/0, redis+cluster://node:6379 "
        "for a Redis Cluster (any one node), or redis+sentinel://host:26379[,host:26379]/service[/db] for "
        "Redis Sentinel (a secret: it may carry a password, so rsb passes it to its children by environment)",
        secret=True)
    partitions: int = setting(
        1, "job/key partitions; fixed per deployment (1 = strict FIFO on one server; on a Redis Cluster a few "
        "per master: their hash slots are spread evenly over all masters)")
    cluster: bool = setting(
        False, "--redis-url is one node of a Redis Cluster (same as a redis+cluster:// URL)", flag="redis-cluster")
    durability: str = setting(
        "local", "when an event becomes visible to readers: local (as soon as the primary has it) or replicated "
        "(only once WAIT confirms a replica has it too: survives a primary failover; needs a replica)",
        choices=DURABILITY_LEVELS)
    replica_wait_ms: int = setting(
        1000, "replicated: how long one WAIT waits for a replica's acknowledgement; with none, the generation "
        "pauses (readers get heartbeats) and WAIT is retried")

    redis_password: str | None = setting(
        None, "password for Redis, added to --redis-url when the URL carries none (so the URL can be plain "
        "configuration and the password a secret of its own, e.g. a Kubernetes Secret)", secret=True)

    @property
    def url(self) -> str:
        """The Redis URL every role connects to: --redis-url with --redis-password in it (if it has none)."""
        url = self.redis_url or DEFAULT_REDIS_URL
        if not self.redis_password:
            return url
        parts = urlsplit(url)
        if parts.password is not None:  # the URL's own password wins: it names its user too
            return url
        user = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else ""
        hosts = parts.netloc.rpartition("@")[2]
        return urlunsplit(parts._replace(netloc=f"{user}:{quote(self.redis_password, safe='')}@{hosts}"))


@dataclass(frozen=True, slots=True)
class LogSettings(Settings):
    title: ClassVar[str] = "Logging"

    log_level: str = setting("info", "log level", choices=("debug", "info", "warning", "error"))


def redact_url(url: str) -> str:
    """A Redis URL fit for logs: the password replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))
