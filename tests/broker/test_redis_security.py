"""Redis AUTH and TLS (rediss://) work end to end, and no secret reaches a log."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import create, read_sse
from servers import StackFactory

from broker.redis.server import RedisServer, TlsFiles, make_tls_files

PASSWORD = "s3cret-p@ss:word"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.mark.parametrize("tls", [False, True], ids=["auth", "auth+tls"])
def test_stack_runs_on_a_redis_with_a_password_and_tls(stack_factory: StackFactory, tls_files: TlsFiles, tls: bool) -> None:
    server = RedisServer(password=PASSWORD, tls=tls_files if tls else None).start()
    try:
        assert server.url.startswith("rediss://" if tls else "redis://")
        s = stack_factory(server.url)
        s.consumer()
        s.generator()
        with s.client() as c:
            assert c.get("/readyz").status_code == 200
            r = create(c, max_tokens=10)
            assert r.status_code == 201
            events = read_sse(c, r.json()["events_url"]).events
            assert events[-1].event == "done"
        for proc in s.procs:
            assert "s3cret" not in proc.output()
    finally:
        server.cleanup()


def test_a_wrong_password_or_plaintext_to_tls_is_unavailable_not_a_crash(stack_factory: StackFactory, tls_files: TlsFiles) -> None:
    server = RedisServer(password=PASSWORD, tls=tls_files).start()
    try:
        wrong = server.url.replace("s3cret", "wrong")
        plain = server.url.replace("rediss://", "redis://").split("?")[0]
        for url in (wrong, plain):
            s = stack_factory(url)
            _, base = s.consumer()
            with s.client(base) as c:
                assert c.get("/readyz").status_code == 503
                r = create(c)
                assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
                assert "retry-after" in r.headers
    finally:
        server.cleanup()


def test_make_tls_files_writes_a_ca_and_a_server_pair(tls_files: TlsFiles) -> None:
    for f in (tls_files.ca_cert, tls_files.cert, tls_files.key):
        assert Path(f).stat().st_size > 0
