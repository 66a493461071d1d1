"""Hypothesis state machines over the public API, checked by the fuzz ``Driver``.

``EngineMachine`` draws ops (stores, async stores, restores, evictions, pins, compaction, process
crashes at a random effect point of an operation, power loss with lost commits, one
rank failing, a full disk, I/O errors, bit rot) and feeds them to a ``Driver``, which
applies them through the public API and checks the reference model. Keys live in a
bundle (``consumes`` on eviction); pins are taken and released under preconditions;
every invariant runs after every step. ``machine(...)`` makes a variant for a layout
and synchronous mode; ``tests/test_fuzz_stateful.py`` runs several.

A failure is reported as the Driver's op list (``self.driver.history``), which
``prefixstore.fuzz.driver.replay`` replays: pin it as a regression test.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

try:
    from hypothesis import strategies as st
    from hypothesis.stateful import (
        Bundle,
        RuleBasedStateMachine,
        consumes,
        initialize,
        invariant,
        multiple,
        precondition,
        rule,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "prefixstore.fuzz.stateful needs hypothesis: pip install 'prefixstore[fuzz]'"
    ) from exc

from prefixstore.engine.api import Engine
from prefixstore.fuzz.driver import DAMAGE, Driver, RunConfig
from prefixstore.fuzz.faultfs import OPS
from prefixstore.statemachine.policy import DEFAULT, registered

SEQS = st.integers(0, 5)
BLOCKS = st.integers(1, 8)
MODES = st.sampled_from(["drop", "garble"])
SNAPS = st.floats(0.0, 0.999, allow_nan=False)


@st.composite
def policies(draw: st.DrawFn) -> str:
    """An eviction policy registered when drawn (the engine's default twice as often)."""
    return draw(st.sampled_from([DEFAULT, *registered()]))


def _fault(ranks: int) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({
        "op": st.sampled_from(OPS),
        "err": st.sampled_from(["EIO", "ENOSPC"]),
        "rank": st.integers(0, ranks - 1),
        "at": st.integers(1, 4),
        "persistent": st.booleans(),
    })


def _crash(ranks: int) -> st.SearchStrategy[dict[str, Any]]:
    lanes = st.sampled_from(["commit", *range(ranks)])
    return st.fixed_dictionaries(
        {"lane": lanes, "n": st.one_of(st.integers(0, 7), st.integers(0, 23))},
        optional={
            "power": MODES, "snap": SNAPS,
            "again": st.fixed_dictionaries({"lane": lanes, "n": st.integers(0, 11)},
                                           optional={"power": MODES, "snap": SNAPS}),
        },
    )


class EngineMachine(RuleBasedStateMachine):
    """One cache directory; see the module doc. Subclass via ``machine()``."""

    ranks = 1
    synchronous = "FULL"
    snapshot = True
    plant: Any = None

    keys = Bundle("keys")

    def __init__(self) -> None:
        super().__init__()
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # fsyncs cost nothing there
        self.tmp = tempfile.mkdtemp(prefix="prefixstore-hyp-", dir=shm)
        self.driver: Driver | None = None

    def teardown(self) -> None:
        try:
            if self.driver is not None:
                self.driver.close()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    @initialize(
        target=keys,
        per_rank=st.integers(2500, 7000),
        policy=policies(),
        seed=st.integers(0, 2**16),
        low=st.sampled_from([1.0, 0.8, 0.6]),
        first=st.lists(st.tuples(SEQS, BLOCKS), min_size=1, max_size=4),
    )
    def open(self, per_rank: int, policy: str, seed: int, low: float, first) -> Any:
        """Open the engine, then store a few checkpoints (the bundle starts non-empty)."""
        cfg = RunConfig(
            ranks=self.ranks, snapshot=self.snapshot, synchronous=self.synchronous,
            capacity=per_rank * self.ranks, policy=policy, seed=seed,
            high_watermark=1.0 if low == 1.0 else 0.9, low_watermark=low,
        )
        self.driver = Driver(cfg, f"{self.tmp}/cache", self.plant)
        self.driver.auto_check = False  # the invariant below checks after every step
        for seq, blocks in first:
            self._do({"op": "store", "seq": seq, "blocks": blocks})
        return multiple(*first)

    def _do(self, op: dict[str, Any]) -> None:
        assert self.driver is not None
        self.driver.apply(op)

    # -- the public API ------------------------------------------------------------------

    @rule(target=keys, seq=SEQS, blocks=BLOCKS, from_=st.sampled_from([0, 0, 0, 1, 3]),
          valid=st.sampled_from([0, 0, 0, 2]))
    def store(self, seq: int, blocks: int, from_: int, valid: int) -> tuple[int, int]:
        self._do({"op": "store", "seq": seq, "blocks": blocks, "from": from_, "valid": valid})
        return (seq, blocks)

    @rule(target=keys, seq=SEQS, blocks=BLOCKS, from_=st.sampled_from([0, 0, 0, 1, 3]),
          valid=st.sampled_from([0, 0, 0, 2]))
    def store_async(self, seq: int, blocks: int, from_: int, valid: int) -> tuple[int, int]:
        self._do({"op": "store_async", "seq": seq, "blocks": blocks, "from": from_, "valid": valid})
        return (seq, blocks)

    @rule(key=keys, gpu=st.integers(0, 7))
    def restore(self, key: tuple[int, int], gpu: int) -> None:
        self._do({"op": "restore", "seq": key[0], "blocks": key[1], "gpu": min(gpu, key[1] - 1)})

    @rule(seq=SEQS, blocks=BLOCKS)
    def lookup_any(self, seq: int, blocks: int) -> None:
        self._do({"op": "restore", "seq": seq, "blocks": blocks})

    @rule(key=consumes(keys))
    def evict_key(self, key: tuple[int, int]) -> None:
        self._do({"op": "evict_key", "seq": key[0], "blocks": key[1]})

    @rule(nbytes=st.integers(1, 8000))
    def evict(self, nbytes: int) -> None:
        self._do({"op": "evict", "nbytes": nbytes})

    @rule(key=keys)
    def pin(self, key: tuple[int, int]) -> None:
        self._do({"op": "pin", "seq": key[0], "blocks": key[1]})

    @precondition(lambda self: self.driver is not None and bool(self.driver.pins))
    @rule(i=st.integers(0, 7))
    def unpin(self, i: int) -> None:
        self._do({"op": "unpin", "i": i})

    @rule(which=st.sampled_from(["compact", "compact", "reclaim", "reopen", "retry"]),
          interior=st.booleans())
    def maintenance(self, which: str, interior: bool) -> None:
        """A compaction pass (when the engine has one), reclaim, a clean reopen, retries."""
        if which == "compact" and not hasattr(Engine, "compact"):
            which = "reclaim"
        self._do({"op": which, "interior": interior})

    # -- faults ------------------------------------------------------------------------------

    @rule(seq=SEQS, blocks=BLOCKS, op=st.sampled_from(["store", "store", "store_async", "restore", "evict_key",
                                                       "evict", "compact", "reopen"]), data=st.data())
    def crash_during(self, seq: int, blocks: int, op: str, data: st.DataObject) -> None:
        """Process death at a random effect point of an operation (maybe power loss too)."""
        spec = data.draw(_crash(self.ranks))
        self._do({"op": op, "seq": seq, "blocks": blocks, "nbytes": 2000, "crash": spec})

    @rule(mode=MODES, snap=SNAPS)
    def power_loss(self, mode: str, snap: float) -> None:
        self._do({"op": "power", "mode": mode, "snap": snap})

    @rule(seq=SEQS, blocks=BLOCKS, rank=st.integers(0, 3), ops=st.integers(1, 3))
    def rank_failure(self, seq: int, blocks: int, rank: int, ops: int) -> None:
        """Every effect of one rank fails for a few ops, starting with a store."""
        self._do({"op": "rank_down", "rank": rank % self.ranks, "ops": ops})
        self._do({"op": "store", "seq": seq, "blocks": blocks})

    @rule(seq=SEQS, blocks=BLOCKS)
    def disk_full(self, seq: int, blocks: int) -> None:
        self._do({"op": "store", "seq": seq, "blocks": blocks, "faults": [
            {"op": "write", "err": "ENOSPC", "rank": None, "at": 1, "persistent": True}]})

    @rule(seq=SEQS, blocks=BLOCKS, op=st.sampled_from(["store", "store", "store_async", "restore", "evict_key",
                                                       "evict", "compact"]), data=st.data())
    def io_error(self, seq: int, blocks: int, op: str, data: st.DataObject) -> None:
        """EIO or ENOSPC at the nth call of one effect on one rank, during an operation."""
        faults = data.draw(st.lists(_fault(self.ranks), min_size=1, max_size=2))
        self._do({"op": op, "seq": seq, "blocks": blocks, "nbytes": 2000, "faults": faults})

    @rule(how=st.sampled_from(DAMAGE), i=st.integers(0, 63), at=st.floats(0, 0.999),
          bit=st.integers(0, 7))
    def bit_rot(self, how: str, i: int, at: float, bit: int) -> None:
        self._do({"op": "damage", "how": how, "i": i, "at": at, "bit": bit})

    @invariant()
    def invariants_hold(self) -> None:
        if self.driver is not None:
            self.driver.check()


def machine(ranks: int, synchronous: str = "FULL", snapshot: bool = True,
            plant: Any = None) -> type[EngineMachine]:
    """An EngineMachine variant (a fresh class: Hypothesis runs one per test)."""
    name = f"Engine{ranks}R{synchronous.title()}{'Snap' if snapshot else 'NoSnap'}"
    return type(name, (EngineMachine,), {
        "ranks": ranks, "synchronous": synchronous, "snapshot": snapshot, "plant": plant,
    })
