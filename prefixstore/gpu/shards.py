"""Shard files: safetensors bytes (never pickle), their checksum and verification."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import torch
import xxhash
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from prefixstore.engine.errors import ShardError
from prefixstore.engine.layout import Layout

FORMAT = "prefixstore-shard-1"


def checksum(data: bytes | memoryview) -> str:
    """Checksum of a shard file's bytes (xxh3-128, hex)."""
    return xxhash.xxh3_128_hexdigest(data)


def encode(
    segments: Mapping[str, torch.Tensor],
    snapshot: Mapping[str, torch.Tensor],
    meta: Mapping[str, str],
) -> bytes:
    """Serialise one rank's tensors. Names are prefixed ``seg.`` / ``snap.``."""
    tensors = {f"seg.{k}": v.detach().to("cpu").contiguous() for k, v in segments.items()}
    tensors.update({f"snap.{k}": v.detach().to("cpu").contiguous() for k, v in snapshot.items()})
    return st_save(tensors, metadata={"format": FORMAT, **meta})


def header(data: bytes) -> dict:
    """The safetensors JSON header of ``data`` (raises ShardError if malformed)."""
    if len(data) < 8:
        raise ShardError("shard shorter than its header length field")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ShardError("shard header length exceeds the file")
    try:
        return json.loads(data[8 : 8 + n])
    except ValueError as exc:
        raise ShardError(f"shard header is not JSON: {exc}") from exc


def decode(
    data: bytes,
    layout: Layout,
    tokens: int,
    with_snapshot: bool,
    expect_meta: Mapping[str, str],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Parse and validate one rank's shard; raise ShardError on any mismatch."""
    meta = header(data).get("__metadata__") or {}
    for k, v in {"format": FORMAT, **expect_meta}.items():
        if meta.get(k) != v:
            raise ShardError(f"shard metadata {k}={meta.get(k)!r}, expected {v!r}")
    try:
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises its own error types
        raise ShardError(f"shard is not valid safetensors: {exc}") from exc
    segs = {k[4:]: v for k, v in tensors.items() if k.startswith("seg.")}
    snaps = {k[5:]: v for k, v in tensors.items() if k.startswith("snap.")}
    if len(segs) + len(snaps) != len(tensors):
        raise ShardError(f"shard holds unexpected tensors {sorted(tensors)}")
    if not with_snapshot and snaps:
        raise ShardError("shard holds a snapshot the catalog does not record")
    try:
        layout.check_segments(0, segs, tokens)
        if with_snapshot:
            layout.check_snapshot(0, snaps)
    except Exception as exc:
        raise ShardError(f"shard does not match the layout: {exc}") from exc
    return segs, snaps
