"""Every causal-LM architecture of the installed transformers, tiny and random-init,
through the adapter and the engine: exact, or refused at cache_map with a typed error.
Nothing may fail later or come out wrong; docs/models.md is this walk's output.

CI walks a representative subset (:data:`SUBSET`, every kind of cache the adapter maps
and one of each refusal); ``PREFIXSTORE_HF_WALK=full`` walks every type (about 8
minutes on the 2-core development machine) and checks the whole table."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from prefixstore.adapters import hf_walk  # noqa: E402
from prefixstore.adapters.hf_tiny import causal_lm_types  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "models.md"
PAGE = ROOT / "docs" / "transformers.md"
ROW = re.compile(r"^\| `([^`]+)` \| ([^|]*) \| ([^|]+) \| ([^|]*) \|", re.M)
FULL = os.environ.get("PREFIXSTORE_HF_WALK") == "full"
SUBSET = (
    "llama", "mistral", "gemma2", "gpt_oss", "llama4", "cohere2",  # full, sliding, chunked
    "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "deepseek_v4",  # MLA, DSA, compressed
    "falcon", "gpt_bigcode", "dbrx", "bart", "gpt_neox_japanese",  # MQA, fused QKV, decoders
    "qwen3_next", "kimi_linear", "bailing_hybrid", "minimax", "zaya",  # linear attention
    "zamba2", "nemotron_h", "lfm2", "jamba", "mamba", "mamba2", "bamba", "granitemoehybrid",
    "moshi",  # exact against its own cache only
    "bert", "rwkv", "xlstm", "recurrent_gemma", "dory", "cpmant",  # refused
    "musicgen",  # not built
)  # fmt: skip
MUST_BE_EXACT = {
    "deepseek_v4": "1, 2, 4", "deepseek_v32": "1, 2, 4", "glm_moe_dsa": "1, 2, 4",
    "deepseek_v3": "1, 2, 4", "kimi_linear": "1, 2, 4", "llama": "1, 2", "mistral": "1, 2",
    "gemma2": "1, 2", "gpt_oss": "1, 2", "llama4": "1, 2", "falcon": "1, 2", "dbrx": "1, 2",
    "qwen3_next": "1, 2", "minimax": "1, 2", "zaya": "1, 2", "bailing_hybrid": "1, 2",
    "zamba2": "1, 2", "nemotron_h": "1, 2", "lfm2": "1, 2", "jamba": "1, 2", "mamba": "1, 2",
    "mamba2": "1, 2", "gpt_neox_japanese": "1, 2",
}  # fmt: skip


def _docs_rows() -> dict[str, tuple[str, str, str]]:
    text = DOCS.read_text()
    table = text.split(hf_walk.BEGIN, 1)[1].split(hf_walk.END, 1)[0]
    return {m: (ranks.strip(), verdict.strip(), diff.strip()) for m, ranks, verdict, diff in ROW.findall(table)}


@pytest.mark.slow
def test_every_causal_lm_is_exact_or_refused_at_cache_map() -> None:
    verdicts = hf_walk.walk(causal_lm_types() if FULL else SUBSET)
    bad = [f"{v.model_type}: {v.result} {v.detail}" for v in verdicts if v.result not in hf_walk.OK]
    assert not bad, "\n".join(bad)
    results = {v.model_type: (", ".join(map(str, v.ranks)), v.result) for v in verdicts}
    for model_type, ranks in MUST_BE_EXACT.items():  # really exercised, not refused or not built
        assert results[model_type] == (ranks, "exact"), (model_type, results[model_type])
    # docs/models.md lists this walk's verdict and ranks for each type walked
    listed = _docs_rows()
    assert {m: listed[m][:2] for m in results} == results


def test_the_docs_table_covers_every_type_and_no_row_failed() -> None:
    listed = _docs_rows()
    assert sorted(listed) == causal_lm_types()
    assert not [m for m, (_, verdict, _) in listed.items() if verdict not in hf_walk.OK]
    for m, (_, verdict, diff) in listed.items():  # an exact row says by how much
        assert (verdict.startswith("exact")) == bool(diff), m
        assert not diff or float(diff) < hf_walk.TOL, m
    # the transformers page links the table and repeats its summary
    summary = re.search(r"\*\*(\d+ model types: [^*]+)\.\*\*", DOCS.read_text())
    assert summary is not None
    page = PAGE.read_text()
    assert "(models.md)" in page and summary.group(1) in page
