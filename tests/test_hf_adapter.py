"""The transformers adapter: layouts from configs, cache <-> engine round trips, and
restores through the engine that continue generation exactly like a full prefill."""

from __future__ import annotations

import copy
import glob
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    MambaConfig,
    MambaForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from prefixstore.adapters import hf, hf_compressed  # noqa: E402
from prefixstore.adapters.hf_tiny import SLIDING_WINDOW, tiny_config, tiny_model  # noqa: E402
from prefixstore.base.errors import InvalidInputError, LayoutError, RankError, ShapeError  # noqa: E402
from prefixstore.base.keys import Prefix  # noqa: E402

BT = 16  # block_tokens
PROMPT = 96  # tokens of the request
CHECKPOINTS = (32, 64)  # stored checkpoint positions
STEPS = 32  # greedy continuation length
TOL = 1e-5
CAPACITY = 64 << 20


def llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )


def mamba_config() -> MambaConfig:
    return MambaConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=2, state_size=8, conv_kernel=4, expand=2
    )


def qwen3_next_config() -> Qwen3NextConfig:
    return Qwen3NextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        full_attention_interval=2,  # layer 0: gated delta-net, layer 1: full attention
        max_position_embeddings=256,
    )


BUILDERS: dict[str, Callable[[], Any]] = {
    "llama": lambda: LlamaForCausalLM(llama_config()),
    "mamba": lambda: MambaForCausalLM(mamba_config()),
    "qwen3_next": lambda: Qwen3NextForCausalLM(qwen3_next_config()),
}
# tiny configs of the installed transformers (hf_tiny): sliding windows of 24 tokens,
# shorter than the 96-token prompt; Falcon with multi_query=True; MLA; hybrids
for _name in (
    "gemma2",  # sliding + global layers
    "mistral",  # every layer sliding
    "gpt_oss",  # sliding + global, MoE
    "deepseek_v3",  # MLA
    "deepseek_v32",  # MLA + the DSA indexer's keys
    "deepseek_v4",  # shared-KV sliding, CSA (compressor + indexer) and HCA layers
    "falcon",  # multi-query (1 KV head), replicated on 2 ranks
    "gpt_bigcode",  # multi-query
    "zamba2",  # Mamba2 + shared attention
    "nemotron_h",  # Mamba2 + attention
    "lfm2",  # short convolution + attention
    "jamba",  # Mamba-1 + attention (stepwise)
    "mamba2",
):
    BUILDERS[_name] = lambda n=_name: tiny_model(n)


@attrs.frozen
class Case:
    """A tiny model, a request, and the reference: full prefill + greedy decode."""

    name: str
    model: Any
    ids: list[int]
    logits: torch.Tensor
    continuation: list[int]

    def cmap(self, ranks: int) -> hf.CacheMap:
        return hf.cache_map(self.model.config, block_tokens=BT, ranks=ranks)

    def finish(self, cache: Any, start: int, stepwise: bool) -> tuple[torch.Tensor, list[int]]:
        """Feed ``ids[start:]`` after ``cache``; the last logits and greedy continuation."""
        cache, logits = hf.feed(self.model, self.ids[start:], cache, stepwise=stepwise)
        return logits, hf.greedy(self.model, cache, logits, STEPS)

    def check(self, cache: Any, start: int, stepwise: bool) -> None:
        logits, cont = self.finish(cache, start, stepwise)
        assert (logits - self.logits).abs().max().item() < TOL
        assert cont == self.continuation


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread (and do not fight parallel test workers)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=list(BUILDERS))
def case(request: pytest.FixtureRequest) -> Case:
    torch.manual_seed(0)
    model = BUILDERS[request.param]().eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (PROMPT,), generator=gen).tolist()
    cache, logits = hf.feed(model, ids)  # one full prefill
    return Case(request.param, model, ids, logits, hf.greedy(model, cache, logits, STEPS))


def shard_files(root: Path) -> set[str]:
    return set(glob.glob(os.path.join(root, "**", "*.st"), recursive=True))


def flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def store_checkpoints(pc: hf.HFPrefixCache, case: Case) -> list[set[str]]:
    """Prefill in chunks ending at each checkpoint and store it there.

    Returns the shard files each store created (checkpoint order)."""
    created = []
    cache, pos = None, 0
    root = Path(pc.engine.root)
    for end in CHECKPOINTS:
        before = shard_files(root)
        cache, _ = hf.feed(case.model, case.ids[pos:end], cache, stepwise=pc.cmap.stepwise)
        pos = end
        res = pc.store(cache, case.ids[:end])
        assert res.status == "stored", res
        created.append(shard_files(root) - before)
    return created


def open_cache(path: Path, case: Case, ranks: int) -> hf.HFPrefixCache:
    return hf.HFPrefixCache.open(
        path, case.model.config, capacity_bytes=CAPACITY, block_tokens=BT, ranks=ranks
    )


# -- layouts ----------------------------------------------------------------------------


def test_layout_attention_only() -> None:
    layout = hf.layout_for(llama_config(), dtype=torch.bfloat16, block_tokens=BT, ranks=2)
    segs = {s.name: (s.dtype, s.shape) for s in layout.segments}
    assert segs == {
        "tok": ("int32", (1,)),
        "k.0": ("bfloat16", (1, 16)),
        "v.0": ("bfloat16", (1, 16)),
        "k.1": ("bfloat16", (1, 16)),
        "v.1": ("bfloat16", (1, 16)),
    }
    assert layout.snapshots == () and layout.ranks == 2 and layout.block_tokens == BT


def test_layout_mamba_is_snapshot_only() -> None:
    cmap = hf.cache_map(mamba_config(), block_tokens=BT, ranks=2)
    assert [s.name for s in cmap.layout.segments] == ["tok"]
    snaps = {s.name: s.shape for s in cmap.layout.snapshots}
    assert snaps == {"conv.0": (32, 4), "ssm.0": (32, 8), "conv.1": (32, 4), "ssm.1": (32, 8)}
    assert cmap.stepwise


def test_bf16_model_keeps_fp32_recurrent_state() -> None:
    torch.manual_seed(0)
    model = MambaForCausalLM(mamba_config()).to(torch.bfloat16).eval()
    cmap = hf.cache_map(model.config, dtype=torch.bfloat16, block_tokens=BT, ranks=2)
    dtypes = {s.name: s.dtype for s in cmap.layout.snapshots}
    assert dtypes["conv.0"] == "bfloat16" and dtypes["ssm.0"] == "float32"
    ids = list(range(32))
    cache, _ = hf.feed(model, ids)
    t = hf.to_engine(cmap, cache, ids)
    back = hf.from_engine(cmap, model.config, t.segments, t.snapshot, tokens=ids)
    for i in range(2):
        for states in ("conv_states", "recurrent_states"):
            got = getattr(back.layers[i], states)[0]
            assert torch.equal(got, getattr(cache.layers[i], states)[0])


def test_layout_hybrid_has_both() -> None:
    layout = hf.layout_for(qwen3_next_config(), block_tokens=BT, ranks=1)
    assert [s.name for s in layout.segments] == ["tok", "k.1", "v.1"]
    snaps = {s.name: s.shape for s in layout.snapshots}
    # conv channels: q (2 heads x 16) + k (2 x 16) + v (4 x 16); ssm: (v heads, dk, dv)
    assert snaps == {"conv.0": (128, 4), "ssm.0": (4, 16, 16)}


def test_layout_refuses_what_it_cannot_map() -> None:
    with pytest.raises(RankError, match="layer 0.*'num_key_value_heads'"):
        hf.cache_map(llama_config(), ranks=3)  # 2 KV heads on 3 ranks
    unknown = llama_config()
    unknown.layer_types = ["mystery_attention", "full_attention"]
    with pytest.raises(LayoutError, match="layer 0: cache layer type 'mystery_attention'.*layer_types"):
        hf.cache_map(unknown)
    indexed = tiny_config("deepseek_v32")  # DSA: an indexer key cache besides the latent
    indexed.index_head_dim = 0
    with pytest.raises(LayoutError, match="layer 0 \\(layer type 'indexed_attention'\\).*'index_head_dim'"):
        hf.cache_map(indexed)
    many = qwen3_next_config()
    many.number_of_conv_states = 2
    with pytest.raises(LayoutError, match="layer 0.*'number_of_conv_states'"):
        hf.cache_map(many)
    no_window = llama_config()
    no_window.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(LayoutError, match="'sliding_window'"):
        hf.cache_map(no_window)
    no_window.sliding_window = None
    with pytest.raises(LayoutError, match="layer 0 \\(layer type 'sliding_attention'\\).*'sliding_window'"):
        hf.cache_map(no_window)


def test_layout_sliding_layers_are_segments() -> None:
    cmap = hf.cache_map(tiny_config("gemma2"), block_tokens=BT, ranks=2)
    assert [(a.layer, a.window) for a in cmap.attention] == [(0, SLIDING_WINDOW), (1, None)]
    assert [s.name for s in cmap.layout.segments] == ["tok", "k.0", "v.0", "k.1", "v.1"]
    assert cmap.layout.snapshots == ()
    chunked = llama_config()
    chunked.layer_types = ["chunked_attention", "full_attention"]
    chunked.attention_chunk_size = 32
    assert [a.window for a in hf.cache_map(chunked).attention] == [32, None]


def test_layout_mla_latent_is_stored_once() -> None:
    """The MLA latent is the same on every rank: stored once, each rank keeping a
    stripe of its columns (``once.`` names), so 4 ranks store what 1 does."""
    cfg = tiny_config("deepseek_v3")
    for ranks, prefix in ((1, ""), (2, "once."), (4, "once.")):
        cmap = hf.cache_map(cfg, block_tokens=BT, ranks=ranks)
        segs = {s.name: s.shape for s in cmap.layout.segments}
        assert segs == {
            "tok": (1,),
            f"{prefix}kv_latent.0": (1, cfg.kv_lora_rank // ranks),
            f"{prefix}k_rope.0": (1, cfg.qk_rope_head_dim // ranks),
            f"{prefix}kv_latent.1": (1, cfg.kv_lora_rank // ranks),
            f"{prefix}k_rope.1": (1, cfg.qk_rope_head_dim // ranks),
        }
        assert all(a.latent and a.kv_heads == 1 for a in cmap.attention)
    assert {s.name: s.shape for s in hf.cache_map(cfg, ranks=3).layout.segments}["once.k_rope.0"] == (1, 3)


@pytest.mark.parametrize(
    ("fields", "heads"),
    [
        ({"num_key_value_heads": 2}, 2),
        ({"num_kv_heads": 2}, 2),
        ({"n_head_kv": 1}, 1),
        ({"multi_query_group_num": 2}, 2),
        ({"multi_query": True}, 1),
        ({}, 4),  # no KV field: one KV head per attention head
    ],
)
def test_kv_heads_from_every_config_convention(fields: dict[str, Any], heads: int) -> None:
    cfg = llama_config()
    cfg.num_key_value_heads = None
    for name, value in fields.items():
        setattr(cfg, name, value)
    cmap = hf.cache_map(cfg, block_tokens=BT, ranks=1)
    assert [a.kv_heads for a in cmap.attention] == [heads, heads]
    assert {s.name: s.shape for s in cmap.layout.segments}["k.0"] == (heads, 16)


def test_kv_heads_stored_once_when_ranks_outnumber_them() -> None:
    """A KV head that several ranks hold alike is stored once: each of them keeps a
    stripe of its columns, and the stripes join back to the head."""
    torch.manual_seed(0)
    model = tiny_model("falcon")  # multi_query: one KV head
    ids = list(range(40))
    cache, _ = hf.feed(model, ids)
    cmap = hf.cache_map(model.config, block_tokens=BT, ranks=4)
    assert {s.name: s.shape for s in cmap.layout.segments}["once.k.0"] == (1, 4)
    t = hf.to_engine(cmap, cache, ids)
    keys = cache.layers[0].keys[0, :, :32].transpose(0, 1)  # (tokens, 1 head, 16)
    assert all(torch.equal(t.segments[r]["once.k.0"], keys[..., 4 * r : 4 * r + 4]) for r in range(4))
    assert sum(seg["once.k.0"].numel() for seg in t.segments) == keys.numel()
    back = hf.from_engine(cmap, model.config, t.segments, tokens=ids)
    assert torch.equal(back.layers[0].keys[0, :, :32], cache.layers[0].keys[0, :, :32])
    two = llama_config()  # 2 KV heads on 4 ranks: ranks 0-1 hold head 0, ranks 2-3 head 1
    cmap = hf.cache_map(two, ranks=4)
    assert cmap.attention[0].head_of_rank(4) == [[0], [0], [1], [1]]
    assert {s.name: s.shape for s in cmap.layout.segments}["once.v.1"] == (1, 8)


def _exact_through_engine(model: Any, tmp_path: Path, ranks: int) -> None:
    """Store a 48-token prefill, reopen, resume a 64-token request and compare the
    next-token logits with a full prefill."""
    ids = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    opts = {"capacity_bytes": CAPACITY, "block_tokens": BT, "ranks": ranks}
    with hf.HFPrefixCache.open(tmp_path, model.config, **opts) as pc:
        pc.prefill(model, ids[:48])
    with hf.HFPrefixCache.open(tmp_path, model.config, **opts) as pc:
        r = pc.resume(ids)
        assert r.tokens == 48
        _, logits = hf.feed(model, ids[48:], r.cache)
    _, want = hf.feed(model, ids)
    assert (logits - want).abs().max().item() < TOL


@pytest.mark.parametrize("ranks", [1, 2])
def test_falcon_new_decoder_architecture_caches_every_head(ranks: int, tmp_path: Path) -> None:
    """Falcon-40B's layout (``new_decoder_architecture``, fewer KV heads than query
    heads) broadcasts each KV head to its query group before caching: the map follows
    the cache (4 heads), and a map that does not is refused at the store, typed."""
    torch.manual_seed(0)
    model = tiny_model("falcon", new_decoder_architecture=True, multi_query=False, num_kv_heads=2)
    cmap = hf.cache_map(model.config, block_tokens=BT, ranks=ranks)
    assert [a.kv_heads for a in cmap.attention] == [4, 4]
    _exact_through_engine(model, tmp_path, ranks)
    cache, _ = hf.feed(model, list(range(32)))
    wrong = attrs.evolve(cmap, attention=tuple(attrs.evolve(a, kv_heads=2) for a in cmap.attention))
    with pytest.raises(ShapeError, match="layer 0: the cache holds 4 heads of 16 columns for 'k.0', the layout maps 2"):
        hf.to_engine(wrong, cache, list(range(32)))


def test_dbrx_heads_follow_the_attention_config(tmp_path: Path) -> None:
    """DBRX's attention reads ``attn_config.kv_n_heads``; a top-level
    ``num_key_value_heads`` that disagrees is not what the cache holds."""
    torch.manual_seed(0)
    model = tiny_model("dbrx", num_key_value_heads=1)
    cfg = model.config
    assert (cfg.attn_config.kv_n_heads, cfg.num_key_value_heads) == (2, 1)
    assert [a.kv_heads for a in hf.cache_map(cfg, block_tokens=BT).attention] == [2, 2]
    _exact_through_engine(model, tmp_path, 2)


def test_layout_deepseek_v4_is_stored_once() -> None:
    """DeepSeek V4's caches are one head every rank holds alike: on 4 ranks each tensor
    is a stripe, and a checkpoint's bytes are those of 1 rank (up to padding)."""
    cfg = tiny_config("deepseek_v4")
    one, four = (hf.cache_map(cfg, block_tokens=BT, ranks=r).layout for r in (1, 4))
    assert [s.name for s in one.segments] == ["tok", "k.0", "cmp.1", "icmp.1", "cmp.2"]
    assert {s.name for s in four.snapshots} == {
        f"once.{n}.1" for n in ("win", "buf", "bufg", "ovl", "ovlg", "ibuf", "ibufg", "iovl", "iovlg")
    } | {"once.win.2", "once.buf.2", "once.bufg.2"}
    tok = one.segments[0].nbytes
    # cmp.2 (24-token windows: 2 columns per token) is padded to 4 columns on 4 ranks
    assert 4 * (four.token_bytes - tok) == one.token_bytes - tok + 2 * 4
    assert 4 * four.snapshot_bytes == one.snapshot_bytes
    assert {s.name: s.dtype for s in one.snapshots}["ovlg.1"] == "float32"


@pytest.mark.parametrize(("rate", "bt"), [(4, 16), (24, 16), (16, 16), (5, 8), (3, 4)])
def test_compressed_entries_pack_by_block(rate: int, bt: int) -> None:
    """Entry w (closing at token (w + 1) * rate) lands in the block of its last token:
    any block-aligned span packs and unpacks the entries it completes."""
    dim = 6
    entries = torch.arange(200 * dim, dtype=torch.float32).reshape(200, dim)
    width = hf_compressed.CompressedSpec(0, "x", rate, 4, dim, ()).packed_width(bt, dim)
    for start, end in ((0, 4 * bt), (bt, 3 * bt), (2 * bt, 7 * bt)):
        mine = entries[start // rate : end // rate]
        rows = hf_compressed.pack(mine, start, end, bt, rate, width)
        assert rows.shape == (end - start, width)
        assert torch.equal(hf_compressed.unpack(rows, start, bt, rate, dim), mine)
        # a span's rows are its blocks' rows: cutting at a block boundary changes nothing
        mid = start + bt
        head = hf_compressed.pack(entries[start // rate : mid // rate], start, mid, bt, rate, width)
        assert torch.equal(rows[:bt], head)


@pytest.mark.parametrize("model_type", ["deepseek_v4", "deepseek_v32"])
def test_sparse_selection_continues_like_the_models_own_cache(model_type: str, tmp_path: Path) -> None:
    """With an index top-k below the entry count the indexer really selects; a restore
    on 4 ranks then continues exactly like the model's own cache fed the same chunks."""
    torch.manual_seed(0)
    model = tiny_model(model_type, index_topk=3)
    ids = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    own, _ = hf.feed(model, ids[:48])
    _, want = hf.feed(model, ids[48:], own)
    with hf.HFPrefixCache.open(tmp_path, model, capacity_bytes=CAPACITY, block_tokens=BT, ranks=4) as pc:
        cache, _ = hf.feed(model, ids[:48])
        assert pc.store(cache, ids[:48]).status == "stored"
        r = pc.resume(ids)
        assert r.tokens == 48
        _, got = hf.feed(model, ids[48:], r.cache)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        ("rwkv", "RwkvForCausalLM.forward takes no transformers Cache \\(it carries its state in its own 'state'"),
        ("xlstm", "xLSTMForCausalLM.forward keeps its own xLSTMCache, not a transformers Cache"),
        ("recurrent_gemma", "RecurrentGemmaRecurrentBlock.conv1d_state keeps the recurrent state on the "
                            "model's own module, not in the cache"),
        ("dory", "'n_recurrent_loops' = 2 with recurrent_kv_cache_mode 'per_loop'"),
        ("qwen4_exp_text", "indexed attention without an MLA latent"),
    ],
)
def test_refusals_name_what_the_adapter_cannot_handle(model_type: str, reason: str) -> None:
    """Models without attention layers are refused for what they keep instead, not for
    a "full_attention" layer's KV head count they do not have."""
    with pytest.raises(LayoutError, match=reason):
        hf.cache_map(tiny_config(model_type))


def test_causality_is_read_from_the_architecture() -> None:
    """GPT-NeoX-Japanese is causal by construction though its config says
    ``is_decoder=False``; BERT with the same flag attends both ways and is refused."""
    cfg = tiny_config("gpt_neox_japanese")
    assert cfg.is_decoder is False
    assert [a.kv_heads for a in hf.cache_map(cfg).attention] == [4, 4]
    with pytest.raises(LayoutError, match="'is_decoder' is False"):
        hf.cache_map(tiny_config("bert"))


@pytest.mark.parametrize("model_type", ["kimi_linear", "bailing_hybrid", "minimax", "zaya"])
def test_linear_attention_states_are_derived(model_type: str, tmp_path: Path) -> None:
    """Kimi / Bailing delta attention, MiniMax's lightning attention (its state in
    MiniMaxCache.linear_cache) and Zaya's convolutional attention are read off their
    own mixers and continue exactly on 2 ranks."""
    torch.manual_seed(0)
    model = tiny_model(model_type)
    cmap = hf.cache_map(model, block_tokens=BT, ranks=2)
    assert cmap.states and not cmap.stepwise
    _exact_through_engine(model, tmp_path, 2)


def test_a_cache_with_more_layers_than_the_map_is_refused() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config()).eval()
    ids = list(range(32))
    cache, _ = hf.feed(model, ids)
    cache.layers.append(copy.deepcopy(cache.layers[1]))  # a model that grew its cache at run time
    with pytest.raises(ShapeError, match="the cache holds 3 layers, the cache map describes 2"):
        hf.to_engine(hf.cache_map(model.config, block_tokens=BT), cache, ids)


def test_sliding_layer_needs_its_past_rows() -> None:
    """A model's own cache drops rows older than the window: a checkpoint spanning
    them is refused; feed() keeps them, so the same span stores."""
    torch.manual_seed(0)
    model = tiny_model("mistral")
    cmap = hf.cache_map(model.config, block_tokens=BT)
    ids = list(range(64))
    with torch.no_grad():
        own = model(input_ids=torch.tensor([ids]), use_cache=True).cache
    with pytest.raises(InvalidInputError, match="layer 0 \\(window 24\\) holds tokens \\[41, 64\\)"):
        hf.to_engine(cmap, own, ids)
    cache, _ = hf.feed(model, ids)
    t = hf.to_engine(cmap, cache, ids)
    assert t.segments[0]["k.0"].shape == (64, 2, 16)
    assert torch.equal(t.segments[0]["k.0"][41:], own.layers[0].keys[0, :, -23:].transpose(0, 1))


def test_derived_states_need_no_rule() -> None:
    """Hybrid and recurrent families map from the model's own mixers, no rule needed;
    a registered rule still wins."""
    derived = {
        "zamba2": {"conv.0", "ssm.0", "conv.1", "ssm.1"},
        "nemotron_h": {"conv.0", "ssm.0"},
        "lfm2": {"conv.0"},  # a short convolution: no recurrent state
        "jamba": {"conv.0", "ssm.0"},
        "mamba2": {"conv.0", "ssm.0", "conv.1", "ssm.1"},
    }
    for model_type, names in derived.items():
        cmap = hf.cache_map(tiny_config(model_type), block_tokens=BT, ranks=2)
        assert {s.name for s in cmap.layout.snapshots} == names, model_type
        assert cmap.stepwise == (model_type == "jamba")  # Mamba-1 mixer
    # a Mamba2 conv window: [x (heads x head_dim) | B (groups x state) | C]; one group
    # cannot be split, so 2 ranks replicate the state; two groups split by heads and groups
    conv = hf.cache_map(tiny_config("zamba2"), ranks=2).states[0]
    assert conv.groups == ((4, 16), (1, 8), (1, 8)) and not conv.sharded(2)
    conv = hf.cache_map(tiny_config("zamba2", mamba_ngroups=2), ranks=2).states[0]
    assert conv.groups == ((4, 16), (2, 8), (2, 8)) and conv.rank_shape(2) == (48, 4)
    cfg = mamba_config()
    cfg.model_type = "not_registered"
    assert {s.name for s in hf.cache_map(cfg).layout.snapshots} == {"conv.0", "ssm.0", "conv.1", "ssm.1"}
    hf.register_state_rule(
        "not_registered", lambda c, i: [hf.StateSpec(f"s.{i}", i, "recurrent", (3,), groups=[(3, 1)])]
    )
    try:
        assert {s.name for s in hf.cache_map(cfg).layout.snapshots} == {"s.0", "s.1"}
    finally:
        hf._STATE_RULES.pop("not_registered")


def test_state_split_follows_heads_and_joins_back() -> None:
    # Qwen3-Next-like conv window: [q (2 heads x 2) | k (2 x 2) | v (4 x 1)] channels.
    spec = hf.StateSpec("conv.0", 0, "conv", (12, 3), groups=[(2, 2), (2, 2), (4, 1)])
    full = torch.arange(36.0).reshape(12, 3)
    parts = spec.split(full, 2)
    assert spec.rank_shape(2) == (6, 3)
    # rank 0: q head 0, k head 0, v heads 0-1
    assert torch.equal(parts[0], full[[0, 1, 4, 5, 8, 9]])
    assert torch.equal(parts[1], full[[2, 3, 6, 7, 10, 11]])
    assert torch.equal(spec.join(parts), full)
    # 3 ranks do not divide 2 heads: every rank holds the whole state
    assert spec.rank_shape(3) == (12, 3)
    reps = spec.split(full, 3)
    assert all(torch.equal(p, full) for p in reps) and torch.equal(spec.join(reps), full)
    reps[2] = reps[2] + 1
    with pytest.raises(InvalidInputError):
        spec.join(reps)


# -- conversions without the engine -----------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 2])
def test_round_trip_without_engine(case: Case, ranks: int) -> None:
    cmap = case.cmap(ranks)
    cache, _ = hf.feed(case.model, case.ids[:64])
    t = hf.to_engine(cmap, cache, case.ids[:64])
    assert len(t.segments) == ranks and all(s["tok"].shape == (64, 1) for s in t.segments)
    assert (t.snapshot is not None) == cmap.has_snapshot
    restored = hf.from_engine(cmap, case.model.config, t.segments, t.snapshot, tokens=case.ids)
    case.check(restored, 64, cmap.stepwise)


def test_rank_shards_hold_their_heads() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config()).eval()
    ids = list(range(40))
    cache, _ = hf.feed(model, ids)
    t = hf.to_engine(hf.cache_map(model.config, block_tokens=BT, ranks=2), cache, ids)
    keys = cache.layers[1].keys[0]  # (heads, tokens, dim)
    for r in range(2):
        assert torch.equal(t.segments[r]["k.1"], keys[r, :32].unsqueeze(1))


def test_checks_on_bad_input() -> None:
    torch.manual_seed(0)
    model = MambaForCausalLM(mamba_config()).eval()
    cmap = hf.cache_map(model.config, block_tokens=BT)
    ids = list(range(48))
    cache, _ = hf.feed(model, ids)
    with pytest.raises(InvalidInputError):  # a recurrent state exists only at token 48
        hf.to_engine(cmap, cache, ids, 0, 32)
    t = hf.to_engine(cmap, cache, ids)
    with pytest.raises(hf.TokenMismatchError):
        hf.from_engine(cmap, model.config, t.segments, t.snapshot, tokens=[1, *ids[1:]])
    with pytest.raises(InvalidInputError):
        hf.from_engine(cmap, model.config, t.segments, None)


# -- through the engine -----------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 2])
def test_restore_through_engine_matches_full_prefill(
    case: Case, ranks: int, tmp_path: Path
) -> None:
    with open_cache(tmp_path, case, ranks) as pc:
        store_checkpoints(pc, case)
        again = pc.store(*_prefill(case, 64), end_tok=64)  # same checkpoint again
        assert again.status == "duplicate"
        r = pc.resume(case.ids)
        assert (r.tokens, r.failed_restores) == (64, 0)
        case.check(r.cache, r.tokens, pc.cmap.stepwise)
    with open_cache(tmp_path, case, ranks) as pc:  # after close and reopen
        r = pc.resume(case.ids)
        assert (r.tokens, r.failed_restores) == (64, 0)
        case.check(r.cache, r.tokens, pc.cmap.stepwise)
        # a request diverging inside block 3 matches the 32-token checkpoint only
        other = case.ids[:40] + [(t + 1) % 256 for t in case.ids[40:]]
        assert pc.resume(other).tokens == 32


def _prefill(case: Case, n: int) -> tuple[Any, list[int]]:
    cache, _ = hf.feed(case.model, case.ids[:n])
    return cache, case.ids[:n]


def test_prefill_stores_at_last_block_boundary(case: Case, tmp_path: Path) -> None:
    with open_cache(tmp_path, case, 2) as pc:
        first = case.ids[:72]
        _, logits = pc.prefill(case.model, first, pc.resume(first))
        _, want = hf.feed(case.model, first)
        assert (logits - want).abs().max().item() < TOL
        r = pc.resume(case.ids)
        assert r.tokens == 64
        case.check(r.cache, r.tokens, pc.cmap.stepwise)


def test_block_aligned_request(case: Case, tmp_path: Path) -> None:
    """A request ending exactly at a checkpoint: attention-only models restore it and
    rewind one token; recurrent ones fall back to the checkpoint before."""
    with open_cache(tmp_path, case, 1) as pc:
        store_checkpoints(pc, case)
        r = pc.resume(case.ids[:64])
        expect = 63 if not pc.cmap.has_snapshot else 32
        assert r.tokens == expect
        _, logits = hf.feed(case.model, case.ids[r.tokens : 64], r.cache, stepwise=pc.cmap.stepwise)
        _, want = hf.feed(case.model, case.ids[:64])
        assert (logits - want).abs().max().item() < TOL
        assert pc.resume([]).cache is None


def test_prefill_after_block_aligned_resume(case: Case, tmp_path: Path) -> None:
    """``prefill(ids, resume(ids))`` with ``ids`` ending at a stored checkpoint (longer
    than every sliding window): the rewound cache keeps its past rows, the prefill
    stores nothing it already has, and the cache goes on to store a deeper checkpoint
    from the restore point only."""
    with open_cache(tmp_path, case, 1) as pc:
        store_checkpoints(pc, case)
        ids = case.ids[:64]
        cache, logits = pc.prefill(case.model, ids, pc.resume(ids))
        _, want = hf.feed(case.model, ids)
        assert (logits - want).abs().max().item() < TOL
        assert hf.held_from(pc.cmap, cache) == 0  # every past row is still there
        resumed = hf.Resumed(cache, 64)  # nothing is stored at 80 yet: store from 64 on
        cache, logits = pc.prefill(case.model, case.ids[:80], resumed)
        r = pc.resume(case.ids)
        assert r.tokens == 80
        case.check(r.cache, r.tokens, pc.cmap.stepwise)


def test_store_takes_rows_from_what_the_cache_holds(tmp_path: Path) -> None:
    """A model's own cache dropped a sliding layer's old rows: ``store`` stores from
    the first block every layer still holds, which the engine accepts where it needs
    no earlier rows, and refuses (typed, nothing stored) where it does."""
    torch.manual_seed(0)
    model = tiny_model("mistral")  # window 24
    ids = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    cmap = hf.cache_map(model.config, block_tokens=BT)
    with hf.HFPrefixCache.open(tmp_path, model.config, capacity_bytes=CAPACITY, block_tokens=BT) as pc:
        with torch.no_grad():
            own = model(input_ids=torch.tensor([ids]), use_cache=True).cache
        assert hf.held_from(cmap, own) == 48  # rows [41, 64): the first whole block is 48
        with pytest.raises(InvalidInputError, match="needs tokens from 0"):
            pc.store(own, ids)
        assert pc.engine.stats()["nodes"] == 0
        cache, _ = hf.feed(model, ids[:48])
        assert pc.store(cache, ids[:48]).status == "stored"
        assert pc.store(own, ids).status == "stored"  # the new node starts at 48
        r = pc.resume(ids + [3])
        assert r.tokens == 64
        _, logits = hf.feed(model, [3], r.cache)
        _, want = hf.feed(model, ids + [3])
        assert (logits - want).abs().max().item() < TOL


def test_gpu_resident_prefix_is_not_restored(case: Case, tmp_path: Path) -> None:
    with open_cache(tmp_path, case, 2) as pc:
        store_checkpoints(pc, case)
        base, _ = hf.feed(case.model, case.ids[:32])  # blocks 0-1 still on the "GPU"
        match = pc.engine.lookup(Prefix.from_tokens(case.ids[: PROMPT - 1], BT), gpu_blocks=2)
        assert match.hit and match.tokens == 64
        restored = pc.engine.restore(match)
        assert restored is not None and restored.segments[0]["tok"].shape[0] == 32
        cache = hf.from_engine(
            pc.cmap,
            case.model.config,
            restored.segments,
            restored.snapshot if pc.cmap.has_snapshot else None,
            tokens=case.ids,
            start_tok=32,
            base=base,
        )
        case.check(cache, 64, pc.cmap.stepwise)


def test_damaged_shard_falls_back_to_shallower_match_then_prefill(
    case: Case, tmp_path: Path
) -> None:
    with open_cache(tmp_path, case, 2) as pc:
        shallow, deep = store_checkpoints(pc, case)
    assert deep and shallow and not deep & shallow
    flip_byte(sorted(deep)[-1])  # one rank's shard of the 64-token checkpoint
    with open_cache(tmp_path, case, 2) as pc:
        r = pc.resume(case.ids)
        assert (r.tokens, r.failed_restores) == (32, 1)
        case.check(r.cache, r.tokens, pc.cmap.stepwise)
        flip_byte(sorted(shallow)[0])
        r = pc.resume(case.ids)
        assert (r.cache, r.tokens, r.failed_restores) == (None, 0, 1)
        case.check(None, 0, pc.cmap.stepwise)  # full prefill
        # the damaged checkpoint is refilled by storing it again
        assert pc.store(*_prefill(case, 32)).status in ("refilled", "stored")
        r = pc.resume(case.ids)
        assert (r.tokens, r.failed_restores) == (32, 0)
        case.check(r.cache, r.tokens, pc.cmap.stepwise)
