"""Key names of the remote tier (the same in every backend).

Every key starts with ``ps:<namespace>:<layout id>:`` so that two caches (namespaces) or
two layouts never read each other's keys. A checkpoint's keys share one Redis Cluster
hash tag, ``{<prefix key hex>}``: its manifest and its blobs live in one slot, so one
node holds (or loses) the whole checkpoint and one read (on that node) gets all its blobs.

    ps:<ns>:<layout>:{<prefix>}:m                     the manifest (JSON)
    ps:<ns>:<layout>:{<prefix>}:b:<rank>:<checksum>   one rank's shard bytes

A blob's key names its content's checksum: a blob is never rewritten with other bytes.
"""

from __future__ import annotations

import hashlib
import re

from prefixstore.base.errors import InvalidArgumentError

NAMESPACE_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
LAYOUT_ID_BYTES = 16
CHECKSUM_RE = re.compile(r"[0-9a-f]{32}")


def check_namespace(namespace: object) -> str:
    """``namespace`` if it is 1-64 characters of ``[A-Za-z0-9._-]``."""
    if not isinstance(namespace, str) or not NAMESPACE_RE.fullmatch(namespace):
        raise InvalidArgumentError(
            "namespace", f"must be 1-64 characters of [A-Za-z0-9._-], got {namespace!r}"
        )
    return namespace


def layout_id(layout_json: str) -> str:
    """A layout's identity: a hash of its canonical JSON (``Layout.to_json()``)."""
    if not isinstance(layout_json, str) or not layout_json:
        raise InvalidArgumentError("layout_json", "must be the layout's JSON text")
    digest = hashlib.blake2b(layout_json.encode(), digest_size=LAYOUT_ID_BYTES)
    return digest.hexdigest()


class KeySpace:
    """The key names of one namespace and layout."""

    __slots__ = ("base",)

    def __init__(self, namespace: str, layout: str) -> None:
        self.base = f"ps:{check_namespace(namespace)}:{layout}:"

    def manifest(self, prefix_key: bytes) -> str:
        """The manifest key of the checkpoint ending at ``prefix_key``."""
        return f"{self.base}{{{prefix_key.hex()}}}:m"

    def blob(self, prefix_key: bytes, rank: int, checksum: str) -> str:
        """The key of one rank's blob with content checksum ``checksum``."""
        return f"{self.base}{{{prefix_key.hex()}}}:b:{rank}:{checksum}"
