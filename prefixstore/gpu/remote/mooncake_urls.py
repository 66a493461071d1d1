"""Mooncake Store URLs: where the master and its metadata service are, and what this
client brings.

    mooncake://host[:port]?metadata=http://host:port/metadata[&local_hostname=ip]
        [&segment=size][&protocol=tcp]

``host:port``: the ``mooncake_master`` RPC address (port 50051 if not given).
``metadata``: the transfer engine's metadata service, ``http://`` or ``https://`` (the
master's own ``-enable_http_metadata_server``), or ``P2PHANDSHAKE`` (none: peers exchange
it directly); percent-encode it if it has ``&`` or ``#`` of its own.
``local_hostname``: the address other clients reach this one's transfer engine at, and
the one it advertises (``127.0.0.1`` when the master is on loopback, else required).
``segment``: bytes of this process's memory lent to the store (default 0: it only uses
the memory others lend), a number with an optional ``KiB``/``MiB``/``GiB`` suffix.
``protocol``: ``tcp`` (the only transport this client is tested with).

A parsed URL never shows the metadata service's password (``repr``, ``redacted()``),
and a refused URL's error names the argument ``remote`` without quoting the URL.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse

import attrs

from prefixstore.base.errors import InvalidArgumentError

SCHEME = "mooncake"
DEFAULT_PORT = 50051
P2P = "P2PHANDSHAKE"
PARAMS = ("metadata", "local_hostname", "segment", "protocol")
PROTOCOLS = ("tcp",)
SIZE_RE = re.compile(r"([0-9]{1,20})(|KiB|MiB|GiB)")
UNITS = {"": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
MAX_SEGMENT = 1 << 50


@attrs.frozen
class MooncakeURL:
    """A parsed ``mooncake://`` URL (``metadata`` keeps any password: never log it)."""

    host: str
    port: int
    metadata: str = attrs.field(repr=False)
    local_hostname: str
    segment: int = 0
    protocol: str = "tcp"

    @property
    def master(self) -> str:
        """The master's RPC address as Mooncake takes it (``host:port``, IPv6 in brackets)."""
        return f"{_bracketed(self.host)}:{self.port}"

    def redacted(self) -> str:
        """The URL with the metadata service's password replaced by ``***``."""
        query = urllib.parse.urlencode({
            "metadata": _redacted_metadata(self.metadata),
            "local_hostname": self.local_hostname,
            "segment": self.segment,
            "protocol": self.protocol,
        }, safe=":/*@")
        return f"{SCHEME}://{self.master}?{query}"

    def __repr__(self) -> str:
        return f"MooncakeURL({self.redacted()!r})"


def parse(url: object) -> MooncakeURL:
    """``url`` parsed; InvalidArgumentError (naming ``remote``, never quoting the URL) if bad."""
    if not isinstance(url, str):
        raise InvalidArgumentError("remote", f"must be a mooncake:// URL string, got {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != SCHEME:
        raise InvalidArgumentError("remote", "a Mooncake Store URL starts with mooncake://")
    netloc, _, query = rest.partition("?")
    if "#" in query:
        raise InvalidArgumentError("remote", "a mooncake:// URL has no fragment (percent-encode # in a value)")
    netloc, _, path = netloc.partition("/")
    if path or "@" in netloc:
        raise InvalidArgumentError("remote", "a mooncake:// URL names host:port only (no user, no path)")
    host, port = _host_port(netloc)
    params = _params(query)
    if "metadata" not in params:
        raise InvalidArgumentError("remote", "metadata= is required (http://host:port/metadata or P2PHANDSHAKE)")
    metadata = _metadata(params["metadata"])
    local = params.get("local_hostname")
    if local is None:
        if not _loopback(host):
            raise InvalidArgumentError(
                "remote", "local_hostname= is required when the master is not on loopback")
        local = "127.0.0.1"
    elif not local or any(c in local for c in "/?#@ ") or local.startswith("["):
        raise InvalidArgumentError("remote", "local_hostname= must be a bare host name or address")
    protocol = params.get("protocol", "tcp")
    if protocol not in PROTOCOLS:
        raise InvalidArgumentError("remote", f"protocol= must be one of {', '.join(PROTOCOLS)}")
    segment = _size(params.get("segment", "0"))
    return MooncakeURL(host, port, metadata, local, segment, protocol)


def _params(query: str) -> dict[str, str]:
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise InvalidArgumentError("remote", "the query must be name=value pairs joined by &") from None
    params: dict[str, str] = {}
    for name, value in pairs:
        if name not in PARAMS:
            raise InvalidArgumentError(
                "remote", f"a parameter is not one of {', '.join(PARAMS)}")
        if name in params:
            raise InvalidArgumentError("remote", f"parameter {name!r} is given twice")
        params[name] = value
    return params


def _host_port(text: str) -> tuple[str, int]:
    if text.startswith("["):
        host, _, port = text[1:].partition("]")
        if port and not port.startswith(":"):
            raise InvalidArgumentError("remote", "an IPv6 master is written [address]:port")
        port = port.removeprefix(":")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise InvalidArgumentError("remote", "the master's [address] is not an IPv6 address") from None
    else:
        host, _, port = text.partition(":")
        if ":" in port:
            raise InvalidArgumentError("remote", "write an IPv6 master as [address]:port")
    if not host:
        raise InvalidArgumentError("remote", "the master needs a host name")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise InvalidArgumentError("remote", "the master's port must be 1-65535")
    return host, int(port) if port else DEFAULT_PORT


def _metadata(value: str) -> str:
    if value == P2P:
        return value
    try:
        parts = urllib.parse.urlsplit(value)
        port = parts.port
    except ValueError:
        raise InvalidArgumentError("remote", "metadata= is not a valid http:// URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise InvalidArgumentError(
            "remote", "metadata= must be http://host:port/path, https://host:port/path or P2PHANDSHAKE")
    if parts.query or parts.fragment:
        raise InvalidArgumentError("remote", "metadata= takes no query or fragment of its own")
    return value


def _size(text: str) -> int:
    m = SIZE_RE.fullmatch(text)
    if not m or int(m[1]) * UNITS[m[2]] > MAX_SEGMENT:
        raise InvalidArgumentError(
            "remote", "segment= must be a number of bytes (optionally KiB, MiB or GiB), at most 1 PiB")
    return int(m[1]) * UNITS[m[2]]


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _redacted_metadata(metadata: str) -> str:
    parts = urllib.parse.urlsplit(metadata)
    if parts.password is None:
        return metadata
    user = parts.username or ""
    netloc = f"{user}:***@{parts.netloc.rpartition('@')[2]}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))
