"""A checkpoint's manifest in the remote tier: which blobs make it, and how to verify them.

JSON (never pickle), written after every blob it names, at most ``max_bytes(ranks)``
long. It carries its own checksum over its canonical body (with a shared key, ``auth``:
that body's MAC, and each blob's MAC in its entry), and ``decode`` checks that it names
the namespace, layout and prefix key it was read for and that every blob key is the one
derived from its rank and checksum: a manifest that was altered, truncated, forged or
written for another cache is refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import attrs

from prefixstore.gpu import shards
from prefixstore.gpu.remote.auth import SharedKey
from prefixstore.gpu.remote.keys import CHECKSUM_RE, KeySpace

VERSION = 1
MAC_RE = re.compile(r"[0-9a-f]{64}")
BASE_BYTES = 1024
RANK_BYTES = 256


def max_bytes(ranks: int) -> int:
    """The longest manifest of a ``ranks``-rank checkpoint: 1 KiB plus 256 bytes per rank
    (a longer value at a manifest key is refused unread)."""
    return BASE_BYTES + RANK_BYTES * ranks


class ManifestError(ValueError):
    """A manifest's bytes do not describe a valid checkpoint of this key space."""


@attrs.frozen
class BlobRef:
    """One rank's blob: its key, size in bytes, content checksum and, with a shared
    key, its MAC (``SharedKey.blob_mac``)."""

    key: str
    size: int
    checksum: str
    mac: str | None = None

    def verify(self, data: bytes | None) -> bool:
        """Whether ``data`` is this blob's bytes (right size and checksum)."""
        return data is not None and len(data) == self.size and shards.checksum(data) == self.checksum


@attrs.frozen
class Manifest:
    """A checkpoint of blocks ``[start, end)`` ending at ``prefix`` (the chained key's hex):
    one blob per rank, the checkpoint's generation and whether it holds a snapshot."""

    prefix: str
    start: int
    end: int
    generation: int
    snapshot: bool
    blobs: tuple[BlobRef, ...] = attrs.field(converter=tuple)
    stored: bytes | None = attrs.field(default=None, eq=False, repr=False)
    """The bytes this manifest was decoded from (None: built here)."""

    @property
    def nbytes(self) -> int:
        """Bytes of all ranks' blobs."""
        return sum(b.size for b in self.blobs)

    @property
    def prefix_key(self) -> bytes:
        return bytes.fromhex(self.prefix)


def build(
    keys: KeySpace,
    prefix_key: bytes,
    blobs: Sequence[bytes],
    *,
    start: int,
    end: int,
    generation: int,
    snapshot: bool,
    checksums: Sequence[str] | None = None,
) -> Manifest:
    """The manifest of ``blobs`` (one per rank) for the checkpoint ending at ``prefix_key``;
    ``checksums``: their ``shards.checksum`` when already known (else computed)."""
    refs = []
    for rank, data in enumerate(blobs):
        ck = shards.checksum(data) if checksums is None else checksums[rank]
        refs.append(BlobRef(keys.blob(prefix_key, rank, ck), len(data), ck))
    return Manifest(prefix_key.hex(), int(start), int(end), int(generation), bool(snapshot), refs)


def _body(keys: KeySpace, m: Manifest) -> dict:
    return {
        "v": VERSION,
        "space": keys.base,
        "prefix": m.prefix,
        "start": m.start,
        "end": m.end,
        "generation": m.generation,
        "snapshot": m.snapshot,
        "blobs": [[b.size, b.checksum] if b.mac is None else [b.size, b.checksum, b.mac] for b in m.blobs],
    }


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign(key: SharedKey, m: Manifest, blobs: Sequence[bytes]) -> Manifest:
    """``m`` with each blob's MAC under ``key`` (``blobs``: the bytes ``m`` names)."""
    refs = [attrs.evolve(r, mac=key.blob_mac(r.key, b)) for r, b in zip(m.blobs, blobs, strict=True)]
    return attrs.evolve(m, blobs=refs)


def encode(keys: KeySpace, m: Manifest, key: SharedKey | None = None) -> bytes:
    """The manifest's stored bytes: its canonical body plus that body's checksum, or
    with ``key`` its MAC (``m`` then ``sign``-ed: every blob carries its MAC)."""
    body = _body(keys, m)
    if key is None:
        return _canonical({**body, "sum": shards.checksum(_canonical(body))})
    if any(b.mac is None for b in m.blobs):
        raise ValueError("sign the manifest's blobs before encoding it with a key")
    return _canonical({**body, "mac": key.manifest_mac(_canonical(body))})


def decode(keys: KeySpace, prefix_key: bytes, data: bytes, ranks: int, key: SharedKey | None = None) -> Manifest:
    """The manifest in ``data``, read at ``prefix_key``'s manifest key; ManifestError unless
    it is intact (with ``key``: signed under it) and describes a ``ranks``-rank checkpoint
    of this key space at that key."""
    if len(data) > max_bytes(ranks):
        raise ManifestError(f"longer than {max_bytes(ranks)} bytes")
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise ManifestError(f"not JSON: {type(exc).__name__}") from None
    if not isinstance(body, dict):
        raise ManifestError("no checksum")
    if key is None:
        if "mac" in body:
            raise ManifestError("signed with a key this reader does not hold")
        claimed = body.pop("sum", None)
        if not isinstance(claimed, str):
            raise ManifestError("no checksum")
        if shards.checksum(_canonical(body)) != claimed:
            raise ManifestError("checksum mismatch")
    else:
        claimed = body.pop("mac", None)
        if not isinstance(claimed, str):
            raise ManifestError("not signed")
        if not SharedKey.same(key.manifest_mac(_canonical(body)), claimed):
            raise ManifestError("signature mismatch (another key, or altered)")
    m = _parse(keys, prefix_key, body, ranks, signed=key is not None)
    if _body(keys, m) != body:
        raise ManifestError("unexpected fields")
    return attrs.evolve(m, stored=data)


def _parse(keys: KeySpace, prefix_key: bytes, body: dict, ranks: int, signed: bool) -> Manifest:
    if body.get("v") != VERSION or body.get("space") != keys.base:
        raise ManifestError("another version or key space")
    if body.get("prefix") != prefix_key.hex():
        raise ManifestError("written for another prefix key")
    start, end, gen = body.get("start"), body.get("end"), body.get("generation")
    if not all(type(x) is int for x in (start, end, gen)) or not 0 <= start < end or gen < 0:
        raise ManifestError("bad block range or generation")
    if type(body.get("snapshot")) is not bool:
        raise ManifestError("bad snapshot flag")
    blobs = body.get("blobs")
    if not isinstance(blobs, list) or len(blobs) != ranks:
        raise ManifestError(f"names {len(blobs) if isinstance(blobs, list) else 'no'} blobs, want {ranks}")
    return Manifest(body["prefix"], start, end, gen, body["snapshot"],
                    [_blob(keys, prefix_key, rank, entry, signed) for rank, entry in enumerate(blobs)])


def _blob(keys: KeySpace, prefix_key: bytes, rank: int, entry: object, signed: bool) -> BlobRef:
    if not (isinstance(entry, list) and len(entry) == 2 + signed and type(entry[0]) is int
            and entry[0] >= 0 and isinstance(entry[1], str) and CHECKSUM_RE.fullmatch(entry[1])
            and (not signed or isinstance(entry[2], str) and MAC_RE.fullmatch(entry[2]))):
        raise ManifestError(f"bad blob entry for rank {rank}")
    return BlobRef(keys.blob(prefix_key, rank, entry[1]), entry[0], entry[1], entry[2] if signed else None)
