"""Walk every causal-LM architecture of the installed transformers through the adapter.

For each ``model_type`` a tiny random-init model is built (:mod:`hf_tiny`) and one of:

* ``exact`` -- restore through the engine (2 checkpoints, close and reopen) + prefill of
  the rest gives the full prefill's next-token logits (max abs diff < 1e-5) and the same
  greedy continuation, on 1 and 2 ranks; a request diverging inside the stored prefix
  resumes from the checkpoint before the divergence;
* ``exact (own cache)`` -- as above, but compared with the model's own cache continuation,
  which already differs from a full prefill;
* ``refused`` -- :func:`hf.cache_map` raised a typed error (the reason is kept);
* ``not built`` -- the tiny config does not build or run a plain forward on the CPU
  (nothing to do with the adapter);
* ``FAILED`` -- anything else: a late error or a wrong result (the test fails on it).

    python -m prefixstore.adapters.hf_walk            # prints the README table
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from collections.abc import Iterable

import attrs
import torch

from prefixstore.adapters import hf
from prefixstore.adapters.hf_tiny import causal_lm_types, tiny_config
from prefixstore.base.errors import PrefixStoreError

BT = 16
PROMPT = 64
CHECKPOINTS = (16, 32)
STEPS = 32
TOL = 1e-5
MAX_PARAMS = 20_000_000  # a config the generic shrink did not make tiny is not built


@attrs.frozen
class Verdict:
    model_type: str
    result: str
    detail: str = ""
    seconds: float = 0.0


def _build(model_type: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if params > MAX_PARAMS:
        raise ValueError(f"{params} parameters: not tiny")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@attrs.frozen
class Reference:
    """A full prefill's last logits and greedy continuation, and the same fed in the
    checkpoints' chunks through the model's own cache."""

    full: torch.Tensor
    full_cont: list[int]
    own: torch.Tensor
    own_cont: list[int]

    @classmethod
    def of(cls, model: torch.nn.Module, ids: list[int], stepwise: bool) -> Reference:
        cache, full = hf.feed(model, ids)
        full_cont = hf.greedy(model, cache, full, STEPS)
        cache, pos = None, 0  # the same chunks the checkpoints are stored after
        for end in (*CHECKPOINTS, len(ids)):
            cache, own = hf.feed(model, ids[pos:end], cache, stepwise=stepwise)
            pos = end
        return cls(full, full_cont, own, hf.greedy(model, cache, own, STEPS))


def check(model: torch.nn.Module, ranks: int, ids: list[int], ref: Reference) -> str:
    """Store, reopen, resume and continue; '' when exact, else what differed.

    Returns ``"own"`` when it matched the model's own cache continuation only."""
    cmap = hf.cache_map(model.config, block_tokens=BT, ranks=ranks)
    with tempfile.TemporaryDirectory(prefix="hf-walk-") as root:
        with hf.HFPrefixCache.open(
            root, model.config, capacity_bytes=64 << 20, block_tokens=BT, ranks=ranks
        ) as pc:
            cache, pos = None, 0
            for end in CHECKPOINTS:
                cache, _ = hf.feed(model, ids[pos:end], cache, stepwise=cmap.stepwise)
                pos = end
                pc.store(cache, ids[:end])
        with hf.HFPrefixCache.open(
            root, model.config, capacity_bytes=64 << 20, block_tokens=BT, ranks=ranks
        ) as pc:
            r = pc.resume(ids)
            if r.tokens != CHECKPOINTS[-1]:
                return f"resumed {r.tokens} tokens, expected {CHECKPOINTS[-1]}"
            cache, logits = hf.feed(model, ids[r.tokens :], r.cache, stepwise=cmap.stepwise)
            cont = hf.greedy(model, cache, logits, STEPS)
            vocab = model.config.get_text_config(decoder=True).vocab_size
            other = ids[:20] + [(t + 1) % vocab for t in ids[20:]]
            if (got := pc.resume(other).tokens) != CHECKPOINTS[0]:
                return f"a request diverging at token 20 resumed {got} tokens"
    if _diff(logits, ref.full) < TOL and cont == ref.full_cont:
        return ""
    if _diff(logits, ref.own) < TOL and cont == ref.own_cont:
        return "own"
    full, own = _diff(logits, ref.full), _diff(logits, ref.own)
    return f"logits differ by {full:.2e} (own cache: {own:.2e})"


def walk_one(model_type: str) -> Verdict:
    t0 = time.perf_counter()

    def done(result: str, detail: str = "") -> Verdict:
        return Verdict(model_type, result, detail, time.perf_counter() - t0)

    try:
        model = _build(model_type)
        vocab = int(model.config.get_text_config(decoder=True).vocab_size)
        ids = torch.randint(0, vocab, (PROMPT,), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            model(input_ids=ids[None, :BT])
    except Exception as exc:
        return done("not built", f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    try:
        stepwise = any(hf.cache_map(model.config, ranks=r).stepwise for r in (1, 2))
    except PrefixStoreError as exc:
        return done("refused", f"{type(exc).__name__}: {str(exc)[:160]}")
    except Exception as exc:
        return done("FAILED", f"cache_map raised {type(exc).__name__}: {exc}")
    own = False
    ref: Reference | None = None
    for ranks in (1, 2):
        try:
            ref = ref or Reference.of(model, ids.tolist(), stepwise)
            why = check(model, ranks, ids.tolist(), ref)
        except Exception as exc:
            return done("FAILED", f"{ranks} ranks: {type(exc).__name__}: {str(exc)[:200]}")
        if why == "own":
            own = True
        elif why:
            return done("FAILED", f"{ranks} ranks: {why}")
    return done("exact (own cache)" if own else "exact")


def walk(model_types: Iterable[str] | None = None) -> list[Verdict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return [walk_one(t) for t in (model_types or causal_lm_types())]
    finally:
        torch.set_num_threads(threads)


def markdown(verdicts: Iterable[Verdict]) -> str:
    rows = ["| model_type | result | detail |", "|---|---|---|"]
    for v in verdicts:
        detail = v.detail.replace("|", "/").replace("\n", " ")
        rows.append(f"| `{v.model_type}` | {v.result} | {detail} |")
    return "\n".join(rows)


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    print(markdown(walk(sys.argv[1:] or None)))
