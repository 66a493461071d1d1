"""The engine's numbers: ``Engine.stats`` and the live gauges read at scrape time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefixstore.engine import remote, tiering

if TYPE_CHECKING:
    from prefixstore.engine.api import Engine


def collect(eng: Engine) -> dict[str, Any]:
    """Counters, capacity and node counts as one dict (lock held)."""
    by_status = eng.catalog.bytes_by_status()
    damaged = eng.catalog.damaged_bytes()
    snap_nodes = sum(1 for n in eng.index if n.has_snapshot)
    return {
        "capacity_bytes": eng.account.capacity,
        "charged_bytes": eng.account.charged,
        "live_bytes": by_status.get("live", 0),
        "writing_bytes": by_status.get("writing", 0),
        "garbage_bytes": by_status.get("garbage", 0),
        "damaged_bytes": damaged,
        "snapshot_bytes_used": snap_nodes * eng.layout.snapshot_bytes * eng.layout.ranks,
        "nodes": len(eng.index),
        "nodes_damaged": sum(1 for n in eng.index if n.state == "damaged"),
        "pinned": len(eng.holds.pins),
        "fenced": len(eng.holds.fences),
        "pending_retries": len(eng.retries.pending),
        "counters": eng.counters.snapshot(),
        "last_decision": eng.counters.last_decision,
        "backing": tiering.stats(eng),
        "remote": remote.stats(eng),
        "disk": eng.account.disk.stats(),
        "read_only": None if eng.read_only is None else str(eng.read_only),
        "nodes_unsettled": len(eng.unsettled),
        "transfers": {**eng.transfers.stats(), "copies": eng.executor.stats.snapshot(),
                      "staging_pool": eng.executor.pool.stats(), "calibration": eng.calibration},
    }


def publish(eng: Engine, out: dict[str, Any]) -> None:
    """Set the byte gauges from a ``collect`` result."""
    eng.counters.set_bytes(
        capacity=eng.account.capacity, charged=out["charged_bytes"], damaged=out["damaged_bytes"],
        garbage=out["garbage_bytes"], snapshot_used=out["snapshot_bytes_used"],
    )


def watch(eng: Engine) -> None:
    """Live gauges read at scrape time (``prefixstore_state{kind=...}``)."""
    eng.counters.watch(
        capacity_bytes=lambda: eng.account.capacity,
        charged_bytes=lambda: eng.account.charged,
        nodes=lambda: len(eng.index),
        pinned=lambda: len(eng.holds.pins),
        fenced=lambda: len(eng.holds.fences),
        pending_retries=lambda: len(eng.retries.pending),
    )
