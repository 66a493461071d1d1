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

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from prefixstore.engine.account import Account
from prefixstore.engine.catalog import Catalog
from prefixstore.engine.counters import Counters
from prefixstore.engine.driver import Driver, Handler, Txn
from prefixstore.engine.readonly import Mode
from prefixstore.engine.tiering import Tiers
from prefixstore.gpu.tier import Capability, has
from prefixstore.statemachine.machine import Step
from prefixstore.statemachine.transactions import MACHINES


@attrs.frozen(slots=True, eq=False)
class Ledger:
    """The journal's side of the engine: the catalog, the driver built with the
    handlers below, and what the handlers change (the ranks' files, the space
    account, the counters)."""

    catalog: Catalog
    driver: Driver
    tiers: Tiers
    account: Account
    counters: Counters
    mode: Mode


def open_ledger(catalog: Catalog, tiers: Tiers, account: Account, counters: Counters, mode: Mode,
                ranks: int) -> Ledger:
    """The engine's ledger (at open): its driver's handlers, checked against the tables now."""
    ledger: Ledger | None = None

    def bound(txn: Txn, ok: str, failed: str, barrier: bool) -> None:
        assert ledger is not None
        unlink_owned(ledger, txn, ok, failed, barrier=barrier)

    driver = Driver(handlers=handlers(bound), ranks=ranks, durable=lambda r, name: durable(tiers, r, name))
    ledger = Ledger(catalog, driver, tiers, account, counters, mode)
    return ledger


# Every output of the engine's tables unlinks the files its transaction owns.
UNLINKING = {"store": ("retire_old", "clean_up"), "compact": ("retire_old", "clean_up"), "evict": ("reclaim",)}

GROUPED_COMMITS = ("evict.reclaimed",)
"""The commits of an unlinking output written without a sync of their own (group
commit, ``Catalog.txn(grouped=True)``): an evict's reclaim. Its files are unlinked and
their directories fsynced before it, and the removal it follows is durable (a FULL
commit), so a power loss that takes it back leaves the evict in REMOVED with its
garbage rows, and recovery re-runs the reclaim, whose unlinks find the files gone
(success). It is durable with the next sync of the log or FULL commit."""


def handlers(unlink: Callable[[Txn, str, str, bool], None]) -> dict[str, Mapping[str, Handler]]:
    """The output handlers per transaction kind, over ``unlink(txn, ok, failed, barrier)``
    (``unlink_owned`` of the engine's ledger): each unlinks the files its transaction
    owns and fires the events its table declares for it (``outcome``); the files of a
    published state are unlinked only after its commit is durable (``barrier``)."""
    def unlinker(kind: str, output: str) -> Handler:
        m = MACHINES[kind]
        done = m.outcome(output)
        barrier = any(m.is_published(s) for s in m.runs_in(output))
        return lambda txn: unlink(txn, done.ok, done.failed, barrier)

    return {kind: {o: unlinker(kind, o) for o in outputs} for kind, outputs in UNLINKING.items()}


def durable(tiers: Tiers, rank: int, name: str) -> bool | None:
    """Whether rank ``rank`` holds ``name`` durably; None when its tier cannot tell."""
    tier = tiers.ranks[rank]
    return tier.durable(name) if has(tier, Capability.REPORTS_DURABILITY) else None


def begin(led: Ledger, c: Any, kind: str, payload: dict[str, Any], rows=None) -> Txn:
    """Record a new ``kind`` transaction in its table's initial state, inside ``c``;
    ``rows(tid)`` writes the rows it owns from the start, in the same commit."""
    return led.driver.begin(c, kind, payload, rows)


def fire(led: Ledger, c: Any, txn: Txn, event: str, *then: str) -> tuple[str, ...]:
    """Feed ``event``, then each of ``then``, to ``txn`` inside ``c`` (the commit's last
    statement; the journal row read and written once); the last edge's outputs."""
    return led.driver.fire(c, txn, event, *then)


def skipped(txn: Txn, output: str) -> str:
    """The event that ends the state ``output`` would end when it has nothing to do
    (its ``ok``: a store with no old generation to retire), for ``fire``'s ``then``."""
    return MACHINES[txn.kind].outcome(output).ok


def run(led: Ledger, txn: Txn, outputs: tuple[str, ...]) -> None:
    """Run ``outputs`` of ``txn`` (after the commit that fired them)."""
    led.driver.run_outputs(txn, outputs)


def unlink_owned(led: Ledger, txn: Txn, ok: str, failed: str, *, barrier: bool) -> None:
    """Unlink the files ``txn`` owns, drop their rows (one left stays as loose
    garbage) and fire ``ok`` (``failed`` when one stayed); the old generation of a
    published transaction is unlinked only after its commit is durable (``barrier``).
    The commit that settles the rows is grouped for the labels of ``GROUPED_COMMITS``;
    the rows are ``txn.files`` when its beginning handed them over, else read."""
    rows = led.catalog.files_of_txn(txn.id) if txn.files is None else txn.files
    if barrier:
        led.catalog.barrier()
    left = unlink_rows(led, rows)
    label = f"{txn.kind}.{ok}"
    with led.catalog.txn(label, grouped=label in GROUPED_COMMITS) as c:
        led.catalog.settle_files(c, rows, left)
        outs = led.driver.fire(c, txn, failed if left else ok)
    led.account.charged -= unlinked_bytes(rows, left)
    led.driver.run_outputs(txn, outs)


def advance(led: Ledger, txn: Txn, event: str, label: str) -> None:
    """Fire ``event`` in a commit of its own (``label``), with the row event its
    transition names for the rows ``txn`` owns (``owned``), then run its outputs."""
    def rows(t) -> None:
        if t.owned is not None:
            led.catalog.owned_event(c, t.owned, txn.id)

    with led.catalog.txn(label) as c:
        outs = led.driver.fire(c, txn, event, rows=rows)
    led.driver.run_outputs(txn, outs)


def rollback(led: Ledger, txn: Txn, event: str) -> None:
    """End a transaction that had not published by ``event`` (``failed``, ``stale``:
    INTENT -> ROLLING_BACK, its new rows abandoned in the same commit), then its
    outputs (``clean_up``)."""
    advance(led, txn, event, f"{txn.kind}.rollback")


def end(led: Ledger, txn: Txn, step: Step) -> None:
    """End ``txn`` by a recovery or abort ``step``, as its table says: fire the step's
    event now (``advance``; a step back is the transaction's rollback), or re-run its
    state's outputs, which fire the events their ``outcome`` declares."""
    if step.fire is None:
        led.driver.run_outputs(txn, step.outputs)
    else:
        back = step.direction == "back"
        advance(led, txn, step.fire, f"{txn.kind}.{'rollback' if back else step.fire}")


def drop_rows(led: Ledger, c: Any, tids) -> None:
    """Delete the journal rows ``tids`` inside ``c`` (repair: rows no table can read)."""
    for tid in tids:
        led.driver.journal.delete(c, tid)


def unlink_rows(led: Ledger, rows) -> set[tuple[int, str]]:
    """Remove the files of ``rows`` on their ranks; return those that failed."""
    led.mode.check_writable("unlink")
    failed: set[tuple[int, str]] = set()
    touched: set[int] = set()
    for r, name, _size in rows:
        try:
            led.tiers.ranks[r].remove(name)
            touched.add(r)
        except OSError:
            led.counters.inc("faults", "unlink")
            failed.add((r, name))
            led.account.garbage_hint = True
    for r in sorted(touched):
        try:
            led.tiers.ranks[r].sync_dir()
        except OSError:
            led.counters.inc("faults", "fsync_dir")
    return failed


def reclaim_rows(led: Ledger, tid: int | None, rows) -> None:
    """Unlink garbage ``rows`` and delete the rows of those gone."""
    if not rows:
        return
    led.catalog.barrier()
    left = unlink_rows(led, rows)
    with led.catalog.txn("reclaim") as c:
        led.catalog.delete_files(c, rows, left)
    led.account.charged -= unlinked_bytes(rows, left)


def unlinked_bytes(rows, left: set[tuple[int, str]]) -> int:
    """The bytes of ``rows`` whose files are gone (not in ``left``)."""
    return sum(size for r, name, size in rows if (r, name) not in left)

