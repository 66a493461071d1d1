"""A transformers cache directory belongs to one model: opened under another config or
other weights with the same layout, it is refused, naming what differs, instead of
serving the other model's rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from prefixstore.adapters import hf  # noqa: E402
from prefixstore.adapters.hf_identity import model_identity, weights_fingerprint  # noqa: E402
from prefixstore.adapters.hf_tiny import tiny_model  # noqa: E402
from prefixstore.base.errors import IdentityMismatchError  # noqa: E402

BT = 16
OPTS = {"capacity_bytes": 64 << 20, "block_tokens": BT}
IDS = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(1)).tolist()


def _store(root: Path, model: torch.nn.Module) -> None:
    with hf.HFPrefixCache.open(root, model, **OPTS) as pc:
        pc.prefill(model, IDS[:48])


def _logits_after_resume(root: Path, model: torch.nn.Module, **kw) -> torch.Tensor:
    with hf.HFPrefixCache.open(root, model, **OPTS, **kw) as pc:
        r = pc.resume(IDS)
        assert r.tokens == 48
        return hf.feed(model, IDS[48:], r.cache)[1]


def _full(model: torch.nn.Module) -> torch.Tensor:
    return hf.feed(model, IDS)[1]


def test_another_window_with_the_same_layout_is_refused(tmp_path: Path) -> None:
    ours, theirs = tiny_model("mistral"), tiny_model("mistral", sliding_window=32)
    assert hf.layout_for(ours.config, block_tokens=BT) == hf.layout_for(theirs.config, block_tokens=BT)
    _store(tmp_path, ours)
    with pytest.raises(IdentityMismatchError) as info:
        hf.HFPrefixCache.open(tmp_path, theirs, **OPTS)
    assert info.value.differences == ["config.sliding_window '24' vs '32'"]
    # what the check prevents: the other window's rows, restored without a word
    wrong = _logits_after_resume(tmp_path, theirs, check_identity=False)
    assert (wrong - _full(theirs)).abs().max().item() > 1e-3
    assert (_logits_after_resume(tmp_path, ours) - _full(ours)).abs().max().item() < 1e-5


def test_other_weights_with_the_same_config_are_refused(tmp_path: Path) -> None:
    ours, theirs = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    _store(tmp_path, ours)
    with pytest.raises(IdentityMismatchError) as info:
        hf.HFPrefixCache.open(tmp_path, theirs, **OPTS)
    assert [d.split(" ")[0] for d in info.value.differences] == ["weights"]
    wrong = _logits_after_resume(tmp_path, theirs, check_identity=False)
    assert (wrong - _full(theirs)).abs().max().item() > 1e-3


def test_the_revision_the_caller_gives_is_compared(tmp_path: Path) -> None:
    model = tiny_model("llama")
    with hf.HFPrefixCache.open(tmp_path, model.config, revision="v1", **OPTS):
        pass  # a config only: no weights fingerprint, the revision names them
    with hf.HFPrefixCache.open(tmp_path, model.config, revision="v1", **OPTS):
        pass
    with pytest.raises(IdentityMismatchError, match="revision 'v1' vs 'v2'"):
        hf.HFPrefixCache.open(tmp_path, model.config, revision="v2", **OPTS)


def test_the_fingerprint_follows_the_weights_not_the_build() -> None:
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    assert weights_fingerprint(a) == weights_fingerprint(b) is not None
    with torch.no_grad():
        b.model.layers[1].self_attn.v_proj.weight.mul_(1.001)
    assert weights_fingerprint(a) != weights_fingerprint(b)
    ident = model_identity(a, "llama")
    assert ident["config.num_key_value_heads"] == "2" and "config.transformers_version" not in ident
    assert all(len(v) <= 256 + 7 for v in ident.values())
