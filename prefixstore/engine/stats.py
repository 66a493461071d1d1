"""The engine's numbers: ``Engine.stats`` and the live gauges read at scrape time."""

from __future__ import annotations

from typing import Any

import attrs

from prefixstore.base.layout import Layout
from prefixstore.engine import remote, tiering
from prefixstore.engine.account import Account
from prefixstore.engine.catalog import Catalog
from prefixstore.engine.counters import Counters
from prefixstore.engine.holds import Holds
from prefixstore.engine.index import Index
from prefixstore.engine.readonly import Mode
from prefixstore.engine.remote import RemoteLink
from prefixstore.engine.retry import RetryQueue
from prefixstore.engine.tiering import Tiers
from prefixstore.engine.transfers import Transfers


@attrs.frozen(slots=True, eq=False)
class Sources:
    """What ``Engine.stats`` reads: every component that has a number to show."""

    layout: Layout
    catalog: Catalog
    index: Index
    account: Account
    holds: Holds
    retries: RetryQueue
    counters: Counters
    tiers: Tiers
    remotes: RemoteLink
    mode: Mode
    transfers: Transfers
    executor: Any


def collect(src: Sources, calibration: dict[str, Any] | None) -> dict[str, Any]:
    """Counters, capacity and node counts as one dict (lock held)."""
    by_status = src.catalog.bytes_by_status()
    damaged = src.catalog.damaged_bytes()
    snap_nodes = sum(1 for n in src.index if n.has_snapshot)
    return {
        "capacity_bytes": src.account.capacity,
        "charged_bytes": src.account.charged,
        "live_bytes": by_status.get("live", 0),
        "writing_bytes": by_status.get("writing", 0),
        "garbage_bytes": by_status.get("garbage", 0),
        "damaged_bytes": damaged,
        "snapshot_bytes_used": snap_nodes * src.layout.snapshot_bytes * src.layout.ranks,
        "nodes": len(src.index),
        "nodes_damaged": sum(1 for n in src.index if n.state == "damaged"),
        "pinned": len(src.holds.pins),
        "fenced": len(src.holds.fences),
        "pending_retries": len(src.retries.pending),
        "counters": src.counters.snapshot(),
        "last_decision": src.counters.last_decision,
        "backing": tiering.stats(src.tiers, src.account),
        "remote": remote.stats(src.remotes),
        "disk": src.account.disk.stats(),
        "read_only": None if src.mode.read_only is None else str(src.mode.read_only),
        "ranks_down": {str(r): why for r, why in sorted(src.tiers.down.why.items())},
        "nodes_unsettled": len(src.mode.unsettled),
        "transfers": {**src.transfers.stats(), "copies": src.executor.stats.snapshot(),
                      "staging_pool": src.executor.pool.stats(), "calibration": calibration},
    }


def publish(counters: Counters, account: Account, out: dict[str, Any]) -> None:
    """Set the byte gauges from a ``collect`` result."""
    counters.set_bytes(
        capacity=account.capacity, charged=out["charged_bytes"], damaged=out["damaged_bytes"],
        garbage=out["garbage_bytes"], snapshot_used=out["snapshot_bytes_used"],
    )


def watch(counters: Counters, account: Account, index: Index, holds: Holds, retries: RetryQueue) -> None:
    """Live gauges read at scrape time (``prefixstore_state{kind=...}``)."""
    counters.watch(
        capacity_bytes=lambda: account.capacity,
        charged_bytes=lambda: account.charged,
        nodes=lambda: len(index),
        pinned=lambda: len(holds.pins),
        fenced=lambda: len(holds.fences),
        pending_retries=lambda: len(retries.pending),
    )
