"""The journal's side of the engine: the driver it is built with and the output
handlers of every transaction kind.

No state is written here by hand: ``begin`` / ``fire`` go through the engine's
``Driver`` (``engine/driver.py``), which reads the current state from the journal
row and takes the next state and its outputs from the transaction's table. The
handlers are the tables' outputs: ``retire_old`` / ``reclaim`` unlink the files a
published transaction owns (the retired generation, the evicted nodes' files) and
``clean_up`` unlinks the files of one that rolled back; each then fires the event its
table declares for it (``Machine.outcome``: ``ok``, or ``failed`` when a file stays).
A fire that ends a state at once (``advance``: a rollback, a recovery or abort step
that fires) feeds the rows the transaction owns the row event its transition names
(``Transition.owned``) in the same commit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prefixstore.engine import lifecycle
from prefixstore.engine.driver import Driver, Handler, Txn
from prefixstore.gpu.tier import Capability, has
from prefixstore.statemachine.machine import Step
from prefixstore.statemachine.transactions import MACHINES

if TYPE_CHECKING:
    from prefixstore.engine.api import Engine


def build(eng: Engine) -> Driver:
    """The engine's driver (at open): its handlers, checked against the tables now."""
    return Driver(handlers=handlers(eng), ranks=eng.layout.ranks, durable=lambda r, name: durable(eng, r, name))


# Every output of the engine's tables unlinks the files its transaction owns.
UNLINKING = {"store": ("retire_old", "clean_up"), "compact": ("retire_old", "clean_up"), "evict": ("reclaim",)}


def handlers(eng: Engine) -> dict[str, Mapping[str, Handler]]:
    """The output handlers per transaction kind: each unlinks the files its transaction
    owns and fires the events its table declares for it (``outcome``); the files of a
    published state are unlinked only after its commit is durable (``barrier``)."""
    def unlinker(kind: str, output: str) -> Handler:
        m = MACHINES[kind]
        done = m.outcome(output)
        barrier = any(m.is_published(s) for s in m.runs_in(output))
        return lambda txn: unlink_owned(eng, txn, done.ok, done.failed, barrier=barrier)

    return {kind: {o: unlinker(kind, o) for o in outputs} for kind, outputs in UNLINKING.items()}


def durable(eng: Engine, rank: int, name: str) -> bool | None:
    """Whether rank ``rank`` holds ``name`` durably; None when its tier cannot tell."""
    tier = eng.ranks[rank]
    return tier.durable(name) if has(tier, Capability.REPORTS_DURABILITY) else None


def begin(eng: Engine, c: Any, kind: str, payload: dict[str, Any], rows=None) -> Txn:
    """Record a new ``kind`` transaction in its table's initial state, inside ``c``;
    ``rows(tid)`` writes the rows it owns from the start, in the same commit."""
    return eng.driver.begin(c, kind, payload, rows)


def fire(eng: Engine, c: Any, txn: Txn, event: str) -> tuple[str, ...]:
    """Feed ``event`` to ``txn`` inside ``c`` (the commit's last statement); its outputs."""
    return eng.driver.fire(c, txn, event)


def skip(eng: Engine, c: Any, txn: Txn, output: str) -> tuple[str, ...]:
    """End, inside ``c``, the state ``output`` would end, by its ``ok`` event (it has
    nothing to do: a store with no old generation to retire); the outputs to run."""
    return eng.driver.fire(c, txn, MACHINES[txn.kind].outcome(output).ok)


def run(eng: Engine, txn: Txn, outputs: tuple[str, ...]) -> None:
    """Run ``outputs`` of ``txn`` (after the commit that fired them)."""
    eng.driver.run_outputs(txn, outputs)


def unlink_owned(eng: Engine, txn: Txn, ok: str, failed: str, *, barrier: bool) -> None:
    """Unlink the files ``txn`` owns, drop their rows (one left stays as loose
    garbage) and fire ``ok`` (``failed`` when one stayed); the old generation of a
    published transaction is unlinked only after its commit is durable (``barrier``)."""
    rows = eng.catalog.files_of_txn(txn.id)
    if barrier:
        eng.catalog.barrier()
    left = unlink_rows(eng, rows)
    with eng.catalog.txn(f"{txn.kind}.{ok}") as c:
        eng.catalog.settle_files(c, rows, left)
        outs = eng.driver.fire(c, txn, failed if left else ok)
    eng._charged -= unlinked_bytes(rows, left)
    eng.driver.run_outputs(txn, outs)


def advance(eng: Engine, txn: Txn, event: str, label: str) -> None:
    """Fire ``event`` in a commit of its own (``label``), with the row event its
    transition names for the rows ``txn`` owns (``owned``), then run its outputs."""
    with eng.catalog.txn(label) as c:
        owned = eng.driver.transition(c, txn, event).owned
        if owned is not None:
            eng.catalog.owned_event(c, owned, txn.id)
        outs = eng.driver.fire(c, txn, event)
    eng.driver.run_outputs(txn, outs)


def rollback(eng: Engine, txn: Txn, event: str) -> None:
    """End a transaction that had not published by ``event`` (``failed``, ``stale``:
    INTENT -> ROLLING_BACK, its new rows abandoned in the same commit), then its
    outputs (``clean_up``)."""
    advance(eng, txn, event, f"{txn.kind}.rollback")


def end(eng: Engine, txn: Txn, step: Step) -> None:
    """End ``txn`` by a recovery or abort ``step``, as its table says: fire the step's
    event now (``advance``; a step back is the transaction's rollback), or re-run its
    state's outputs, which fire the events their ``outcome`` declares."""
    if step.fire is None:
        eng.driver.run_outputs(txn, step.outputs)
    else:
        back = step.direction == "back"
        advance(eng, txn, step.fire, f"{txn.kind}.{'rollback' if back else step.fire}")


def drop_rows(eng: Engine, c: Any, tids) -> None:
    """Delete the journal rows ``tids`` inside ``c`` (repair: rows no table can read)."""
    for tid in tids:
        eng.driver.journal.delete(c, tid)


def unlink_rows(eng: Engine, rows) -> set[tuple[int, str]]:
    """Remove the files of ``rows`` on their ranks; return those that failed."""
    lifecycle.check_writable(eng, "unlink")
    failed: set[tuple[int, str]] = set()
    touched: set[int] = set()
    for r, name, _size in rows:
        try:
            eng.ranks[r].remove(name)
            touched.add(r)
        except OSError:
            eng.counters.inc("faults", "unlink")
            failed.add((r, name))
            eng._garbage_hint = True
    for r in sorted(touched):
        try:
            eng.ranks[r].sync_dir()
        except OSError:
            eng.counters.inc("faults", "fsync_dir")
    return failed


def reclaim_rows(eng: Engine, tid: int | None, rows) -> None:
    """Unlink garbage ``rows`` and delete the rows of those gone."""
    if not rows:
        return
    eng.catalog.barrier()
    left = unlink_rows(eng, rows)
    with eng.catalog.txn("reclaim") as c:
        eng.catalog.delete_files(c, rows, left)
    eng._charged -= unlinked_bytes(rows, left)


def unlinked_bytes(rows, left: set[tuple[int, str]]) -> int:
    """The bytes of ``rows`` whose files are gone (not in ``left``)."""
    return sum(size for r, name, size in rows if (r, name) not in left)

