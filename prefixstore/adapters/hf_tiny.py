"""Tiny random-init transformers models built from configs (for tests and examples).

:func:`tiny_config` shrinks the default config of any ``model_type`` to a few layers
of width 64 and a vocabulary of 256, keeping each kind of layer the default has (so a
hybrid stays hybrid). Nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

import torch

from prefixstore.base.errors import InvalidInputError

try:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("prefixstore.adapters.hf_tiny needs transformers 5.x") from exc

VOCAB = 256
HIDDEN = 64
LAYERS = 2
SLIDING_WINDOW = 24  # shorter than the test prompts: sliding layers really slide

# config field -> tiny value (set only where the default config has the field)
_SIZES: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "head_dim": 16,
    "attention_head_dim": 16,
    "max_position_embeddings": 512,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "rotary_dim": 8,  # GPT-J, CodeGen: at most the head size
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "mamba_n_heads": 4,
    "mamba_num_heads": 4,
    "n_mamba_heads": 4,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_headdim": 16,
    "mamba_d_state": 8,
    "ssm_state_size": 8,
    "state_size": 8,
    "mamba_d_ssm": 64,
    "mamba_dt_rank": 8,
    "time_step_rank": 8,
    "mamba_chunk_size": 16,
    "chunk_size": 16,
    "num_heads": 4,
    "mamba_expand": 1,
    "expand": 1,
    "d_model": HIDDEN,
    "n_embd": HIDDEN,
    "n_positions": 512,
    "n_ctx": 512,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 128,  # at least the prompt: see the deepseek_v4 override
    "encoder_layers": LAYERS,  # the cache of a *ForCausalLM decoder is sized by num_hidden_layers (the encoder's)
    "decoder_layers": LAYERS,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "n_inner": 128,
    "ffn_dim": 128,
    "num_key_value_groups": 1,
    "shared_experts_intermediate_size": 32,
    "ffn_hidden_size": 128,
    "expert_ffn_hidden_size": 32,
    "zero_expert_num": 2,
    "emb_dim": HIDDEN,
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16,
    "encoder_hash_byte_group_vocab": 512,
}
_WINDOWS = ("sliding_window", "attention_chunk_size", "attention_window_size", "sliding_window_size")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


def causal_lm_types() -> list[str]:
    """Every ``model_type`` the installed transformers maps to a causal-LM class."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _keep_kinds(layer_types: list[str], n: int) -> list[str]:
    """The first ``n`` layer types, widened so that each kind present appears once."""
    kinds = list(dict.fromkeys(layer_types))
    return kinds if len(kinds) >= n else (kinds * n)[:n]


# window fields a default config leaves None although the model uses them
WINDOWED: dict[str, tuple[str, ...]] = {"mistral": ("sliding_window",)}

# per-model fields a generic shrink cannot guess (layer pattern fields, group counts)
OVERRIDES: dict[str, dict[str, Any]] = {
    "falcon": {"multi_query": True, "new_decoder_architecture": False},
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid"], "mamba_ngroups": 1},
    "nemotron_h": {"layers_block_type": ["linear_attention", "full_attention"], "n_groups": 1},
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    "mamba2": {"n_groups": 2},
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # every attention kind V4 has (sliding, CSA, HCA); compression rates below and above
    # a block; index_topk above the entry count (a smaller one ties on random weights,
    # whose top-k picks then depend on the sequence length: prefixes stop agreeing)
    "deepseek_v4": {
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        "mlp_layer_types": ["hash_moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 24},
        "head_dim": 32,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "hc_mult": 2,
        "index_topk": 64,
    },
    "deepseek_v2": {"topk_method": "greedy", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2},
    "nemotron": {"num_key_value_heads": 2},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "num_layers": LAYERS},
    "qwen4_exp_text": {
        "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
        "indexer_budget": 16, "indexer_compress_ratio": 4,
    },
    "qwen4_exp": {
        "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
        "indexer_budget": 16, "indexer_compress_ratio": 4,
    },
    "zaya": {"num_experts_per_tok": 1},
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32]},
    "dory": {
        "num_hidden_layers": 4, "n_input_layers": 1, "n_output_layers": 1,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "kimi_linear": {"num_experts_per_token": 2, "mlp_layer_types": ["dense", "sparse"]},
    "bailing_hybrid": {
        "num_experts_per_token": 2, "num_expert_group": 1, "topk_group": 1,
        "mlp_layer_types": ["dense", "sparse"], "layer_group_size": 2,
    },
    "minimax": {"block_size": 16},
    "dbrx": {
        "n_heads": 4,
        "n_layers": LAYERS,
        "max_seq_len": 512,
        "num_key_value_heads": 2,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    },
}


def tiny_config(model_type: str, *, window: int = SLIDING_WINDOW, **overrides: Any) -> Any:
    """The default config of ``model_type`` shrunk to a tiny model, its sliding windows
    and attention chunks ``window`` tokens long.

    Fields are passed to the config class (so derived fields such as ``layer_types``
    follow), then :data:`OVERRIDES` for ``model_type``, then ``overrides``.
    """
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise InvalidInputError(f"model_type {model_type!r} is not a causal LM of this transformers")
    default = AutoConfig.for_model(model_type)
    composite = default.get_text_config(decoder=True) is not default and "text_config" in default.to_dict()
    fields = default.get_text_config(decoder=True).to_dict()
    if not composite:  # a decoder's view may hide fields its class has (BART's decoder_layers)
        fields = {**default.to_dict(), **fields}
    kw: dict[str, Any] = {}
    for name, value in _SIZES.items():
        if name in fields and fields[name] is not None:
            kw[name] = value
    mla = fields.get("kv_lora_rank") is not None
    if mla:  # the rotary width is the head size
        kw.pop("head_dim", None)
    elif "head_dim" in fields and fields["head_dim"] is None and "num_attention_heads" in kw:
        kw["head_dim"] = HIDDEN // kw["num_attention_heads"]  # a None some models read as is
    for name in ("num_key_value_heads", "num_kv_heads", "n_head_kv"):
        if isinstance(fields.get(name), int):
            kw[name] = min(fields[name], 4 if mla else 2)
    if "n_head" in fields:
        kw["n_head"] = 4
    for name in _WINDOWS:
        if isinstance(fields.get(name), int) or name in WINDOWED.get(model_type, ()):
            kw[name] = window
    for name in _TOKEN_IDS:
        if isinstance(fields.get(name), int) and fields[name] >= VOCAB:
            kw[name] = VOCAB - 1
    layers = LAYERS
    for name in ("layer_types", "layers_block_type"):
        if isinstance(fields.get(name), list) and fields[name]:
            kw[name] = _keep_kinds(fields[name], LAYERS)
            layers = len(kw[name])
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        if name in fields:
            kw[name] = layers
    kw.update(OVERRIDES.get(model_type, {}))
    kw.update(overrides)
    if composite:
        return AutoConfig.for_model(model_type, text_config=kw)  # a composite (multimodal) config
    return AutoConfig.for_model(model_type, **kw)


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    """A tiny random-init causal LM of ``model_type`` (fp32, CPU, eval mode)."""
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()
