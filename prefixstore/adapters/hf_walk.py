"""Walk every causal-LM architecture of the installed transformers through the adapter.

For each ``model_type`` a tiny random-init model is built (``hf_tiny``, sliding
windows and attention chunks of 12 tokens: shorter than a 16-token block) and, on 1 and
2 ranks (also 4 for DeepSeek V3, V3.2, V4, GLM-MoE-DSA, AXK2, HY-V4 and Kimi Linear),
through the engine:

1. a request that is not block-aligned (40 tokens) is prefilled: a checkpoint at 32;
2. after a close and reopen, a 72-token request resumes from 32; its next 32 tokens are
   fed from the restored cache and stored as a checkpoint at 64 (written from a restored
   cache), then the last 8 are fed and 8 tokens are decoded greedily;
3. a block-aligned request (64 tokens) goes through ``prefill(ids, resume(ids))``;
4. a request diverging at token 40, inside block 3, resumes from 32 (a partial hit)
   and is fed to its end.

Every position after a restore point is compared with a full prefill's logits. The
verdict is one of:

* ``exact`` -- every logit within 1e-5 of the full prefill's, the same greedy tokens;
* ``exact (own cache)`` -- as above against the model's own cache fed the same chunks,
  which already differs from a full prefill;
* ``refused`` -- ``cache_map`` raised a typed error before any forward pass (the reason
  is kept);
* ``not built`` -- the tiny config does not build or run a plain forward on the CPU
  (the reason is kept: nothing to do with the adapter);
* ``FAILED`` -- anything else: a late error or a wrong result (the test fails on it).

    python -m prefixstore.adapters.hf_walk                  # every type: the docs table
    python -m prefixstore.adapters.hf_walk llama mamba      # some types
    python -m prefixstore.adapters.hf_walk --write docs/models.md
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Sequence

import attrs
import torch

from prefixstore.adapters import hf
from prefixstore.adapters.hf_tiny import causal_lm_types, tiny_config
from prefixstore.base.errors import PrefixStoreError

BT = 16
WINDOW = 12  # sliding windows and attention chunks: shorter than a block
PROMPT = 72
FIRST = 40  # the first request: not block-aligned, stores at 32
STORED = (32, 64)
DIVERGE = 40
STEPS = 8
TOL = 1e-5
MAX_PARAMS = 100_000_000  # a config the generic shrink did not make tiny is not built
# (a multimodal model's vision tower is built too, though no image goes through it)
FOUR_RANKS = frozenset({
    "deepseek_v4", "deepseek_v32", "glm_moe_dsa", "axk2", "hy_v4", "deepseek_v3", "kimi_linear",
})
EXACT, OWN, REFUSED, NOT_BUILT, FAILED = "exact", "exact (own cache)", "refused", "not built", "FAILED"
OK = frozenset({EXACT, OWN, REFUSED, NOT_BUILT})


@attrs.frozen
class Verdict:
    model_type: str
    result: str
    detail: str = ""
    ranks: tuple[int, ...] = ()
    max_diff: float | None = None
    seconds: float = 0.0


class Wrong(Exception):
    """A restore that did not continue like the reference (the walk's FAILED)."""


def build(model_type: str) -> torch.nn.Module:
    """The walk's tiny model of ``model_type`` (ValueError when it is not tiny)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, window=WINDOW)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if params > MAX_PARAMS:
        raise ValueError(f"{params} parameters: not tiny")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@torch.no_grad()
def run(model: torch.nn.Module, ids: Sequence[int], cache: object | None, stepwise: bool) -> tuple[object, torch.Tensor]:
    """Feed ``ids`` after ``cache``: the cache and the logits of every position ``(n, vocab)``."""
    device = next(model.parameters()).device
    x = torch.as_tensor(list(ids), device=device)[None]
    chunks = x.split(1, dim=1) if stepwise and cache is not None else (x,)
    if cache is None:
        cache = hf.new_cache(model.config)
    logits = []
    for chunk in chunks:
        out = model(input_ids=chunk, cache=cache, use_cache=True)
        cache = out.cache
        logits.append(out.logits[0])
    return cache, torch.cat(logits)


def _greedy(model: torch.nn.Module, cache: object, last: torch.Tensor, stepwise: bool) -> list[int]:
    out = []
    for _ in range(STEPS):
        out.append(int(torch.argmax(last)))
        cache, logits = run(model, out[-1:], cache, stepwise)
        last = logits[-1]
    return out


@attrs.frozen
class Reference:
    """What a restore must reproduce: a full prefill's logits (and greedy tokens after
    it), and the same from the model's own cache fed in the walk's chunks."""

    full: torch.Tensor
    full_greedy: list[int]
    own: torch.Tensor
    own_greedy: list[int]
    other_full: torch.Tensor
    other_own: torch.Tensor
    aligned_own: torch.Tensor  # after chunks 0:32, 32:64 (what a recurrent model resumes)
    rewound_own: torch.Tensor  # after chunks 0:32, 32:63, 63:64 (an attention-only rewind)

    @classmethod
    def of(cls, model: torch.nn.Module, ids: list[int], other: list[int], stepwise: bool) -> Reference:
        cache, full = run(model, ids, None, False)
        full_greedy = _greedy(model, cache, full[-1], stepwise)
        cache, head = run(model, ids[: STORED[0]], None, False)
        cache, mid = run(model, ids[STORED[0] : STORED[1]], cache, stepwise)
        aligned_own = mid[-1]
        cache, tail = run(model, ids[STORED[1] :], cache, stepwise)
        own = torch.cat([head, mid, tail])
        own_greedy = _greedy(model, cache, own[-1], stepwise)
        _, other_full = run(model, other, None, False)
        cache, _ = run(model, other[: STORED[0]], None, False)
        _, other_tail = run(model, other[STORED[0] :], cache, stepwise)
        other_own = torch.cat([other_full[: STORED[0]], other_tail])
        cache, _ = run(model, ids[: STORED[0]], None, False)
        cache, _ = run(model, ids[STORED[0] : STORED[1] - 1], cache, stepwise)
        _, rewound = run(model, ids[STORED[1] - 1 : STORED[1]], cache, stepwise)
        return cls(full, full_greedy, own, own_greedy, other_full, other_own, aligned_own, rewound[-1])


@attrs.define
class Compare:
    """Logits compared so far with the full prefill and with the model's own cache."""

    ref: Reference
    full: float = 0.0
    own: float = 0.0
    greedy_full: bool = True
    greedy_own: bool = True

    def logits(self, got: torch.Tensor, full: torch.Tensor, own: torch.Tensor) -> None:
        self.full = max(self.full, (got - full).abs().max().item())
        self.own = max(self.own, (got - own).abs().max().item())

    def verdict(self) -> tuple[str, float]:
        if self.full < TOL and self.greedy_full:
            return EXACT, self.full
        if self.own < TOL and self.greedy_own:
            return OWN, self.own
        raise Wrong(f"logits differ by {self.full:.2e} (own cache: {self.own:.2e}), greedy "
                    f"{'same' if self.greedy_full else 'differs'}")


def _expect(what: str, got: int, want: int) -> None:
    if got != want:
        raise Wrong(f"{what} resumed {got} tokens, expected {want}")


def check(model: torch.nn.Module, ranks: int, ids: list[int], other: list[int], ref: Reference) -> Compare:
    """The four steps of the module docstring on ``ranks`` ranks."""
    cmap = hf.cache_map(model, block_tokens=BT, ranks=ranks)
    sw, cmp = cmap.stepwise, Compare(ref)
    opts = {"capacity_bytes": 64 << 20, "block_tokens": BT, "ranks": ranks}
    with tempfile.TemporaryDirectory(prefix="hf-walk-") as root:
        with hf.HFPrefixCache.open(root, model, **opts) as pc:
            pc.prefill(model, ids[:FIRST])
        with hf.HFPrefixCache.open(root, model, **opts) as pc:
            r = pc.resume(ids)
            _expect("the 72-token request", r.tokens, STORED[0])
            cache, mid = run(model, ids[STORED[0] : STORED[1]], r.cache, sw)
            if pc.store(cache, ids[: STORED[1]], tokens_from=STORED[0]).status != "stored":
                raise Wrong("the checkpoint at 64, from a restored cache, was not stored")
            cache, tail = run(model, ids[STORED[1] :], cache, sw)
            cmp.logits(torch.cat([mid, tail]), ref.full[STORED[0] :], ref.own[STORED[0] :])
            cont = _greedy(model, cache, tail[-1], sw)
            cmp.greedy_full, cmp.greedy_own = cont == ref.full_greedy, cont == ref.own_greedy
            aligned = ids[: STORED[1]]
            r = pc.resume(aligned)
            _expect("the block-aligned request", r.tokens, STORED[0] if cmap.has_snapshot else STORED[1] - 1)
            _, last = pc.prefill(model, aligned, r)
            own = ref.aligned_own if cmap.has_snapshot else ref.rewound_own
            cmp.logits(last[None], ref.full[STORED[1] - 1][None], own[None])
            r = pc.resume(other)
            _expect("the request diverging at token 40", r.tokens, STORED[0])
            _, got = run(model, other[STORED[0] :], r.cache, sw)
            cmp.logits(got, ref.other_full[STORED[0] :], ref.other_own[STORED[0] :])
    return cmp


def walk_one(model_type: str) -> Verdict:
    t0 = time.perf_counter()

    def done(result: str, detail: str = "", ranks: tuple[int, ...] = (), diff: float | None = None) -> Verdict:
        return Verdict(model_type, result, detail, ranks, diff, time.perf_counter() - t0)

    try:
        model = build(model_type)
    except Exception as exc:
        return done(NOT_BUILT, _reason(exc))
    ranks = (1, 2, 4) if model_type in FOUR_RANKS else (1, 2)
    try:  # before any forward: what the adapter cannot map is refused whatever runs
        stepwise = any(hf.cache_map(model, ranks=r).stepwise for r in ranks)
    except PrefixStoreError as exc:
        return done(REFUSED, f"{type(exc).__name__}: {exc}")
    except Exception as exc:
        return done(FAILED, f"cache_map raised {type(exc).__name__}: {exc}")
    try:
        vocab = int(model.config.get_text_config(decoder=True).vocab_size)
        ids = torch.randint(0, vocab, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
        with torch.no_grad():
            model(input_ids=torch.tensor([ids[:BT]]))
    except Exception as exc:
        return done(NOT_BUILT, _reason(exc))
    other = ids[:DIVERGE] + [(t + 1) % vocab for t in ids[DIVERGE:]]
    results, diff = [], 0.0
    try:
        ref = Reference.of(model, ids, other, stepwise)
    except Exception as exc:
        return done(NOT_BUILT, f"the model's own cache does not continue: {type(exc).__name__}: {exc}")
    for r in ranks:
        try:
            result, d = check(model, r, ids, other, ref).verdict()
        except Wrong as exc:
            return done(FAILED, f"{r} ranks: {exc}", ranks)
        except Exception as exc:
            return done(FAILED, f"{r} ranks: {type(exc).__name__}: {str(exc)[:300]}", ranks)
        results.append(result)
        diff = max(diff, d)
    return done(OWN if OWN in results else EXACT, "", ranks, diff)


def _reason(exc: Exception) -> str:
    text = str(exc).splitlines()[0][:160] if str(exc) else ""
    cause = exc.__cause__
    if cause is not None and str(cause):  # a strict config's validator says why in its cause
        text += f" ({str(cause).splitlines()[0][:120]})"
    return f"{type(exc).__name__}: {text}"


def walk(model_types: Iterable[str] | None = None) -> list[Verdict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return [walk_one(t) for t in (model_types or causal_lm_types())]
    finally:
        torch.set_num_threads(threads)


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def markdown(verdicts: Iterable[Verdict]) -> str:
    rows = ["| model_type | ranks | verdict | max difference | detail |", "|---|---|---|---|---|"]
    for v in verdicts:
        ranks = ", ".join(map(str, v.ranks))
        diff = "" if v.max_diff is None else f"{v.max_diff:.1e}"
        rows.append(f"| `{v.model_type}` | {ranks} | {v.result} | {diff} | {_cell(v.detail)} |")
    return "\n".join(rows)


BEGIN, END = "<!-- hf-walk:begin -->", "<!-- hf-walk:end -->"


def models_page(verdicts: Sequence[Verdict]) -> str:
    """``docs/models.md``: how the walk checks, its summary and its table."""
    import transformers

    how = __doc__.split("\n\n", 1)[1].split("\n    python -m", 1)[0].strip().replace("``", "`")
    return "\n".join([
        f"# Models: every causal LM of transformers {transformers.__version__}",
        "",
        "Generated by `python -m prefixstore.adapters.hf_walk --write docs/models.md`;",
        "`tests/test_hf_walk.py` checks it (a representative subset in CI, every type with",
        "`PREFIXSTORE_HF_WALK=full`).",
        "",
        how,
        "",
        f"**{summary(verdicts)}.** The maximum difference is the largest absolute logit",
        "difference over every compared position and rank count, against the reference the",
        "verdict names.",
        "",
        BEGIN,
        markdown(verdicts),
        END,
        "",
    ])


def summary(verdicts: Sequence[Verdict]) -> str:
    count = {k: sum(v.result == k for v in verdicts) for k in (EXACT, OWN, REFUSED, NOT_BUILT, FAILED)}
    return (f"{len(verdicts)} model types: {count[EXACT]} exact, {count[OWN]} exact against their own "
            f"cache, {count[REFUSED]} refused at cache_map, {count[NOT_BUILT]} not built, "
            f"{count[FAILED]} failed")


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    args = sys.argv[1:]
    target = None
    if args[:1] == ["--write"]:
        target, args = args[1], args[2:]
    verdicts = walk(args or None)
    if target is None:
        print(markdown(verdicts))
        print(summary(verdicts))
    else:
        with open(target, "w") as f:
            f.write(models_page(verdicts))
