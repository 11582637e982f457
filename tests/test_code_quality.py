"""The house rules, checked: ruff and mypy clean (tests included), layers that only import downwards, no
import circle, modules small enough to hold one concept, and a public client surface that is exactly
``rsb.__all__``."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rsb", "broker", "generator", "consumer")
# Who may import whom (besides itself). broker is the floor; rsb.cli (and the command modules it
# dispatches to) may import everything; the public client imports only what the floor offers it.
ALLOWED: dict[str, frozenset[str]] = {
    "broker": frozenset(),
    "generator": frozenset({"broker"}),
    "consumer": frozenset({"broker"}),
    "rsb": frozenset({"broker"}),
}
# The command line dispatches to every role: the one place allowed to import them all.
ENTRY_POINTS = frozenset({"rsb.cli", "rsb.up", "rsb.docs", "rsb.__main__"})
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


def test_lower_layers_never_import_higher_ones() -> None:
    wrong = []
    for name, deps in _graph().items():
        if name in ENTRY_POINTS:
            continue
        layer = name.split(".")[0]
        for dep in deps:
            target = dep.split(".")[0]
            if target != layer and target not in ALLOWED[layer]:
                wrong.append(f"{name} imports {dep}")
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
    """`from rsb import Client` must not pull in the server roles (nor llama.cpp): it is what a client-only
    install runs."""
    code = ("import sys; from rsb import Client, AsyncClient; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('generator', 'consumer', 'llama_cpp', "
            "'starlette', 'uvicorn')); print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_blanket_type_ignores_in_tests() -> None:
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "tests").rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if "type: ignore" in line and "type: ignore[" not in line]
    assert not offenders, offenders


def test_ruff_is_clean() -> None:
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_is_clean() -> None:
    """mypy --strict over the packages and the tests (pyproject.toml names them)."""
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
