"""A multi-turn chat over the prefix cache, with a tiny random model (Llama-style by default).

Each turn's prompt is the whole conversation so far plus the new user message. The
deepest stored checkpoint of the prompt is restored, only the tokens after it are
prefilled, a reply is decoded greedily, and checkpoints are stored at block boundaries
(after the prompt, and after the reply). Tokens are bytes (vocab 256); the weights are
random (``torch.manual_seed``), so the replies are noise, but the bookkeeping is real.

    python examples/chat.py                      # temp dir, 6 turns, 1 rank
    python examples/chat.py --ranks 2 --dir /tmp/chat-cache   # run twice: turn 0 restores
    python examples/chat.py --model zamba2       # a hybrid (Mamba2 + attention)
    python examples/chat.py --model gemma2       # sliding-window + global layers

``--model`` takes any ``model_type`` of the installed transformers, built tiny from its
default config (``prefixstore.adapters.hf_tiny``; sliding windows of 24 tokens).

Needs the ``transformers`` extra: ``pip install 'prefixstore[transformers]'``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from contextlib import ExitStack

import torch

try:
    from transformers import LlamaConfig, LlamaForCausalLM

    from prefixstore.adapters.hf import HFPrefixCache, greedy
    from prefixstore.adapters.hf_tiny import tiny_model
except ImportError:
    sys.exit("examples/chat.py needs transformers: pip install 'prefixstore[transformers]'")

MESSAGES = [
    "Hello! Can you help me plan a trip?",
    "I want to see mountains and lakes.",
    "What about two weeks in early autumn?",
    "Which towns would you stay in?",
    "And how should I travel between them?",
    "Thanks, please summarise the plan.",
]


def build_model(seed: int, model_type: str = "llama") -> torch.nn.Module:
    """A 2-layer random model over bytes (``model_type`` other than llama: hf_tiny)."""
    if model_type != "llama":
        return tiny_model(model_type, seed=seed, vocab_size=256)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config).eval()


def describe(pc: HFPrefixCache) -> str:
    """What the checkpoints hold, e.g. '1 sliding(24), 1 full, 2 recurrent states'."""
    sliding = [a.window for a in pc.cmap.attention if a.window]
    parts = [f"{len(sliding)} sliding({sliding[0]})"] if sliding else []
    parts.append(f"{len(pc.cmap.attention) - len(sliding)} full")
    if pc.cmap.compressed:
        parts.append(f"{len(pc.cmap.compressed)} compressed")
    if pc.cmap.states:
        parts.append(f"{len(pc.cmap.states)} recurrent states")
    return ", ".join(parts)


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="cache directory (default: a temporary one)")
    ap.add_argument("--turns", type=int, default=len(MESSAGES))
    ap.add_argument("--ranks", type=int, default=1, choices=[1, 2])
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--reply-tokens", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="llama", help="transformers model_type (default llama)")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)  # a model this small runs fastest on one thread
    model = build_model(args.seed, args.model)
    with ExitStack() as stack:
        path = args.dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="chat-"))
        pc = stack.enter_context(
            HFPrefixCache.open(
                path,
                model,  # the model: its weights' fingerprint is part of the cache's identity
                capacity_bytes=256 << 20,
                block_tokens=args.block_tokens,
                ranks=args.ranks,
            )
        )
        print(
            f"cache: {path} (model={args.model}, ranks={args.ranks}, "
            f"block_tokens={args.block_tokens}, layers: {describe(pc)})"
        )
        history: list[int] = []
        total_restored = total_prefilled = 0
        for turn in range(args.turns):
            msg = MESSAGES[turn % len(MESSAGES)]
            prompt = history + encode(f"User: {msg}\nAssistant:")
            t0 = time.perf_counter()
            resumed = pc.resume(prompt)
            # prefill the rest, storing a checkpoint at the prompt's last block boundary
            cache, logits = pc.prefill(model, prompt, resumed)
            reply = greedy(model, cache, logits, args.reply_tokens)
            consumed = prompt + reply[:-1]  # the last reply token was not fed yet
            # a recurrent state exists only where the cache stands: models with one store
            # after the reply only when it ends on a block boundary (the next turn's
            # prefill stores at its prompt's last boundary anyway)
            aligned = len(consumed) % args.block_tokens == 0
            stored = pc.store(cache, consumed) if aligned or not pc.cmap.has_snapshot else None
            ms = (time.perf_counter() - t0) * 1e3
            prefilled = len(prompt) - resumed.tokens
            total_restored += resumed.tokens
            total_prefilled += prefilled
            end = len(consumed) if stored or not pc.cmap.has_snapshot else len(prompt)
            depth = end // args.block_tokens * args.block_tokens
            print(
                f"turn {turn}: prompt {len(prompt):4d} tokens | restored {resumed.tokens:4d}"
                f" | prefilled {prefilled:4d} | stored up to {depth:4d}"
                f" ({stored.status if stored else 'at the prompt'}) | {ms:6.1f} ms"
            )
            history = prompt + reply + encode("\n")
        print(f"total: restored {total_restored} tokens, prefilled {total_prefilled} tokens")


if __name__ == "__main__":
    main()
