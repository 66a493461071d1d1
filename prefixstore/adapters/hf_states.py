"""Recurrent-state shapes derived from a model's own mixer modules.

A transformers 5.x model with recurrent layers (Mamba, Mamba2, gated delta-net, short
convolution) is built on the ``meta`` device (no weights, no forward pass) and each
recurrent layer's mixer -- the module with that ``layer_idx`` and a ``conv_kernel_size``
-- is read: its ``nn.Conv1d`` gives the convolution window ``(channels, kernel)``, and
the attributes the mixer families share give the recurrent state and how tensor
parallelism splits both:

* Mamba2 (``num_heads``, ``head_dim``, ``n_groups``, ``ssm_state_size``): conv channels
  ``[x (heads x head_dim) | B (groups x state) | C (groups x state)]``, state
  ``(heads, head_dim, state)``.
* gated delta-net (``num_k_heads``, ``num_v_heads``, ``head_k_dim``, ``head_v_dim``):
  conv channels ``[q | k | v]`` by heads, state ``(v_heads, head_k_dim, head_v_dim)``.
* Mamba-1 (``intermediate_size``, ``ssm_state_size``, no heads): conv ``(d, kernel)``,
  state ``(d, state)``; its reference multi-token scan does not start from a cached
  state, so continuing it is *stepwise* (one token per call).
* short convolution (a conv only, e.g. LFM2): conv ``(channels, kernel)``, no state.
* Kimi / Bailing delta attention (``num_heads``, ``head_dim``, a conv of ``3 x heads x
  head_dim`` channels): conv channels ``[q | k | v]`` by heads, state ``(heads,
  head_dim, head_dim)``.
* MiniMax lightning attention (``num_attention_heads``, ``head_dim``, ``block_size``,
  per-head decay ``slope_rate``; no conv): the ``K^T V`` state ``(heads, head_dim,
  head_dim)``, kept in the model's dtype in ``MiniMaxCache.linear_cache``.
* Zaya's compressed convolutional attention (``q_proj``, ``k_proj``,
  ``v_proj_delayed``, two convolutions of ``conv_kernel_size`` together): the window
  of ``[q | k]`` projections and the previous token's delayed value projection.

A model that keeps its recurrent state on its own modules (RecurrentGemma's
``conv1d_state`` / ``recurrent_states``) is refused: a cache object cannot carry it.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any

import attrs
from torch import nn

from prefixstore.base.errors import LayoutError


@attrs.frozen
class MixerStates:
    """What a recurrent layer caches: (name suffix, kind, shape, groups) per tensor.

    ``model_dtype``: the suffixes kept in the model's dtype (not float32) whatever their
    kind. ``source``: where the cache keeps them: ``"layer"`` (the cache layer's conv /
    recurrent states) or ``"linear_cache"`` (MiniMax's ``cache.linear_cache[layer]``).
    """

    family: str
    tensors: tuple[tuple[str, str, tuple[int, ...], tuple[tuple[int, int], ...]], ...]
    stepwise: bool = False
    model_dtype: frozenset[str] = frozenset()
    source: str = "layer"


def meta_model(config: Any) -> nn.Module:
    """``config``'s causal LM built on the meta device (shapes only, no memory),
    refused unless it keeps a transformers ``Cache`` (:func:`check_cache_kind`)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    check_cache_kind(model)
    return model


def check_cache_kind(model: nn.Module) -> None:
    """Refuse a model whose ``forward`` keeps no transformers ``Cache`` of layers: it
    takes none (RWKV carries its own ``state``; XLNet's ``mems``), or one of its own
    (xLSTM's ``xLSTMCache``). The adapter maps ``DynamicCache`` layers only."""
    from transformers.cache_utils import Cache

    name = type(model).__name__
    params = inspect.signature(model.forward).parameters
    if "cache" not in params:
        state = [p for p in params if p in ("state", "mems", "past_buckets_states", "cache_params")]
        carried = f" (it carries its state in its own {state[0]!r} argument)" if state else ""
        raise LayoutError(f"{name}.forward takes no transformers Cache{carried}: the adapter maps "
                          "the layers of a DynamicCache only")
    # a class of the model's own (not a builtin container: legacy annotations of models
    # that do take a Cache still say tuple)
    annotation = params["cache"].annotation
    kinds = [a for a in typing.get_args(annotation) or (annotation,)
             if isinstance(a, type) and a.__module__ != "builtins"]
    if kinds and not any(issubclass(a, Cache) for a in kinds):
        raise LayoutError(f"{name}.forward keeps its own {kinds[0].__name__}, not a transformers "
                          "Cache of layers: the adapter maps the layers of a DynamicCache only")
    returned = inspect.signature(model.forward).return_annotation
    outputs = [a for a in typing.get_args(returned) or (returned,) if isinstance(a, type) and dataclasses.is_dataclass(a)]
    if outputs and not any("cache" in {f.name for f in dataclasses.fields(a)} for a in outputs):
        held = _module_state(model)
        where = (f"{held} keeps the recurrent state on the model's own module, not in the cache"
                 if held else "the model keeps no transformers Cache the adapter could map")
        raise LayoutError(f"{name}.forward returns {outputs[0].__name__}, which holds no cache: {where}")


def causal_by_construction(model: nn.Module) -> bool:
    """True when the model's modeling code builds causal attention masks and never a
    bidirectional one (GPT-NeoX-Japanese: causal whatever ``is_decoder`` says)."""
    module = inspect.getmodule(type(model))
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return False
    return "create_causal_mask" in source and "create_bidirectional_mask" not in source


# attributes that keep a recurrent state on a module itself, outside any cache object
MODULE_STATES = ("conv1d_state", "recurrent_states", "conv_state", "ssm_state", "ssm_states")


def _mixer(model: nn.Module, layer: int) -> nn.Module | None:
    for module in model.modules():
        if getattr(module, "layer_idx", None) != layer:
            continue
        if hasattr(module, "conv_kernel_size") or _is_lightning(module):
            return module
    return None


def _is_lightning(module: nn.Module) -> bool:
    """MiniMax's lightning attention: per-head decay, state ``K^T V`` of each head."""
    return isinstance(getattr(module, "block_size", None), int) and hasattr(module, "slope_rate")


def _module_state(model: nn.Module) -> str | None:
    """``Class.attribute`` of a module that keeps a recurrent state on itself, if any."""
    for module in model.modules():
        for name in MODULE_STATES:
            if name in vars(module) and not isinstance(vars(module)[name], nn.Module):
                return f"{type(module).__name__}.{name}"
    return None


def _conv(mixer: nn.Module) -> nn.Conv1d | None:
    convs = [m for m in mixer.modules() if isinstance(m, nn.Conv1d)]
    return convs[0] if len(convs) == 1 else None


def _linear_out(mixer: nn.Module, name: str) -> int | None:
    m = getattr(mixer, name, None)
    return int(m.out_features) if isinstance(m, nn.Linear) else None


def mixer_states(model: nn.Module, layer: int, layer_type: str) -> MixerStates:
    """The states recurrent layer ``layer`` of ``model`` caches (LayoutError if unknown)."""
    mixer = _mixer(model, layer)
    where = f"layer {layer} (layer type {layer_type!r}, config field 'layer_types')"
    if mixer is None:
        held = _module_state(model)
        if held is not None:
            raise LayoutError(
                f"{where}: {held} keeps the recurrent state on the model's own module, not "
                "in the cache: a restored cache cannot carry it"
            )
        raise LayoutError(f"{where}: no recurrent mixer module with layer_idx={layer} found")
    for family in (_lightning, _cca):
        found = family(mixer)
        if found is not None:
            return found
    conv = _conv(mixer)
    if conv is None:
        raise LayoutError(f"{where}: {type(mixer).__name__} has no single Conv1d window")
    found = _conv_family(mixer, int(conv.out_channels), int(conv.kernel_size[0]))
    if found is None:
        raise LayoutError(f"{where}: the state of mixer {type(mixer).__name__} cannot be derived")
    return found


def _lightning(mixer: nn.Module) -> MixerStates | None:
    """MiniMax: the ``(heads, head_dim, head_dim)`` state in ``MiniMaxCache.linear_cache``,
    in the model's dtype; no convolution."""
    h, d = getattr(mixer, "num_attention_heads", None), getattr(mixer, "head_dim", None)
    if not (_is_lightning(mixer) and isinstance(h, int) and isinstance(d, int)):
        return None
    return MixerStates("lightning", (("ssm", "recurrent", (h, d, d), ((h, 1),)),),
                       model_dtype=frozenset({"ssm"}), source="linear_cache")


def _cca(mixer: nn.Module) -> MixerStates | None:
    """Zaya's compressed convolutional attention: the window of ``[q | k]`` projections
    before its two convolutions, and the previous token's delayed value projection (in
    the model's dtype)."""
    q, k, v = (_linear_out(mixer, n) for n in ("q_proj", "k_proj", "v_proj_delayed"))
    heads, kv, d = (getattr(mixer, n, None) for n in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    kernel = getattr(mixer, "conv_kernel_size", None)
    if None in (q, k, v) or not all(isinstance(x, int) for x in (heads, kv, d, kernel)):
        return None
    qk = ((heads, d), (kv, d)) if (q, k) == (heads * d, kv * d) else ((q + k, 1),)
    vg = ((kv, v // kv),) if v % kv == 0 else ((v, 1),)
    return MixerStates("cca", (
        ("conv", "conv", (q + k, kernel), qk),
        ("ssm", "recurrent", (v,), vg),
    ), model_dtype=frozenset({"ssm"}))


def _conv_family(mixer: nn.Module, channels: int, kernel: int) -> MixerStates | None:
    a = {k: getattr(mixer, k, None) for k in (
        "num_heads", "head_dim", "n_groups", "ssm_state_size", "intermediate_size",
        "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim",
    )}
    if all(isinstance(a[k], int) for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")):
        nk, nv, dk, dv = a["num_k_heads"], a["num_v_heads"], a["head_k_dim"], a["head_v_dim"]
        groups = ((nk, dk), (nk, dk), (nv, dv))
        return MixerStates("gated_delta_net", (
            ("conv", "conv", (channels, kernel), groups),
            ("ssm", "recurrent", (nv, dk, dv), ((nv, 1),)),
        ))
    if all(isinstance(a[k], int) for k in ("num_heads", "head_dim", "n_groups", "ssm_state_size")):
        h, d, g, s = a["num_heads"], a["head_dim"], a["n_groups"], a["ssm_state_size"]
        return MixerStates("mamba2", (
            ("conv", "conv", (channels, kernel), ((h, d), (g, s), (g, s))),
            ("ssm", "recurrent", (h, d, s), ((h, 1),)),
        ))
    if isinstance(a["ssm_state_size"], int) and isinstance(a["intermediate_size"], int):
        d, s = a["intermediate_size"], a["ssm_state_size"]
        return MixerStates("mamba", (
            ("conv", "conv", (channels, kernel), ((channels, 1),)),
            ("ssm", "recurrent", (d, s), ((d, 1),)),
        ), stepwise=True)
    h, d = a["num_heads"], a["head_dim"]
    if isinstance(h, int) and isinstance(d, int) and channels == 3 * h * d and a["n_groups"] is None:
        # Kimi / Bailing delta attention: q, k, v of h heads each; per-channel decay
        return MixerStates("kimi_delta_attention", (
            ("conv", "conv", (channels, kernel), ((h, d), (h, d), (h, d))),
            ("ssm", "recurrent", (h, d, d), ((h, 1),)),
        ))
    if not any(isinstance(v, int) for v in a.values()):
        return MixerStates("short_conv", (("conv", "conv", (channels, kernel), ((channels, 1),)),))
    return None
