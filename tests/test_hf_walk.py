"""Every causal-LM architecture of the installed transformers, tiny and random-init,
through the adapter and the engine: exact, or refused at cache_map with a typed error.
Nothing may fail later or come out wrong; the README's table is this walk's output."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from prefixstore.adapters import hf_walk  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
TABLE = re.compile(r"<!-- hf-walk:begin -->\n(.*?)\n?<!-- hf-walk:end -->", re.S)
MODEL_TYPE = re.compile(r"^\| `([^`]+)` \| ([^|]+) \|", re.M)
OK = {"exact", "exact (own cache)", "refused", "not built"}


@pytest.mark.slow
def test_every_causal_lm_is_exact_or_refused_at_cache_map() -> None:
    verdicts = hf_walk.walk()
    bad = [f"{v.model_type}: {v.result} {v.detail}" for v in verdicts if v.result not in OK]
    assert not bad, "\n".join(bad)
    results = {v.model_type: v.result for v in verdicts}
    # the families the adapter maps must really be exercised, not "not built"
    for model_type in (
        "llama", "gemma2", "mistral", "gpt_oss", "llama4", "deepseek_v3", "falcon",
        "gpt_bigcode", "zamba2", "nemotron_h", "lfm2", "jamba", "mamba", "mamba2",
        "qwen3_next", "qwen3_5", "granitemoehybrid",
    ):  # fmt: skip
        assert results[model_type].startswith("exact"), (model_type, results[model_type])
    assert results["deepseek_v32"] == "refused"  # indexed attention
    # the README lists this walk's result by architecture
    table = TABLE.search(README.read_text())
    assert table is not None, "README lacks the hf-walk table"
    listed = dict(MODEL_TYPE.findall(table.group(1)))
    assert {k: v.strip() for k, v in listed.items()} == results
