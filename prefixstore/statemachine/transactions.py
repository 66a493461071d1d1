"""The transactions of the engine: one table each, with its outputs and invariants.

Every mutation is a journaled transaction. The driver (``engine.driver``) commits the
state a transaction reaches to the catalog, then runs the outputs of that transition;
an output does its effects and fires the next event. Recovery resumes a transaction
from its table: forward from a *published* state, back otherwise.

STORE (a new generation of one node: store, refill)::

    begin -> INTENT --durable--> PUBLISHED --retired--> DONE
               |                     \\--retire_failed--> DONE   (old files stay as loose garbage)
               +--failed / recover--> ROLLING_BACK --cleaned--> ROLLED_BACK
                                            \\--cleanup_failed--> ROLLED_BACK (files stay as garbage)

COMPACT (compact-replace: a chain of rows replaced by one covering the same span;
merge, split, republish, snapshot retirement, row refill): STORE's table plus one
edge, ``INTENT --stale--> ROLLING_BACK`` (the old rows changed, or stayed pinned,
while the new files were written).

    transition                        outputs (after its commit)  recovery  abort
    INTENT --durable--> PUBLISHED     retire_old                  -         -
    INTENT --failed--> ROLLING_BACK   clean_up                    -         yes
    INTENT --stale--> ROLLING_BACK    clean_up (COMPACT only)     -         -
    INTENT --recover--> ROLLING_BACK  clean_up                    yes       -
    PUBLISHED --retired--> DONE       -                           yes       (as recovery)
    PUBLISHED --retire_failed--> DONE -                           -         -
    ROLLING_BACK --cleaned--> ROLLED_BACK       -                 yes       (as recovery)
    ROLLING_BACK --cleanup_failed--> ROLLED_BACK -                -         -

    ``retire_old`` unlinks the files the transaction owns (the old generation) and
    fires ``retired`` (or ``retire_failed``); with nothing to retire it fires
    ``retired`` at once. ``clean_up`` unlinks the new files and fires ``cleaned`` (or
    ``cleanup_failed``). These pairs are declared with the table (``outcomes``), and
    the handlers fire what it says. Recovery of PUBLISHED / ROLLING_BACK re-runs the
    state's output (both are idempotent: a missing file is success). The commit of
    each edge into ROLLING_BACK abandons the rows the transaction owns (``owned``:
    FILE's ``writing --abandoned--> garbage``).

    STORE / COMPACT invariants ("new rows": the file rows of the names the payload writes):
    INTENT       1. the journal row is in INTENT.
                 2. the new rows are ``writing``, owned by the transaction, one per rank,
                    of the payload's generation.
                 3. the transaction owns no other row.
                 4. the node(s) it replaces (payload ``node`` / ``old``) still exist.
    PUBLISHED    1. the journal row is in PUBLISHED.
                 2. the new rows are ``live`` on every rank, owned by no transaction,
                    each durable on its rank.
                 3. their node rows are ``ready`` at the payload's generation (a kept id
                    is kept; COMPACT: every old row is kept or gone).
                 4. every row the transaction owns is ``garbage`` of another
                    generation: the old one, to be unlinked.
    ROLLING_BACK 1. the journal row is in ROLLING_BACK.
                 2. every row it owns is ``garbage``; no new row is ``live``.
                 3. the node(s) it would have replaced still exist.
    DONE         1. no journal row. 2. it owns no row. 3. the new rows are ``live``.
    ROLLED_BACK  1. no journal row. 2. it owns no row. 3. no new row is ``live`` or
                    ``writing``.

EVICT::

    begin -> REMOVED --reclaimed--> DONE          outputs of begin: reclaim
                \\--reclaim_failed--> DONE (files stay as loose garbage, reclaimed later)

    ``reclaim`` unlinks the removed nodes' files and fires ``reclaimed`` (or
    ``reclaim_failed``); recovery of REMOVED re-runs it. An evict is published at
    once: the node rows go in the same commit as the journal row, never undone.

    REMOVED      1. the journal row is in REMOVED.
                 2. no node row of the payload's ``nodes`` exists, and no file row names one.
                 3. every row the transaction owns is ``garbage``.
    DONE         1. no journal row. 2. it owns no row. 3. no node row of ``nodes`` exists.

Loose garbage (rows with status 'garbage' and no transaction, left by a failed
cleanup) needs no journal row: the committed garbage rows are themselves the durable
intent. Reclaiming unlinks each file (a missing file is success) and deletes the rows
of the files it removed; it is idempotent, so recovery simply runs it again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from prefixstore.statemachine.machine import Machine, MachineDefinitionError, Outcome, T
from prefixstore.statemachine.rows import (
    FILE,
    FileRow,
    NodeRow,
    file_row_violations,
    node_row_violations,
)

# A rollback's commit abandons the new rows (writing --abandoned--> garbage) with the fire.
_STORE_EDGES = [
    T("INTENT", "durable", "PUBLISHED", "retire_old"),
    T("INTENT", "failed", "ROLLING_BACK", "clean_up", abort=True, owned="abandoned"),
    T("INTENT", "recover", "ROLLING_BACK", "clean_up", recovery=True, owned="abandoned"),
    T("PUBLISHED", "retired", "DONE", recovery=True),
    T("PUBLISHED", "retire_failed", "DONE"),
    T("ROLLING_BACK", "cleaned", "ROLLED_BACK", recovery=True),
    T("ROLLING_BACK", "cleanup_failed", "ROLLED_BACK"),
]

# What each output fires to end the state it runs in: ``ok`` when every file it
# unlinks is gone, ``failed`` when one stays (loose garbage, reclaimed later).
_STORE_OUTCOMES = {
    "retire_old": Outcome(ok="retired", failed="retire_failed"),
    "clean_up": Outcome(ok="cleaned", failed="cleanup_failed"),
}

STORE = Machine("store", "INTENT", {"DONE", "ROLLED_BACK"}, _STORE_EDGES, published={"PUBLISHED"},
                outcomes=_STORE_OUTCOMES)

COMPACT = Machine(
    "compact", "INTENT", {"DONE", "ROLLED_BACK"},
    [*_STORE_EDGES, T("INTENT", "stale", "ROLLING_BACK", "clean_up", owned="abandoned")],
    published={"PUBLISHED"},
    outcomes=_STORE_OUTCOMES,
)

EVICT = Machine(
    "evict", "REMOVED", {"DONE"},
    [
        T("REMOVED", "reclaimed", "DONE", recovery=True),
        T("REMOVED", "reclaim_failed", "DONE"),
    ],
    published={"REMOVED"},
    initial_outputs=("reclaim",),
    outcomes={"reclaim": Outcome(ok="reclaimed", failed="reclaim_failed")},
)

MACHINES: dict[str, Machine] = {m.name: m for m in (STORE, COMPACT, EVICT)}

# Derived from the tables (kept for their importers): the event recovery feeds each
# unfinished state, and whether it drives it forward or back.
RECOVERY_EVENT: dict[str, dict[str, str]] = {
    m.name: {s: m.recovery_event(s) for s in sorted(m.states - m.finals)} for m in MACHINES.values()
}


def recovery_direction(kind: str, state: str) -> str:
    """'forward' when ``state`` is a published state of ``kind``'s table, else 'back'."""
    return MACHINES[kind].direction(state)


# ---------------------------------------------------------------------------- invariants


@attrs.frozen
class TxnSnapshot:
    """What the invariants of one transaction read, taken inside its commit.

    ``state``: the state the transaction just reached; ``journal_state``: what its
    journal row says (None when the row is gone). ``files``: the rows it owns, the
    rows of the names it writes and the rows naming the nodes in ``nodes``. ``nodes``:
    the rows of the node ids it names or its new rows name (an id with no row is
    absent). ``durable``: the (rank, name) of its new rows durable on their rank.
    """

    tid: int
    kind: str
    state: str
    journal_state: str | None
    payload: Mapping[str, Any]
    ranks: int
    files: tuple[FileRow, ...] = ()
    nodes: Mapping[int, NodeRow] = attrs.field(factory=dict)
    durable: frozenset[tuple[int, str]] = frozenset()

    @property
    def owned(self) -> list[FileRow]:
        return [f for f in self.files if f.txn == self.tid]

    def rows_of(self, name: str) -> list[FileRow]:
        return [f for f in self.files if f.name == name]


def new_names(kind: str, payload: Mapping[str, Any]) -> dict[str, int]:
    """The file names a transaction writes, with their generation."""
    if kind == "store":
        return {str(payload["name"]): int(payload["generation"])}
    if kind == "compact":
        return {str(r["name"]): int(r["generation"]) for r in payload.get("new", [])}
    return {}


def named_nodes(kind: str, payload: Mapping[str, Any]) -> list[int]:
    """The node ids a transaction's payload names (replaced, compacted or evicted)."""
    if kind == "store":
        return [] if payload.get("node") is None else [int(payload["node"])]
    if kind == "compact":
        return [int(i) for i in payload.get("old", [])]
    return [int(i) for i in payload.get("nodes", [])]


Check = Callable[[TxnSnapshot], list[str]]


def _journal(s: TxnSnapshot) -> list[str]:
    want = None if MACHINES[s.kind].is_final(s.state) else s.state
    if s.journal_state != want:
        return [f"journal row is {s.journal_state!r}, expected {want!r}"]
    return []


def _owns_none(s: TxnSnapshot) -> list[str]:
    return [f"still owns rank{f.rank}/{f.name} ({f.status})" for f in s.owned]


def _owned_garbage(s: TxnSnapshot) -> list[str]:
    return [f"owns rank{f.rank}/{f.name} in status {f.status}" for f in s.owned if f.status != "garbage"]


def _one_per_rank(s: TxnSnapshot, name: str, status: str) -> list[str]:
    rows = s.rows_of(name)
    out = []
    if sorted(f.rank for f in rows) != list(range(s.ranks)):
        out.append(f"{name}: rows on ranks {sorted(f.rank for f in rows)}, expected one on each of {s.ranks}")
    out += [f"{name}: rank{f.rank} is {f.status}, expected {status}" for f in rows if f.status != status]
    return out


def _new_writing(s: TxnSnapshot) -> list[str]:
    out = []
    for name, gen in new_names(s.kind, s.payload).items():
        out += _one_per_rank(s, name, "writing")
        out += [f"{name}: rank{f.rank} not owned by the transaction" for f in s.rows_of(name) if f.txn != s.tid]
        out += [f"{name}: rank{f.rank} of generation {f.generation}, expected {gen}"
                for f in s.rows_of(name) if f.generation != gen]
    return out


def _owns_only_new(s: TxnSnapshot) -> list[str]:
    names = new_names(s.kind, s.payload)
    return [f"owns rank{f.rank}/{f.name}, which it does not write" for f in s.owned if f.name not in names]


def _replaced_exist(s: TxnSnapshot) -> list[str]:
    return [f"node {i} it replaces is gone" for i in named_nodes(s.kind, s.payload) if i not in s.nodes]


def _new_live_durable(s: TxnSnapshot) -> list[str]:
    out = []
    for name in new_names(s.kind, s.payload):
        out += _one_per_rank(s, name, "live")
        out += [f"{name}: rank{f.rank} still owned by txn {f.txn}" for f in s.rows_of(name) if f.txn is not None]
        out += [f"{name}: not durable on rank{f.rank}" for f in s.rows_of(name) if f.where not in s.durable]
    return out


def _new_nodes_ready(s: TxnSnapshot) -> list[str]:
    out = []
    keep = {str(r["name"]): r.get("keep") for r in s.payload.get("new", [])} if s.kind == "compact" else {
        str(s.payload["name"]): s.payload.get("node")}
    ids = set()
    for name, gen in new_names(s.kind, s.payload).items():
        nodes = {f.node for f in s.rows_of(name)}
        if len(nodes) != 1 or None in nodes:
            out.append(f"{name}: rows name nodes {sorted(map(str, nodes))}, expected one")
            continue
        nid = nodes.pop()
        ids.add(nid)
        n = s.nodes.get(nid)
        if n is None or n.state != "ready" or n.generation != gen:
            out.append(f"{name}: node {nid} is {n and (n.state, n.generation)}, expected ready at {gen}")
        if keep.get(name) is not None and nid != keep[name]:
            out.append(f"{name}: published as node {nid}, expected the kept id {keep[name]}")
    if s.kind == "compact":
        out += [f"old row {i} neither kept nor gone" for i in named_nodes(s.kind, s.payload)
                if i in s.nodes and i not in ids]
    return out


def _owned_old_generation(s: TxnSnapshot) -> list[str]:
    names = new_names(s.kind, s.payload)
    return _owned_garbage(s) + [f"owns its own new row rank{f.rank}/{f.name}" for f in s.owned if f.name in names]


def _new_not_live(s: TxnSnapshot) -> list[str]:
    return [f"{f.name}: rank{f.rank} is live" for name in new_names(s.kind, s.payload)
            for f in s.rows_of(name) if f.status == "live"]


def _new_gone(s: TxnSnapshot) -> list[str]:
    return [f"{f.name}: rank{f.rank} is {f.status}" for name in new_names(s.kind, s.payload)
            for f in s.rows_of(name) if f.status in ("live", "writing")]


def _new_live(s: TxnSnapshot) -> list[str]:
    return [e for name in new_names(s.kind, s.payload) for e in _one_per_rank(s, name, "live")]


def _evicted_gone(s: TxnSnapshot) -> list[str]:
    ids = named_nodes(s.kind, s.payload)
    out = [f"evicted node {i} still has a row" for i in ids if i in s.nodes]
    return out + [f"rank{f.rank}/{f.name} still names evicted node {f.node}" for f in s.files if f.node in ids]


def _evicted_rows_gone(s: TxnSnapshot) -> list[str]:
    return [f"evicted node {i} still has a row" for i in named_nodes(s.kind, s.payload) if i in s.nodes]


_REPLACING: dict[str, list[Check]] = {
    "INTENT": [_journal, _new_writing, _owns_only_new, _replaced_exist],
    "PUBLISHED": [_journal, _new_live_durable, _new_nodes_ready, _owned_old_generation],
    "ROLLING_BACK": [_journal, _owned_garbage, _new_not_live, _replaced_exist],
    "DONE": [_journal, _owns_none, _new_live],
    "ROLLED_BACK": [_journal, _owns_none, _new_gone],
}

INVARIANTS: dict[str, dict[str, list[Check]]] = {
    "store": _REPLACING,
    "compact": _REPLACING,
    "evict": {
        "REMOVED": [_journal, _evicted_gone, _owned_garbage],
        "DONE": [_journal, _owns_none, _evicted_rows_gone],
    },
}


def violations(s: TxnSnapshot) -> list[str]:
    """Every per-state invariant ``s`` breaks, numbered as in this module's tables, plus
    the row invariants (``statemachine/rows.py``) of the file rows and the node rows it
    holds; empty when all hold (a kind with no invariants here, e.g. a test's own table,
    is checked for its row invariants only)."""
    checks = INVARIANTS.get(s.kind, {}).get(s.state, [])
    out = [f"{s.kind} {s.state} {i}: {msg}" for i, check in enumerate(checks, 1) for msg in check(s)]
    out += [e for f in s.files for e in file_row_violations(f)]
    return out + [e for n in s.nodes.values() for e in node_row_violations(n, s.files, s.ranks)]


def _check_coverage() -> None:
    for kind, m in MACHINES.items():
        if set(INVARIANTS[kind]) != set(m.states):
            raise MachineDefinitionError(f"{kind}: invariants for {sorted(INVARIANTS[kind])}, states {sorted(m.states)}")
        for t in m.transitions():
            if t.owned is not None and t.owned not in FILE.all_events():
                raise MachineDefinitionError(f"{kind}: {t.src} --{t.event}--> feeds its rows {t.owned!r}, "
                                             "no event of the file row table")


_check_coverage()
