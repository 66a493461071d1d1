"""The catalog's row states as tables: a node row and a file row.

Every status change of a catalog row is an event of these tables: the catalog's
row writes (``engine/catalog.py``, ``Catalog.file_event`` / ``node_event``) take the
event, move only rows in its ``sources(event)`` (their ``WHERE status IN (...)``)
to its ``target(event)`` (a row reaching ``removed`` is deleted, one leaving
``absent`` inserted), and refuse a selected row in any other state with
RowTransitionError naming the table, the row, its state and the event. Both tables
are ``targeted``: an event leads to one state from every state that takes it.
The in-memory index asks ``NODE.next(state, event)`` for a node's new state.

With ``PREFIXSTORE_DEBUG_INVARIANTS=1`` the journal driver asserts the invariants
below (``file_row_violations``, ``node_row_violations``) on every transition, over
the rows of the transaction and of the nodes it names or writes.

NODE (``nodes.state``; ``absent`` / ``removed``: no row)::

    absent --published--> ready --invalidated--> damaged
                          ready <--published---- damaged   (refill, compact-replace)
                          ready --published--> ready        (new generation in place)
               ready | damaged --removed--> removed         (evict, compact drops it)

    1. ready:   one ``live`` file row per rank, all of the node's generation.
    2. damaged: its file rows stay ``live`` (charged until refilled or evicted); some
                shards may be missing or altered on disk.

FILE (``files.status``; ``absent`` / ``removed``: no row)::

    absent --reserved--> writing --published--> live --retired--> garbage
                         writing --abandoned--> garbage --unlinked--> removed
                                                garbage --unlink_failed--> garbage (loose)

    1. writing: no node; owned by the transaction writing it (``txn`` set).
    2. live:    a node's shard (``node`` set); owned by no transaction.
    3. garbage: no node; owned by the transaction that will unlink it, or loose
                (``txn`` NULL: a failed unlink, reclaimed later).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from prefixstore.statemachine.machine import Machine, T

NODE = Machine(
    "node",
    initial="absent",
    finals={"removed"},
    targeted=True,
    edges=[
        T("absent", "published", "ready"),
        T("ready", "published", "ready"),
        T("ready", "invalidated", "damaged"),
        T("damaged", "published", "ready"),
        T("ready", "removed", "removed"),
        T("damaged", "removed", "removed"),
    ],
)

FILE = Machine(
    "file",
    initial="absent",
    finals={"removed"},
    targeted=True,
    edges=[
        T("absent", "reserved", "writing"),
        T("writing", "published", "live"),
        T("writing", "abandoned", "garbage"),
        T("live", "retired", "garbage"),
        T("garbage", "unlinked", "removed"),
        T("garbage", "unlink_failed", "garbage"),
    ],
)


@attrs.frozen
class FileRow:
    """One ``files`` row."""

    rank: int
    name: str
    node: int | None
    generation: int
    size: int
    checksum: str | None
    status: str
    txn: int | None

    @property
    def where(self) -> tuple[int, str]:
        return self.rank, self.name


@attrs.frozen
class NodeRow:
    """One ``nodes`` row (the columns the invariants read)."""

    id: int
    parent: int | None
    start: int
    end: int
    state: str
    generation: int
    has_snapshot: bool


def file_row_violations(f: FileRow) -> list[str]:
    """FILE invariants 1-3 for one row."""
    at = f"file rank{f.rank}/{f.name}"
    if f.status not in FILE.states - {"absent", "removed"}:
        return [f"{at}: unknown status {f.status!r}"]
    out = []
    if f.status == "writing" and (f.node is not None or f.txn is None):
        out.append(f"FILE 1: {at} is writing but node={f.node} txn={f.txn}")
    if f.status == "live" and (f.node is None or f.txn is not None):
        out.append(f"FILE 2: {at} is live but node={f.node} txn={f.txn}")
    if f.status == "garbage" and f.node is not None:
        out.append(f"FILE 3: {at} is garbage but still names node {f.node}")
    return out


def node_row_violations(n: NodeRow, files: Iterable[FileRow], ranks: int) -> list[str]:
    """NODE invariants 1-2 for one row; ``files``: the rows naming it."""
    mine = [f for f in files if f.node == n.id]
    out = []
    if n.state not in NODE.states - {"absent", "removed"}:
        return [f"node {n.id}: unknown state {n.state!r}"]
    if any(f.status != "live" for f in mine):
        out.append(f"NODE {1 if n.state == 'ready' else 2}: node {n.id} has non-live file rows")
    if n.state == "ready":
        if sorted(f.rank for f in mine) != list(range(ranks)):
            out.append(f"NODE 1: ready node {n.id} has file rows on ranks {sorted(f.rank for f in mine)}")
        if any(f.generation != n.generation for f in mine):
            out.append(f"NODE 1: ready node {n.id} has file rows of another generation")
    return out
