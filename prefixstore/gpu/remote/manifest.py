"""A checkpoint's manifest in the remote tier: which blobs make it, and how to verify them.

JSON (never pickle), written after every blob it names. It carries its own checksum over
its canonical body, and ``decode`` checks that it names the namespace, layout and prefix
key it was read for and that every blob key is the one derived from its rank and
checksum: a manifest that was altered, truncated or written for another cache is refused.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import attrs

from prefixstore.gpu import shards
from prefixstore.gpu.remote.keys import CHECKSUM_RE, KeySpace

VERSION = 1


class ManifestError(ValueError):
    """A manifest's bytes do not describe a valid checkpoint of this key space."""


@attrs.frozen
class BlobRef:
    """One rank's blob: its key, size in bytes and content checksum."""

    key: str
    size: int
    checksum: str

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
        "blobs": [[b.size, b.checksum] for b in m.blobs],
    }


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def encode(keys: KeySpace, m: Manifest) -> bytes:
    """The manifest's stored bytes: its canonical body plus that body's checksum."""
    body = _body(keys, m)
    return _canonical({**body, "sum": shards.checksum(_canonical(body))})


def decode(keys: KeySpace, prefix_key: bytes, data: bytes, ranks: int) -> Manifest:
    """The manifest in ``data``, read at ``prefix_key``'s manifest key; ManifestError unless
    it is intact and describes a ``ranks``-rank checkpoint of this key space at that key."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise ManifestError(f"not JSON: {type(exc).__name__}") from None
    if not isinstance(body, dict) or not isinstance(body.get("sum"), str):
        raise ManifestError("no checksum")
    claimed = body.pop("sum")
    if shards.checksum(_canonical(body)) != claimed:
        raise ManifestError("checksum mismatch")
    m = _parse(keys, prefix_key, body, ranks)
    if _body(keys, m) != body:
        raise ManifestError("unexpected fields")
    return m


def _parse(keys: KeySpace, prefix_key: bytes, body: dict, ranks: int) -> Manifest:
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
    refs = []
    for rank, entry in enumerate(blobs):
        if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int
                and entry[0] >= 0 and isinstance(entry[1], str) and CHECKSUM_RE.fullmatch(entry[1])):
            raise ManifestError(f"bad blob entry for rank {rank}")
        refs.append(BlobRef(keys.blob(prefix_key, rank, entry[1]), entry[0], entry[1]))
    return Manifest(body["prefix"], start, end, gen, body["snapshot"], refs)
