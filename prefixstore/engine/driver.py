"""The journal driver: the one code that reads or writes the ``journal`` table.

A transaction's table (``statemachine.transactions``) is the truth: ``begin`` inserts
the row in the table's initial state; ``fire(c, txn, event)`` reads the row's current
state from the journal (never from the caller), looks up the transition, updates the
row (or deletes it on a final state) inside the caller's open catalog transaction
``c``, and returns the transition's outputs; the caller commits, then
``run_outputs(txn, outputs)`` runs them through the handlers registered for the
transaction's kind. An output with no handler (or a handler for no output) raises
``DriverDefinitionError`` when the driver is built, at engine open.

``fire`` must be the last statement of its commit: the row changes of that commit
come first, so the invariants of the state reached see them. ``fire(c, txn, e1, e2)``
moves through both edges with one read and one write of the row; only the last
edge's outputs run (a store with nothing to retire fires ``durable`` then ``retired``
in one commit).

With ``debug`` on (``PREFIXSTORE_DEBUG_INVARIANTS=1`` in the environment, or the
``debug`` argument / attribute) ``begin`` and every ``fire`` assert the per-state
invariants of the state reached and the row invariants of the file and node rows
it holds (``transactions.violations``; the rows' own from ``statemachine/rows.py``)
over a snapshot of the transaction's rows read through ``c`` (the rows it owns or
writes, the nodes it names or its rows name, every row naming those nodes) and the
ranks' answer to "is this shard durable on rank r" (``durable(rank, name)``;
without one, durability is not checked), raising ``InvariantViolation``.

Recovery and abort come from the table: ``recover(c, row)`` / ``abort(c, txn)``
give a ``Step`` (the event, the direction, and either the event to fire now or
the state's outputs to re-run).

The engine's wiring: ``eng.driver`` is built at open (``lifecycle.bind`` ->
``journal.open_ledger``) with the handlers of ``journal.handlers`` (``retire_old``,
``clean_up``, ``reclaim``: unlink the owned files, settle their rows, fire the
events the table declares for the output, ``Machine.outcome``) and ``durable(r, name)`` = the rank tier's ``durable(name)`` when it
declares ``Capability.REPORTS_DURABILITY`` (``LocalRank``: the fault file system's
``is_durable``, else what its own fsync, rename and directory fsync completed), else
None (taken as durable). Call sites: ``store.intent`` / ``replace._intent`` /
``evict.evict_nodes`` begin (their rows written by ``rows(tid)``); ``store.publish`` /
``replace._swap`` fire ``durable`` (a store with nothing to retire also ``retired``)
and run the outputs after the commit; ``journal.rollback`` fires ``failed`` /
``stale`` (``journal.advance``: the rows it owns take its transition's ``owned`` row
event, ``abandoned``, in the same commit);
``recovery.recover`` and ``abort.fail_txn`` end a transaction by
``recover`` / ``abort``'s step (``journal.end``). Repair's and a volatile backing's
journal deletes go through ``Journal``. The flag: ``tests/conftest.py`` and the fuzz
``Driver`` set ``PREFIXSTORE_DEBUG_INVARIANTS=1`` unless the environment says
otherwise; ``fuzz/driver.py`` reports an ``InvariantViolation`` as an ``invariant``
violation of the op that raised it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from prefixstore.base.debug import DEBUG_ENV as DEBUG_ENV  # re-exported: the flag's name
from prefixstore.base.debug import debug_from_env
from prefixstore.base.errors import CatalogCorruptError, IllegalTransitionError
from prefixstore.statemachine.machine import Machine, Step, Transition
from prefixstore.statemachine.rows import FileRow, NodeRow
from prefixstore.statemachine.transactions import (
    MACHINES,
    TxnSnapshot,
    named_nodes,
    new_names,
    violations,
)

Handler = Callable[["Txn"], None]
Durable = Callable[[int, str], "bool | None"]


class DriverDefinitionError(Exception):
    """The handlers do not match the tables' outputs (raised when the driver is built)."""


class InvariantViolation(AssertionError):
    """A transaction reached a state whose invariants do not hold (debug check)."""


@attrs.frozen
class Txn:
    """A journaled transaction: its id, kind and payload; ``outputs`` are what its
    beginning asks to run after the commit (e.g. an evict's ``reclaim``). ``files``: the
    (rank, name, size) of the file rows it owns, as the commit that gave them to it
    wrote them, for the output run right after it (None: read from the catalog)."""

    id: int
    kind: str
    payload: Mapping[str, Any]
    outputs: tuple[str, ...] = ()
    files: tuple[tuple[int, str, int], ...] | None = None


@attrs.define(slots=True, eq=False)
class Journal:
    """The SQL of the ``journal`` table, plus the row reads of the invariant checks
    (no state: every statement runs in the caller's connection ``c``)."""

    def insert(self, c: Any, kind: str, state: str, payload: Mapping[str, Any]) -> int:
        cur = c.execute("INSERT INTO journal(kind, state, payload) VALUES(?, ?, ?)",
                        (kind, state, json.dumps(payload)))
        return int(cur.lastrowid)

    def state(self, c: Any, tid: int) -> tuple[str, str] | None:
        """The (kind, state) of row ``tid``, or None when it is gone."""
        row = c.execute("SELECT kind, state FROM journal WHERE id=?", (tid,)).fetchone()
        return None if row is None else (row[0], row[1])

    def set_state(self, c: Any, tid: int, state: str) -> None:
        c.execute("UPDATE journal SET state=? WHERE id=?", (state, tid))

    def delete(self, c: Any, tid: int) -> None:
        c.execute("DELETE FROM journal WHERE id=?", (tid,))

    def delete_all(self, c: Any) -> None:
        """Forget every transaction (a volatile cache's rows dropped at open)."""
        c.execute("DELETE FROM journal")

    def files(self, c: Any, tid: int, names: Iterable[str], nodes: Iterable[int], ranks: int) -> list[FileRow]:
        """File rows owned by ``tid``, of ``names`` (on ranks below ``ranks``) or naming
        one of ``nodes``; each part looked up by its index."""
        cols = "SELECT rank, name, node, generation, size, checksum, status, txn FROM files"
        names, nodes = list(names), list(nodes)
        parts, args = [f"{cols} WHERE txn=?"], [tid]
        if names:
            parts.append(f"{cols} WHERE rank IN ({_marks(ranks)}) AND name IN ({_marks(len(names))})")
            args += [*range(ranks), *names]
        if nodes:
            parts.append(f"{cols} WHERE node IN ({_marks(len(nodes))})")
            args += nodes
        return [FileRow(*r) for r in c.execute(" UNION ".join(parts), args).fetchall()]

    def nodes(self, c: Any, ids: Iterable[int]) -> dict[int, NodeRow]:
        ids = list(ids)
        if not ids:
            return {}
        rows = c.execute(
            "SELECT id, parent, start_block, end_block, state, generation, has_snapshot FROM nodes "
            f"WHERE id IN ({_marks(len(ids))})", ids).fetchall()
        return {r[0]: NodeRow(r[0], r[1], r[2], r[3], r[4], r[5], bool(r[6])) for r in rows}


def _marks(n: int) -> str:
    return ",".join("?" * n)


@attrs.define(slots=True, eq=False, init=False, repr=False)
class Driver:
    """Drives every journaled transaction by its table; see the module docstring.
    Fixed once built: every call runs in its caller's catalog transaction (under the
    engine lock where the caller holds it)."""

    machines: dict[str, Machine]
    handlers: dict[str, dict[str, Handler]]
    ranks: int
    durable: Durable | None
    debug: bool
    journal: Journal

    def __init__(
        self,
        handlers: Mapping[str, Mapping[str, Handler]],
        *,
        machines: Mapping[str, Machine] = MACHINES,
        ranks: int = 1,
        durable: Durable | None = None,
        debug: bool | None = None,
    ) -> None:
        self.machines = dict(machines)
        self.handlers = {k: dict(v) for k, v in handlers.items()}
        self.ranks = ranks
        self.durable = durable
        self.debug = debug_from_env() if debug is None else debug
        self.journal = Journal()
        self._check_handlers()

    def _check_handlers(self) -> None:
        if extra := set(self.handlers) - set(self.machines):
            raise DriverDefinitionError(f"handlers for unknown transaction kinds {sorted(extra)}")
        for kind, m in self.machines.items():
            have = set(self.handlers.get(kind, {}))
            if missing := m.all_outputs() - have:
                raise DriverDefinitionError(f"{kind}: no handler for outputs {sorted(missing)}")
            if unused := have - m.all_outputs():
                raise DriverDefinitionError(f"{kind}: handlers {sorted(unused)} are no output of its table")

    # ------------------------------------------------------------------ transitions

    def begin(self, c: Any, kind: str, payload: Mapping[str, Any],
              rows: Callable[[int], None] | None = None) -> Txn:
        """Insert the journal row of a new ``kind`` transaction in its initial state;
        ``rows(tid)`` writes, in the same commit, the rows it owns from the start."""
        m = self._machine(kind)
        txn = Txn(self.journal.insert(c, kind, m.initial, payload), kind, dict(payload), m.initial_outputs)
        if rows is not None:
            rows(txn.id)
        self._assert(c, txn, m.initial)
        return txn

    def fire(self, c: Any, txn: Txn, event: str, *then: str,
             rows: Callable[[Transition], None] | None = None) -> tuple[str, ...]:
        """Feed ``event`` to ``txn`` in the state its journal row holds, then each event
        of ``then`` in the state the last one reached; return the last transition's
        outputs, to run after the commit. The row is read once and written once (the
        state finally reached, or deleted on a final state); with ``debug`` the
        invariants of each state passed through are asserted as if the row held it.
        ``rows(t)``: writes, before the row, what the first transition ``t`` asks of
        the rows the transaction owns (its ``owned`` event). IllegalTransitionError
        when the row is gone, belongs to another kind, or a state cannot take its event."""
        kind, state = self._current(c, txn)
        m = self._machine(kind)
        t = m.transition(state, event)
        if rows is not None:
            rows(t)
        for nxt in then:
            if self.debug and (broken := violations(self.snapshot(c, txn, t.dst, row_state=t.dst))):
                raise InvariantViolation(f"txn {txn.id}: " + "; ".join(broken))
            t = m.transition(t.dst, nxt)
        if m.is_final(t.dst):
            self.journal.delete(c, txn.id)
        else:
            self.journal.set_state(c, txn.id, t.dst)
        self._assert(c, txn, t.dst)
        return t.outputs

    def transition(self, c: Any, txn: Txn, event: str) -> Transition:
        """The edge ``event`` takes from the state ``txn``'s journal row holds now (as
        ``fire`` would take it; nothing is written)."""
        kind, state = self._current(c, txn)
        return self._machine(kind).transition(state, event)

    def run_outputs(self, txn: Txn, outputs: Iterable[str]) -> None:
        """Run ``outputs`` in order through ``txn.kind``'s handlers (after the commit)."""
        for name in outputs:
            self.handlers[txn.kind][name](txn)

    # ------------------------------------------------------------------ recovery, abort

    def txn(self, row: tuple[int, str, str, Mapping[str, Any]]) -> Txn:
        """The Txn of a journal row ``(id, kind, state, payload)`` (``catalog.journal()``)."""
        tid, kind, state, payload = row
        if kind not in self.machines or state not in self.machines[kind].states:
            raise CatalogCorruptError(f"journal row {tid}: unknown transaction {kind}/{state}")
        return Txn(tid, kind, dict(payload))

    def recover(self, c: Any, row: tuple[int, str, str, Mapping[str, Any]]) -> tuple[Txn, Step]:
        """How recovery ends the unfinished transaction of journal ``row``: from the
        state its journal row holds now, by its table."""
        txn = self.txn(row)
        kind, state = self._current(c, txn)
        return txn, self._machine(kind).recovery(state)

    def abort(self, c: Any, txn: Txn) -> Step | None:
        """How an unexpected error ends ``txn`` (None when its row is already gone)."""
        cur = self.journal.state(c, txn.id)
        return None if cur is None else self._machine(cur[0]).abort(cur[1])

    # ------------------------------------------------------------------ invariants

    def snapshot(self, c: Any, txn: Txn, state: str, row_state: str | None = None) -> TxnSnapshot:
        """The rows ``txn``'s invariants read, through ``c``, with ``txn`` in ``state``;
        ``row_state``: the state its journal row is taken to hold (None: read it)."""
        names = new_names(txn.kind, txn.payload)
        ids = named_nodes(txn.kind, txn.payload)
        files = self.journal.files(c, txn.id, names, ids, self.ranks)
        node_ids = {*ids, *(f.node for f in files if f.node is not None)}
        if more := node_ids - set(ids):  # every row naming a node the new rows name
            have = {f.where for f in files}
            files += [f for f in self.journal.files(c, txn.id, (), more, self.ranks) if f.where not in have]
        mine = [f for f in files if f.name in names]
        if self.durable is None:
            durable = frozenset(f.where for f in mine)
        else:
            durable = frozenset(f.where for f in mine if self.durable(f.rank, f.name) is not False)
        if row_state is None:
            cur = self.journal.state(c, txn.id)
            row_state = None if cur is None else cur[1]
        return TxnSnapshot(txn.id, txn.kind, state, row_state, txn.payload,
                           self.ranks, tuple(files), self.journal.nodes(c, node_ids), durable)

    def check(self, c: Any, txn: Txn, state: str) -> list[str]:
        """The invariants of ``state`` that ``txn``'s rows break now."""
        return violations(self.snapshot(c, txn, state))

    def _assert(self, c: Any, txn: Txn, state: str) -> None:
        if self.debug and (broken := self.check(c, txn, state)):
            raise InvariantViolation(f"txn {txn.id}: " + "; ".join(broken))

    # ------------------------------------------------------------------ helpers

    def _machine(self, kind: str) -> Machine:
        try:
            return self.machines[kind]
        except KeyError:
            raise IllegalTransitionError(f"unknown transaction kind {kind!r}") from None

    def _current(self, c: Any, txn: Txn) -> tuple[str, str]:
        cur = self.journal.state(c, txn.id)
        if cur is None:
            raise IllegalTransitionError(f"{txn.kind}: transaction {txn.id} has no journal row (it ended)")
        if cur[0] != txn.kind:
            raise IllegalTransitionError(f"transaction {txn.id} is a {cur[0]}, not a {txn.kind}")
        return cur
