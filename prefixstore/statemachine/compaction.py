"""When merging a single-child chain pays. Pure: no I/O, no engine state.

A merge rewrites a run of rows ``n_0 -> n_1 -> ... -> n_k`` (each ``n_i``, i < k, has
exactly one child, ``n_{i+1}``) as one row with ``n_k``'s key and snapshot. What it buys
and what it costs:

- **per-file overhead**: every restore through the run opens, reads and verifies
  ``k + 1`` files per rank; after the merge, one. Each file costs ``file_overhead_s``
  (open, header parse, checksum setup, a seek) on top of its bytes.
- **restore read pattern**: the saving recurs on every restore that reads the run;
  ``expected_reads`` of them are assumed for a run read recently (within
  ``hot_window`` clock ticks), ``cold_reads`` for one not read since. A merged row
  is read whole, so a restore whose GPU-resident prefix ends inside it reads bytes it
  then drops: ``max_merge_bytes`` bounds that waste (and the eviction granularity).
- **the rewrite**: the run's bytes are read and written once more
  (``bytes / read_bandwidth + bytes / write_bandwidth`` per rank, in parallel across
  ranks) and held twice until the swap.
- **row count**: past ``row_budget`` rows in the catalog, every merge pays (the index,
  the catalog and recovery all scale with rows).

``merge_verdict`` decides for one run; ``chunks`` cuts a long run into merges that
respect ``max_merge_rows`` and ``max_merge_bytes``.

``keep_interior_checkpoints`` (default True): only rows that are not restore targets
may disappear inside a merge, i.e. on a layout with snapshots, rows whose snapshot was
retired. With False, interior checkpoints (and their snapshots) are merged away too:
the run keeps only its endpoint as a restore target. (On an attention-only layout a
lookup can stop inside any row, so a merge loses no restorable prefix there; what it
changes is that such a restore reads the whole merged shard.)
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


@attrs.frozen
class CompactionPolicy:
    """Knobs of the merge decision (defaults measured on the development machines)."""

    file_overhead_s: float = 3e-4
    read_bandwidth: float = 1.2e9
    write_bandwidth: float = 0.4e9
    expected_reads: float = 4.0
    cold_reads: float = 1.0
    hot_window: int = 1000
    row_budget: int = 100_000
    max_merge_rows: int = 256
    max_merge_bytes: int = 64 << 20
    keep_interior_checkpoints: bool = True
    interval_s: float = 1.0
    max_jobs: int = 64
    pin_wait_s: float = 2.0

    def __attrs_post_init__(self) -> None:
        if self.max_merge_rows < 2:
            raise ValueError("max_merge_rows must be at least 2")
        if min(self.read_bandwidth, self.write_bandwidth) <= 0 or self.file_overhead_s < 0:
            raise ValueError("bandwidths must be positive and file_overhead_s non-negative")
        if self.interval_s <= 0 or self.max_jobs < 1 or self.pin_wait_s < 0:
            raise ValueError("interval_s must be positive, max_jobs >= 1, pin_wait_s >= 0")


@attrs.frozen
class RunStats:
    """What the policy knows about one candidate run (bytes are per rank)."""

    rows: int
    bytes_per_rank: int
    age: int  # clock ticks since the run was last read
    rows_total: int  # rows in the whole catalog


@attrs.frozen
class Verdict:
    """A merge decision with both sides of the trade, in seconds."""

    merge: bool
    reason: str
    saved_s: float  # per-file overhead saved over the expected reads
    cost_s: float  # one-off rewrite cost


def merge_verdict(policy: CompactionPolicy, run: RunStats) -> Verdict:
    """Whether merging ``run`` into one row pays under ``policy``."""
    if run.rows < 2:
        return Verdict(False, "single_row", 0.0, 0.0)
    if run.bytes_per_rank > policy.max_merge_bytes:
        return Verdict(False, "too_large", 0.0, 0.0)
    reads = policy.expected_reads if run.age <= policy.hot_window else policy.cold_reads
    saved = reads * (run.rows - 1) * policy.file_overhead_s
    b = run.bytes_per_rank
    cost = b / policy.read_bandwidth + b / policy.write_bandwidth + (run.rows + 1) * policy.file_overhead_s
    if run.rows_total > policy.row_budget:
        return Verdict(True, "row_count", saved, cost)
    if saved >= cost:
        return Verdict(True, "file_overhead", saved, cost)
    return Verdict(False, "not_worth_it", saved, cost)


def chunks(policy: CompactionPolicy, row_bytes: Sequence[int]) -> list[tuple[int, int]]:
    """Cut a run (bytes per rank of each row, root first) into ``[lo, hi)`` merges.

    Greedy from the root: a chunk grows while it stays within ``max_merge_rows`` and
    ``max_merge_bytes``; chunks of one row are dropped (nothing to merge).
    """
    out: list[tuple[int, int]] = []
    lo, acc = 0, 0
    for i, b in enumerate(row_bytes):
        if i > lo and (i - lo >= policy.max_merge_rows or acc + b > policy.max_merge_bytes):
            if i - lo >= 2:
                out.append((lo, i))
            lo, acc = i, 0
        acc += b
    if len(row_bytes) - lo >= 2:
        out.append((lo, len(row_bytes)))
    return out
