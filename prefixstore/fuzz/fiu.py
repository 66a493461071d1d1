"""Real I/O faults through libfiu: ENOSPC and EIO returned by the C library itself.

The workload runs in a child started with ``fiu-run -x`` (Debian package
``fiu-utils``): libfiu's POSIX preload wraps libc's ``write``, ``pwrite``, ``read``,
``pread``, ``fsync``, ``fdatasync``, ``rename`` and ``unlink``. The child enables the
failure points through libfiu's C API (ctypes) with an external callback: once armed,
each call through a point fails with probability ``p``, with ENOSPC or EIO drawn from a
seeded RNG, and is counted by point and errno. Python's ``os.write`` / ``os.fsync`` /
``os.rename`` / ``os.unlink`` and unbuffered reads (the engine's shard effects) call
``write`` / ``fsync`` / ``rename`` / ``unlink`` / ``read``; SQLite's unix VFS calls
``pwrite`` / ``pread`` / ``fdatasync`` (the catalog). Targets: ``files`` (the shard
effects), ``catalog`` (SQLite's I/O), ``all``.

Setup (creating the cache, warm-up operations so no lazy import reads a file while
armed) runs unarmed; then N operations run armed: stores, lookups with restores
checked bit for bit, evictions of single checkpoints, reclaims, retries, and reopens
(recovery under faults). Any exception, of a call or of an open, is counted by type:
a ``PrefixStoreError`` is a typed error; anything else is "untyped". After a catalog
error (CatalogIOError: the engine refuses mutations until reopened) the engine is
closed and reopened, as a server would. The child disarms before it prints its JSON
result (printing while armed could itself fail), then exits without closing the engine.

Then the parent, without faults, opens the cache (recovery), audits it with
checksums, checks that the journal is empty and that every store acknowledged
(stored, refilled, duplicate) and not since evicted by the driver restores
bit-identically. The capacity is far above the data set, so the policy never evicts.

Run: ``prefixstore fiu [--target all] [--ops 400] [--p 0.05] [--seed 0] [--json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import traceback
from collections import Counter
from typing import Any

import attrs
import torch

from prefixstore.base.errors import CatalogIOError, EngineClosedError, PrefixStoreError
from prefixstore.base.keys import Prefix
from prefixstore.engine.api import Engine
from prefixstore.fuzz.soak import (
    BT,
    CAPACITY,
    CONVERSATIONS,
    MAX_BLOCKS,
    conv_tokens,
    soak_layout,
    tensors,
    verify_restore,
)
from prefixstore.gpu.ranks import LocalRank

POINTS = {
    "files": ["posix/io/oc/open", "posix/io/rw/write", "posix/io/sync/fsync", "posix/io/dir/rename",
              "posix/io/dir/unlink", "posix/io/rw/read"],
    "catalog": ["posix/io/rw/pwrite", "posix/io/rw/pread", "posix/io/sync/fdatasync"],
}
POINTS["all"] = POINTS["files"] + POINTS["catalog"]
ERRNOS = (errno.ENOSPC, errno.EIO)
RANKS = 2


def fiu_available() -> bool:
    """Whether ``fiu-run`` and libfiu's POSIX preload are installed."""
    return shutil.which("fiu-run") is not None


# ---------------------------------------------------------------------- the child


_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int),
                       ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint))


class Injector:
    """libfiu failure points driven by a seeded, counting callback."""

    def __init__(self, points: list[str], probability: float, seed: int) -> None:
        if "fiu_posix_preload" not in os.environ.get("LD_PRELOAD", ""):
            raise RuntimeError("not running under `fiu-run -x`: libc calls are not intercepted")
        self.lib = ctypes.CDLL("libfiu.so.0")
        self.lib.fiu_enable_external.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p,
                                                 ctypes.c_uint, _CB]
        self.lib.fiu_disable.argtypes = [ctypes.c_char_p]
        self.points, self.p = points, probability
        self.rng = random.Random(seed)
        self.armed = False
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._cb = _CB(self._decide)  # keep a reference: libfiu holds only the pointer
        for name in points:
            if self.lib.fiu_enable_external(name.encode(), 1, None, 0, self._cb) != 0:
                raise RuntimeError(f"libfiu refused failure point {name}")

    def _decide(self, name, _failnum, failinfo, _flags) -> int:
        if not self.armed:
            return 0
        with self._lock:
            if self.rng.random() >= self.p:
                return 0
            err = self.rng.choice(ERRNOS)
            self.counts[f"{name.decode()} {errno.errorcode[err]}"] += 1
        failinfo[0] = err
        return 1

    @contextlib.contextmanager
    def unarmed(self):
        was, self.armed = self.armed, False
        try:
            yield
        finally:
            self.armed = was

    def close(self) -> None:
        self.armed = False
        for name in self.points:
            self.lib.fiu_disable(name.encode())


def _open(root: str, inj: Injector | None, res: Counter[str], examples: dict[str, str]):
    for _ in range(8):
        try:
            return Engine.open(root, soak_layout(RANKS), CAPACITY)
        except Exception as exc:  # recovery under faults may fail (with a typed error); it is retried
            typed = isinstance(exc, PrefixStoreError)
            kind = f"{'' if typed else 'untyped '}open failed ({type(exc).__name__})"
            res[kind] += 1
            examples.setdefault(kind, str(exc)[:200] + ("" if typed else f" at {_where(exc)}"))
    assert inj is not None
    with inj.unarmed():
        res["open without faults after 8 failures"] += 1
        return Engine.open(root, soak_layout(RANKS), CAPACITY)


def _where(exc: BaseException) -> str:
    """The innermost project frames an exception passed through (``module:line`` each)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "prefixstore" in f.filename]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames[-4:]))


def _plant_swallow_write_errors() -> None:
    """A planted bug: a rank's shard write ignores I/O errors (reports success)."""
    orig = LocalRank.write_shard

    def careless(self: LocalRank, name: str, data: bytes) -> None:
        with contextlib.suppress(OSError):
            orig(self, name, data)

    LocalRank.write_shard = careless  # type: ignore[method-assign]


PLANTS = {"swallow-write-errors": _plant_swallow_write_errors}


def child_main(root: str, target: str, ops: int, probability: float, seed: int,
               plant: str | None = None) -> dict[str, Any]:
    """The armed workload; returns its figures (printed as JSON by ``__main__``)."""
    if plant is not None:
        PLANTS[plant]()
    torch.set_num_threads(1)
    inj = Injector(POINTS[target], probability, seed)
    rng = random.Random(seed)
    out: Counter[str] = Counter()
    acked: dict[tuple[int, int], bool] = {}
    wrong: list[str] = []
    examples: dict[str, str] = {}
    eng = _open(root, None, out, examples)
    layout = eng.layout
    # warm-up, unarmed: every code path once (lazy imports read files)
    for conv in range(CONVERSATIONS):
        toks = conv_tokens(conv)[: 3 * BT]
        if eng.store(Prefix.from_tokens(toks, BT), *tensors(layout, toks)).ok:
            acked[(conv, 3)] = True
        verify_restore(eng, layout, toks)
    eng.reclaim()
    eng.retry_pending()
    eng.audit()
    eng.stats()
    eng.close()
    eng = _open(root, None, out, examples)
    inj.armed = True
    try:
        for _ in range(ops):
            conv, blocks = rng.randrange(CONVERSATIONS), rng.randint(1, MAX_BLOCKS)
            toks = conv_tokens(conv)[: blocks * BT]
            roll = rng.random()
            try:
                if roll < 0.5:
                    r = eng.store(Prefix.from_tokens(toks, BT), *tensors(layout, toks))
                    out[f"store {r.status}"] += 1
                    if r.ok:
                        acked[(conv, blocks)] = True
                elif roll < 0.85:
                    got, bad = verify_restore(eng, layout, toks)
                    out["restore served" if got else "restore miss"] += 1
                    if bad is not None:
                        wrong.append(f"conversation {conv} at {blocks} blocks: {bad}")
                elif roll < 0.93:
                    acked.pop((conv, blocks), None)  # announced before the call
                    eng.evict(prefix=Prefix.from_tokens(toks, BT))
                    out["evict"] += 1
                elif roll < 0.97:
                    eng.reclaim()
                    out["reclaim"] += 1
                else:
                    eng.close()
                    out["reopen"] += 1
                    eng = _open(root, inj, out, examples)
            except Exception as exc:
                typed = isinstance(exc, PrefixStoreError)
                kind = f"{'typed' if typed else 'untyped'} error {type(exc).__name__}"
                out[kind] += 1
                examples.setdefault(kind, str(exc)[:200] + ("" if typed else f" at {_where(exc)}"))
                if not typed or isinstance(exc, CatalogIOError | EngineClosedError):
                    with contextlib.suppress(Exception):
                        eng.close()
                    out["reopen after a catalog error"] += 1
                    eng = _open(root, inj, out, examples)
    finally:
        inj.armed = False
    inj.close()  # the engine is not closed: the parent's recovery finds what the faults left
    return {"target": target, "ops": ops, "probability": probability, "seed": seed,
            "injected": sum(inj.counts.values()), "faults": dict(sorted(inj.counts.items())),
            "outcomes": dict(sorted(out.items())), "errors": examples, "wrong_bytes": wrong,
            "acked": sorted(acked)}


# ---------------------------------------------------------------------- the parent


@attrs.define
class FiuResult:
    """The child's figures plus the fault-free check after it."""

    child: dict[str, Any]
    audit_ok: bool = False
    violations: list[str] = attrs.field(factory=list)
    journal_after_recovery: int = 0
    recovered: dict[str, Any] = attrs.field(factory=dict)
    acked_checked: int = 0
    lost: list[str] = attrs.field(factory=list)

    @property
    def ok(self) -> bool:
        return (self.audit_ok and not self.lost and not self.child.get("wrong_bytes")
                and not self.journal_after_recovery and self.child.get("injected", 0) > 0)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, **attrs.asdict(self)}


def run_under_fiu(root: str, *, target: str = "all", ops: int = 400, probability: float = 0.05,
                  seed: int = 0, timeout: float = 300, plant: str | None = None) -> FiuResult:
    """Run the armed workload in ``fiu-run -x``, then recover and audit without faults."""
    env = {**os.environ, "PREFIXSTORE_LOG_LEVEL": "CRITICAL"}
    cmd = ["fiu-run", "-x", "-f", "", sys.executable, "-m", "prefixstore.fuzz.fiu", "--child", root,
           "--target", target, "--ops", str(ops), "--p", str(probability), "--seed", str(seed)]
    if plant is not None:
        cmd += ["--plant", plant]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the fiu child failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    res = FiuResult(json.loads(lines[-1]))
    layout = soak_layout(RANKS)
    with Engine.open(root, layout, CAPACITY) as eng:
        rr = eng.recovery_report
        res.recovered = {"rolled_back": len(rr.rolled_back), "rolled_forward": len(rr.rolled_forward),
                         "garbage_reclaimed": rr.garbage_reclaimed, "orphans_removed": len(rr.orphans_removed),
                         "quarantined": len(rr.quarantined), "damaged": len(rr.damaged)}
        rep = eng.audit()
        res.audit_ok = rep.ok
        res.violations = [f"invariant {v.invariant}: {v.detail}" for v in rep.violations]
        res.journal_after_recovery = len(eng.catalog.journal())
        for conv, blocks in res.child["acked"]:
            got, bad = verify_restore(eng, layout, conv_tokens(conv)[: blocks * BT])
            res.acked_checked += 1
            if bad is not None or got < blocks:
                res.lost.append(f"conversation {conv} at {blocks} blocks: restored {got} {bad or ''}")
    return res


def summary(res: FiuResult) -> list[str]:
    c = res.child
    out = [f"libfiu run ({c['target']}, p={c['probability']}, {c['ops']} ops, seed {c['seed']}): "
           f"{c['injected']} faults injected"]
    out += [f"  {k}: {v}" for k, v in c["faults"].items()]
    out.append("  outcomes: " + ", ".join(f"{k} {v}" for k, v in c["outcomes"].items()))
    out += [f"  e.g. {k}: {v}" for k, v in c.get("errors", {}).items()]
    out.append(f"  after recovery without faults: {res.recovered}")
    out.append(f"  audit: {'CLEAN' if res.audit_ok else 'VIOLATIONS'}; journal entries left: "
               f"{res.journal_after_recovery}; acknowledged stores checked: {res.acked_checked}, "
               f"lost: {len(res.lost)}; wrong bytes served: {len(c['wrong_bytes'])}")
    out += [f"    - {v}" for v in (res.violations + res.lost + c["wrong_bytes"])[:20]]
    return out


def main(argv: list[str] | None = None) -> int:
    """The child's entry (``python -m prefixstore.fuzz.fiu --child ROOT ...``, as
    :func:`run_under_fiu` starts it under ``fiu-run -x``): run the armed workload, print
    its JSON result, and end as a process death would."""
    p = argparse.ArgumentParser(prog="python -m prefixstore.fuzz.fiu")
    p.add_argument("--child", required=True, metavar="ROOT")
    p.add_argument("--target", choices=sorted(POINTS), default="all")
    p.add_argument("--ops", type=int, default=400)
    p.add_argument("--p", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plant", choices=sorted(PLANTS), default=None)
    args = p.parse_args(argv)
    out = child_main(args.child, args.target, args.ops, args.p, args.seed, args.plant)
    print(json.dumps(out), flush=True)
    os._exit(0)  # as a process death: no clean close of the engine


if __name__ == "__main__":
    sys.exit(main())
