"""Authenticated content: HMAC-SHA256 under a key every engine of a deployment shares.

With a key, a manifest carries the MAC of its canonical body (in place of the unkeyed
checksum) and of each blob (over the blob's key name and bytes): an engine that can write
to the remote store but does not hold the key cannot make a checkpoint the others
accept. The key comes from an environment variable or a file that ``RemoteConfig``
names, never from the URL, and is never shown.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from prefixstore.base.errors import InvalidArgumentError

MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 4096


class SharedKey:
    """The shared key; ``repr`` never shows it."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        self._key = key

    def __repr__(self) -> str:
        return "SharedKey(***)"

    def _mac(self, *parts: bytes | memoryview) -> str:
        h = hmac.new(self._key, digestmod=hashlib.sha256)
        for p in parts:  # each part preceded by its length: no two splits hash alike
            h.update(memoryview(p).nbytes.to_bytes(8, "big"))
            h.update(p)
        return h.hexdigest()

    def manifest_mac(self, body: bytes) -> str:
        """The MAC of a manifest's canonical body."""
        return self._mac(b"prefixstore manifest", body)

    def blob_mac(self, key: str, data: bytes | memoryview) -> str:
        """The MAC of one blob: its key name (namespace, layout, prefix, rank, checksum) and bytes."""
        return self._mac(b"prefixstore blob", key.encode(), data)

    @staticmethod
    def same(a: str, b: object) -> bool:
        """Whether MAC ``b`` (from storage: anything) is ``a``, in constant time."""
        return isinstance(b, str) and hmac.compare_digest(a, b)


def load(env: str | None, file: str | None) -> SharedKey | None:
    """The key in environment variable ``env`` or in ``file`` (at most one of them
    named; a trailing newline is not part of it); None when neither is. Typed errors name
    the option, never the key."""
    if env is None and file is None:
        return None
    if env is not None and file is not None:
        raise InvalidArgumentError("auth_key_env", "give the key in auth_key_env or auth_key_file, not both")
    if env is not None:
        value = os.environb.get(env.encode())
        if value is None:
            raise InvalidArgumentError("auth_key_env", f"environment variable {env!r} is not set")
        return SharedKey(_checked("auth_key_env", value))
    try:
        with Path(file).open("rb") as f:
            value = f.read(MAX_KEY_BYTES + 2)
    except OSError as exc:
        raise InvalidArgumentError("auth_key_file", f"cannot read {file!r}: {exc.strerror}") from None
    return SharedKey(_checked("auth_key_file", value))


def _checked(option: str, value: bytes) -> bytes:
    key = value.removesuffix(b"\n").removesuffix(b"\r")
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise InvalidArgumentError(option, f"the key must be {MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes")
    return key
