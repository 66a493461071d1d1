"""transformers adapter: model caches <-> engine checkpoints.

Install with ``pip install 'prefixstore[transformers]'``. Written against the transformers
5.x cache API (``DynamicCache`` made of per-layer ``DynamicLayer`` / ``LinearAttentionLayer``
objects) and batch size 1: a checkpoint is one token sequence.

How a model's cache maps onto an engine :class:`Layout` (see :func:`cache_map`):

* ``tok`` -- a segment of the token ids themselves (int32, per-token shape ``(1,)``,
  replicated on every rank). It lets :func:`from_engine` check that restored rows belong to
  the tokens asked for, and gives pure recurrent models (which have no per-token state)
  the segment every layout needs.
* attention layer ``i`` -> segments ``k.i`` and ``v.i`` with per-token shape
  ``(kv_heads // ranks, head_dim)``, token axis first. Rank ``r`` holds KV heads
  ``[r * kv_heads // ranks, (r + 1) * kv_heads // ranks)``, like tensor parallelism does;
  when ranks outnumber the KV heads (``ranks % kv_heads == 0``) each head, which
  ``ranks // kv_heads`` ranks hold alike, is stored once: each of them keeps a stripe of
  its columns, under a ``once.`` name (:mod:`prefixstore.adapters.hf_place`). KV heads
  are read from every config convention (:data:`KV_HEAD_FIELDS`, ``multi_query``,
  Falcon's ``new_decoder_architecture``) and from the layer's own ``k_proj`` (or a fused
  QKV's ``num_key_value_heads``); a store checks the cache's real shapes (ShapeError).
* sliding-window / chunked layer -> the same segments: every token's row is stored once
  and a restore rebuilds the model's sliding layer (which keeps the last ``window - 1``
  rows). :func:`feed` and restored caches keep such a layer's past rows, so a
  checkpoint may span more than a window.
* MLA layer (config declares ``kv_lora_rank``) -> ``kv_latent.i`` (``kv_lora_rank``
  wide) and ``k_rope.i`` (``qk_rope_head_dim`` wide): one head every rank holds alike,
  stored once. An indexed (DSA) layer adds ``idx.i``, the indexer's key of each token.
* DeepSeek V4's compressed layers (CSA, HCA) -> packed compressed-entry segments and
  snapshots of the sliding branch, the open window and the overlap state
  (:mod:`prefixstore.adapters.hf_compressed`), all stored once across ranks.
* recurrent layer ``i`` (Mamba, Mamba2, gated delta-net, Kimi delta attention, MiniMax
  lightning attention, Zaya's convolutional attention, short convolution) -> snapshots
  ``conv.i`` (the causal-conv window) and ``ssm.i`` (the recurrent state, if any) at
  the checkpoint's end, their shapes read off the model's own mixer modules
  (:mod:`prefixstore.adapters.hf_states`). Each is split along its channel/head
  dimension the way tensor parallelism shards it (a conv window's channel groups are
  each split by heads and every rank holds its ``[q_r, k_r, v_r]`` / ``[x_r, B_r, C_r]``).
  A state whose heads or channels do not divide evenly by ``ranks`` is *replicated*:
  every rank stores the whole tensor and :func:`from_engine` checks the copies agree.

:func:`register_state_rule` overrides the derived state of a ``model_type``. Whatever
cannot be mapped is refused by :func:`cache_map` with a typed error naming the layer,
its layer type and the config field.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from prefixstore.adapters import hf_compressed, hf_place
from prefixstore.adapters.hf_compressed import COMPRESSED_TYPES, CompressedSpec
from prefixstore.adapters.hf_identity import model_identity
from prefixstore.adapters.hf_states import (
    causal_by_construction,
    check_cache_kind,
    meta_model,
    mixer_states,
)
from prefixstore.base.errors import (
    InvalidInputError,
    LayoutError,
    PrefixStoreError,
    RankError,
    ShapeError,
)
from prefixstore.base.keys import Prefix
from prefixstore.base.layout import Layout, TensorSpec
from prefixstore.engine.api import Engine

try:
    import transformers
    from transformers.cache_utils import (
        Cache,
        DynamicCache,
        LinearAttentionCacheLayerMixin,
        get_layer_types_and_kwargs,
    )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "prefixstore.adapters.hf needs transformers 5.x: pip install 'prefixstore[transformers]'"
    ) from exc

__all__ = [
    "AttentionSpec",
    "CacheMap",
    "EngineTensors",
    "HFPrefixCache",
    "Resumed",
    "StateSpec",
    "TokenMismatchError",
    "cache_map",
    "feed",
    "from_engine",
    "greedy",
    "held_from",
    "layout_for",
    "new_cache",
    "register_state_rule",
    "to_engine",
]

TOKENS = "tok"
TOKEN_DTYPE = torch.int32
INDEXED = "indexed_attention"  # DSA: an MLA latent plus the indexer's keys, every token
FULL_TYPES = frozenset({"full_attention", "hybrid", INDEXED})
SLIDING_TYPES = frozenset({"sliding_attention", "chunked_attention", "hybrid_sliding"})
ATTENTION_TYPES = FULL_TYPES | SLIDING_TYPES
# models whose attention caches one tensor as both keys and values (only keys are stored)
SHARED_KV_MODELS = frozenset({"deepseek_v4"})
RECURRENT_TYPES = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding"})
SKIPPED_TYPES = frozenset({"dummy"})
# config conventions for the number of KV heads, in the order they are read
KV_HEAD_FIELDS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")


class TokenMismatchError(PrefixStoreError):
    """Restored token ids differ from the tokens the caller asked for."""


# -- specs ------------------------------------------------------------------------------


@attrs.frozen
class AttentionSpec:
    """One attention layer's per-token cache: ``kv_heads`` heads (all ranks together)
    of ``key_dim`` / ``value_dim`` columns, placed on ``ranks`` ranks (:mod:`hf_place`).

    ``window`` is the sliding window (or attention chunk) of a sliding / chunked layer,
    None for a full one. ``latent`` marks an MLA layer: its one "head" is the compressed
    latent (key: ``kv_lora_rank`` wide, value: the ``qk_rope_head_dim`` rotary key).
    ``index_dim`` is the width of an indexed (DSA) layer's indexer keys, one head per
    token (0: none). ``shared_kv`` marks a layer whose keys are its values (DeepSeek V4):
    only the keys are stored. A head that several ranks hold alike (the latent, the
    indexer keys, KV heads when ranks outnumber them) is stored once, striped across
    those ranks, under a ``once.`` name.
    """

    layer: int
    kv_heads: int
    key_dim: int
    value_dim: int
    window: int | None = None
    latent: bool = False
    ranks: int = 1
    index_dim: int = 0
    shared_kv: bool = False

    def _name(self, base: str, heads: int) -> str:
        return hf_place.layout_name(f"{base}.{self.layer}", heads, self.ranks)

    @property
    def key_name(self) -> str:
        return self._name("kv_latent" if self.latent else "k", self.kv_heads)

    @property
    def value_name(self) -> str | None:
        if self.shared_kv:
            return None
        return self._name("k_rope" if self.latent else "v", self.kv_heads)

    @property
    def index_name(self) -> str | None:
        return self._name("idx", 1) if self.index_dim else None

    @property
    def head_dim(self) -> int:
        return self.key_dim

    def tensors(self) -> list[tuple[str, int, int, str]]:
        """(layout name, heads, columns per head, cache attribute) of each per-token tensor."""
        out = [(self.key_name, self.kv_heads, self.key_dim, "keys")]
        if self.value_name is not None:
            out.append((self.value_name, self.kv_heads, self.value_dim, "values"))
        if self.index_name is not None:
            out.append((self.index_name, 1, self.index_dim, "indexer_keys"))
        return out

    def rank_heads(self, ranks: int) -> int:
        """KV heads one rank holds: a share, or one head's stripe when ranks outnumber them."""
        return max(self.kv_heads // ranks, 1)

    def head_of_rank(self, ranks: int) -> list[list[int]]:
        """The heads each rank holds (whole, or a stripe of)."""
        per = self.rank_heads(ranks)
        if self.kv_heads >= ranks:
            return [list(range(r * per, (r + 1) * per)) for r in range(ranks)]
        return [[r * self.kv_heads // ranks] for r in range(ranks)]


def _groups(value: Iterable[Iterable[int]]) -> tuple[tuple[int, int], ...]:
    return tuple((int(u), int(w)) for u, w in value)


@attrs.frozen
class StateSpec:
    """One recurrent state tensor of one layer, without its batch dimension.

    ``groups`` lists ``(units, unit_width)`` pairs laid end to end along ``split_dim``
    (e.g. ``((heads, head_dim),)``); each group is split by units across ranks.
    ``kind`` is ``"conv"`` or ``"recurrent"``; ``state_idx`` is the layer's state slot.
    """

    name: str
    layer: int
    kind: str
    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(d) for d in s))
    groups: tuple[tuple[int, int], ...] = attrs.field(converter=_groups)
    split_dim: int = 0
    state_idx: int = 0
    model_dtype: bool = False  # kept in the model's dtype (not float32) whatever its kind
    source: str = "layer"  # "layer": the cache layer's states; "linear_cache": MiniMax's

    def __attrs_post_init__(self) -> None:
        if self.kind not in ("conv", "recurrent"):
            raise LayoutError(f"state {self.name!r}: kind must be conv or recurrent")
        if not 0 <= self.split_dim < len(self.shape):
            raise LayoutError(f"state {self.name!r}: split_dim {self.split_dim} out of range")
        if sum(u * w for u, w in self.groups) != self.shape[self.split_dim]:
            raise LayoutError(
                f"state {self.name!r}: groups {self.groups} do not cover dim "
                f"{self.split_dim} of shape {self.shape}"
            )

    def sharded(self, ranks: int) -> bool:
        """True when every group divides evenly by ``ranks`` (else the state is replicated)."""
        return ranks > 1 and all(u % ranks == 0 for u, _ in self.groups)

    def rank_shape(self, ranks: int) -> tuple[int, ...]:
        """The shape one rank holds."""
        if not self.sharded(ranks):
            return self.shape
        shape = list(self.shape)
        shape[self.split_dim] //= ranks
        return tuple(shape)

    def split(self, tensor: torch.Tensor, ranks: int) -> list[torch.Tensor]:
        """Cut a full state (no batch dim) into per-rank contiguous copies."""
        if tuple(tensor.shape) != self.shape:
            raise ShapeError(
                f"state {self.name!r} has shape {tuple(tensor.shape)}, expected {self.shape}"
            )
        if not self.sharded(ranks):
            return [_copy(tensor) for _ in range(ranks)]
        pieces = tensor.split([u * w for u, w in self.groups], dim=self.split_dim)
        chunks = [p.chunk(ranks, dim=self.split_dim) for p in pieces]
        return [_copy(torch.cat([c[r] for c in chunks], dim=self.split_dim)) for r in range(ranks)]

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`split`."""
        ranks = len(parts)
        if not self.sharded(ranks):
            for r, p in enumerate(parts[1:], start=1):
                if not torch.equal(p, parts[0]):
                    raise InvalidInputError(
                        f"replicated state {self.name!r} differs between rank 0 and rank {r}"
                    )
            return parts[0]
        sizes = [u // ranks * w for u, w in self.groups]
        per_rank = [p.split(sizes, dim=self.split_dim) for p in parts]
        groups = [
            torch.cat([pr[g] for pr in per_rank], dim=self.split_dim) for g in range(len(sizes))
        ]
        return torch.cat(groups, dim=self.split_dim)


StateRule = Callable[[Any, int], list[StateSpec]]
"""Given a layer's config and index, the recurrent state tensors the layer caches."""

_STATE_RULES: dict[str, StateRule] = {}
_STEPWISE: set[str] = set()


def register_state_rule(model_type: str, rule: StateRule, *, stepwise: bool = False) -> None:
    """Teach the adapter the recurrent state shapes of ``model_type`` (``config.model_type``).

    ``stepwise=True`` says that continuing from a restored state must feed tokens one
    at a time (the model's multi-token path does not start from a cached state).
    """
    _STATE_RULES[model_type] = rule
    if stepwise:
        _STEPWISE.add(model_type)
    else:
        _STEPWISE.discard(model_type)


def _mamba_states(cfg: Any, i: int) -> list[StateSpec]:
    d = int(cfg.intermediate_size)
    return [
        StateSpec(f"conv.{i}", i, "conv", (d, cfg.conv_kernel), groups=[(d, 1)]),
        StateSpec(f"ssm.{i}", i, "recurrent", (d, cfg.state_size), groups=[(d, 1)]),
    ]


def _gated_delta_net_states(cfg: Any, i: int) -> list[StateSpec]:
    nk, nv = int(cfg.linear_num_key_heads), int(cfg.linear_num_value_heads)
    hk, hv = int(cfg.linear_key_head_dim), int(cfg.linear_value_head_dim)
    conv_dim = 2 * nk * hk + nv * hv  # channels laid out as [q | k | v]
    return [
        StateSpec(
            f"conv.{i}",
            i,
            "conv",
            (conv_dim, cfg.linear_conv_kernel_dim),
            groups=[(nk, hk), (nk, hk), (nv, hv)],
        ),
        StateSpec(f"ssm.{i}", i, "recurrent", (nv, hk, hv), groups=[(nv, 1)]),
    ]


# Mamba's reference (no mamba_ssm) multi-token scan ignores the cached SSM state.
register_state_rule("mamba", _mamba_states, stepwise=True)
register_state_rule("qwen3_next", _gated_delta_net_states)


# -- the map ----------------------------------------------------------------------------


@attrs.frozen
class CacheMap:
    """How one model's cache maps onto an engine layout (build it with :func:`cache_map`)."""

    layout: Layout
    model_type: str
    num_layers: int
    attention: tuple[AttentionSpec, ...]
    states: tuple[StateSpec, ...]
    stepwise: bool = False
    compressed: tuple[CompressedSpec, ...] = ()

    @property
    def ranks(self) -> int:
        return self.layout.ranks

    @property
    def block_tokens(self) -> int:
        return self.layout.block_tokens

    @property
    def has_snapshot(self) -> bool:
        return bool(self.states or self.compressed)


def _field(cfg: Any, *names: str) -> tuple[str, Any]:
    """The first of ``names`` that ``cfg`` sets (not None), and its value."""
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return name, value
    return names[0], None


def _kv_heads(cfg: Any, where: str) -> tuple[str, int]:
    if getattr(cfg, "new_decoder_architecture", False) is True:
        # Falcon-40B/180B: each KV head is broadcast to its query group before caching
        return "num_attention_heads", _positive_heads(cfg, "num_attention_heads", where)
    if getattr(cfg, "multi_query", False):
        return "multi_query", 1
    name, heads = _field(cfg, *KV_HEAD_FIELDS, "num_attention_heads")
    if not isinstance(heads, int) or heads <= 0:
        raise LayoutError(f"{where}: cannot read the KV head count (config field {name!r} = {heads!r})")
    return name, heads


def _positive_heads(cfg: Any, name: str, where: str) -> int:
    heads = getattr(cfg, name, None)
    if not isinstance(heads, int) or heads <= 0:
        raise LayoutError(f"{where}: cannot read the KV head count (config field {name!r} = {heads!r})")
    return heads


def _window(cfg: Any, kind: str, where: str) -> int | None:
    if kind not in SLIDING_TYPES:
        return None
    field = "attention_chunk_size" if kind == "chunked_attention" else "sliding_window"
    window = getattr(cfg, field, None)
    if not isinstance(window, int) or window <= 1:
        raise LayoutError(f"{where}: needs an integer config field {field!r} > 1, got {window!r}")
    return window


def _attention_spec(cfg: Any, i: int, kind: str, ranks: int, model_type: str) -> AttentionSpec:
    where = f"layer {i} (layer type {kind!r})"
    window = _window(cfg, kind, where)
    rank = getattr(cfg, "kv_lora_rank", None)
    if kind == INDEXED and rank is None:
        raise LayoutError(
            f"{where}: indexed attention without an MLA latent (config field 'kv_lora_rank'): "
            "only DSA's cache (the latent and one indexer key per token) is mapped"
        )
    index_dim = _index_dim(cfg, kind, where)
    if rank is not None:  # MLA: one latent "head" of kv_lora_rank + the rotary key
        rope = getattr(cfg, "qk_rope_head_dim", None)
        if not isinstance(rank, int) or not isinstance(rope, int):
            raise LayoutError(
                f"{where}: MLA needs integer config fields 'kv_lora_rank' and "
                f"'qk_rope_head_dim', got {rank!r} and {rope!r}"
            )
        return AttentionSpec(i, 1, rank, rope, window, latent=True, ranks=ranks, index_dim=index_dim)
    field, heads = _kv_heads(cfg, where)
    _, head_dim = _field(cfg, "head_dim", "attention_head_dim")
    if head_dim is None:
        head_dim = cfg.hidden_size // cfg.num_attention_heads
    _, value_dim = _field(cfg, "v_head_dim")
    if heads % ranks and ranks % heads:
        raise RankError(
            f"{where}: {heads} KV heads (config field {field!r}) can be neither split "
            f"evenly across {ranks} ranks nor replicated onto them"
        )
    return AttentionSpec(
        i, heads, int(head_dim), int(value_dim or head_dim), window, ranks=ranks,
        shared_kv=model_type in SHARED_KV_MODELS,
    )


def _index_dim(cfg: Any, kind: str, where: str) -> int:
    """An indexed (DSA) layer's indexer key width (config field ``index_head_dim``), else 0."""
    if kind != INDEXED:
        return 0
    dim = getattr(cfg, "index_head_dim", None)
    if not isinstance(dim, int) or dim <= 0:
        raise LayoutError(f"{where}: needs a positive integer config field 'index_head_dim', got {dim!r}")
    return dim


def cache_map(
    config: Any,
    *,
    dtype: torch.dtype | str = torch.float32,
    block_tokens: int = 16,
    ranks: int = 1,
    state_dtype: torch.dtype | str | None = None,
) -> CacheMap:
    """Derive the cache map (and engine layout) of a transformers model config.

    ``config`` may also be the model itself (its recurrent mixers are read directly;
    from a bare config they are read off the model built on the meta device).
    ``dtype`` is the KV dtype. Snapshot dtypes default to what transformers keeps:
    conv windows in ``dtype``, recurrent (SSM / delta-rule) states in float32 whatever
    the model dtype; ``state_dtype`` overrides both. Whatever cannot be mapped is
    refused here, with the layer, its layer type and the config field.
    """
    model = config if isinstance(config, torch.nn.Module) else None
    config = model.config if model is not None else config
    if model is not None:
        check_cache_kind(model)
    text = config.get_text_config(decoder=True)
    model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))
    _check_causal_cache(config, text)
    try:
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    except (AttributeError, KeyError, TypeError) as exc:
        raise LayoutError(f"cannot read the cache layer types of this config: {exc}") from exc
    layer_cfgs = list(text.per_layer_config)
    if ranks <= 0:
        raise RankError(f"ranks must be positive, got {ranks}")
    attention: list[AttentionSpec] = []
    states: list[StateSpec] = []
    compressed: list[CompressedSpec] = []
    stepwise = model_type in _STEPWISE
    probe: torch.nn.Module | bool | None = None  # the model read for KV head counts
    known = ATTENTION_TYPES | RECURRENT_TYPES | COMPRESSED_TYPES | SKIPPED_TYPES
    for i, (kind, cfg, kw) in enumerate(zip(layer_types, layer_cfgs, layer_kwargs, strict=True)):
        if kind in SKIPPED_TYPES:
            continue
        if kind not in known:
            raise LayoutError(
                f"layer {i}: cache layer type {kind!r} (config field 'layer_types') is not "
                f"supported; supported: {sorted(known)}"
            )
        if kind in COMPRESSED_TYPES:
            compressed.append(hf_compressed.compressed_spec(cfg, i, kind, ranks))
            continue
        if kind in ATTENTION_TYPES:
            if probe is None:  # before the config's head count: it may keep no KV at all
                probe = model or _try_meta_model(config)
                _check_causal_attention(text, probe)
            spec = _attention_spec(cfg, i, kind, ranks, model_type)
            if not spec.latent and probe:
                spec = _checked_heads(spec, probe, kind, ranks)
            attention.append(spec)
        if kind in RECURRENT_TYPES:
            if kw.get("number_of_states", 1) != 1:
                raise LayoutError(
                    f"layer {i} (layer type {kind!r}): config field 'number_of_conv_states' = "
                    f"{kw['number_of_states']}; only one state per layer is supported"
                )
            rule = _STATE_RULES.get(model_type)
            if rule is not None:
                states.extend(rule(cfg, i))
                continue
            if model is None:
                model = _meta_model(config, i, kind)
            derived = mixer_states(model, i, kind)
            stepwise = stepwise or derived.stepwise
            states.extend(
                StateSpec(f"{suffix}.{i}", i, skind, shape, groups=groups,
                          model_dtype=suffix in derived.model_dtype, source=derived.source)
                for suffix, skind, shape, groups in derived.tensors
            )

    layout = _layout(attention, states, compressed, dtype, state_dtype, block_tokens, ranks)
    return CacheMap(
        layout=layout,
        model_type=model_type,
        num_layers=len(layer_types),
        attention=tuple(attention),
        states=tuple(states),
        stepwise=stepwise,
        compressed=tuple(compressed),
    )


def _layout(
    attention: list[AttentionSpec],
    states: list[StateSpec],
    compressed: list[CompressedSpec],
    dtype: torch.dtype | str,
    state_dtype: torch.dtype | str | None,
    block_tokens: int,
    ranks: int,
) -> Layout:
    def sdtype(s: StateSpec) -> torch.dtype | str:
        if state_dtype is not None:
            return state_dtype
        return dtype if s.kind == "conv" or s.model_dtype else torch.float32

    segments = [TensorSpec(TOKENS, TOKEN_DTYPE, (1,))]
    for a in attention:
        segments += [TensorSpec(name, dtype, hf_place.rank_shape(heads, width, ranks))
                     for name, heads, width, _ in a.tensors()]
    snapshots = [TensorSpec(s.name, sdtype(s), s.rank_shape(ranks)) for s in states]
    for c in compressed:
        segments += [TensorSpec(name, dtype, hf_place.rank_shape(1, width, ranks))
                     for name, width in c.segments(block_tokens)]
        snapshots += [TensorSpec(name, torch.float32 if f32 else dtype, (rows, 1, hf_place.rank_shape(1, cols, ranks)[1]))
                      for name, rows, cols, f32 in c.snapshots()]
    return Layout(segments=segments, block_tokens=block_tokens, snapshots=snapshots, ranks=ranks)


def _check_causal_cache(config: Any, text: Any) -> None:
    """Refuse configs whose model keeps no per-token cache of the tokens alone."""
    for cfg, field, bad in (
        (config, "is_encoder_decoder", True),
        (text, "add_cross_attention", True),  # a decoder that expects encoder states
    ):
        if getattr(cfg, field, None) is bad:
            raise LayoutError(
                f"config field {field!r} is {bad}: the cache is not a causal self-attention cache"
            )
    loops = getattr(text, "n_recurrent_loops", 1)
    if isinstance(loops, int) and loops > 1 and getattr(text, "recurrent_kv_cache_mode", "per_loop") == "per_loop":
        raise LayoutError(
            f"config field 'n_recurrent_loops' = {loops} with recurrent_kv_cache_mode 'per_loop': "
            "the model appends a cache layer per loop at run time, beyond 'layer_types'"
        )
    if getattr(text, "prompt_length", 0) and getattr(text, "use_prompt", True):
        raise LayoutError(
            f"config field 'prompt_length' = {text.prompt_length}: the cache holds "
            "learned prompt rows before the tokens"
        )


def _check_causal_attention(text: Any, model: torch.nn.Module | bool) -> None:
    """BERT-style models (``is_decoder`` False) attend both ways and keep no cache;
    a model whose attention declares ``is_causal``, or whose modeling code builds
    causal masks only, is causal whatever the field says."""
    if getattr(text, "is_decoder", None) is not False:
        return
    if not isinstance(model, torch.nn.Module):
        modules: Iterable[torch.nn.Module] = ()
    elif causal_by_construction(model):
        return
    else:
        modules = model.modules()
    if not any(getattr(m, "is_causal", None) is True for m in modules):
        raise LayoutError(
            "config field 'is_decoder' is False and no attention layer is causal: "
            "the model keeps no causal cache"
        )


def _checked_heads(
    spec: AttentionSpec, model: torch.nn.Module, kind: str, ranks: int
) -> AttentionSpec:
    """The KV head count the layer's attention module caches, where it says: the heads
    its own ``k_proj`` / ``v_proj`` produce (a model may scale the config's count for
    some layer types), or, with a fused QKV projection, its ``num_key_value_heads``
    (DBRX reads it from ``attn_config.kv_n_heads``, whatever the top-level field says).
    :func:`to_engine` checks the cache's real shapes against the result."""
    for module in model.modules():
        if getattr(module, "layer_idx", None) != spec.layer:
            continue
        k, v = getattr(module, "k_proj", None), getattr(module, "v_proj", None)
        if isinstance(k, torch.nn.Linear) and isinstance(v, torch.nn.Linear):
            heads, rest = divmod(k.out_features, spec.key_dim)
            if rest or heads * spec.value_dim != v.out_features:
                return spec
            source = "its k_proj gives"
        elif k is None and isinstance(getattr(module, "num_key_value_heads", None), int):
            heads, source = module.num_key_value_heads, "its num_key_value_heads is"
        else:
            continue
        if heads == spec.kv_heads or heads <= 0:
            return spec
        if heads % ranks and ranks % heads:
            raise RankError(
                f"layer {spec.layer} (layer type {kind!r}): {source} {heads} KV heads, "
                f"which can be neither split evenly across {ranks} ranks nor replicated"
            )
        return attrs.evolve(spec, kv_heads=heads)
    return spec


def _try_meta_model(config: Any) -> torch.nn.Module | bool:
    """The meta-device model, or False where it cannot be built from ``config``."""
    try:
        return meta_model(config)
    except LayoutError:
        raise
    except Exception:
        return False


def _meta_model(config: Any, layer: int, kind: str) -> torch.nn.Module:
    try:
        return meta_model(config)
    except Exception as exc:  # the model class itself rejects the config
        raise LayoutError(
            f"layer {layer} (layer type {kind!r}): cannot build the model to read its "
            f"cache shapes: {type(exc).__name__}: {exc}"
        ) from exc


def layout_for(config: Any, **kwargs: Any) -> Layout:
    """The engine layout of a model config (keyword arguments as for :func:`cache_map`)."""
    return cache_map(config, **kwargs).layout


# -- conversion -------------------------------------------------------------------------


@attrs.frozen
class EngineTensors:
    """A checkpoint as the engine takes it: per-rank segments and (optional) snapshot."""

    segments: list[dict[str, torch.Tensor]]
    snapshot: list[dict[str, torch.Tensor]] | None


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone(memory_format=torch.contiguous_format)


def _token_tensor(tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    if not isinstance(tokens, torch.Tensor) and len(tokens) == 0:
        return torch.empty(0, dtype=torch.int64)
    t = torch.as_tensor(tokens).reshape(-1)
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise InvalidInputError(f"token ids must be integers, got {t.dtype}")
    return t.to("cpu", torch.int64)


def _attention_length(cmap: CacheMap, cache: Cache) -> int | None:
    """Tokens the cache's first attention (or compressed attention) layer has seen."""
    layers = [a.layer for a in cmap.attention] + [c.layer for c in cmap.compressed]
    if not layers:
        return None
    return int(cache.layers[min(layers)].get_seq_length())


def held_from(cmap: CacheMap, cache: Cache) -> int:
    """The first block boundary from which every attention layer of ``cache`` still
    holds its rows (0 for caches fed by :func:`feed` or restored by :func:`from_engine`;
    later for a model's own cache whose sliding layers dropped their old rows)."""
    total = _attention_length(cmap, cache)
    if total is None:
        return 0
    first = 0
    for a in cmap.attention:
        keys = cache.layers[a.layer].keys
        rows = 0 if keys is None or keys.dim() != 4 else int(keys.shape[2])
        first = max(first, total - rows)
    bt = cmap.block_tokens
    return -(-first // bt) * bt


def to_engine(
    cmap: CacheMap,
    cache: Cache,
    tokens: Sequence[int] | torch.Tensor,
    start_tok: int = 0,
    end_tok: int | None = None,
) -> EngineTensors:
    """Cut tokens ``[start_tok, end_tok)`` of ``cache`` into per-rank engine tensors.

    ``tokens`` are *all* the tokens ``cache`` has consumed. ``end_tok`` (default: the
    deepest block boundary) must be a block boundary; with recurrent layers it must
    equal ``len(tokens)``, the only position whose state the cache holds. Tensors are
    copied, so later decoding (which updates recurrent states in place) leaves them be.
    """
    ids = _token_tensor(tokens)
    total = len(ids)
    bt = cmap.block_tokens
    if end_tok is None:
        end_tok = total // bt * bt
    cmap.layout.check_blocks(end_tok)
    if not 0 <= start_tok <= end_tok <= total:
        raise InvalidInputError(f"bad span [{start_tok}, {end_tok}) of {total} tokens")
    if cmap.has_snapshot and end_tok != total:
        raise InvalidInputError(
            f"the cache holds recurrent state at token {total} only, cannot checkpoint {end_tok}"
        )
    seen = _attention_length(cmap, cache)
    if seen is not None and seen != total:
        raise InvalidInputError(f"cache holds {seen} tokens but {total} token ids were given")
    if len(cache.layers) > cmap.num_layers:
        raise ShapeError(
            f"the cache holds {len(cache.layers)} layers, the cache map describes {cmap.num_layers}: "
            "the map does not describe this model's cache"
        )
    ranks = cmap.ranks
    n = end_tok - start_tok
    tok = ids[start_tok:end_tok].to(TOKEN_DTYPE).reshape(n, 1)
    segments: list[dict[str, torch.Tensor]] = [{TOKENS: tok.clone()} for _ in range(ranks)]
    for a in cmap.attention:
        layer = cache.layers[a.layer]
        for name, heads, width, attr in a.tensors():
            full = _layer_rows(a, layer, name, attr, heads, width)
            first = total - full.shape[2]  # sliding layers keep only their last rows
            if start_tok < first:
                raise InvalidInputError(
                    f"layer {a.layer} (window {a.window}) holds tokens [{first}, {total}) only, "
                    f"cannot checkpoint from token {start_tok}: feed the cache with feed(), "
                    "which keeps sliding layers' past rows"
                )
            rows = full[0, :, start_tok - first : end_tok - first].transpose(0, 1)
            for r, part in enumerate(hf_place.split(rows, ranks)):
                segments[r][name] = _copy(part)
    snapshot: list[dict[str, torch.Tensor]] | None = None
    if cmap.has_snapshot:
        snapshot = [{} for _ in range(ranks)]
        for s in cmap.states:
            state = _read_state(cache, s)
            for r, part in enumerate(s.split(state[0], ranks)):
                snapshot[r][s.name] = part
        for c in cmap.compressed:
            dtype = _spec_dtype(cmap.layout, c.snapshots()[0][0])
            segs, snaps = hf_compressed.read(c, cache.layers[c.layer], total, start_tok, end_tok, bt, dtype)
            for r in range(ranks):
                segments[r].update({k: v[r] for k, v in segs.items()})
                snapshot[r].update({k: v[r] for k, v in snaps.items()})
    for r in range(ranks):
        cmap.layout.check_segments(r, segments[r], n)
        if snapshot is not None:
            cmap.layout.check_snapshot(r, snapshot[r])
    return EngineTensors(segments, snapshot)


def _layer_rows(
    a: AttentionSpec, layer: Any, name: str, attr: str, heads: int, width: int
) -> torch.Tensor:
    """The layer's ``attr`` tensor as ``(1, heads, tokens, width)``, its shape checked
    against the layout (a cache the map does not describe is refused, typed)."""
    full = getattr(layer, attr, None)
    if attr == "indexer_keys":
        if getattr(layer, "indexer_position_ids", None) is not None:
            raise LayoutError(f"layer {a.layer}: indexer position ids are not supported")
        full = full.unsqueeze(1) if isinstance(full, torch.Tensor) and full.dim() == 3 else full
    if not isinstance(full, torch.Tensor) or full.dim() != 4 or full.shape[0] != 1:
        raise ShapeError(f"layer {a.layer}: expected a (1, heads, tokens, dim) tensor for {name!r}")
    if (int(full.shape[1]), int(full.shape[3])) != (heads, width):
        raise ShapeError(
            f"layer {a.layer}: the cache holds {full.shape[1]} heads of {full.shape[3]} columns "
            f"for {name!r}, the layout maps {heads} of {width}: the cache map does not "
            "describe this model's cache"
        )
    return full


def _read_state(cache: Cache, s: StateSpec) -> torch.Tensor:
    if s.source == "linear_cache":
        states = getattr(cache, "linear_cache", None)
        t = states[s.layer] if isinstance(states, list) and s.layer < len(states) else None
        if not isinstance(t, torch.Tensor) or tuple(t.shape[1:]) != s.shape or t.shape[0] != 1:
            raise InvalidInputError(f"layer {s.layer} has no linear attention state of shape {s.shape} yet")
        return t
    layer = cache.layers[s.layer]
    if not isinstance(layer, LinearAttentionCacheLayerMixin):
        raise ShapeError(f"layer {s.layer} is {type(layer).__name__}, not a recurrent layer")
    if not layer.has_previous_state[s.state_idx]:
        raise InvalidInputError(f"layer {s.layer} has no recurrent state yet")
    states = layer.conv_states if s.kind == "conv" else layer.recurrent_states
    t = states[s.state_idx]
    if t is None or t.dim() != len(s.shape) + 1 or t.shape[0] != 1:
        raise ShapeError(f"state {s.name!r}: expected batch size 1 and shape {s.shape}")
    return t


def _spec_dtype(layout: Layout, name: str) -> torch.dtype:
    return next(t for t in (*layout.segments, *layout.snapshots) if t.name == name).torch_dtype


def own_cache_class(config: Any) -> type[DynamicCache] | None:
    """The ``DynamicCache`` subclass a model's own modeling code keeps its state in
    (MiniMax's ``MiniMaxCache``: its ``linear_cache``), or None for a plain one."""
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(getattr(config, "model_type", "")))
    module = inspect.getmodule(getattr(transformers, name, None)) if name else None
    for obj in vars(module).values() if module is not None else ():
        if isinstance(obj, type) and issubclass(obj, DynamicCache) and obj.__module__ == module.__name__:
            return obj
    return None


def new_cache(config: Any) -> DynamicCache:
    """An empty cache of the kind the model of ``config`` keeps, recording past rows."""
    own = own_cache_class(config)
    if own is None:
        return record_past(DynamicCache(config=config))
    try:
        return record_past(own(config=config))
    except TypeError:  # MiniMaxCache() takes no config
        return record_past(own())


def record_past(cache: Cache) -> Cache:
    """Make ``cache``'s sliding / chunked layers keep their past rows (a checkpoint
    stores every token's rows; the model still attends within its window)."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) and hasattr(layer, "activate_past_recording"):
            layer.activate_past_recording()
    return cache


def from_engine(
    cmap: CacheMap,
    config: Any,
    segments: Sequence[Mapping[str, torch.Tensor]],
    snapshot: Sequence[Mapping[str, torch.Tensor]] | None = None,
    *,
    tokens: Sequence[int] | torch.Tensor | None = None,
    start_tok: int = 0,
    base: Cache | None = None,
    device: torch.device | str | None = None,
) -> DynamicCache:
    """Join per-rank engine tensors back into a ``DynamicCache`` the model accepts.

    ``segments`` cover tokens ``[start_tok, end)``. With ``start_tok > 0`` the first
    ``start_tok`` attention rows come from ``base`` (the GPU-resident prefix). When
    ``tokens`` is given, the restored ``tok`` rows must equal ``tokens[start_tok:end]``
    (else :class:`TokenMismatchError`).
    """
    layout = cmap.layout
    segments = layout.per_rank(segments)
    if cmap.has_snapshot and snapshot is None:
        raise InvalidInputError("this layout needs a snapshot")
    snaps = layout.per_rank(snapshot) if cmap.has_snapshot else []
    n = int(segments[0][TOKENS].shape[0]) if TOKENS in segments[0] else -1
    for r in range(cmap.ranks):
        layout.check_segments(r, segments[r], n)
        if cmap.has_snapshot:
            layout.check_snapshot(r, snaps[r])
    if tokens is not None:
        want = _token_tensor(tokens)[start_tok : start_tok + n]
        for r in range(cmap.ranks):
            got = segments[r][TOKENS].reshape(-1).to(torch.int64)
            if len(want) != n or not torch.equal(got, want):
                raise TokenMismatchError(
                    f"rank {r}: restored token ids of [{start_tok}, {start_tok + n}) differ from the request"
                )
    if start_tok and (cmap.attention or cmap.compressed):
        if base is None:
            raise InvalidInputError(
                f"start_tok={start_tok} needs the base cache holding those rows"
            )
        have = _attention_length(cmap, base)
        if have is None or have < start_tok:
            raise InvalidInputError(f"base cache holds {have} tokens, need {start_tok}")
    cache = new_cache(config)
    for a in cmap.attention:
        _restore_attention(cmap, a, cache, segments, start_tok, base, device)
    if cmap.has_snapshot:
        for s in cmap.states:
            _restore_state(cmap, s, cache, snaps, device)
        bt, ranks = cmap.block_tokens, range(cmap.ranks)
        for c in cmap.compressed:
            segs = {name: [segments[r][name] for r in ranks] for name, _ in c.segments(bt)}
            parts = {name: [snaps[r][name] for r in ranks] for name, *_ in c.snapshots()}
            hf_compressed.write(c, cache.layers[c.layer], segs, parts, start_tok + n, bt,
                                start=start_tok, base=base, device=device)
    return cache


def _restore_attention(
    cmap: CacheMap,
    a: AttentionSpec,
    cache: DynamicCache,
    segments: Sequence[Mapping[str, torch.Tensor]],
    start_tok: int,
    base: Cache | None,
    device: Any,
) -> None:
    """Join one attention layer's rows across ranks (after ``base``'s first
    ``start_tok`` rows) into ``cache``'s layer."""
    whole = {}
    for name, heads, width, attr in a.tensors():
        rows = hf_place.join([segments[r][name] for r in range(cmap.ranks)], heads, width)
        t = rows.transpose(0, 1).unsqueeze(0)  # (1, heads, tokens, width)
        if start_tok:
            prev = _layer_rows(a, base.layers[a.layer], name, attr, heads, width)
            first = _attention_length(cmap, base) - prev.shape[2]
            if first > 0:
                raise InvalidInputError(f"layer {a.layer}: the base cache dropped tokens [0, {first})")
            t = torch.cat([prev[:, :, :start_tok].to(t.device), t], dim=2)
        whole[attr] = t.to(device).contiguous() if device is not None else t.contiguous()
    cache.update(whole["keys"], whole.get("values", whole["keys"]), a.layer)  # adds lazy layers
    layer = cache.layers[a.layer]
    if "indexer_keys" in whole:
        if not hasattr(layer, "update_indexer"):
            raise LayoutError(f"layer {a.layer} of this config is {type(layer).__name__}, not indexed")
        layer.update_indexer(whole["indexer_keys"][:, 0])


def _restore_state(
    cmap: CacheMap,
    s: StateSpec,
    cache: DynamicCache,
    snaps: Sequence[Mapping[str, torch.Tensor]],
    device: Any,
) -> None:
    t = s.join([snaps[r][s.name] for r in range(cmap.ranks)]).unsqueeze(0)
    t = t.to(device) if device is not None else t
    if s.source == "linear_cache":
        if not hasattr(cache, "set_linear_cache"):
            raise LayoutError(f"layer {s.layer}: this config's cache ({type(cache).__name__}) keeps no linear_cache")
        cache.set_linear_cache(s.layer, t.clone())
        return
    layer = cache.layers[s.layer]
    if not isinstance(layer, LinearAttentionCacheLayerMixin):
        raise LayoutError(f"layer {s.layer} of this config is not a recurrent layer")
    if s.kind == "conv":
        layer.lazy_initialization(conv_states=t, state_idx=s.state_idx, conv_kernel_size=t.shape[-1])
        layer.conv_states[s.state_idx].copy_(t)
    else:
        layer.lazy_initialization(recurrent_states=t, state_idx=s.state_idx)
        layer.recurrent_states[s.state_idx].copy_(t)
    layer.has_previous_state[s.state_idx] = True


# -- running a model --------------------------------------------------------------------


@torch.no_grad()
def feed(
    model: Any,
    ids: Sequence[int] | torch.Tensor,
    cache: Cache | None = None,
    *,
    stepwise: bool = False,
) -> tuple[Cache, torch.Tensor]:
    """Run ``ids`` through ``model`` after ``cache`` (None: a fresh prefill).

    Returns the updated cache and the logits after the last token, shape ``(vocab,)``.
    With ``stepwise`` (see :attr:`CacheMap.stepwise`) a non-empty cache is continued one
    token at a time.
    """
    ids = _token_tensor(ids)
    if len(ids) == 0:
        raise InvalidInputError("feed needs at least one token")
    device = next(model.parameters()).device
    ids = ids.to(device).unsqueeze(0)
    chunks = ids.split(1, dim=1) if (stepwise and cache is not None) else (ids,)
    if cache is None:
        cache = new_cache(model.config)
    out = None
    for chunk in chunks:
        out = model(input_ids=chunk, cache=cache, use_cache=True)
        cache = out.cache
    return cache, out.logits[0, -1]


@torch.no_grad()
def greedy(model: Any, cache: Cache, logits: torch.Tensor, steps: int) -> list[int]:
    """Greedy-decode ``steps`` tokens from ``logits``, one token per call (updates ``cache``).

    The last token returned is not fed, so ``cache`` ends one token behind the output.
    """
    out: list[int] = []
    for i in range(steps):
        token = int(torch.argmax(logits))
        out.append(token)
        if i + 1 < steps:
            cache, logits = feed(model, [token], cache)
    return out


# -- engine glue ------------------------------------------------------------------------


@attrs.frozen
class Resumed:
    """What :meth:`HFPrefixCache.resume` found: a cache covering ``tokens`` tokens
    (``cache`` None and ``tokens`` 0 on a miss), and how many restores failed first."""

    cache: DynamicCache | None
    tokens: int
    match: Any = None
    failed_restores: int = 0


class HFPrefixCache:
    """An engine paired with one model config: store caches, resume from the deepest match."""

    def __init__(self, engine: Any, config: Any, cmap: CacheMap, *, device: Any = None) -> None:
        layout = getattr(engine, "layout", None)
        if layout is not None and layout != cmap.layout:
            raise LayoutError("the engine's layout differs from the model's cache map")
        self.engine = engine
        self.config = config
        self.cmap = cmap
        self.device = device

    @classmethod
    def open(
        cls,
        path: Any,
        model: Any,
        *,
        capacity_bytes: int,
        dtype: torch.dtype | str = torch.float32,
        block_tokens: int = 16,
        ranks: int = 1,
        state_dtype: torch.dtype | str | None = None,
        device: Any = None,
        revision: str | None = None,
        check_identity: bool = True,
        **opts: Any,
    ) -> HFPrefixCache:
        """Open (or create) an engine at ``path`` with the layout of ``model`` (the
        model, or its config).

        The engine records the model's identity (:func:`hf_identity.model_identity`:
        its config fields, a fingerprint of its weights when the model is given, and
        ``revision`` when given) and refuses to open under another one
        (``IdentityMismatchError`` naming the fields). ``identity=`` in ``opts`` replaces
        it; ``check_identity=False`` opens without one (a cache made before identities).
        Other ``opts`` go to ``Engine.open``."""
        cmap = cache_map(
            model, dtype=dtype, block_tokens=block_tokens, ranks=ranks, state_dtype=state_dtype
        )
        if check_identity:
            opts.setdefault("identity", model_identity(model, cmap.model_type, revision=revision))
        engine = Engine.open(path, cmap.layout, capacity_bytes, **opts)
        config = model.config if isinstance(model, torch.nn.Module) else model
        return cls(engine, config, cmap, device=device)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> HFPrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def store(
        self,
        cache: Cache,
        tokens: Sequence[int] | torch.Tensor,
        end_tok: int | None = None,
        *,
        tokens_from: int | None = None,
        valid: Callable[[], bool] | None = None,
    ) -> Any:
        """Store the checkpoint of ``cache`` at ``end_tok`` (default: deepest block boundary).

        ``tokens`` are all the tokens ``cache`` consumed (with recurrent layers
        ``end_tok`` must be ``len(tokens)``: see :func:`to_engine`). The rows handed to
        the engine start at ``tokens_from`` (default: :func:`held_from`, the first block
        every layer still holds); the engine keeps those its new node needs and refuses
        (``InvalidInputError``, nothing stored) when it needs earlier ones. ``valid`` is
        passed to the engine (a store refused for space is retried while it returns
        True). Returns the engine's StoreResult, or None when there is no full block.
        """
        ids = _token_tensor(tokens)
        bt = self.cmap.block_tokens
        end = len(ids) // bt * bt if end_tok is None else end_tok
        if end == 0:
            return None
        if tokens_from is None:
            tokens_from = min(held_from(self.cmap, cache), end - bt)
        t = to_engine(self.cmap, cache, ids, tokens_from, end)
        prefix = Prefix.from_tokens(ids[:end], bt)
        opts = {} if valid is None else {"valid": valid}
        return self.engine.store(prefix, t.segments, t.snapshot, tokens_from=tokens_from, **opts)

    def prefill(
        self,
        model: Any,
        tokens: Sequence[int] | torch.Tensor,
        resumed: Resumed | None = None,
    ) -> tuple[Cache, torch.Tensor]:
        """Feed ``tokens`` after what ``resumed`` covers, storing a checkpoint at their
        last block boundary on the way (the run stops there, so recurrent states can be
        taken). Returns the cache and the logits after the last token.

        The store hands the engine the rows from the restore point on (the block
        ``resumed`` covers), not from token 0; nothing is stored when the boundary is
        the checkpoint ``resumed`` restored."""
        ids = _token_tensor(tokens)
        start, cache = (resumed.tokens, resumed.cache) if resumed is not None else (0, None)
        if not 0 <= start < len(ids):
            raise InvalidInputError(f"nothing to prefill: {start} of {len(ids)} tokens covered")
        bt = self.cmap.block_tokens
        boundary = len(ids) // bt * bt
        restored = resumed.match.tokens if resumed is not None and resumed.match is not None else 0
        stepwise = self.cmap.stepwise
        if boundary > start:
            cache, logits = feed(model, ids[start:boundary], cache, stepwise=stepwise)
            if boundary > restored:
                self._store_from(cache, ids[:boundary], start // bt * bt)
            start = boundary
        if start < len(ids):
            cache, logits = feed(model, ids[start:], cache, stepwise=stepwise)
        return cache, logits

    def _store_from(self, cache: Cache, ids: torch.Tensor, tokens_from: int) -> Any:
        """Store ``cache`` at ``len(ids)`` with rows from ``tokens_from``; when the
        engine no longer holds the checkpoint there (evicted meanwhile), from the
        first block the cache still holds."""
        try:
            return self.store(cache, ids, tokens_from=tokens_from)
        except InvalidInputError:
            first = held_from(self.cmap, cache)
            if first >= tokens_from:
                raise
            return self.store(cache, ids, tokens_from=first)

    def resume(self, tokens: Sequence[int] | torch.Tensor) -> Resumed:
        """Restore the deepest stored checkpoint of ``tokens``, falling back to shallower
        ones when a restore fails (the engine marks that node damaged).

        The last token is never covered, so the caller always has one token to feed to
        get next-token logits: attention-only models restore a checkpoint ending at the
        last token and drop its last row (before the cache is built, so sliding
        layers keep their past rows); models with recurrent state (which cannot be
        rewound) look up the checkpoints before the last token only.
        """
        ids = _token_tensor(tokens)
        if len(ids) == 0:
            return Resumed(None, 0)
        cut = len(ids) - 1 if self.cmap.has_snapshot else len(ids)
        prefix = Prefix.from_tokens(ids[: max(cut, 0)], self.cmap.block_tokens)
        failed = 0
        match = None
        for _ in range(len(prefix) + 2):
            match = self.engine.lookup(prefix)
            if not match.hit:
                break
            restored = self.engine.restore(match)
            if restored is None:
                failed += 1
                continue
            covered = min(match.tokens, len(ids) - 1)  # attention only: leave one to feed
            segments = [{k: t[:covered] for k, t in seg.items()} for seg in restored.segments]
            cache = from_engine(
                self.cmap,
                self.config,
                segments,
                restored.snapshot if self.cmap.has_snapshot else None,
                tokens=ids,
                device=self.device,
            )
            return Resumed(cache, covered, match, failed)
        return Resumed(None, 0, match, failed)
