"""ASCII digits only, everywhere text becomes a number or an id (broker/ascii.py): the parsers themselves, the
settings' numbers, and a scan of the source for the Python parsers that take every script's digits."""

from __future__ import annotations

import ast
import uuid
from pathlib import Path

import pytest

from broker.ascii import decimal, is_decimal, parse_uuid, parse_uuid_hex
from broker.events import parse_event_id
from broker.settings import BrokerSettings
from consumer.settings import ConsumerSettings

ROOT = Path(__file__).resolve().parents[2]
OTHER_DIGITS = ["١٢٣", "²", "٣", "१२", "１２", "𝟏", "1²", "½"]


@pytest.mark.parametrize("raw", [*OTHER_DIGITS, "", " 1", "1 ", "+1", "-1", "1_000", "1.0", "9" * 21])
def test_decimal_refuses_everything_but_ascii_digits(raw: str) -> None:
    assert decimal(raw) is None and not is_decimal(raw)


def test_decimal_takes_ascii_digits_within_its_length() -> None:
    assert decimal("0") == 0 and decimal("0042") == 42 and decimal("9" * 20) == 10**20 - 1
    assert decimal("123", max_digits=2) is None and decimal(None) is None


def test_uuids_have_one_spelling() -> None:
    u = uuid.uuid4()
    assert parse_uuid(str(u)) == u and parse_uuid(str(u).upper()) == u and parse_uuid_hex(u.hex) == u
    digits = str(u).translate(str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩"))
    for other in (digits, u.hex, "{" + str(u) + "}", f"urn:uuid:{u}", u.hex[:8] + "-" * 4 + u.hex[8:],
                  str(u).replace("-", "_"), f" {u}", 12, None):
        assert parse_uuid(other) is None, other
    assert parse_uuid_hex("٠" * 32) is None and parse_uuid_hex("+" + u.hex[1:]) is None


@pytest.mark.parametrize("raw", ["١٢٣-0", "1-²", "١-١", "+1-0", "1-+0", " 1-0"])
def test_event_ids_are_ascii(raw: str) -> None:
    assert parse_event_id(raw) is None


def test_settings_numbers_are_ascii_and_finite() -> None:
    assert ConsumerSettings.from_argv(["--port", "8001", "--heartbeat-s", "2.5"], {}).port == 8001
    for flag, value in (("--port", "٨٠٠٠"), ("--port", "8²"), ("--heartbeat-s", "nan"), ("--heartbeat-s", "inf"),
                        ("--heartbeat-s", "١.5")):
        with pytest.raises(SystemExit):
            ConsumerSettings.from_argv([flag, value], {})
    with pytest.raises(SystemExit):  # an RSB_* variable too: the flag's error, naming it
        BrokerSettings.from_argv([], {"RSB_PARTITIONS": "٢"})


# Python parsers that accept other scripts' digits: str.isdigit/isdecimal/isnumeric, and \d in a pattern.
_LENIENT_METHODS = frozenset({"isdigit", "isdecimal", "isnumeric"})


def _lenient_uses(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if node.func.attr in _LENIENT_METHODS:
            lines.append(node.lineno)
        is_re_call = isinstance(node.func.value, ast.Name) and node.func.value.id == "re"
        if is_re_call and node.args and isinstance(node.args[0], ast.Constant) and "\\d" in str(node.args[0].value):
            lines.append(node.lineno)
    return lines


def test_no_parser_of_client_text_takes_other_scripts_digits() -> None:
    found = []
    for package in ("broker", "consumer", "generator", "rsb"):
        for path in sorted((ROOT / package).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)}:{n}" for n in _lenient_uses(ast.parse(path.read_text()))]
    assert not found, "use broker.ascii, or [0-9] in a pattern: " + ", ".join(found)


def test_the_scan_finds_what_it_looks_for() -> None:
    assert _lenient_uses(ast.parse('x.isdigit()\nre.compile(r"\\d+")\ns.isnumeric()')) == [1, 2, 3]
