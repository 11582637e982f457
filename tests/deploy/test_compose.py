"""docker-compose.yml, checked without Docker: every rsb command, flag and RSB_* variable it uses is one rsb
really has (read from `rsb <command> --help`), the consumer port is the one nginx.conf and the healthcheck
use, and the stop grace periods cover rsb's own drain times (docs/deployment.md)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import CliCommand, cli_command, flag_values, parse_bytes

ROOT = Path(__file__).resolve().parents[2]

COMPOSE = ROOT / "docker-compose.yml"
NGINX_CONF = ROOT / "deploy" / "nginx.conf"
# A grace period must exceed rsb's own bound by at least this much (process exit, the last write).
MARGIN_S = 2.0


def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())  # resolves the x-rsb-env anchor and `<<` merges
    assert isinstance(data, dict)
    return data


def rsb_services() -> dict[str, dict[str, Any]]:
    """The services that run the image built from this repository (ENTRYPOINT rsb)."""
    return {name: svc for name, svc in compose()["services"].items() if svc.get("build")}


def command_of(svc: dict[str, Any]) -> list[str]:
    cmd = svc.get("command")
    assert cmd, "an rsb service needs a command (the image's CMD is `up`, the one-machine stack)"
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def environment_of(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def effective(cli: CliCommand, env: dict[str, str], args: list[str], name: str) -> float:
    """A numeric setting as the process sees it: the flag wins over the variable, then the default."""
    return float(cli.effective(env, args, name))


def seconds(duration: str) -> float:
    """A compose duration (``15s``, ``1m30s``) in seconds."""
    total = 0.0
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"bad duration {duration!r}"
    for number, unit in parts:
        total += float(number) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[unit]
    return total


def test_dockerfile_entrypoint_is_rsb() -> None:
    """Compose commands and Kubernetes args are rsb subcommands because the image's ENTRYPOINT is rsb."""
    entrypoint = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", (ROOT / "Dockerfile").read_text(), re.M)
    assert entrypoint and yaml.safe_load(entrypoint.group(1)) == ["rsb"]


def test_commands_flags_and_env_are_real() -> None:
    services = rsb_services()
    assert {command_of(s)[0] for s in services.values()} == {"consumer", "generator"}
    for name, svc in services.items():
        cmd = command_of(svc)
        cli = cli_command(cmd[0])  # fails unless `rsb <cmd> --help` works
        unknown_flags = set(flag_values(cmd[1:])) - cli.flags
        assert not unknown_flags, f"service {name}: `rsb {cmd[0]}` has no {sorted(unknown_flags)}"
        env = environment_of(svc)
        unknown_env = {k for k in env if k.startswith("RSB_")} - set(cli.settings)
        assert not unknown_env, f"service {name}: `rsb {cmd[0]}` reads no {sorted(unknown_env)}"


def test_partitions_are_the_same_everywhere() -> None:
    """RSB_PARTITIONS is part of every key's name: consumers and generators must agree."""
    values = {name: effective(cli_command(command_of(svc)[0]), environment_of(svc), command_of(svc)[1:],
                              "RSB_PARTITIONS") for name, svc in rsb_services().items()}
    assert len(set(values.values())) == 1, values


def test_consumer_port_matches_nginx_and_healthcheck() -> None:
    svc = rsb_services()["consumer"]
    cmd = command_of(svc)
    env = environment_of(svc)
    cli = cli_command("consumer")
    port = int(effective(cli, env, cmd[1:], "RSB_PORT"))
    host = flag_values(cmd[1:]).get("--host") or env.get("RSB_HOST") or cli.value(env, "RSB_HOST")
    assert host == "0.0.0.0", "the consumer must listen on all interfaces for nginx to reach it"
    upstream = re.findall(r"^\s*server\s+consumer:(\d+)", NGINX_CONF.read_text(), re.M)
    assert upstream == [str(port)], f"deploy/nginx.conf proxies to consumer:{upstream}, the consumer listens on {port}"
    check = " ".join(str(x) for x in svc["healthcheck"]["test"])
    url = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", check)
    assert url and (int(url.group(1)), url.group(2)) == (port, "/readyz"), check
    nginx = compose()["services"]["nginx"]
    assert nginx["depends_on"]["consumer"]["condition"] == "service_healthy"


def test_stop_grace_periods_cover_the_drain() -> None:
    """docs/deployment.md: a consumer drains within --shutdown-grace-s, a generator finishes or hands back its job
    within --generator-grace-s; the orchestrator must wait longer than that before SIGKILL."""
    services = rsb_services()
    consumer, generator = services["consumer"], services["generator"]
    drain = effective(cli_command("consumer"), environment_of(consumer), command_of(consumer)[1:],
                      "RSB_SHUTDOWN_GRACE_S")
    assert seconds(consumer["stop_grace_period"]) >= drain + MARGIN_S
    handover = effective(cli_command("generator"), environment_of(generator), command_of(generator)[1:],
                         "RSB_GENERATOR_GRACE_S")
    assert seconds(generator["stop_grace_period"]) >= handover + MARGIN_S


@pytest.mark.parametrize("duration,expected", [("15s", 15.0), ("1m30s", 90.0), ("500ms", 0.5)])
def test_seconds(duration: str, expected: float) -> None:
    assert seconds(duration) == expected


def test_compose_file_is_where_the_docs_say() -> None:
    assert Path(COMPOSE).exists()
    assert "docker compose up" in (ROOT / "docs" / "deployment.md").read_text()


def test_redis_refuses_writes_before_its_container_is_killed() -> None:
    """Redis has a maxmemory well below its container's memory limit, and noeviction: full, it refuses writes
    (rsb answers 507 storage_full) instead of being OOM-killed or evicting unfinished streams."""
    redis = compose()["services"]["redis"]
    args = command_of(redis)
    maxmemory = parse_bytes(args[args.index("--maxmemory") + 1])
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert 0 < maxmemory <= parse_bytes(str(redis["mem_limit"])) * 3 // 4


def test_redis_has_a_password_and_no_default_one() -> None:
    """Redis requires a password that compose takes from RSB_REDIS_PASSWORD, with no default (``:?``: compose
    refuses to start without one), and every rsb service's URL carries that same password."""
    required = re.compile(r"\$\{RSB_REDIS_PASSWORD:\?[^}]+\}")
    redis_svc = compose()["services"]["redis"]
    cmd = [str(c) for c in redis_svc["command"]]
    assert "--requirepass" in cmd and required.fullmatch(cmd[cmd.index("--requirepass") + 1]), cmd
    assert required.fullmatch(str(redis_svc["environment"]["REDISCLI_AUTH"]))  # the healthcheck authenticates
    for name, svc in rsb_services().items():
        url = environment_of(svc)["RSB_REDIS_URL"]
        assert re.fullmatch(r"redis://:" + required.pattern + r"@redis:6379/0", url), (name, url)
    assert "${RSB_REDIS_PASSWORD}" not in COMPOSE.read_text() and "RSB_REDIS_PASSWORD:-" not in COMPOSE.read_text()
