"""DeepSeek V4's compressed attention layers (CSA and HCA) mapped onto the engine.

Read from transformers 5.24's ``DeepseekV4HCACache`` / ``DeepseekV4CSACache``: after
``T`` tokens a layer of compression rate ``rate`` keeps

* the sliding-window branch: the single shared K=V head of the last ``window - 1``
  tokens (``keys`` is ``values``), never the older ones -> snapshot ``win.i``
  ``(window - 1, head_dim)``, its first ``min(T, window - 1)`` rows valid;
* per compressor (``compressor``; CSA also its lightning ``indexer``) the compressed
  entries ``compressed_kv``, one per ``rate`` tokens (``entry_count == T // rate``) ->
  segment ``cmp.i`` / ``icmp.i``, packed by block (below);
* the projections ``buffer_kv`` / ``buffer_gate`` of the ``T % rate`` tokens since the
  last closed window -> snapshots ``buf.i`` / ``bufg.i`` (``ibuf.i`` / ``ibufg.i``)
  of ``rate - 1`` rows, the first ``T % rate`` valid;
* CSA only: ``overlap_kv`` / ``overlap_gate``, the first half of the last closed
  window's projections (set once ``T >= rate``) -> snapshots ``ovl.i`` / ``ovlg.i``
  (``iovl.i`` / ``iovlg.i``); the gate has the float32 position bias added.

``entry_count`` and the sliding branch's length follow from ``T``. Everything is one
head that every tensor-parallel rank holds alike: it is stored once, striped across
the ranks (``once.`` names, :mod:`hf_place`).

Packing: entry ``w`` closes at token ``(w + 1) * rate`` and belongs to the block that
holds its last token. A block completes at most ``c = ceil(block_tokens / rate)``
entries; their ``c * dim`` values, zero-padded, are laid over the block's rows,
``ceil(c * dim / block_tokens)`` columns per token. A node's segment thus holds exactly
the entries its own blocks complete, whatever the rate and the block size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from prefixstore.adapters import hf_place
from prefixstore.base.errors import InvalidInputError, LayoutError, ShapeError

COMPRESSED_TYPES = frozenset({"compressed_sparse_attention", "heavily_compressed_attention"})
CSA = "compressed_sparse_attention"


@attrs.frozen
class Entry:
    """One compressor of a layer: its cache key, name prefix, entry and buffer widths."""

    key: str  # "compressor" | "indexer"
    prefix: str  # "" | "i"
    dim: int  # columns of one compressed entry
    buffer: int  # columns of one buffered projection (2 * dim with the overlap scheme)


@attrs.frozen
class CompressedSpec:
    """One compressed attention layer (see the module docstring)."""

    layer: int
    kind: str
    rate: int
    window: int
    head_dim: int
    entries: tuple[Entry, ...]
    ranks: int = 1

    @property
    def overlap(self) -> bool:
        return self.kind == CSA

    def name(self, base: str) -> str:
        return hf_place.layout_name(f"{base}.{self.layer}", 1, self.ranks)

    def packed_width(self, block_tokens: int, dim: int) -> int:
        per_block = -(-block_tokens // self.rate) * dim
        return -(-per_block // block_tokens)

    def segments(self, block_tokens: int) -> list[tuple[str, int]]:
        """(name, per-token columns of the whole tensor) of each packed entry segment."""
        return [(self.name(e.prefix + "cmp"), self.packed_width(block_tokens, e.dim)) for e in self.entries]

    def snapshots(self) -> list[tuple[str, int, int, bool]]:
        """(name, rows, columns, float32) of each snapshot tensor (whole, not per rank)."""
        out = [(self.name("win"), self.window - 1, self.head_dim, False)]
        for e in self.entries:
            if self.rate > 1:
                out += [(self.name(e.prefix + "buf"), self.rate - 1, e.buffer, False),
                        (self.name(e.prefix + "bufg"), self.rate - 1, e.buffer, False)]
            if self.overlap:
                out += [(self.name(e.prefix + "ovl"), self.rate, e.dim, False),
                        (self.name(e.prefix + "ovlg"), self.rate, e.dim, True)]
        return out


def compressed_spec(cfg: Any, layer: int, kind: str, ranks: int) -> CompressedSpec:
    """The spec of layer ``layer`` of a DeepSeek V4 config; LayoutError naming the field."""
    where = f"layer {layer} (layer type {kind!r})"
    rates = getattr(cfg, "compress_rates", None)
    rate = rates.get(kind) if isinstance(rates, Mapping) else None
    fields = {"compress_rates": rate, "sliding_window": getattr(cfg, "sliding_window", None),
              "head_dim": getattr(cfg, "head_dim", None)}
    if kind == CSA:
        fields["index_head_dim"] = getattr(cfg, "index_head_dim", None)
    for name, value in fields.items():
        if not isinstance(value, int) or value < 1 or (name == "sliding_window" and value < 2):
            raise LayoutError(f"{where}: needs a positive integer config field {name!r}, got {value!r}")
    if getattr(cfg, "num_key_value_heads", 1) != 1:
        raise LayoutError(f"{where}: compressed attention caches one shared KV head, "
                          f"config field 'num_key_value_heads' = {cfg.num_key_value_heads}")
    hd = fields["head_dim"]
    entries = [Entry("compressor", "", hd, 2 * hd if kind == CSA else hd)]
    if kind == CSA:
        idx = fields["index_head_dim"]
        entries.append(Entry("indexer", "i", idx, 2 * idx))
    return CompressedSpec(layer, kind, rate, fields["sliding_window"], hd, tuple(entries), ranks)


# -- packing ----------------------------------------------------------------------------


def _blocks_of(w: torch.Tensor, rate: int, bt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block holding each entry's last token, and the entry's slot in that block."""
    block = ((w + 1) * rate - 1) // bt
    return block, w - (block * bt) // rate


def pack(entries: torch.Tensor, start: int, end: int, bt: int, rate: int, width: int) -> torch.Tensor:
    """Entries ``[start // rate, end // rate)`` ``(m, dim)`` -> rows ``(end - start, width)``."""
    nb, dim = (end - start) // bt, int(entries.shape[-1])
    c = -(-bt // rate)
    out = entries.new_zeros((nb, c, dim))
    w = torch.arange(start // rate, end // rate, device=entries.device)
    block, slot = _blocks_of(w, rate, bt)
    out[block - start // bt, slot] = entries
    flat = out.reshape(nb, c * dim)
    return F.pad(flat, (0, bt * width - c * dim)).reshape(nb * bt, width)


def unpack(rows: torch.Tensor, start: int, bt: int, rate: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack`: rows of tokens ``[start, start + n)`` -> their entries."""
    n, width = int(rows.shape[0]), int(rows.shape[-1])
    nb, c = n // bt, -(-bt // rate)
    flat = rows.reshape(nb, bt * width)[:, : c * dim].reshape(nb, c, dim)
    w = torch.arange(start // rate, (start + n) // rate, device=rows.device)
    block, slot = _blocks_of(w, rate, bt)
    return flat[block - start // bt, slot]


# -- reading and writing a cache layer ----------------------------------------------------


def _stripes(t: torch.Tensor, ranks: int) -> list[torch.Tensor]:
    """A one-head ``(rows, cols)`` tensor -> per rank ``(rows, 1, c)`` contiguous copies."""
    return [p.clone(memory_format=torch.contiguous_format) for p in hf_place.split(t.unsqueeze(1), ranks)]


def _unstripe(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    return hf_place.join(parts, 1, width)[:, 0]


def _padded(t: torch.Tensor | None, rows: int, width: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` ``(1, k, width)`` (or None: k = 0) as ``(rows, width)``, zero rows after it."""
    out = torch.zeros((rows, width), dtype=dtype, device=like.device)
    if t is not None and t.shape[1]:
        out[: t.shape[1]] = t[0]
    return out


def _check(spec: CompressedSpec, what: str, t: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    got = None if t is None else tuple(t.shape)
    if got != shape and not (t is None and shape[1] == 0):
        raise ShapeError(f"layer {spec.layer}: {what} has shape {got}, expected {shape}")


def read(spec: CompressedSpec, layer: Any, total: int, start: int, end: int, bt: int,
         dtype: torch.dtype) -> tuple[dict[str, list[torch.Tensor]], dict[str, list[torch.Tensor]]]:
    """Per-rank segment rows ``[start, end)`` and snapshot tensors of a layer after ``total`` tokens."""
    if not hasattr(layer, "compressed_kv"):
        raise ShapeError(f"layer {spec.layer} is {type(layer).__name__}, not a compressed attention layer")
    R, rate = spec.ranks, spec.rate
    held = min(total, spec.window - 1)
    _check(spec, "the sliding branch", layer.keys, (1, 1, held, spec.head_dim))
    segs: dict[str, list[torch.Tensor]] = {}
    snaps: dict[str, list[torch.Tensor]] = {}
    snap_specs = iter(spec.snapshots())
    name, rows, cols, _ = next(snap_specs)
    snaps[name] = _stripes(_padded(layer.keys[:, 0], rows, cols, layer.keys, _dtype(layer.keys, dtype)), R)
    for e, (seg_name, width) in zip(spec.entries, spec.segments(bt), strict=True):
        entries = layer.compressed_kv[e.key]
        _check(spec, f"compressed {e.key} entries", entries, (1, total // rate, e.dim))
        if layer.entry_count[e.key] != total // rate:
            raise ShapeError(f"layer {spec.layer}: {layer.entry_count[e.key]} {e.key} entries "
                             f"after {total} tokens, expected {total // rate}")
        mine = entries[0, start // rate : end // rate] if entries is not None else layer.keys.new_zeros((0, e.dim))
        segs[seg_name] = _stripes(pack(mine, start, end, bt, rate, width), R)
        if rate > 1:
            for src in (layer.buffer_kv[e.key], layer.buffer_gate[e.key]):
                name, rows, cols, _ = next(snap_specs)
                _check(spec, f"buffered {e.key} projections", src, (1, total % rate, e.buffer))
                snaps[name] = _stripes(_padded(src, rows, cols, layer.keys, _dtype(src, dtype)), R)
        if spec.overlap:
            for src, f32 in ((layer.overlap_kv[e.key], False), (layer.overlap_gate[e.key], True)):
                name, rows, cols, _ = next(snap_specs)
                want = (1, rate, e.dim) if total >= rate else None
                if (None if src is None else tuple(src.shape)) != want:
                    raise ShapeError(f"layer {spec.layer}: {e.key} overlap state has shape "
                                     f"{None if src is None else tuple(src.shape)}, expected {want}")
                t = src[0] if src is not None else torch.zeros((rows, cols), device=layer.keys.device)
                snaps[name] = _stripes(t.to(torch.float32) if f32 else t.to(_dtype(src, dtype)), R)
    return segs, snaps


def _dtype(t: torch.Tensor | None, default: torch.dtype) -> torch.dtype:
    return default if t is None else t.dtype


def write(spec: CompressedSpec, layer: Any, segs: Mapping[str, list[torch.Tensor]],
          snaps: Mapping[str, list[torch.Tensor]], total: int, bt: int, *, start: int = 0,
          base: Any = None, device: Any = None) -> None:
    """Rebuild a fresh ``DeepseekV4*Cache`` layer after ``total`` tokens from per-rank
    tensors (segments cover ``[start, total)``; entries before ``start`` from ``base``)."""
    if not hasattr(layer, "compressed_kv"):
        raise LayoutError(f"layer {spec.layer} of this config is {type(layer).__name__}, not compressed")
    rate = spec.rate

    def whole(name: str, rows: int, width: int) -> torch.Tensor:
        t = _unstripe(list(snaps[name]), width)[:rows]
        return t.to(device) if device is not None else t

    snap_specs = iter(spec.snapshots())
    name, _, cols, _ = next(snap_specs)
    win = whole(name, min(total, spec.window - 1), cols)[None, None]
    layer.lazy_initialization(win, win)
    layer.keys, layer.cumulative_length = win.contiguous(), total
    layer.values = layer.keys
    for e, (seg_name, width) in zip(spec.entries, spec.segments(bt), strict=True):
        rows = _unstripe(list(segs[seg_name]), width)
        entries = unpack(rows.to(device) if device is not None else rows, start, bt, rate, e.dim)
        if start:
            before = None if base is None else base.layers[spec.layer].compressed_kv[e.key]
            have = 0 if before is None else int(before.shape[1])
            if have < start // rate:
                raise InvalidInputError(f"layer {spec.layer}: the base cache holds {have} {e.key} "
                                        f"entries, need {start // rate}")
            entries = torch.cat([before[0, : start // rate].to(entries.device), entries]) if have else entries
        layer.compressed_kv[e.key] = entries[None].contiguous() if len(entries) else None
        layer.entry_count[e.key] = len(entries)
        if rate > 1:
            for store in (layer.buffer_kv, layer.buffer_gate):
                name, _, cols, _ = next(snap_specs)
                store[e.key] = whole(name, total % rate, cols)[None].contiguous()
        if spec.overlap:
            for store in (layer.overlap_kv, layer.overlap_gate):
                name, _, cols, _ = next(snap_specs)
                store[e.key] = whole(name, rate, cols)[None].contiguous() if total >= rate else None
