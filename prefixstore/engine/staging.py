"""A store's shards on their way to the ranks: zero-copy staging and the writes.

Each rank's tensors are copied by the executor straight into a host buffer laid out
as the shard file (``stage_store``); the checksum is taken over that buffer and the
file is written from it (``write_shard``), or a tier that declares ``ADOPTS_BUFFERS``
adopts the buffer as its copy. No other host copy is made. ``write_all`` writes one
shard name on every rank in parallel and reports the ranks that failed.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Any

import attrs

from prefixstore.base.layout import Layout
from prefixstore.engine.counters import Counters
from prefixstore.engine.readonly import Mode
from prefixstore.engine.tiering import Tiers
from prefixstore.engine.transfers import Transfers
from prefixstore.gpu import shards
from prefixstore.gpu.diskroom import enospc_reason
from prefixstore.gpu.executor import Staged
from prefixstore.gpu.tier import Capability, has


@attrs.frozen(slots=True, eq=False)
class Staging:
    """What staging a store's shards uses: the layout, the executor's copies, and the
    transfers' count of stores staged again."""

    layout: Layout
    executor: Any
    transfers: Transfers


@attrs.frozen(slots=True, eq=False)
class Writer:
    """What writing a shard on every rank uses: the tiers and their pool, the fault
    counters, and the read-only mode (which refuses every write)."""

    tiers: Tiers
    counters: Counters
    mode: Mode


@attrs.frozen(slots=True, eq=False)
class Prestaged:
    """A store's shards staged (and checksummed) before the lock hold that decides the
    store, for the header metadata and token rows it foresaw; that hold takes them when
    it decides the same, else stages again (``store.begin``)."""

    meta: dict[str, str]
    lo: int
    hi: int
    datas: list[Staged]

    def fits(self, meta: dict[str, str], lo: int, hi: int) -> bool:
        """Whether these shards are the ones a store of ``meta`` over rows ``[lo, hi)`` writes."""
        return self.lo == lo and self.hi == hi and self.meta == meta


def stage_store(
    sg: Staging,
    staged: list[Staged] | None,
    meta: dict[str, str],
    segs: Sequence[Any],
    snaps: Sequence[Any] | None,
    lo: int,
    hi: int,
) -> list[Staged]:
    """The staged shards of a store (``staged`` itself when it already matches)."""
    L = sg.layout
    plans = [shards.plan_for_layout(L, hi - lo, L.has_snapshot, {**meta, "rank": str(r)}) for r in range(L.ranks)]
    if staged is not None:
        if all(s.plan.header == p.header for s, p in zip(staged, plans, strict=True)):
            return staged
        sg.transfers.restaged += 1  # the plan moved since the peek: stage again from the host copy
    out: list[Staged] = []
    try:
        for r in range(L.ranks):
            tensors = {f"seg.{k}": v[lo:hi] for k, v in segs[r].items()}
            if snaps is not None:
                tensors.update({f"snap.{k}": v for k, v in snaps[r].items()})
            out.append(sg.executor.stage(plans[r], tensors))
    except BaseException:
        release(out)
        raise
    return out


def release(datas: Sequence[Any]) -> None:
    """Release staged shards (bytes need nothing)."""
    for d in datas:
        if isinstance(d, Staged):
            d.release()


def size_of(d: Any) -> int:
    return d.size if isinstance(d, Staged) else len(d)


def checksum_of(d: Any) -> str:
    return d.checksum() if isinstance(d, Staged) else shards.checksum(d)


def write_shard(tiers: Tiers, r: int, name: str, d: Any) -> None:
    """Apply one rank's write of a store: bytes, or a staged buffer (adopted by a RAM
    tier, or written from in place). Any failure of the effect is an OSError, so it
    fails the transaction (rolled back), never the thread that ran it."""
    rank = tiers.ranks[r]
    try:
        if not isinstance(d, Staged):
            rank.write_shard(name, d)
            return
        if has(rank, Capability.ADOPTS_BUFFERS):
            d.buffer.retain()  # the tier's reference
            try:
                rank.adopt_shard(name, d.buffer)  # type: ignore[attr-defined]
            except BaseException:
                d.buffer.release()
                raise
        else:
            rank.write_shard(name, d.buffer.mv())
    except OSError:
        raise
    except Exception as exc:
        raise OSError(errno.EIO, f"rank {r} write failed: {type(exc).__name__}: {exc}") from exc


def write_all(w: Writer, name: str, datas: list[Any]) -> list[tuple[int, OSError]]:
    """Write ``name`` on every rank (in parallel); return the ranks that failed."""
    w.mode.check_writable("write")
    if len(datas) == 1:
        try:
            write_shard(w.tiers, 0, name, datas[0])
            return []
        except OSError as exc:
            w.counters.inc("faults", "write")
            return [(0, exc)]
    futures = [w.tiers.pool.submit(write_shard, w.tiers, r, name, d) for r, d in enumerate(datas)]
    errors: list[tuple[int, OSError]] = []
    crash: BaseException | None = None
    for r, f in enumerate(futures):
        try:
            f.result()
        except OSError as exc:
            w.counters.inc("faults", "write")
            errors.append((r, exc))
        except BaseException as exc:  # a crash or a bug in a rank: re-raised below
            crash = crash or exc
    if crash is not None:
        raise crash
    return errors


def failure_reason(tiers: Tiers, errors: list[tuple[int, OSError]], datas: list[Any]) -> str:
    """Why the writes of ``datas`` failed, per rank: a file system found full is named
    as such (out of bytes or of inodes, ``gpu/diskroom.py``), any other error as it
    was raised."""
    parts = []
    for r, e in errors:
        where = getattr(tiers.ranks[r], "directory", None)
        full = enospc_reason(where, datas[r].size) if e.errno == errno.ENOSPC and where else None
        parts.append(f"rank {r}: {full or e}")
    return "; ".join(parts)
