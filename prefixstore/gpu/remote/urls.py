"""Redis URLs (the Redis backend): ``redis://``, ``rediss://`` (TLS) and ``redis+cluster://``.

    redis://[user:password@]host:port[/db]
    rediss://[user:password@]host:port[/db]
    redis+cluster://[user:password@]host:port[,host:port...]
    rediss+cluster://...

The userinfo (``user:password``) is everything before the last ``@``, so a password may
hold ``/``, ``?``, ``#``, ``:`` or ``@`` without percent-encoding. No part of it ever
appears in an error, a ``repr`` or ``redacted()``: errors quote only what follows it.
"""

from __future__ import annotations

import urllib.parse

import attrs

from prefixstore.base.errors import InvalidArgumentError

SCHEMES = {
    "redis": (False, False),
    "rediss": (False, True),
    "redis+cluster": (True, False),
    "rediss+cluster": (True, True),
}
DEFAULT_PORT = 6379


@attrs.frozen
class RemoteURL:
    """Where the Redis server (or cluster) is and how to log in (``password`` is never shown)."""

    cluster: bool
    tls: bool
    hosts: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = attrs.field(default=None, repr=False)
    password: str | None = attrs.field(default=None, repr=False)

    def redacted(self) -> str:
        """The URL with its userinfo replaced by ``***`` (for logs and errors)."""
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        auth = "***@" if self.username or self.password else ""
        hosts = ",".join(f"{h}:{p}" for h, p in self.hosts)
        return f"{scheme}://{auth}{hosts}" + ("" if self.cluster else f"/{self.db}")


def parse(url: object) -> RemoteURL:
    """``url`` parsed; InvalidArgumentError (naming ``remote``, without the password) if bad."""
    if not isinstance(url, str):
        raise InvalidArgumentError("remote", f"must be a redis:// URL string, got {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise InvalidArgumentError(
            "remote", f"scheme must be one of {', '.join(s + '://' for s in SCHEMES)}"
        )
    cluster, tls = SCHEMES[scheme.lower()]
    auth, at, rest = rest.rpartition("@")  # nothing from ``auth`` may reach a message
    hostlist, _, path = rest.partition("/")
    username = password = None
    if at:
        user, colon, pw = auth.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(pw) if colon else None
    hosts = tuple(_host(h) for h in hostlist.split(","))
    if not cluster and len(hosts) != 1:
        raise InvalidArgumentError("remote", "a redis:// URL names one host (use redis+cluster://)")
    db = 0
    path = path.split("?", 1)[0]
    if path:
        if cluster or not path.isdigit():
            raise InvalidArgumentError("remote", "the path must be a database number (not for a cluster)")
        db = int(path)
    return RemoteURL(cluster, tls, hosts, db, username, password)


def _host(text: str) -> tuple[str, int]:
    if text.startswith("["):
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise InvalidArgumentError("remote", "every host needs a name")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise InvalidArgumentError("remote", f"bad port {port!r} for host {host!r}")
    return host, int(port) if port else DEFAULT_PORT
