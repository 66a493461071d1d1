"""Options of the remote tier, validated once (typed errors naming the option)."""

from __future__ import annotations

import math

import attrs

from prefixstore.base.errors import InvalidArgumentError
from prefixstore.gpu.remote.keys import check_namespace


def _seconds(inst, attr, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(attr.name, f"must be a positive number of seconds, got {value!r}")


def _count(inst, attr, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(attr.name, f"must be a positive integer, got {value!r}")


def _optional_seconds(inst, attr, value) -> None:
    if value is not None:
        _seconds(inst, attr, value)


def _flag(inst, attr, value) -> None:
    if not isinstance(value, bool):
        raise InvalidArgumentError(attr.name, f"must be True or False, got {value!r}")


def _optional_text(inst, attr, value) -> None:
    if value is not None and not isinstance(value, str):
        raise InvalidArgumentError(attr.name, f"must be a string or None, got {type(value).__name__}")


def _namespace(inst, attr, value) -> None:
    check_namespace(value)


def _tls(inst, attr, value) -> None:
    if not isinstance(value, dict) or any(not k.startswith("ssl_") for k in value):
        raise InvalidArgumentError(attr.name, "must map redis-py ssl_* options to values")


@attrs.frozen
class RemoteConfig:
    """How the remote tier behaves.

    ``lookup_timeout`` / ``restore_timeout``: the most a ``deepest`` / ``fetch`` call waits
    (connecting included) before it answers a miss. ``write_timeout``: the same for one
    write attempt. ``write_behind``: queue writes for a background thread (False: write
    in the caller, within ``write_timeout``). ``queue_items`` / ``queue_bytes``: the
    queue's bounds (a put beyond them is dropped and counted). ``write_attempts``: tries
    per checkpoint, ``retry_backoff`` seconds doubling between them. ``reconnect_interval``:
    seconds between background reconnect attempts while the server is unreachable.
    ``call_threads``: threads that run calls so that a caller can stop waiting at its budget.
    ``ttl``: seconds a stored key lives (None: until the store evicts it). Redis only:
    ``username`` / ``password`` override the URL's; ``tls``: redis-py ``ssl_*`` options
    (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``...). A backend
    refuses, naming it, an option it cannot honour (Mooncake Store: ``ttl``, ``username``,
    ``password``, ``tls``).

    ``auth_key_env`` / ``auth_key_file``: the name of an environment variable, or the path
    of a file, holding a key (16-4096 bytes; a trailing newline is not part of it) that
    every engine sharing the namespace holds: manifests and blobs then carry HMAC-SHA256
    MACs under it, and a checkpoint without them, or with another key's, is a verify
    failure (a miss, counted). At most one of the two; never in the URL; the key itself
    is read when the tier is built and never shown. Engines with and without a key do
    not read each other's checkpoints.
    """

    namespace: str = attrs.field(default="default", validator=_namespace)
    lookup_timeout: float = attrs.field(default=0.25, validator=_seconds)
    restore_timeout: float = attrs.field(default=2.0, validator=_seconds)
    write_timeout: float = attrs.field(default=2.0, validator=_seconds)
    write_behind: bool = attrs.field(default=True, validator=_flag)
    queue_items: int = attrs.field(default=1024, validator=_count)
    queue_bytes: int = attrs.field(default=1 << 30, validator=_count)
    write_attempts: int = attrs.field(default=4, validator=_count)
    retry_backoff: float = attrs.field(default=0.05, validator=_seconds)
    reconnect_interval: float = attrs.field(default=0.5, validator=_seconds)
    call_threads: int = attrs.field(default=8, validator=_count)
    ttl: float | None = attrs.field(default=None, validator=_optional_seconds)
    username: str | None = attrs.field(default=None, validator=_optional_text)
    password: str | None = attrs.field(default=None, validator=_optional_text, repr=False)
    tls: dict = attrs.field(factory=dict, validator=_tls, repr=False)
    auth_key_env: str | None = attrs.field(default=None, validator=_optional_text)
    auth_key_file: str | None = attrs.field(default=None, validator=_optional_text)

    def __attrs_post_init__(self) -> None:
        if self.auth_key_env is not None and self.auth_key_file is not None:
            raise InvalidArgumentError("auth_key_env", "give the key in auth_key_env or auth_key_file, not both")
