"""The in-memory index of the catalog: nodes by id and key, and every stored block.

Because ancestry is whole, if block ``p`` of a prefix is stored then so are blocks
``1..p``: the deepest stored block of a prefix is found by binary search over its
chained keys (O(log n) dict probes).
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from prefixstore.base.keys import DIGEST_SIZE, ROOT, chain_all


@attrs.define(eq=False)
class Node:
    """A catalog row, as the engine keeps it in memory."""

    id: int
    key: bytes
    parent: int | None
    start: int  # block position of the parent's end
    end: int  # block position of this checkpoint
    digests: bytes
    has_snapshot: bool
    state: str  # 'ready' | 'damaged'
    generation: int
    last_used: int
    snap_used: int
    nbytes: int = 0  # charged bytes of its live files, all ranks
    children: set[int] = attrs.field(factory=set)
    # (generation, {rank: (name, size, checksum)}): its live file rows, read once per
    # generation (a generation's live files never change: every rewrite is a new one)
    files: tuple[int, dict[int, tuple[str, int, str]]] | None = attrs.field(default=None, repr=False)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def blocks(self) -> int:
        return self.end - self.start

    def block_keys(self, parent_key: bytes) -> list[bytes]:
        d = self.digests
        return chain_all(parent_key, [d[i : i + DIGEST_SIZE] for i in range(0, len(d), DIGEST_SIZE)])


@attrs.define(slots=True, eq=False, repr=False)
class Index:
    """Nodes by id and by key, and block key -> owning node id. Changed and read under
    the engine lock (``CallGuard.lock``)."""

    nodes: dict[int, Node] = attrs.field(factory=dict)
    by_key: dict[bytes, int] = attrs.field(factory=dict)
    blocks: dict[bytes, int] = attrs.field(factory=dict)

    def clear(self) -> None:
        """Forget every node (new tables: a caller holding the old ``nodes`` keeps them)."""
        self.nodes, self.by_key, self.blocks = {}, {}, {}

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    def get(self, node_id: int) -> Node | None:
        return self.nodes.get(node_id)

    def parent_key(self, node: Node) -> bytes:
        return ROOT if node.parent is None else self.nodes[node.parent].key

    def add(self, node: Node) -> None:
        self.nodes[node.id] = node
        self.by_key[node.key] = node.id
        for k in node.block_keys(self.parent_key(node)):
            self.blocks[k] = node.id
        if node.parent is not None:
            self.nodes[node.parent].children.add(node.id)

    def remove(self, node_id: int) -> Node:
        node = self.nodes.pop(node_id)
        assert not node.children, f"removing node {node_id} that still has children"
        del self.by_key[node.key]
        for k in node.block_keys(self.parent_key_of_removed(node)):
            if self.blocks.get(k) == node_id:
                del self.blocks[k]
        if node.parent is not None and node.parent in self.nodes:
            self.nodes[node.parent].children.discard(node_id)
        return node

    def parent_key_of_removed(self, node: Node) -> bytes:
        if node.parent is None:
            return ROOT
        parent = self.nodes.get(node.parent)
        return parent.key if parent else ROOT

    def deepest_block(self, keys: tuple[bytes, ...], limit: int | None = None) -> int:
        """The largest p <= limit such that block p of the prefix is stored (0 if none)."""
        hi = len(keys) if limit is None else min(limit, len(keys))
        lo = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] in self.blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def deepest_owner(self, keys: tuple[bytes, ...], limit: int) -> tuple[int, Node | None]:
        """``deepest_block(keys, limit)`` and the node whose span holds that block (None
        at 0): the search's last hit is that block, so its owner costs no second probe."""
        blocks = self.blocks
        hi = limit if limit < len(keys) else len(keys)
        lo = 0
        nid = None
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            got = blocks.get(keys[mid - 1])
            if got is None:
                hi = mid - 1
            else:
                lo, nid = mid, got
        return lo, None if nid is None else self.nodes.get(nid)

    def owner(self, keys: tuple[bytes, ...], p: int) -> Node | None:
        """The node whose span holds block p (1-based) of the prefix."""
        if p <= 0:
            return None
        nid = self.blocks.get(keys[p - 1])
        return self.nodes.get(nid) if nid is not None else None

    def path(self, node: Node) -> list[Node]:
        """Root-first list of ``node``'s ancestors and ``node`` itself."""
        out = [node]
        while out[-1].parent is not None:
            out.append(self.nodes[out[-1].parent])
        out.reverse()
        return out
