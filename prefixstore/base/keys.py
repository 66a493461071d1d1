"""Chained block hashes.

A request is a sequence of per-block *digests* ``d_i`` (a hash of block i's tokens, or a
trace's block id). Its keys are the chain ``h_i = H(h_{i-1} || d_i)`` with ``h_0 = ROOT``,
so equal keys mean equal prefixes. A node's key is ``h_end``; the catalog keeps the
digests of the node's own blocks so the chain can be re-verified (invariant 2).
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Iterable, Sequence

import torch

from prefixstore.base.errors import InvalidArgumentError, InvalidInputError

DIGEST_SIZE = 16
ROOT = bytes(DIGEST_SIZE)


def chain(prev: bytes, digest: bytes) -> bytes:
    """The key of a block given the key before it and the block's digest."""
    return hashlib.blake2b(prev + digest, digest_size=DIGEST_SIZE).digest()


def chain_all(prev: bytes, digests: Iterable[bytes]) -> list[bytes]:
    """Keys of consecutive blocks after ``prev`` (``chain`` inlined: a prefix's keys
    are hashed on every request)."""
    out = []
    blake2b = hashlib.blake2b
    for d in digests:
        prev = blake2b(prev + d, digest_size=DIGEST_SIZE).digest()
        out.append(prev)
    return out


class Prefix:
    """A prefix as a sequence of block digests, with its chained keys.

    ``block_tokens``: the tokens per block its digests were computed over. An engine
    refuses a Prefix whose block size differs from its layout's. None (a trace's
    block ids, or digests from elsewhere) means the blocks are taken to be the
    engine's own.
    """

    __slots__ = ("block_tokens", "digests", "keys")

    def __init__(self, digests: Sequence[bytes], block_tokens: int | None = None) -> None:
        self.digests: tuple[bytes, ...] = tuple(bytes(d) for d in digests)
        for d in self.digests:
            if len(d) != DIGEST_SIZE:
                raise InvalidInputError(f"block digests must be {DIGEST_SIZE} bytes, got {len(d)}")
        self.block_tokens: int | None = _block_size(block_tokens)
        self.keys: tuple[bytes, ...] = tuple(chain_all(ROOT, self.digests))

    @classmethod
    def from_tokens(cls, tokens: Sequence[int] | torch.Tensor, block_tokens: int) -> Prefix:
        """Digests of every *full* block of ``tokens`` (a trailing partial block is dropped)."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.reshape(-1).tolist()
        tokens = [int(t) for t in tokens]
        block_tokens = _block_size(block_tokens)
        if block_tokens is None:
            raise InvalidArgumentError("block_tokens", "from_tokens needs the block size")
        full = len(tokens) // block_tokens
        digests = []
        for b in range(full):
            block = tokens[b * block_tokens : (b + 1) * block_tokens]
            raw = b"".join(t.to_bytes(8, "little", signed=True) for t in block)
            digests.append(hashlib.blake2b(raw, digest_size=DIGEST_SIZE).digest())
        return cls(digests, block_tokens)

    @classmethod
    def from_ids(cls, ids: Iterable[int], block_tokens: int | None = None) -> Prefix:
        """Digests from a trace's per-block ids (Mooncake ``hash_ids``); ``block_tokens``
        is the trace's block size when it is known (None: the engine's)."""
        return cls([int(i).to_bytes(DIGEST_SIZE, "little", signed=True) for i in ids], block_tokens)

    def __len__(self) -> int:
        return len(self.digests)

    def __getitem__(self, item: slice) -> Prefix:
        if not isinstance(item, slice) or item.start not in (None, 0) or item.step not in (None, 1):
            raise InvalidInputError("a Prefix can only be cut to a leading prefix: p[:n]")
        # a leading cut keeps its keys: the chain up to block n does not depend on what follows
        cut = Prefix.__new__(Prefix)
        cut.digests, cut.keys, cut.block_tokens = self.digests[item], self.keys[item], self.block_tokens
        return cut

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Prefix) and other.digests == self.digests
                and other.block_tokens == self.block_tokens)

    def __hash__(self) -> int:
        return hash(self.keys[-1] if self.keys else ROOT)

    def __repr__(self) -> str:
        tail = self.keys[-1].hex()[:12] if self.keys else "root"
        return f"Prefix(blocks={len(self)}, block_tokens={self.block_tokens}, key={tail})"


def _block_size(value: object) -> int | None:
    """``value`` as a block size (a positive int) or None."""
    if value is None:
        return None
    try:
        size = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        size = None
    if size is None or size <= 0:
        raise InvalidArgumentError("block_tokens", f"must be a positive int, got {value!r}")
    return size
