"""The code maps in README.md and docs/ARCHITECTURE.md name only modules that exist.

A map that names a moved or deleted module sends a newcomer to the wrong place, and no other test reads it.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("broker", "generator", "consumer", "rsb")


def _layout_rows(text: str) -> dict[str, str]:
    """`| \\`pkg/\\` | cell |` rows of README's Layout table, by package."""
    rows = {}
    for line in text.splitlines():
        match = re.match(r"\| `(\w+)/` \| (.*) \|$", line)
        if match and match.group(1) in PACKAGES:
            rows[match.group(1)] = match.group(2)
    return rows


def _resolve(package: str, cell: str) -> list[str]:
    """Every `name.py` and `sub/` of a cell, resolved against the folder it sits in, that does not exist.

    A `sub/ (` opens a subpackage whose modules follow until its closing parenthesis.
    """
    missing = []
    folders = [ROOT / package]
    pending = None  # a `sub/` just named: the parenthesis that follows lists its modules
    for token in re.finditer(r"`([\w/.]+)`|(\()|(\))", cell):
        name, opening, closing = token.groups()
        if opening:
            folders.append(pending or folders[-1])
            pending = None
        elif closing:
            if len(folders) > 1:
                folders.pop()
        elif name.endswith("/"):
            pending = folders[-1] / name.rstrip("/")
            if not pending.is_dir():
                missing.append(str(pending.relative_to(ROOT)))
        elif name.endswith((".py", ".js")):
            pending = None
            if not (folders[-1] / name).is_file():
                missing.append(str((folders[-1] / name).relative_to(ROOT)))
    return missing


def test_readme_layout_names_existing_modules() -> None:
    rows = _layout_rows((ROOT / "README.md").read_text())
    assert set(rows) == set(PACKAGES), sorted(rows)
    missing = [path for package, cell in rows.items() for path in _resolve(package, cell)]
    assert not missing, missing


def test_architecture_names_existing_modules() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    missing = []
    for dotted in sorted(set(re.findall(r"`((?:broker|generator|consumer|rsb)(?:[./]\w+)+(?:\.py)?)`", text))):
        path = dotted.removesuffix(".py").replace(".", "/")
        if not ((ROOT / f"{path}.py").is_file() or (ROOT / path).is_dir()):
            # `rsb.__all__`, `StreamKeys.events`: a module then a name it defines
            module, _, attribute = path.rpartition("/")
            source = ROOT / f"{module}.py" if (ROOT / f"{module}.py").is_file() else ROOT / module / "__init__.py"
            if not (source.is_file() and attribute in source.read_text()):
                missing.append(dotted)
    assert not missing, missing
