"""The engine's flows, each built once at open over the components it uses.

A flow's first argument is a small frozen object naming exactly the components it
reads and changes (``store.Storing``, ``replace.Replacing``, ``space.Room``, ...); no
flow is given the engine. ``build`` wires them, bottom-up: a flow holds the flows it
calls (the store's ``room`` and ``spans``, the replacement's ``reader`` and
``writer``, ...). ``docs/ARCHITECTURE.md`` lists which flow takes which components.
"""

from __future__ import annotations

from typing import Any

import attrs

from prefixstore.base.layout import Layout
from prefixstore.engine.abort import Abort
from prefixstore.engine.account import Account
from prefixstore.engine.audit import LiveView
from prefixstore.engine.catalog import Catalog
from prefixstore.engine.compaction import Compacting
from prefixstore.engine.counters import Counters
from prefixstore.engine.degraded import Reviving
from prefixstore.engine.evict import Evicting
from prefixstore.engine.guard import CallGuard
from prefixstore.engine.health import Health
from prefixstore.engine.holds import Holds
from prefixstore.engine.index import Index
from prefixstore.engine.journal import Ledger
from prefixstore.engine.lookup import Looking
from prefixstore.engine.pipeline import AsyncStores
from prefixstore.engine.readonly import Mode
from prefixstore.engine.recency import Recency
from prefixstore.engine.recovery import Recovering
from prefixstore.engine.remote import RemoteLink, RemoteReads, Sender
from prefixstore.engine.replace import Replacing
from prefixstore.engine.restore import Reader, Restoring
from prefixstore.engine.retry import Retrying, RetryQueue
from prefixstore.engine.settings import Settings
from prefixstore.engine.space import Room
from prefixstore.engine.spans import Admit, Spans
from prefixstore.engine.staging import Staging, Writer
from prefixstore.engine.stats import Sources
from prefixstore.engine.store import Storing
from prefixstore.engine.tiering import Tiers
from prefixstore.engine.transfers import Fetch, Transfers


@attrs.frozen(slots=True, eq=False)
class Components:
    """The engine's components a flow may be built over (each owns one concern)."""

    root: str
    layout: Layout
    cache_id: str
    settings: Settings
    guard: CallGuard
    holds: Holds
    account: Account
    recency: Recency
    index: Index
    retries: RetryQueue
    mode: Mode
    remotes: RemoteLink
    catalog: Catalog
    ledger: Ledger
    tiers: Tiers
    counters: Counters
    executor: Any
    transfers: Transfers
    admit: Admit | None


@attrs.frozen(slots=True, eq=False)
class Flows:
    """Every flow of one engine (see the module docstring)."""

    health: Health
    abort: Abort
    reader: Reader
    writer: Writer
    replacing: Replacing
    evicting: Evicting
    room: Room
    spans: Spans
    storing: Storing
    retrying: Retrying
    async_stores: AsyncStores
    restoring: Restoring
    looking: Looking
    remote_reads: RemoteReads
    compacting: Compacting
    recovering: Recovering
    reviving: Reviving
    stats: Sources
    live: LiveView


def build(c: Components) -> Flows:
    """The flows over ``c``, each over the components it uses."""
    L, cat, led = c.layout, c.catalog, c.ledger
    health = Health(cat, c.mode, c.recency, c.counters)
    abort = Abort(c.guard, led, c.index, c.recency, c.account, c.counters)
    reader = Reader(L, c.tiers, c.counters)
    writer = Writer(c.tiers, c.counters, c.mode)
    replacing = Replacing(c.guard, L, cat, led, c.index, c.holds, c.recency, c.account, c.counters, health,
                          reader, writer, abort)
    evicting = Evicting(led, c.account, c.index, c.recency, abort)
    room = Room(c.account, L, c.index, c.holds, c.recency, cat, led, c.counters, evicting, replacing)
    spans = Spans(c.guard, L, c.index, c.holds, c.settings, c.counters, c.recency, replacing, room, c.admit)
    storing = Storing(c.guard, L, c.settings, c.index, c.holds, cat, led, c.account, c.recency, c.counters,
                      c.mode, c.tiers, spans, room, Staging(L, c.executor, c.transfers), writer, reader,
                      health, abort, Sender(c.remotes, L, c.index, cat, c.tiers), c.admit)
    retrying = Retrying(c.guard, c.retries, storing, c.counters)
    restoring = Restoring(c.guard, L, c.index, cat, c.holds, c.recency, c.counters, health,
                          Fetch(L, c.tiers, c.executor, c.transfers, c.counters))
    recovering = Recovering(c.root, L, cat, led, c.tiers, c.account, c.recency)
    return Flows(
        health=health, abort=abort, reader=reader, writer=writer, replacing=replacing, evicting=evicting,
        room=room, spans=spans, storing=storing, retrying=retrying,
        async_stores=AsyncStores(c.guard, L, cat, c.holds, c.counters, c.executor, c.transfers, spans,
                                 storing, retrying),
        restoring=restoring,
        looking=Looking(L, c.index, c.settings, c.counters, c.cache_id),
        remote_reads=RemoteReads(c.remotes, L, c.settings, c.counters, c.mode, restoring, storing),
        compacting=Compacting(c.guard, L, c.index, c.holds, c.recency, c.account, c.counters, c.settings,
                              replacing),
        recovering=recovering,
        reviving=Reviving(c.guard, c.tiers, c.counters, recovering),
        stats=Sources(L, cat, c.index, c.account, c.holds, c.retries, c.counters, c.tiers, c.remotes, c.mode,
                      c.transfers, c.executor),
        live=LiveView(c.root, cat, c.index, c.account, c.holds, c.tiers, c.mode),
    )
