"""Where each stored SGLang page sits in its pool engine's chains.

An engine addresses a checkpoint by its chain of block digests from the sequence start.
SGLang passes the pages before a call's keys (``prefix_keys``) only when the
extra_config key ``hicache_storage_pass_prefix_keys`` is true; without them, and for a
run whose prefix is not stored, the backend stores the call's pages as a chain of their
own. ``PageChains`` remembers, for every stored page digest, the digest before it on the
chain it was stored on, so a later call finds a page from its hash alone, with or
without prefix keys. SGLang's page hashes are chained (a page's hash covers every token
before it), so one hash names one page of one sequence wherever it is stored.

The map is built from the catalog's nodes when the pool opens (``read_listing``: the
catalog is the truth) and learns every store. Entries of evicted pages stay until the
next rebuild (they read as misses); a rebuild runs when the map has grown past twice
its size at the last one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from prefixstore.base.keys import DIGEST_SIZE
from prefixstore.engine.catalog_reader import read_listing

REBUILD_MIN = 1 << 16
"""The map is rebuilt from the catalog no sooner than at this many entries."""
_UNKNOWN = b""


class PageChains:
    """Page digest -> the digest before it on its stored chain (None at a chain's start)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.before: dict[bytes, bytes | None] = {}
        self.rebuild_at = REBUILD_MIN
        self.lock = threading.Lock()
        self.rebuild()

    def __len__(self) -> int:
        return len(self.before)

    def rebuild(self) -> None:
        """Every block of every node in the catalog, linked to the block before it."""
        with self.lock:
            rows = read_listing(self.root, ("nodes",)).tables[0].rows
            by_id = {r["id"]: r for r in rows}
            before: dict[bytes, bytes | None] = {}
            for r in rows:
                parent = by_id.get(r["parent"])
                prev = bytes(parent["digests"])[-DIGEST_SIZE:] if parent is not None else None
                digests = bytes(r["digests"])
                for i in range(0, len(digests), DIGEST_SIZE):
                    cur = digests[i : i + DIGEST_SIZE]
                    before[cur] = prev or None
                    prev = cur
            self.before = before
            self.rebuild_at = max(REBUILD_MIN, 2 * len(before))

    def learn(self, chain: Sequence[bytes], start: int) -> None:
        """Blocks ``start..`` of ``chain`` (a chain from its start) are stored."""
        with self.lock:
            for i in range(start, len(chain)):
                self.before[chain[i]] = chain[i - 1] if i else None
            grown = len(self.before) > self.rebuild_at
        if grown:
            self.rebuild()

    def chain_to(self, digest: bytes) -> list[bytes] | None:
        """The stored chain from its start through ``digest``; None when ``digest`` is
        not stored (or its chain is broken)."""
        before = self.before
        prev = before.get(digest, _UNKNOWN)
        if prev == _UNKNOWN:
            return None
        out, seen = [digest], {digest}
        while prev is not None:
            if prev in seen:
                return None
            out.append(prev)
            seen.add(prev)
            prev = before.get(prev, _UNKNOWN)
            if prev == _UNKNOWN:
                return None
        out.reverse()
        return out

    def continues(self, digest: bytes, prev: bytes) -> bool:
        """Whether ``digest`` is stored right after ``prev`` on one chain."""
        return self.before.get(digest, _UNKNOWN) == prev
