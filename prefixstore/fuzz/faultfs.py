"""A fault-injecting FileSystem over the real disk: power loss, I/O errors, damage at rest.

``FaultFS`` implements ``prefixstore.gpu.fileio.FileSystem``. Every file it writes
really exists on disk (so the SQLite catalog, which does not go through this layer, and
``audit`` work normally), while it tracks what a power loss would keep, in the manner
of RocksDB's fault-injection FS and SQLite's crash VFS. ``crash(mode)`` rewrites the
real directory tree into the post-power-loss state. ``FaultPlan`` injects ENOSPC/EIO
(or any errno) per op, rank, call number or seeded probability. ``CrashAt`` is a
``FaultHook`` that kills the process model (raises ``SimulatedCrash``) at the nth
effect point. Everything random draws from seeded RNGs: one seed replays a run.

Power-loss model (the rules ``crash()`` applies; tests/test_faultfs.py checks each):

1. A file's *data* is durable as of its last successful ``fsync(path)``; each file
   (inode) remembers those bytes, or "never synced". Names do not matter: the bytes
   follow the file through renames and unlinks.
2. A *directory entry* change (create by ``write_new``, ``rename_new``, ``unlink``) is
   pending until ``fsync_dir(d)`` is called on its directory *after* it: the file's
   directory for a create/unlink, the *destination's* directory for a rename (the
   rename is atomic: once durable, both the removal of ``src`` and the new ``dst`` are).
   ``fsync_dir(d)`` also commits, in order, the earlier pending changes that the
   committed ones depend on (same file, or same name), as a journal would.
3. At a crash each tracked name ends up holding what its durable entry says:
   - a create not durable -> the name disappears;
   - a rename not durable -> the file is back under its old name (and gone from the new);
   - an unlink not durable -> the file reappears, with its durable data (rule 4).
4. The content of each surviving file is its data as of rule 1. Bytes beyond the last
   fsync are lost: mode ``"drop"`` truncates to the synced bytes (a durable entry to a
   never-synced file is left empty, as on a journaling fs: the entry is durable, the
   data is not); mode ``"garble"`` keeps the synced bytes and replaces the unsynced
   rest, up to the length the file had, with seeded random bytes.
5. A failed ``fsync`` poisons the file: later fsyncs of it succeed but never make its
   data durable (Linux drops dirty pages after a writeback error; see STYLE.md: never
   retry a failed fsync as if nothing happened).
6. Files this layer has not created or touched (e.g. present before it started, or
   after the last crash) are durable. Directories (``makedirs``) are durable at once.
   Damage at rest (``flip_bit``, ``truncate``, ``delete``...) is durable at once.
7. After ``crash()`` the disk holds the post-power-loss state and tracking restarts
   clean: everything on disk is durable.

The engine fsyncs a shard before renaming it into place and fsyncs the rank directory
after the rename, so a published shard survives; anything short of that must not.
Rank processes in other OS processes do not share this state (one FaultFS per process).
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import os
import random
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Literal

import attrs

from prefixstore.base.errors import SimulatedCrash
from prefixstore.gpu.fileio import FaultHook, OsFS

__all__ = [
    "OPS",
    "ChainHook",
    "CountingHook",
    "CrashAt",
    "CrashReport",
    "FaultFS",
    "FaultPlan",
    "FaultRule",
    "Injected",
    "SimulatedCrash",
    "count_crash_points",
    "delete",
    "enumerate_crash_points",
    "flip_bit",
    "rank_of",
    "run_to_crash",
    "swap_contents",
    "truncate",
    "zero_length",
]

OPS: tuple[str, ...] = ("write", "fsync", "rename", "fsync_dir", "unlink", "read")
"""Ops that FaultFS can fail (the FaultHook op names, less 'commit')."""

CrashMode = Literal["drop", "garble"]
_RANK_DIR = re.compile(r"rank(\d+)")


def rank_of(path: str) -> int | None:
    """The rank of a path: its last ``rank{r}`` component, None if it has none."""
    for part in reversed(os.path.normpath(path).split(os.sep)):
        m = _RANK_DIR.fullmatch(part)
        if m:
            return int(m.group(1))
    return None


def _norm(path: str) -> str:
    return os.path.normpath(os.path.abspath(path))


# --------------------------------------------------------------------------------------
# Fault plans: which calls fail, and with which errno
# --------------------------------------------------------------------------------------


@attrs.define
class FaultRule:
    """Fail matching calls of ``op`` with ``err``.

    A call matches when its op is ``op``, its rank is ``rank`` (None: any rank) and,
    if ``match`` is given, ``match`` is a substring of its target path. The rule fires
    on the ``at``-th matching call (1-based; with ``persistent``, on it and every later
    one) and/or with ``probability`` per matching call. A failed write leaves a file
    holding a seeded-random prefix of the data when ``partial`` (a short write).
    """

    op: str
    err: str = "EIO"
    rank: int | None = None
    at: int | None = None
    persistent: bool = False
    probability: float = 0.0
    partial: bool = True
    match: str | None = None
    seen: int = 0
    """Matching calls so far."""
    fired: int = 0
    """Faults this rule injected so far."""

    def __attrs_post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; known: {OPS}")
        if not isinstance(getattr(errno_mod, self.err, None), int):
            raise ValueError(f"unknown errno name {self.err!r}")
        if self.at is not None and self.at < 1:
            raise ValueError(f"at is 1-based, got {self.at}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1], got {self.probability}")
        if self.persistent and self.at is None:
            raise ValueError("persistent needs at (the first failing call)")

    @property
    def errno(self) -> int:
        """The numeric errno."""
        return int(getattr(errno_mod, self.err))

    def matches(self, op: str, target: str, rank: int | None) -> bool:
        """Whether a call is one this rule counts."""
        return (
            op == self.op
            and (self.rank is None or rank == self.rank)
            and (self.match is None or self.match in target)
        )


@attrs.frozen
class Injected:
    """One injected fault: the call it failed and the rule's errno name."""

    op: str
    target: str
    rank: int | None
    err: str
    call: int
    """The op's call number (1-based, counted over all ranks)."""


class FaultPlan:
    """A list of FaultRules plus the counters of what was called and what was injected.

    ``calls[op]`` counts calls per op, ``calls_by_rank[(op, rank)]`` per op and rank,
    ``injected['write:ENOSPC']`` faults per kind, ``log`` every injected fault in order.
    Probabilistic rules draw from one seeded stream per (rule, rank), so runs replay
    even when ranks call concurrently. ``at`` counts matching calls in arrival order:
    with concurrent ranks, give the rule a rank for a reproducible choice.
    """

    def __init__(self, rules: Iterable[FaultRule] = (), seed: int = 0) -> None:
        self.rules: list[FaultRule] = list(rules)
        self.seed = seed
        self._rngs: dict[tuple[int, int | None], random.Random] = {}
        self.calls: Counter[str] = Counter()
        self.calls_by_rank: Counter[tuple[str, int | None]] = Counter()
        self.injected: Counter[str] = Counter()
        self.log: list[Injected] = []
        self.enabled = True

    def add(
        self,
        op: str,
        err: str = "EIO",
        *,
        rank: int | None = None,
        at: int | None = None,
        persistent: bool = False,
        probability: float = 0.0,
        partial: bool = True,
        match: str | None = None,
    ) -> FaultRule:
        """Add a rule and return it."""
        rule = FaultRule(op, err, rank, at, persistent, probability, partial, match)
        self.rules.append(rule)
        return rule

    def fail_nth(
        self,
        op: str,
        n: int,
        err: str = "EIO",
        *,
        rank: int | None = None,
        persistent: bool = False,
    ) -> FaultRule:
        """Fail the nth matching call (and every later one if ``persistent``)."""
        return self.add(op, err, rank=rank, at=n, persistent=persistent)

    def fail_randomly(
        self, op: str, probability: float, err: str = "EIO", *, rank: int | None = None
    ) -> FaultRule:
        """Fail each matching call with ``probability``."""
        return self.add(op, err, rank=rank, probability=probability)

    @property
    def total_injected(self) -> int:
        """Faults injected so far, all kinds."""
        return sum(self.injected.values())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inject nothing inside the block (calls are still counted, rules are not)."""
        was, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = was

    def _rng(self, rule_index: int, rank: int | None) -> random.Random:
        key = (rule_index, rank)
        if key not in self._rngs:
            self._rngs[key] = random.Random(f"{self.seed}/rule{rule_index}/rank{rank}")
        return self._rngs[key]

    def check(self, op: str, target: str, rank: int | None) -> FaultRule | None:
        """Count a call; return the rule that fails it, or None.

        Every matching rule counts the call (so ``at`` means the same whatever other
        rules exist) and draws if probabilistic; the first firing rule wins.
        """
        self.calls[op] += 1
        self.calls_by_rank[(op, rank)] += 1
        if not self.enabled:
            return None
        chosen: FaultRule | None = None
        for i, rule in enumerate(self.rules):
            if not rule.matches(op, target, rank):
                continue
            rule.seen += 1
            fire = rule.at is not None and (
                rule.seen == rule.at or (rule.persistent and rule.seen >= rule.at)
            )
            if rule.probability > 0.0 and self._rng(i, rank).random() < rule.probability:
                fire = True
            if fire and chosen is None:
                chosen = rule
        if chosen is not None:
            chosen.fired += 1
            self.injected[f"{op}:{chosen.err}"] += 1
            self.log.append(Injected(op, target, rank, chosen.err, self.calls[op]))
        return chosen


# --------------------------------------------------------------------------------------
# Damage at rest (plain functions on real files; FaultFS has tracked versions)
# --------------------------------------------------------------------------------------


def flip_bit(path: str, offset: int, bit: int = 0) -> None:
    """Flip bit ``bit`` (0-7) of the byte at ``offset`` of a file, in place."""
    if not 0 <= bit < 8:
        raise ValueError(f"bit must be in 0..7, got {bit}")
    with open(path, "r+b", buffering=0) as f:
        f.seek(offset)
        b = f.read(1)
        if len(b) != 1:
            raise ValueError(f"offset {offset} is past the end of {path}")
        f.seek(offset)
        f.write(bytes([b[0] ^ (1 << bit)]))


def truncate(path: str, n: int) -> None:
    """Cut a file to its first ``n`` bytes."""
    os.truncate(path, n)


def zero_length(path: str) -> None:
    """Empty a file (it keeps its name)."""
    os.truncate(path, 0)


def delete(path: str) -> None:
    """Remove a file."""
    os.unlink(path)


def swap_contents(a: str, b: str) -> None:
    """Exchange the bytes of two files (each keeps its name)."""
    with open(a, "rb") as f:
        da = f.read()
    with open(b, "rb") as f:
        db = f.read()
    for path, data in ((a, db), (b, da)):
        with open(path, "wb") as f:
            f.write(data)


# --------------------------------------------------------------------------------------
# FaultFS
# --------------------------------------------------------------------------------------


@attrs.define
class _File:
    """One inode: its durable bytes and the length its content last had."""

    synced: bytes | None
    length: int
    poisoned: bool = False


@attrs.frozen
class _DirOp:
    """A pending directory-entry change; durable once ``commit_dir`` is fsynced."""

    kind: Literal["create", "rename", "unlink"]
    fid: int
    path: str
    src: str | None
    commit_dir: str

    def names(self) -> tuple[str, ...]:
        return (self.path,) if self.src is None else (self.path, self.src)

    def describe(self) -> str:
        if self.kind == "rename":
            return f"rename {self.src} -> {self.path}"
        return f"{self.kind} {self.path}"


@attrs.frozen
class CrashReport:
    """What a crash changed on disk, by path (sorted)."""

    mode: str
    removed: tuple[str, ...]
    """Names that disappeared (undurable creates, renames' new names)."""
    restored: tuple[str, ...]
    """Names that came back (undurable unlinks, renames' old names)."""
    rewritten: tuple[str, ...]
    """Names that stayed but whose bytes changed (unsynced data dropped or garbled)."""

    @property
    def changed(self) -> bool:
        """Whether the crash changed anything."""
        return bool(self.removed or self.restored or self.rewritten)


class FaultFS:
    """A ``FileSystem`` on the real disk that tracks durability and injects faults.

    ``plan`` decides which calls fail (an empty plan: none). ``seed`` drives short-write
    lengths (one stream per rank), garbled bytes (drawn in name order) and random bit
    flips, so a run replays even with ranks writing concurrently. ``real_sync`` also issues the real fsyncs (off by
    default: durability is simulated, so tests stay fast). Thread-safe.
    """

    def __init__(
        self, plan: FaultPlan | None = None, seed: int = 0, real_sync: bool = False
    ) -> None:
        self.plan = plan if plan is not None else FaultPlan(seed=seed)
        self.seed = seed
        self.real_sync = real_sync
        self._rngs: dict[str, random.Random] = {}
        self.crashes = 0
        self._os = OsFS()
        self._lock = threading.RLock()
        self._reset()

    def _reset(self) -> None:
        self._files: dict[int, _File] = {}
        self._live: dict[str, int] = {}  # name -> fid, as the running system sees it
        self._durable: dict[str, int] = {}  # name -> fid, as a crash would leave it
        self._pending: list[_DirOp] = []
        self._next_fid = 0
        self.acknowledged: list[tuple[str, str]] = []
        """(op, target) of every call that succeeded since the last crash, in order."""

    # -- FileSystem protocol ----------------------------------------------------------

    def write_new(self, path: str, data: bytes | memoryview) -> None:
        """Create ``path`` exclusively and write ``data`` (no sync)."""
        path = _norm(path)
        with self._lock:
            rule = self.plan.check("write", path, rank_of(path))
            if rule is not None:
                if os.path.lexists(path):
                    raise FileExistsError(errno_mod.EEXIST, "file exists", path)
                view = memoryview(data).cast("B")
                if rule.partial:
                    # a short write: the file exists and holds a prefix of the data
                    rng = self._rng(f"short/rank{rank_of(path)}")
                    keep = rng.randrange(len(view)) if len(view) else 0
                    self._os.write_new(path, view[:keep])
                    self._track_create(path, keep)
                raise self._error(rule, path)
            self._os.write_new(path, data)
            self._track_create(path, memoryview(data).nbytes)
            self.acknowledged.append(("write", path))

    def fsync(self, path: str) -> None:
        """Make the file's current bytes durable (rule 1), unless it is poisoned."""
        path = _norm(path)
        with self._lock:
            rule = self.plan.check("fsync", path, rank_of(path))
            if rule is not None:
                if os.path.lexists(path):
                    self._files[self._fid_at(path)].poisoned = True
                raise self._error(rule, path)
            if self.real_sync:
                self._os.fsync(path)
            fid = self._fid_at(path)
            data = self._os.read(path)
            f = self._files[fid]
            f.length = len(data)
            if not f.poisoned:
                f.synced = data
            self.acknowledged.append(("fsync", path))

    def rename_new(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst``, refusing to overwrite; durable per rule 2."""
        src, dst = _norm(src), _norm(dst)
        with self._lock:
            rule = self.plan.check("rename", dst, rank_of(dst))
            if rule is not None:
                raise self._error(rule, dst)
            fid = self._fid_at(src) if os.path.lexists(src) else None
            self._os.rename_new(src, dst)
            assert fid is not None  # rename_new raised otherwise
            del self._live[src]
            self._live[dst] = fid
            self._pending.append(_DirOp("rename", fid, dst, src, os.path.dirname(dst)))
            self.acknowledged.append(("rename", dst))

    def fsync_dir(self, path: str) -> None:
        """Make the pending entry changes of directory ``path`` durable (rule 2)."""
        path = _norm(path)
        with self._lock:
            rule = self.plan.check("fsync_dir", path, rank_of(path))
            if rule is not None:
                raise self._error(rule, path)
            if not os.path.isdir(path):
                raise FileNotFoundError(errno_mod.ENOENT, "no such directory", path)
            if self.real_sync:
                self._os.fsync_dir(path)
            self._commit([i for i, op in enumerate(self._pending) if op.commit_dir == path])
            self.acknowledged.append(("fsync_dir", path))

    def unlink(self, path: str) -> None:
        """Remove ``path``; the removal is durable per rule 2."""
        path = _norm(path)
        with self._lock:
            rule = self.plan.check("unlink", path, rank_of(path))
            if rule is not None:
                raise self._error(rule, path)
            fid = self._fid_at(path) if os.path.lexists(path) else None
            self._os.unlink(path)
            assert fid is not None  # unlink raised otherwise
            del self._live[path]
            self._pending.append(_DirOp("unlink", fid, path, None, os.path.dirname(path)))
            self.acknowledged.append(("unlink", path))

    def read(self, path: str) -> bytes:
        """The file's bytes."""
        path = _norm(path)
        with self._lock:
            rule = self.plan.check("read", path, rank_of(path))
            if rule is not None:
                raise self._error(rule, path)
        return self._os.read(path)

    def size(self, path: str) -> int | None:
        """The file's size, None if missing (never fails)."""
        return self._os.size(path)

    def exists(self, path: str) -> bool:
        """Whether the entry exists, whatever it is (a symlink counts)."""
        return self._os.exists(path)

    def listdir(self, path: str) -> list[str]:
        """Sorted names in a directory, [] if it is missing (never fails)."""
        return self._os.listdir(path)

    def makedirs(self, path: str) -> None:
        """Create a directory and its parents (durable at once, rule 6)."""
        self._os.makedirs(path)

    # -- power loss -------------------------------------------------------------------

    def crash(self, mode: CrashMode = "drop") -> CrashReport:
        """Simulate power loss: rewrite the disk to what would survive, restart tracking."""
        if mode not in ("drop", "garble"):
            raise ValueError(f"unknown crash mode {mode!r}; use 'drop' or 'garble'")
        with self._lock:
            names = set(self._live) | set(self._durable)
            for op in self._pending:
                names.update(op.names())
            rng = self._rng(f"crash{self.crashes}")
            contents: dict[int, bytes] = {}
            for name in sorted(self._durable):  # by name, not fid: thread order is not seeded
                fid = self._durable[name]
                if fid not in contents:
                    contents[fid] = self._crash_content(self._files[fid], mode, rng)
            removed: list[str] = []
            restored: list[str] = []
            rewritten: list[str] = []
            for name in sorted(names):  # removals first: a restored name may be free now
                if name not in self._durable and os.path.lexists(name):
                    os.unlink(name)
                    removed.append(name)
            for name in sorted(names):
                fid = self._durable.get(name)
                if fid is None:
                    continue
                want = contents[fid]
                if not os.path.lexists(name):
                    restored.append(name)
                elif self._os.read(name) == want:
                    continue
                else:
                    rewritten.append(name)
                os.makedirs(os.path.dirname(name), exist_ok=True)
                with open(name, "wb") as f:
                    f.write(want)
            self.crashes += 1
            self._reset()
            return CrashReport(mode, tuple(removed), tuple(restored), tuple(rewritten))

    def sync_all(self) -> None:
        """Make everything durable (a clean shutdown): all data and entry changes."""
        with self._lock:
            for name, fid in self._live.items():
                f = self._files[fid]
                try:
                    data = self._os.read(name)
                except FileNotFoundError:  # removed behind this layer's back
                    continue
                f.synced, f.length, f.poisoned = data, len(data), False
            self._commit(list(range(len(self._pending))))

    def unsynced(self) -> list[str]:
        """Live names whose bytes a crash would not keep as they are (rule 4)."""
        with self._lock:
            out = []
            for name, fid in sorted(self._live.items()):
                f = self._files[fid]
                if f.synced is None or len(f.synced) != f.length:
                    out.append(name)
            return out

    def pending(self) -> list[str]:
        """Directory changes not yet durable, in order ("create p", "rename a -> b")."""
        with self._lock:
            return [op.describe() for op in self._pending]

    def is_durable(self, path: str) -> bool:
        """Whether a crash now would keep ``path`` with exactly its current bytes."""
        path = _norm(path)
        with self._lock:
            if path not in self._live:
                return path not in self._durable and os.path.lexists(path)
            return self._durable.get(path) == self._live[path] and path not in self.unsynced()

    # -- damage at rest (durable at once, rule 6) ----------------------------------------

    def flip_bit(self, path: str, offset: int, bit: int = 0) -> None:
        """Flip one bit of a file at rest."""
        path = _norm(path)
        with self._lock:
            flip_bit(path, offset, bit)
            self._settle(path)

    def flip_random_bit(self, path: str) -> tuple[int, int]:
        """Flip a seeded-random bit of a non-empty file; return (offset, bit)."""
        path = _norm(path)
        with self._lock:
            n = os.path.getsize(path)
            if n == 0:
                raise ValueError(f"{path} is empty")
            rng = self._rng("damage")
            offset, bit = rng.randrange(n), rng.randrange(8)
            self.flip_bit(path, offset, bit)
            return offset, bit

    def truncate(self, path: str, n: int) -> None:
        """Cut a file at rest to ``n`` bytes."""
        path = _norm(path)
        with self._lock:
            truncate(path, n)
            self._settle(path)

    def zero_length(self, path: str) -> None:
        """Empty a file at rest."""
        path = _norm(path)
        with self._lock:
            zero_length(path)
            self._settle(path)

    def swap(self, a: str, b: str) -> None:
        """Exchange two files' bytes at rest."""
        a, b = _norm(a), _norm(b)
        with self._lock:
            swap_contents(a, b)
            self._settle(a)
            self._settle(b)

    def delete(self, path: str) -> None:
        """Remove a file at rest; no crash brings it back."""
        path = _norm(path)
        with self._lock:
            delete(path)
            fid = self._live.pop(path, None)
            if fid is None:
                return
            self._files.pop(fid, None)
            self._durable = {n: f for n, f in self._durable.items() if f != fid}
            self._pending = [op for op in self._pending if op.fid != fid]

    # -- internal helpers -------------------------------------------------------------

    def _rng(self, stream: str) -> random.Random:
        """A seeded stream per purpose (and per rank for short writes)."""
        if stream not in self._rngs:
            self._rngs[stream] = random.Random(f"{self.seed}/{stream}")
        return self._rngs[stream]

    @staticmethod
    def _error(rule: FaultRule, path: str) -> OSError:
        return OSError(rule.errno, f"injected {rule.err} on {rule.op}", path)

    def _new_fid(self, synced: bytes | None, length: int) -> int:
        fid = self._next_fid
        self._next_fid += 1
        self._files[fid] = _File(synced, length)
        return fid

    def _track_create(self, path: str, length: int) -> None:
        fid = self._new_fid(None, length)
        self._live[path] = fid
        self._pending.append(_DirOp("create", fid, path, None, os.path.dirname(path)))

    def _fid_at(self, path: str) -> int:
        """The tracked file at ``path``; a file not seen before is adopted as durable."""
        fid = self._live.get(path)
        if fid is not None:
            return fid
        data = self._os.read(path)  # raises FileNotFoundError if missing
        fid = self._new_fid(data, len(data))
        self._live[path] = fid
        if path not in self._durable:  # else: a pending unlink/rename still owns the name
            self._durable[path] = fid
        return fid

    def _settle(self, path: str) -> None:
        """Make a file's current bytes and name durable (damage at rest)."""
        fid = self._fid_at(path)
        data = self._os.read(path)
        f = self._files[fid]
        f.synced, f.length, f.poisoned = data, len(data), False
        deps = [i for i, op in enumerate(self._pending) if op.fid == fid]
        self._commit(deps)

    def _commit(self, chosen: list[int]) -> None:
        """Apply pending ops ``chosen`` (indices) and the earlier ones they depend on."""
        if not chosen:
            return
        take = set(chosen)
        changed = True
        while changed:  # close over earlier ops on the same file or the same name
            changed = False
            for j in range(max(take)):
                if j in take:
                    continue
                op = self._pending[j]
                names = set(op.names())
                for i in take:
                    later = self._pending[i]
                    if i > j and (later.fid == op.fid or names & set(later.names())):
                        take.add(j)
                        changed = True
                        break
        for i in sorted(take):
            op = self._pending[i]
            if op.kind == "create":
                self._durable[op.path] = op.fid
            elif op.kind == "unlink":
                if self._durable.get(op.path) == op.fid:
                    del self._durable[op.path]
            else:
                assert op.src is not None
                if self._durable.get(op.src) == op.fid:
                    del self._durable[op.src]
                self._durable[op.path] = op.fid
        self._pending = [op for i, op in enumerate(self._pending) if i not in take]
        live_fids = set(self._live.values()) | set(self._durable.values())
        live_fids.update(op.fid for op in self._pending)
        for fid in [f for f in self._files if f not in live_fids]:
            del self._files[fid]  # durably unlinked and closed: nothing can bring it back

    def _crash_content(self, f: _File, mode: CrashMode, rng: random.Random) -> bytes:
        base = b"" if f.synced is None else f.synced
        if mode == "drop":
            return base
        extra = f.length - len(base)
        return base + (rng.randbytes(extra) if extra > 0 else b"")


# --------------------------------------------------------------------------------------
# In-process crashes: hooks that count effect points and raise SimulatedCrash
# --------------------------------------------------------------------------------------


class CountingHook(FaultHook):
    """Counts (and records) effect points: each ``before`` and each ``after`` is one.

    Only points whose op is in ``ops`` (None: all, including 'commit') and whose rank is
    ``rank`` (None: any) count.
    """

    def __init__(self, *, rank: int | None = None, ops: Iterable[str] | None = None) -> None:
        self.rank = rank
        self.ops = None if ops is None else frozenset(ops)
        self.count = 0
        self.points: list[tuple[str, str, str, int | None]] = []
        """(when, op, target, rank) of every counted point, when in {'before', 'after'}."""

    def _counts(self, op: str, rank: int | None) -> bool:
        return (self.ops is None or op in self.ops) and (self.rank is None or rank == self.rank)

    def _point(self, when: str, op: str, target: str, rank: int | None) -> None:
        if self._counts(op, rank):
            self.points.append((when, op, target, rank))
            self.count += 1

    def before(self, op: str, target: str, rank: int | None) -> None:
        self._point("before", op, target, rank)

    def after(self, op: str, target: str, rank: int | None) -> None:
        self._point("after", op, target, rank)


class CrashAt(CountingHook):
    """Raises ``SimulatedCrash`` at counted point ``n`` (0-based); None never crashes.

    A crash at a ``before`` point prevents the effect; at an ``after`` point the effect
    happened but its caller never learns it (a death inside the effect). After firing it
    stays quiet, so cleanup code the test runs later is not interrupted.
    """

    def __init__(
        self, n: int | None, *, rank: int | None = None, ops: Iterable[str] | None = None
    ) -> None:
        super().__init__(rank=rank, ops=ops)
        self.n = n
        self.fired: tuple[str, str, str, int | None] | None = None
        """The point it crashed at, once it has."""

    def _point(self, when: str, op: str, target: str, rank: int | None) -> None:
        if not self._counts(op, rank):
            return
        index = self.count
        super()._point(when, op, target, rank)
        if self.fired is None and index == self.n:
            self.fired = (when, op, target, rank)
            raise SimulatedCrash(f"simulated crash at point {index}: {when} {op} {target}")


class ChainHook(FaultHook):
    """Calls several hooks in order (e.g. a CrashAt beside a recorder)."""

    def __init__(self, *hooks: FaultHook) -> None:
        self.hooks = hooks

    def before(self, op: str, target: str, rank: int | None) -> None:
        for h in self.hooks:
            h.before(op, target, rank)

    def after(self, op: str, target: str, rank: int | None) -> None:
        for h in self.hooks:
            h.after(op, target, rank)


def count_crash_points(
    run: Callable[[FaultHook], object], *, rank: int | None = None, ops: Iterable[str] | None = None
) -> int:
    """Run ``run(hook)`` once with a counting hook; the number of crash points it has."""
    hook = CountingHook(rank=rank, ops=ops)
    run(hook)
    return hook.count


def run_to_crash(
    run: Callable[[FaultHook], object],
    n: int,
    *,
    rank: int | None = None,
    ops: Iterable[str] | None = None,
) -> CrashAt:
    """Run ``run(CrashAt(n))``, swallowing its SimulatedCrash; return the hook."""
    hook = CrashAt(n, rank=rank, ops=ops)
    try:
        run(hook)
    except SimulatedCrash:
        if hook.fired is None:
            raise
    return hook


def enumerate_crash_points(
    run: Callable[[FaultHook], object], *, rank: int | None = None, ops: Iterable[str] | None = None
) -> Iterator[CrashAt]:
    """Crash ``run`` at each of its points in turn, yielding the hook after each run.

    ``run(hook)`` must set up fresh state each call and use ``hook`` for every effect;
    check the state it left (recover, audit) when each hook is yielded. Raises
    RuntimeError if a point learned from the counting run is not reached again.
    """
    total = count_crash_points(run, rank=rank, ops=ops)
    for i in range(total):
        hook = run_to_crash(run, i, rank=rank, ops=ops)
        if hook.fired is None:
            raise RuntimeError(
                f"crash point {i} of {total} was not reached: the operation is not deterministic"
            )
        yield hook
