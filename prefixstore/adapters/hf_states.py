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
"""

from __future__ import annotations

from typing import Any

import attrs
from torch import nn

from prefixstore.base.errors import LayoutError


@attrs.frozen
class MixerStates:
    """What a recurrent layer caches: (name suffix, kind, shape, groups) per tensor."""

    family: str
    tensors: tuple[tuple[str, str, tuple[int, ...], tuple[tuple[int, int], ...]], ...]
    stepwise: bool = False


def meta_model(config: Any) -> nn.Module:
    """``config``'s causal LM built on the meta device (shapes only, no memory).

    Refuses a model whose ``forward`` takes no ``cache`` (it keeps none)."""
    import inspect

    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if "cache" not in inspect.signature(model.forward).parameters:
        raise LayoutError(f"{type(model).__name__}.forward takes no cache")
    return model


def _mixer(model: nn.Module, layer: int) -> nn.Module | None:
    for module in model.modules():
        if getattr(module, "layer_idx", None) == layer and hasattr(module, "conv_kernel_size"):
            return module
    return None


def _conv(mixer: nn.Module) -> nn.Conv1d | None:
    convs = [m for m in mixer.modules() if isinstance(m, nn.Conv1d)]
    return convs[0] if len(convs) == 1 else None


def mixer_states(model: nn.Module, layer: int, layer_type: str) -> MixerStates:
    """The states recurrent layer ``layer`` of ``model`` caches (LayoutError if unknown)."""
    mixer = _mixer(model, layer)
    where = f"layer {layer} (layer type {layer_type!r}, config field 'layer_types')"
    if mixer is None:
        raise LayoutError(f"{where}: no recurrent mixer module with layer_idx={layer} found")
    conv = _conv(mixer)
    if conv is None:
        raise LayoutError(f"{where}: {type(mixer).__name__} has no single Conv1d window")
    channels, kernel = int(conv.out_channels), int(conv.kernel_size[0])
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
    if not any(isinstance(v, int) for v in a.values()):
        return MixerStates("short_conv", (("conv", "conv", (channels, kernel), ((channels, 1),)),))
    raise LayoutError(f"{where}: the state of mixer {type(mixer).__name__} cannot be derived")
