"""Redis URLs as rsb takes them: ``redis://`` and ``rediss://`` (one server), ``redis+cluster://`` (a Redis Cluster,
any node's address) and ``redis+sentinel://host:26379[,host:port...]/service[/db]`` (the primary its sentinels name);
what each scheme means and the plain forms redis-py parses."""

from __future__ import annotations

from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit, urlunsplit

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SENTINEL_SCHEMES = {"redis+sentinel": "redis", "rediss+sentinel": "rediss"}


def is_sentinel_url(url: str) -> bool:
    return urlsplit(url).scheme in SENTINEL_SCHEMES


def sentinel_auth(parts: SplitResult) -> dict[str, Any]:
    """The primary's credentials in a sentinel URL, percent-decoded as redis-py decodes them in a redis:// URL
    (a password with ``@``, ``:`` or ``/`` is written quoted; --redis-password is added quoted)."""
    if parts.password is None:
        return {}
    return {"username": unquote(parts.username) if parts.username else None, "password": unquote(parts.password)}


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def plain_url(url: str) -> str:
    """The URL with a ``+cluster`` scheme turned into the plain one redis-py parses."""
    parts = urlsplit(url)
    if parts.scheme in CLUSTER_SCHEMES:
        parts = parts._replace(scheme=CLUSTER_SCHEMES[parts.scheme])
    return urlunsplit(parts)


def cluster_url(url: str) -> str:
    """The same server(s) as a cluster URL (``--redis-cluster`` with a plain ``redis://`` URL)."""
    parts = urlsplit(url)
    if parts.scheme in CLUSTER_SCHEMES:
        return url
    if parts.path not in ("", "/", "/0"):
        raise ValueError("Redis Cluster has only database 0: drop the /<db> from --redis-url")
    return urlunsplit(parts._replace(scheme=f"{parts.scheme}+cluster", path=""))


def node_url(url: str, host: str, port: int) -> str:
    """A standalone URL for one node of a cluster, keeping the credentials and TLS of ``url``."""
    parts = urlsplit(plain_url(url))
    auth = parts.netloc.rpartition("@")[0]
    netloc = f"{auth}@{host}:{port}" if auth else f"{host}:{port}"
    return urlunsplit(parts._replace(netloc=netloc, path=""))
