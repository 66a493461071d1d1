"""The identity a transformers model's cache directory records (``Engine.open(identity=)``).

:func:`model_identity` names the model by what gives its cache rows their meaning:

* ``adapter``, ``model_type``;
* ``config.<field>`` for every field of the (text) config that can change a cache row:
  all of them except names, versions, token ids, output switches, training-only fields
  (dropouts, router losses, initialisation) and the dtype (the layout names the KV
  dtype; the weights fingerprint covers the weights'). Values are JSON; a long one (a
  61-layer ``layer_types`` list) is recorded as its SHA-256;
* ``weights``: a SHA-256 over every parameter and buffer's name, shape, dtype and 64
  elements sampled at fixed positions (one gather per tensor, one copy to the host: cheap
  at open, even for a large model on the GPU), when a model with weights is given;
* ``revision``: the checkpoint revision, when the caller gives one.

An engine opened under another identity is refused (``IdentityMismatchError``) naming
the fields that differ, e.g. ``config.sliding_window '24' vs '32'`` or ``weights``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

SAMPLES = 64  # elements sampled per tensor
LONG = 256  # longer JSON values are recorded as their SHA-256
NOT_MEANING = frozenset({
    "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "torchscript",
    "id2label", "label2id", "problem_type", "finetuning_task", "task_specific_params",
    "tokenizer_class", "prefix", "chunk_size_feed_forward", "initializer_range",
    "initializer_factor", "tie_word_embeddings", "pad_token_id", "bos_token_id",
    "eos_token_id", "sep_token_id", "decoder_start_token_id", "output_router_logits",
    "router_aux_loss_coef", "router_z_loss_coef", "router_jitter_noise", "max_length",
})


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _value(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))
    return text if len(text) <= LONG else _digest(text.encode())


def _meaningful(name: str) -> bool:
    return not name.startswith("_") and name not in NOT_MEANING and "dropout" not in name


def config_fields(config: Any) -> dict[str, str]:
    """``config.<field>``: JSON value, for every field of the decoder's config that can
    change what a cache row means."""
    text = config.get_text_config(decoder=True)
    return {f"config.{k}": _value(v) for k, v in sorted(text.to_dict().items()) if _meaningful(k)}


def _sample(t: torch.Tensor) -> torch.Tensor:
    n = t.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.float64, device=t.device)
    at = torch.linspace(0, n - 1, steps=min(n, SAMPLES), device=t.device).long()
    idx = torch.unravel_index(at, t.shape) if t.dim() else ()
    return t.detach()[idx].reshape(-1).to(torch.float64)


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module) -> str | None:
    """SHA-256 of every tensor's name, shape, dtype and sampled elements; None for a
    model without weights (built on the meta device)."""
    tensors = list(model.state_dict(keep_vars=True).items())
    if not tensors or any(t.is_meta for _, t in tensors):
        return None
    h = hashlib.sha256()
    for name, t in tensors:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    samples = [_sample(t) for _, t in tensors]
    on_host: dict[int, torch.Tensor] = {}
    for device in dict.fromkeys(s.device for s in samples):  # one copy per device
        mine = [i for i, s in enumerate(samples) if s.device == device]
        parts = torch.cat([samples[i] for i in mine]).cpu().split([samples[i].numel() for i in mine])
        on_host.update(zip(mine, parts, strict=True))
    for i in range(len(samples)):  # in state_dict order, whatever the device map
        h.update(on_host[i].numpy().tobytes())
    return "sha256:" + h.hexdigest()


def model_identity(model: Any, model_type: str, *, revision: str | None = None) -> dict[str, str]:
    """The identity of ``model`` (a model, or its config: then without ``weights``)."""
    config = model.config if isinstance(model, torch.nn.Module) else model
    out = {"adapter": "transformers", "model_type": model_type, **config_fields(config)}
    if isinstance(model, torch.nn.Module):
        weights = weights_fingerprint(model)
        if weights is not None:
            out["weights"] = weights
    if revision is not None:
        out["revision"] = str(revision)
    return out
