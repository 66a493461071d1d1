"""Shard files: safetensors bytes (never pickle), their checksum and verification.

Two ways to build and parse the same file format:

- ``encode`` / ``decode``: whole-file ``bytes`` (the safetensors library; one copy each
  way). Used by compaction and the auditor.
- the zero-copy path: ``plan_shard`` lays a shard out from the layout alone (header
  bytes, each tensor's offsets, the exact file size) so the executors copy device
  tensors straight into their place in a (pinned) staging buffer, and the file is
  written from that buffer; ``parse`` validates a file read into a buffer and returns
  tensors that are views of it. Files are ordinary safetensors files either way:
  ``u64le header length | JSON header (padded with spaces to 8 bytes) | raw data``,
  tensors ordered by alignment then name, so every tensor is aligned to its dtype.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Mapping, Sequence

import attrs
import torch
import xxhash
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from prefixstore.base.errors import LayoutError, ShardError
from prefixstore.base.keys import ROOT
from prefixstore.base.layout import Layout, TensorSpec

FORMAT = "prefixstore-shard-1"


def meta(key: bytes, gen: int, start: int, end: int, snap: bool) -> dict[str, str]:
    """The metadata a shard of checkpoint ``key`` at generation ``gen`` carries (all ranks)."""
    return {"key": key.hex(), "generation": str(gen), "start": str(start), "end": str(end),
            "snapshot": "1" if snap else "0"}


def provenance(layout: Layout, parent: bytes, digests: bytes) -> dict[str, str]:
    """What a shard carries so that a lost catalog can be rebuilt from the shards alone
    (``engine/rebuild.py``), beyond what verification checks: the node's block digests,
    the key it chains from (for a node at the start of its prefix: none, the root) or
    else the cache's layout. The layout rides on the root nodes' shards only: every
    other node hangs below one, and cannot be placed without it."""
    out = {"digests": digests.hex()}
    if parent == ROOT:
        out["layout"] = layout_code(layout)
    else:
        out["parent"] = parent.hex()
    return out


def span_provenance(layout: Layout, keys: Sequence[bytes], digests: Sequence[bytes], start: int,
                    end: int) -> dict[str, str]:
    """``provenance`` of the node covering blocks ``(start, end]`` of a prefix with these
    chained ``keys`` and block ``digests``."""
    return provenance(layout, keys[start - 1] if start else ROOT, b"".join(digests[start:end]))


@functools.lru_cache(maxsize=8)
def layout_code(layout: Layout) -> str:
    """The layout in a few bytes: ``block_tokens;ranks;segments;snapshots``, each tensor
    ``name:dtype:d1xd2..`` (names are ``[A-Za-z0-9_.]``), comma-separated."""
    def specs(xs) -> str:
        return ",".join(f"{t.name}:{t.dtype}:{'x'.join(str(d) for d in t.shape)}" for t in xs)

    return f"{layout.block_tokens};{layout.ranks};{specs(layout.segments)};{specs(layout.snapshots)}"


def layout_from_code(text: str) -> Layout:
    """The layout ``layout_code`` wrote (LayoutError when ``text`` is not one)."""
    try:
        bt, ranks, segs, snaps = text.split(";")

        def specs(part: str) -> list[TensorSpec]:
            out = []
            for item in part.split(",") if part else []:
                name, dtype, shape = item.split(":")
                out.append(TensorSpec(name, dtype, tuple(int(d) for d in shape.split("x")) if shape else ()))
            return out

        return Layout(segments=specs(segs), snapshots=specs(snaps), block_tokens=int(bt), ranks=int(ranks))
    except (AttributeError, TypeError, ValueError) as exc:
        raise LayoutError(f"not a layout code: {text!r}: {exc}") from exc


@attrs.frozen
class Provenance:
    """What one shard's header says about itself (``read_provenance``)."""

    key: bytes
    generation: int
    start: int
    end: int
    snapshot: bool
    rank: int
    parent: bytes
    digests: bytes
    layout: str | None
    """The layout as a root node's shard records it (``layout_code``; None on other shards)."""


def read_provenance(data: bytes) -> Provenance:
    """The identity a shard's header claims (ShardError when it names none, e.g. a
    shard written before shards carried their digests). Not a verification: the
    caller decodes the shard against the layout."""
    meta = _metadata(header(data))
    if meta.get("format") != FORMAT:
        raise ShardError(f"not a prefixstore shard (format {meta.get('format')!r})")
    if not isinstance(meta.get("digests"), str):
        raise ShardError("the shard's header names no block digests (written before shards carried them)")
    try:
        start = int(meta["start"])
        parent = bytes.fromhex(meta["parent"]) if start else ROOT
        layout = meta["layout"] if not start else None
        out = Provenance(bytes.fromhex(meta["key"]), int(meta["generation"]), start, int(meta["end"]),
                         {"0": False, "1": True}[meta["snapshot"]], int(meta["rank"]), parent,
                         bytes.fromhex(meta["digests"]), layout)
    except (KeyError, TypeError, ValueError) as exc:
        raise ShardError(f"the shard's header is malformed: {exc!r}") from exc
    if not 0 <= out.start < out.end or out.generation < 1 or out.rank < 0 or not isinstance(out.layout, str | None):
        raise ShardError(f"the shard's header claims span ({out.start}, {out.end}], generation "
                         f"{out.generation}, rank {out.rank}")
    return out


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
        head = json.loads(data[8 : 8 + n])
    except ValueError as exc:
        raise ShardError(f"shard header is not JSON: {exc}") from exc
    if not isinstance(head, dict):
        raise ShardError("shard header is not a JSON object")
    return head


def _metadata(head: dict) -> dict:
    """The header's ``__metadata__`` object (ShardError when it is not an object)."""
    meta = head.pop("__metadata__", None)
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise ShardError("shard metadata is not a JSON object")
    return meta



def _split_checked(
    tensors: Mapping[str, torch.Tensor], layout: Layout, tokens: int, with_snapshot: bool
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split a shard's tensors into segments and snapshot; ShardError unless they match the layout."""
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

def decode(
    data: bytes,
    layout: Layout,
    tokens: int,
    with_snapshot: bool,
    expect_meta: Mapping[str, str],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Parse and validate one rank's shard; raise ShardError on any mismatch."""
    meta = _metadata(header(data))
    for k, v in {"format": FORMAT, **expect_meta}.items():
        if meta.get(k) != v:
            raise ShardError(f"shard metadata {k}={meta.get(k)!r}, expected {v!r}")
    try:
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises its own error types
        raise ShardError(f"shard is not valid safetensors: {exc}") from exc
    return _split_checked(tensors, layout, tokens, with_snapshot)


# ---------------------------------------------------------------------------- zero-copy path

ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_FROM_ST: dict[str, torch.dtype] = {v: k for k, v in ST_DTYPES.items()}
_ITEMSIZE: dict[torch.dtype, int] = {d: torch.empty((), dtype=d).element_size() for d in ST_DTYPES}
MAX_HEADER = 1 << 24


@attrs.frozen
class Entry:
    """One tensor of a shard: its safetensors name, dtype, shape and file offsets."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@attrs.frozen
class ShardPlan:
    """Where everything of one shard file goes; ``header`` is its first bytes."""

    header: bytes
    entries: tuple[Entry, ...]
    size: int

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def payload_bytes(self) -> int:
        return self.size - len(self.header)


def plan_shard(
    segments: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    snapshot: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    meta: Mapping[str, str],
) -> ShardPlan:
    """Lay out one rank's shard from ``name -> (dtype, shape)`` (no tensor needed)."""
    specs = [(f"seg.{k}", d, tuple(s)) for k, (d, s) in segments.items()]
    specs += [(f"snap.{k}", d, tuple(s)) for k, (d, s) in snapshot.items()]
    itemsize = _ITEMSIZE
    specs.sort(key=lambda e: (-itemsize[e[1]], e[0]))
    head: dict[str, object] = {"__metadata__": dict(sorted({"format": FORMAT, **meta}.items()))}
    off = 0
    rel = []
    for name, dtype, shape in specs:
        n = itemsize[dtype]
        for dim in shape:
            n *= dim
        head[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        rel.append((name, dtype, shape, off, off + n))
        off += n
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    entries = tuple(Entry(nm, d, s, start + b, start + e) for nm, d, s, b, e in rel)
    return ShardPlan(struct.pack("<Q", len(text)) + text, entries, start + off)


def plan_for_layout(layout: Layout, tokens: int, with_snapshot: bool, meta: Mapping[str, str]) -> ShardPlan:
    """The plan of a shard holding ``tokens`` segment rows (and the snapshot if asked)."""
    segs = {s.name: (s.torch_dtype, (tokens, *s.shape)) for s in layout.segments}
    snaps = {s.name: (s.torch_dtype, tuple(s.shape)) for s in layout.snapshots} if with_snapshot else {}
    return plan_shard(segs, snaps, meta)


def views(plan: ShardPlan, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Typed views of each entry inside ``buf`` (a 1-D uint8 tensor of the file)."""
    return {e.name: buf[e.begin : e.end].view(e.dtype).view(e.shape) for e in plan.entries}


def _header_of(buf: torch.Tensor) -> tuple[bytes, int]:
    size = buf.numel()
    if size < 8:
        raise ShardError("shard shorter than its header length field")
    n = header_length(buf[:8].numpy().tobytes(), size)
    return buf[8 : 8 + n].numpy().tobytes(), 8 + n


def header_length(first8: bytes, file_size: int) -> int:
    """The JSON header's length from a shard's first 8 bytes (ShardError when it cannot
    fit in a file of ``file_size`` bytes)."""
    (n,) = struct.unpack("<Q", first8)
    if n > file_size - 8 or n > MAX_HEADER:
        raise ShardError("shard header length exceeds the file")
    return n


def parse_entries(
    text: bytes,
    file_size: int,
    layout: Layout,
    tokens: int,
    with_snapshot: bool,
    expect_meta: Mapping[str, str],
) -> list[Entry]:
    """Validate a shard's JSON header ``text`` (the bytes after its length field) for a
    file of ``file_size`` bytes: what the safetensors loader checks (known dtypes, each
    tensor's byte size, offsets contiguous from the data start to the end of the file,
    each tensor aligned to its dtype) plus the metadata and the layout, as ``decode``
    does. Returns the entries with absolute file offsets, in file order.

    A pure function of its arguments: a header that passed is remembered (a shard read
    again is not parsed again); one that failed is checked anew each time."""
    return list(_entries(bytes(text), file_size, layout, tokens, with_snapshot, tuple(expect_meta.items())))


@functools.lru_cache(maxsize=4096)
def _entries(text: bytes, file_size: int, layout: Layout, tokens: int, with_snapshot: bool,
             expect_meta: tuple[tuple[str, str], ...]) -> tuple[Entry, ...]:
    return tuple(_parse_entries(text, file_size, layout, tokens, with_snapshot, dict(expect_meta)))


def _parse_entries(text: bytes, file_size: int, layout: Layout, tokens: int, with_snapshot: bool,
                   expect_meta: Mapping[str, str]) -> list[Entry]:
    try:
        head = json.loads(text)
    except ValueError as exc:
        raise ShardError(f"shard header is not JSON: {exc}") from exc
    if not isinstance(head, dict):
        raise ShardError("shard header is not a JSON object")
    start = 8 + len(text)
    meta = _metadata(head)
    for k, v in {"format": FORMAT, **expect_meta}.items():
        if meta.get(k) != v:
            raise ShardError(f"shard metadata {k}={meta.get(k)!r}, expected {v!r}")
    spans = []
    for name, info in head.items():
        try:
            dtype = _FROM_ST[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            b, e = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardError(f"shard entry {name!r} is malformed: {exc}") from exc
        n = _ITEMSIZE[dtype]
        for d in shape:
            if d < 0:
                raise ShardError(f"shard entry {name!r} has a negative dimension")
            n *= d
        if e - b != n:
            raise ShardError(f"shard entry {name!r} spans {e - b} bytes, its shape needs {n}")
        spans.append((b, e, name, dtype, shape))
    spans.sort()
    pos = 0
    for b, e, name, *_ in spans:
        if b != pos:
            raise ShardError(f"shard entry {name!r} starts at {b}, expected {pos}")
        pos = e
    if start + pos != file_size:
        raise ShardError(f"shard data ends at {start + pos}, the file has {file_size} bytes")
    entries = []
    for b, e, name, dtype, shape in spans:
        if (start + b) % _ITEMSIZE[dtype]:  # not a file this engine writes
            raise ShardError(f"shard entry {name!r} is not aligned to its dtype")
        entries.append(Entry(name, dtype, shape, start + b, start + e))
    # the layout's checks, on shape-only tensors
    _split_checked({x.name: torch.empty(x.shape, dtype=x.dtype, device="meta") for x in entries},
                   layout, tokens, with_snapshot)
    return entries


def parse(
    buf: torch.Tensor,
    layout: Layout,
    tokens: int,
    with_snapshot: bool,
    expect_meta: Mapping[str, str],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Validate a whole shard file held in ``buf`` (1-D uint8) and return views of it
    (``parse_entries``'s checks). No tensor byte is copied."""
    text, _ = _header_of(buf)
    entries = parse_entries(text, buf.numel(), layout, tokens, with_snapshot, expect_meta)
    out: dict[str, torch.Tensor] = {}
    for x in entries:
        try:
            out[x.name] = buf[x.begin : x.end].view(x.dtype).view(x.shape)
        except RuntimeError as exc:  # an unaligned buffer
            raise ShardError(f"shard entry {x.name!r} is not aligned to its dtype") from exc
    return _split_checked(out, layout, tokens, with_snapshot)


def buffer_view(buf: torch.Tensor) -> memoryview:
    """The bytes of a 1-D uint8 CPU tensor as a writable memoryview (no copy)."""
    return memoryview(buf.numpy()).cast("B")
