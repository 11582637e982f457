"""The house rules, checked: ruff and mypy clean (tests included), layers that only import downwards, no
import circle, redis-py's errors mapped once (in broker.redis), modules small enough to hold one concept, and a
public client surface that is exactly ``rsb.__all__``, Lua scripts that name their KEYS and ARGV."""

from __future__ import annotations

import ast
import builtins
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rsb", "broker", "generator", "consumer")
# The layers, most specific first: a module belongs to the first layer whose name is its own or a parent of it,
# and imports only modules of its own layer or of the layers it names (see docs/ARCHITECTURE.md, "The house").
# broker's top-level modules are the floor of the floor (events, sse, settings, errors, backoff, ...: no Redis);
# JSON Schema admission (broker.schema) stands on them, the generation request (broker.request) on both; broker.redis
# alone talks redis-py; rsb's streams and Durable Streams stand on it side by side, rsb's streams on the request too.
FLOOR = "broker.*"  # broker's top-level modules
LAYERS: dict[str, frozenset[str]] = {
    "broker.schema": frozenset({FLOOR}),
    "broker.request": frozenset({FLOOR, "broker.schema"}),
    "broker.redis": frozenset({FLOOR}),
    "broker.streams": frozenset({FLOOR, "broker.redis", "broker.request"}),
    "broker.durable": frozenset({FLOOR, "broker.redis"}),
    FLOOR: frozenset(),
    "generator": frozenset({"broker"}),
    # consumer: its settings and metrics, then the HTTP edge, then streaming, then the views, then the app.
    "consumer.settings": frozenset({"broker"}),
    "consumer.metrics": frozenset({"broker"}),
    "consumer.schema": frozenset({"broker"}),
    "consumer.edge": frozenset({"broker", "consumer.settings", "consumer.metrics"}),
    "consumer.streaming": frozenset({"broker", "consumer.settings", "consumer.metrics", "consumer.edge"}),
    "consumer.state": frozenset({"broker", "consumer.settings", "consumer.metrics", "consumer.edge",
                                 "consumer.streaming"}),
    "consumer.views": frozenset({"broker", "consumer.settings", "consumer.metrics", "consumer.schema",
                                 "consumer.edge", "consumer.streaming", "consumer.state"}),
    "consumer": frozenset({"broker"}),  # app, server: they assemble the rest (see APP_MODULES)
    # The public client needs only httpx and broker's floor (no Redis: a client-only install runs it); the
    # sampling fields it names are the request's.
    "rsb": frozenset({FLOOR, "broker.request"}),
}
# What assembles a role may import all of that role.
APP_MODULES = frozenset({"consumer.app", "consumer.server"})
# The command line dispatches to every role: the one place allowed to import them all.
ENTRY_POINTS = frozenset({"rsb.cli", "rsb.up", "rsb.docs", "rsb.__main__", "rsb.commands"})
# Third-party packages only one layer may import.
OWNED_IMPORTS = {"redis": "broker.redis", "llama_cpp": "generator.engines"}
MAX_LINES = 450
# A longer module says why in its docstring, on a line starting with this.
LONG_REASON = "Long because"


def _modules() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield name, path


def _imports(name: str, path: Path) -> set[str]:
    """Every module of ours that ``name`` imports, at any depth of the file (imports hidden inside
    functions count: they are how circles hide)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in out if m.split(".")[0] in PACKAGES}


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _graph() -> dict[str, set[str]]:
    """Module -> the modules importing it runs. Importing ``a.b.c`` runs the ``__init__`` of ``a.b`` too, and
    a package's ``__init__`` runs what it imports: both are edges (a circle through a package ``__init__`` is
    the kind that fails at import time). A module's own ancestors are already being imported when it runs,
    so they are no edge of its."""
    modules = dict(_modules())
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = {m for m in _imports(name, path) if m in modules}
        own = set(_parents(name))
        deps |= {p for m in deps for p in _parents(m) if p in modules and p not in own}
        graph[name] = deps - {name}
    return graph


def layer_of(module: str) -> str:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in LAYERS:
            return name
    if parts[0] == "broker":
        return FLOOR
    raise AssertionError(f"{module} is in no layer")


def _allowed(name: str, dep: str) -> bool:
    own, target = layer_of(name), layer_of(dep)
    if own == target:
        return True
    if name in APP_MODULES and dep.split(".")[0] == name.split(".")[0]:
        return True
    for allowed in LAYERS[own]:
        if target == allowed or target.startswith(allowed + ".") or (allowed == "broker" and
                                                                     dep.startswith("broker")):
            return True
    return False


def test_lower_layers_never_import_higher_ones() -> None:
    wrong = []
    for name, deps in _graph().items():
        if name in ENTRY_POINTS:
            continue
        for dep in deps:
            if not _allowed(name, dep):
                wrong.append(f"{name} ({layer_of(name)}) imports {dep} ({layer_of(dep)})")
    assert not wrong, "\n".join(sorted(wrong))


def _third_party_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_only_the_owning_layer_imports_redis_and_llama_cpp() -> None:
    wrong = []
    for name, path in _modules():
        for package in _third_party_imports(path) & set(OWNED_IMPORTS):
            owner = OWNED_IMPORTS[package]
            if name != owner and not name.startswith(owner + "."):
                wrong.append(f"{name} imports {package} (only {owner} may)")
    assert not wrong, "\n".join(sorted(wrong))


# broker.redis.connection's classifiers of redis-py's exceptions: only broker.redis sees those exceptions.
REDIS_CLASSIFIERS = frozenset({"UNAVAILABLE_ERRORS", "is_unavailable", "is_out_of_memory", "store_error",
                               "store_errors"})


def _names(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, ast.alias):  # what is imported, whatever it is called here
            yield node.lineno, node.name.rpartition(".")[2]


def test_redis_errors_are_mapped_once_at_broker_redis() -> None:
    """Above broker.redis a failed Redis command is rsb's (broker.errors.StoreError and its kinds), never one of
    redis-py's exceptions: no module there names one (or the classifiers that read them), so no caller decides
    "away, full, or a bug" by itself again. Builtins (TimeoutError, ConnectionError) and rsb's own classes of the
    same name (the public client's AuthenticationError) are not redis-py's."""
    import redis.exceptions

    ours = {node.name for _, path in _modules() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef)}
    foreign = {n for n, v in vars(redis.exceptions).items() if isinstance(v, type) and issubclass(v, BaseException)}
    forbidden = (foreign - set(dir(builtins)) - ours) | REDIS_CLASSIFIERS
    wrong = []
    for name, path in _modules():
        if name == "broker.redis" or name.startswith("broker.redis."):
            continue
        for line, n in _names(ast.parse(path.read_text(), str(path))):
            if n in forbidden:
                wrong.append(f"{path.relative_to(ROOT)}:{line} names {n}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circle() -> None:
    graph = _graph()
    # A package imports its own __init__ when any of its modules is imported: that edge is not a circle.
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        path.append(node)
        on_path.add(node)
        for dep in sorted(graph[node]):
            if dep in on_path:
                circles.append([*path[path.index(dep):], dep])
            elif dep not in done:
                visit(dep)
        path.pop()
        on_path.discard(node)
        done.add(node)

    for node in sorted(graph):
        if node not in done:
            visit(node)
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_modules_hold_one_concept_or_say_why_not() -> None:
    long = []
    for name, path in _modules():
        lines = path.read_text().count("\n")
        if lines <= MAX_LINES:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if not any(line.strip().startswith(LONG_REASON) for line in doc.splitlines()):
            long.append(f"{name}: {lines} lines and no '{LONG_REASON} ...' line in its docstring")
    assert not long, "\n".join(long)


def test_scripts_name_their_keys_and_arguments() -> None:
    """Every Lua script is a ``broker.redis.lua.Lua``: it reads ``K.meta`` and ``A.fence``, never ``KEYS[1]`` or
    ``ARGV[9]`` (a tail past the named ones is read by a variable index)."""
    import re

    from broker.redis.lua import Lua

    numbered = re.compile(r"\b(KEYS|ARGV)\[\d+\]")
    found = []
    for name, _path in _modules():
        if name.startswith("broker."):
            module = __import__(name, fromlist=["_"])
            for attr, value in vars(module).items():
                if isinstance(value, Lua) and numbered.search(value.body):
                    found.append(f"{name}.{attr}")
    assert not found, f"scripts reading KEYS or ARGV by number: {found}"


def test_the_wheel_installs_rsbs_four_packages_and_not_bench() -> None:
    """What ``pip install rsb`` puts on sys.path beside other packages: the four packages of the house (README:
    "Installed names"), never the repository's bench/."""
    import tomllib

    from setuptools import find_packages

    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    top = {p.split(".")[0] for p in find_packages(str(ROOT), include=found["include"])}
    assert top == set(PACKAGES)


def test_the_public_client_is_exactly_rsb_all() -> None:
    import rsb

    public = {n for n in vars(rsb) if not n.startswith("_") or n == "__version__"}
    # Submodules appear as attributes once imported; they are not part of the API surface.
    modules = {n for n in public if type(getattr(rsb, n)).__name__ == "module"}
    assert sorted(public - modules) == sorted(rsb.__all__)
    for name in rsb.__all__:
        assert getattr(rsb, name) is not None
    assert {"Client", "AsyncClient"} <= set(rsb.__all__)


def test_the_client_imports_without_the_server_roles() -> None:
    """`from rsb import Client` must not pull in the server roles, llama.cpp or redis-py: it is what a
    client-only install runs (httpx and broker's floor)."""
    code = ("import sys; from rsb import Client, AsyncClient; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('generator', 'consumer', 'llama_cpp', "
            "'starlette', 'uvicorn', 'redis', 'hiredis') or m.startswith(('broker.redis', 'broker.streams', "
            "'broker.durable'))); print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_blanket_type_ignores_in_tests() -> None:
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "tests").rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if "type: ignore" in line and "type: ignore[" not in line]
    assert not offenders, offenders


@pytest.mark.slow
def test_ruff_is_clean() -> None:
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_mypy_is_clean() -> None:
    """mypy --strict over the packages and the tests (pyproject.toml names them)."""
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
