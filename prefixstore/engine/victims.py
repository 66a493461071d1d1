"""The victims one space-making pass has chosen and not yet evicted.

A pass takes its victims from the policy's heap one at a time, but evicts them
together: one evict transaction (one commit of their removal, one of their reclaim)
for up to ``Batch.limit`` nodes; a victim with more nodes than the batch has room for
(a subtree) is batched in parts, leaves first (``space.add_victim``). Until that
transaction runs, the heap is asked about the tree as it will be (``Batch.lookup``): a
chosen node is gone, and a node whose children are all chosen is a leaf (``AsLeaf``),
offered to the heap as soon as its last child is chosen, so the order of victims is
the one a victim-at-a-time pass takes. The batch itself changes nothing but the heap's
entries.
"""

from __future__ import annotations

import attrs

from prefixstore.engine.index import Index, Node


@attrs.frozen(slots=True, eq=False)
class AsLeaf:
    """``node`` as the victim heap sees it once its children (all chosen) are gone."""

    node: Node

    @property
    def id(self) -> int:
        return self.node.id

    @property
    def key(self) -> bytes:
        return self.node.key

    @property
    def state(self) -> str:
        return self.node.state

    @property
    def has_snapshot(self) -> bool:
        return self.node.has_snapshot

    @property
    def last_used(self) -> int:
        return self.node.last_used

    @property
    def snap_used(self) -> int:
        return self.node.snap_used

    @property
    def nbytes(self) -> int:
        return self.node.nbytes

    @property
    def is_leaf(self) -> bool:
        return True


@attrs.define(slots=True, eq=False)
class Batch:
    """Chosen victims, each ``(action, nodes, last)`` with its nodes leaves first, in
    the order chosen (so every node comes after its chosen descendants); ``last`` is
    False for a part of a victim whose other nodes come in a later part."""

    index: Index
    limit: int
    """The most nodes one evict transaction takes."""
    victims: list[tuple[str, list[Node], bool]] = attrs.field(factory=list)
    chosen: dict[int, Node] = attrs.field(factory=dict)
    leafed: dict[int, AsLeaf] = attrs.field(factory=dict)
    """Nodes not chosen whose children all are."""
    unchosen: dict[int, int] = attrs.field(factory=dict)
    """How many children of a chosen node's parent are not chosen."""
    nbytes: int = 0
    """What the chosen nodes charge (all ranks)."""

    def __len__(self) -> int:
        return len(self.chosen)

    @property
    def full(self) -> bool:
        return len(self.chosen) >= self.limit

    def lookup(self, nid: int) -> Node | AsLeaf | None:
        """Node ``nid`` as the tree will be once the batch is evicted (None: gone)."""
        if nid in self.chosen:
            return None
        return self.leafed.get(nid) or self.index.get(nid)

    def children(self, node: Node) -> list[Node]:
        """``node``'s children that are not chosen."""
        return [self.index.nodes[c] for c in node.children if c not in self.chosen]

    @property
    def room(self) -> int:
        """How many more nodes the batch takes."""
        return max(0, self.limit - len(self.chosen))

    def add(self, action: str, nodes: list[Node], last: bool = True) -> list[AsLeaf]:
        """Choose ``nodes`` (leaves first) as one victim of ``action`` (its last part,
        unless ``last`` is False); the parents they leave without a child, to offer to
        the heap."""
        self.victims.append((action, nodes, last))
        for n in nodes:
            self.chosen[n.id] = n
            self.leafed.pop(n.id, None)
            self.nbytes += n.nbytes
        out = []
        for n in nodes:
            pid = n.parent
            if pid is None or pid in self.chosen or (parent := self.index.get(pid)) is None:
                continue
            left = self.unchosen.get(pid, len(parent.children)) - 1
            self.unchosen[pid] = left
            if not left:
                self.leafed[pid] = leaf = AsLeaf(parent)
                out.append(leaf)
        return out

    def take(self) -> tuple[list[tuple[str, list[Node], bool]], set[int]]:
        """The victims and the parents offered as leaves meanwhile; the batch is empty after."""
        victims, leafed = self.victims, set(self.leafed)
        self.victims, self.chosen, self.leafed, self.unchosen, self.nbytes = [], {}, {}, {}, 0
        return victims, leafed
