"""SIGKILL soak: kill a working engine process at random moments, many times.

Each round forks a child (the soak process has imported everything already, so a
child starts in a millisecond) that opens the cache (running recovery itself) and
drives a single-threaded workload forever: stores of prefixes of a few
conversations, lookups whose restores it verifies bit for bit, and evictions of
single checkpoints. After a uniformly random delay the parent kills it with SIGKILL,
then checks the directory:

- always, read-only (``audit_dir``, nothing written): the only violation allowed is
  invariant 7 (the kill may leave an unfinished transaction); every acknowledged
  checkpoint is in the catalog and ready;
- every other round, it also opens an engine (recovery), audits it (clean, journal
  empty) and restores every acknowledged checkpoint bit-identically. On the other
  rounds the next child's own open recovers, so kills also land inside recovery.

Acknowledgements: the child appends ``S <conv> <blocks>`` to an fsynced log after
``store`` returned a durable status (stored, refilled, duplicate), and
``E <conv> <blocks>`` *before* it calls ``evict`` for that checkpoint. A checkpoint
whose last line is ``S`` must survive; one whose last line is ``E`` may be gone.
The capacity is sized so that the eviction policy never runs (the data set is
bounded: a few conversations of a few blocks), so no eviction happens that the log
does not announce. The driver is single-threaded so the log's order is the order of
the calls.

How much a child gets done before its kill depends on the machine's speed and load,
so a soak can also ask for a number of acknowledged stores (``min_acked``): once its
kills are done, it keeps killing, the rank counts in turn, until that many stores
were acknowledged in all, or its time budget (``max_seconds``) is spent;
``SoakStats.target_met`` says which.

Run: ``prefixstore soak [--kills N] [--ranks 1 4] [--seed S] [--min-acked M] [--max-seconds T]
[--json]``.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import threading
import time
import traceback
from typing import Any

import attrs
import torch

from prefixstore.base.errors import NotACacheError, PrefixStoreError
from prefixstore.base.keys import Prefix
from prefixstore.base.layout import Layout, TensorSpec
from prefixstore.engine.api import Engine
from prefixstore.engine.audit import audit_dir, read_catalog
from prefixstore.gpu.fileio import FaultHook
from prefixstore.gpu.ranks import LocalRank

BT = 4
CONVERSATIONS = 6
MAX_BLOCKS = 8
CAPACITY = 1 << 30  # far above the bounded data set: the policy never evicts


def soak_layout(ranks: int) -> Layout:
    return Layout(
        segments=[TensorSpec("k", "bfloat16", (2, 4)), TensorSpec("v", "bfloat16", (2, 4))],
        snapshots=[TensorSpec("state", "float32", (2, 2))],
        block_tokens=BT,
        ranks=ranks,
    )


def conv_tokens(conv: int) -> list[int]:
    """Conversation ``conv``'s tokens; conversations 1, 3, 5 share 2 blocks with 0, 2, 4."""
    g = torch.Generator().manual_seed(1000 + conv)
    toks = torch.randint(0, 50_000, (MAX_BLOCKS * BT,), generator=g).tolist()
    if conv % 2:
        toks[: 2 * BT] = conv_tokens(conv - 1)[: 2 * BT]
    return toks


def tensors(layout: Layout, toks: list[int]) -> tuple[list[dict], list[dict]]:
    """Deterministic segment rows (per token: its id and position) and snapshot."""
    t = torch.tensor(toks, dtype=torch.float64)[:, None, None]
    pos = torch.arange(len(toks), dtype=torch.float64)[:, None, None]
    grid = torch.arange(8, dtype=torch.float64).reshape(1, 2, 4)
    segs = [{"k": (t * 1e-3 + pos * 0.01 + r + grid).to(torch.bfloat16),
             "v": (t * 2e-3 - pos * 0.01 + r - grid).to(torch.bfloat16)} for r in range(layout.ranks)]
    snap = [{"state": torch.full((2, 2), float(sum(toks) % 9973 + len(toks) + r))} for r in range(layout.ranks)]
    return segs, snap


def key_of(conv: int, blocks: int) -> bytes:
    return Prefix.from_tokens(conv_tokens(conv)[: blocks * BT], BT).keys[-1]


def verify_restore(eng: Engine, layout: Layout, toks: list[int]) -> tuple[int, str | None]:
    """Lookup + restore ``toks``: (blocks restored, a mismatch description or None)."""
    m = eng.lookup(Prefix.from_tokens(toks, BT))
    if not m.hit:
        return 0, None
    r = eng.restore(m)
    if r is None:
        return 0, None
    segs, snap = tensors(layout, toks[: m.tokens])
    for rank in range(layout.ranks):
        for name, t in r.segments[rank].items():
            if not torch.equal(t, segs[rank][name]):
                return m.blocks, f"rank {rank} segment {name} differs at {m.blocks} blocks"
        for name, t in r.snapshot[rank].items():
            if not torch.equal(t, snap[rank][name]):
                return m.blocks, f"rank {rank} snapshot {name} differs at {m.blocks} blocks"
    return m.blocks, None


# ---------------------------------------------------------------------- the child


def _plant_lazy_write() -> None:
    """A planted bug: a rank acknowledges a shard write before doing it (50 ms later)."""
    orig = LocalRank.write_shard

    def lazy(self: LocalRank, name: str, data: bytes) -> None:
        threading.Timer(0.05, orig, (self, name, data)).start()

    LocalRank.write_shard = lazy  # type: ignore[method-assign]


PLANTS = {"lazy-write": _plant_lazy_write}


def _log(fd: int, line: str) -> None:
    os.write(fd, line.encode() + b"\n")
    os.fsync(fd)


class SlowDisk(FaultHook):
    """Sleeps after every effect: a slow disk, so kills land inside transactions."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def after(self, op: str, target: str, rank: int | None) -> None:
        time.sleep(self.seconds)


def child_main(root: str, ranks: int, seed: int, log_path: str, synchronous: str,
               plant: str | None = None, effect_delay: float = 0.0) -> None:
    """The workload; runs until killed. Exits 3 on wrong bytes, 4 on any exception."""
    if plant is not None:
        PLANTS[plant]()
    layout = soak_layout(ranks)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    rng = random.Random(seed)
    try:
        hook = SlowDisk(effect_delay) if effect_delay > 0 else None
        eng = Engine.open(root, layout, CAPACITY, synchronous=synchronous, hook=hook)
        while True:
            conv, blocks = rng.randrange(CONVERSATIONS), rng.randint(1, MAX_BLOCKS)
            toks = conv_tokens(conv)[: blocks * BT]
            roll = rng.random()
            if roll < 0.55:
                segs, snap = tensors(layout, toks)
                res = eng.store(Prefix.from_tokens(toks, BT), segs, snap)
                if res.ok:
                    _log(fd, f"S {conv} {blocks}")
            elif roll < 0.9:
                _, bad = verify_restore(eng, layout, toks)
                if bad is not None:
                    _log(fd, f"V wrong bytes restoring conversation {conv} at {blocks} blocks: {bad}")
                    os._exit(3)
            else:
                _log(fd, f"E {conv} {blocks}")
                eng.evict(prefix=Prefix.from_tokens(toks, BT))
    except BaseException:
        with contextlib.suppress(Exception):
            _log(fd, "X " + traceback.format_exc().replace("\n", " | "))
        os._exit(4)


# ---------------------------------------------------------------------- the parent


@attrs.define
class SoakStats:
    """Figures of one soak."""

    kills: int = 0
    kills_by_ranks: dict[int, int] = attrs.field(factory=dict)
    extra_kills: int = 0  # rounds run past ``kills`` to reach ``min_acked``
    unfinished_at_kill: int = 0
    unfinished_kinds: dict[str, int] = attrs.field(factory=dict)
    recoveries: int = 0
    rolled_back: int = 0
    rolled_forward: int = 0
    acked_stores: int = 0
    acked_by_ranks: dict[int, int] = attrs.field(factory=dict)
    target_met: bool = True  # ``min_acked`` was reached within ``max_seconds``
    acked_checks: int = 0
    evictions_announced: int = 0
    restores_verified: int = 0
    lost: int = 0
    violations: list[str] = attrs.field(factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def parse_log(path: str) -> tuple[dict[bytes, tuple[str, int, int]], int, int, list[str]]:
    """Last event per checkpoint key ((kind, conv, blocks)), S lines, E lines, and V/X
    lines (complete lines only). Keyed by checkpoint, not (conv, blocks): conversations
    that share blocks share those checkpoints, and an E of one evicts the other's."""
    last: dict[bytes, tuple[str, int, int]] = {}
    s = e = 0
    bad = []
    with open(path, "rb") as f:
        data = f.read()
    for raw in data.split(b"\n")[:-1]:  # a torn last line (no newline) is ignored
        line = raw.decode(errors="replace")
        kind, _, rest = line.partition(" ")
        if kind in ("S", "E"):
            conv, blocks = (int(x) for x in rest.split())
            last[key_of(conv, blocks)] = (kind, conv, blocks)
            s += kind == "S"
            e += kind == "E"
        elif kind in ("V", "X"):
            bad.append(line)
    return last, s, e, bad


def _kill_round(root: str, ranks: int, seed: int, log_path: str, delay: float, synchronous: str,
                plant: str | None, effect_delay: float = 0.0) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            child_main(root, ranks, seed, log_path, synchronous, plant, effect_delay)
        finally:
            os._exit(5)
    time.sleep(delay)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return status


def check_round(root: str, ranks: int, log_path: str, recover: bool, st: SoakStats, where: str) -> None:
    """The checks after a kill (module doc), their findings added to ``st``: the
    read-only audit, then with ``recover`` recovery, the audit and the restores."""
    layout = soak_layout(ranks)
    last, _, _, bad = parse_log(log_path)
    st.violations += [f"{where}: child reported {b[:300]}" for b in bad]
    acked = {k: (c, b) for k, (ev, c, b) in last.items() if ev == "S"}
    st.acked_checks += len(acked)
    # read-only, as the operator's audit after an incident
    try:
        rep = audit_dir(root, expected=acked, quiescent=False)
    except NotACacheError:
        if acked:
            st.violations.append(f"{where}: the cache cannot be read after the kill")
        elif recover:  # killed before a child created its catalog: an open must still take it
            _recover_and_check(root, layout, acked, st, where)
        return
    if rep.journal:
        st.unfinished_at_kill += 1
        for j in rep.journal:
            k = f"{j['kind']}/{j['state']}"
            st.unfinished_kinds[k] = st.unfinished_kinds.get(k, 0) + 1
    for v in rep.violations:
        st.violations.append(f"{where}: read-only audit: invariant {v.invariant}: {v.detail}")
        if v.invariant == 4:
            st.lost += 1
    states = {bytes(r[1]): r[7] for r in read_catalog(root).nodes.values()}
    for k, (c, b) in acked.items():
        if states.get(k, "ready") != "ready":
            st.violations.append(f"{where}: acknowledged conversation {c} at {b} blocks is {states[k]}")
    if recover:
        _recover_and_check(root, layout, acked, st, where)


def _recover_and_check(root: str, layout: Layout, acked: dict[bytes, tuple[int, int]], st: SoakStats,
                       where: str) -> None:
    """Open (recovery), audit, and restore every acknowledged checkpoint bit for bit."""
    try:
        eng = Engine.open(root, layout, CAPACITY)
    except PrefixStoreError as exc:
        st.violations.append(f"{where}: the cache cannot be opened after the kill: {exc}")
        return
    with eng:
        st.recoveries += 1
        st.rolled_back += len(eng.recovery_report.rolled_back)
        st.rolled_forward += len(eng.recovery_report.rolled_forward)
        rep = eng.audit()
        for v in rep.violations:
            st.violations.append(f"{where}: audit after recovery: invariant {v.invariant}: {v.detail}")
        if eng.catalog.journal():
            st.violations.append(f"{where}: journal not empty after recovery")
        for c, b in acked.values():
            got, wrong = verify_restore(eng, layout, conv_tokens(c)[: b * BT])
            if wrong is not None:
                st.violations.append(f"{where}: conversation {c}: {wrong}")
            elif got < b:
                st.violations.append(f"{where}: acknowledged conversation {c} at {b} blocks restores only {got}")
                st.lost += 1
            else:
                st.restores_verified += 1


def soak(
    root: str,
    *,
    kills: int = 200,
    ranks: tuple[int, ...] = (1, 4),
    seed: int = 0,
    min_delay: float = 0.005,
    max_delay: float = 0.25,
    progress: bool = False,
    plant: str | None = None,
    effect_delay: float = 0.0,
    min_acked: int = 0,
    max_seconds: float = 600.0,
) -> SoakStats:
    """Run ``kills`` SIGKILL rounds, split evenly over the rank counts, then more (the
    rank counts in turn) until the logs hold ``min_acked`` acknowledged stores in all
    or ``max_seconds`` have passed since the start; return the figures."""
    torch.set_num_threads(1)  # no intra-op pool to inherit across fork
    st = SoakStats()
    t0 = time.monotonic()
    rng = random.Random(seed)
    os.makedirs(root, exist_ok=True)
    dirs = {nranks: os.path.join(root, f"ranks{nranks}") for nranks in ranks}
    logs = {nranks: os.path.join(root, f"ranks{nranks}.acks") for nranks in ranks}
    for log_path in logs.values():
        open(log_path, "ab").close()
    done = dict.fromkeys(ranks, 0)  # rounds run per rank count

    def one_round(nranks: int) -> None:
        i = done[nranks]
        done[nranks] += 1
        where = f"ranks={nranks} kill {i + 1}"
        sync = "NORMAL" if i % 3 == 2 else "FULL"
        status = _kill_round(dirs[nranks], nranks, rng.randrange(1 << 30), logs[nranks],
                             rng.uniform(min_delay, max_delay), sync, plant, effect_delay)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            st.kills += 1
            st.kills_by_ranks[nranks] = st.kills_by_ranks.get(nranks, 0) + 1
        else:
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else status
            st.violations.append(f"{where}: the child ended by itself (status {code})")
        check_round(dirs[nranks], nranks, logs[nranks], recover=i % 2 == 1 and i > 2, st=st, where=where)
        if progress and (i + 1) % 50 == 0:
            print(f"  ranks={nranks}: {i + 1} kills, {len(st.violations)} violations", file=sys.stderr)

    for nranks, n in zip(ranks, _split(kills, len(ranks)), strict=True):
        for _ in range(n):
            one_round(nranks)
    while sum(parse_log(p)[1] for p in logs.values()) < min_acked:
        if time.monotonic() - t0 >= max_seconds:
            st.target_met = False
            break
        one_round(ranks[st.extra_kills % len(ranks)])
        st.extra_kills += 1
    for nranks in ranks:
        _, s, e, _ = parse_log(logs[nranks])
        st.acked_stores += s
        st.acked_by_ranks[nranks] = s
        st.evictions_announced += e
        check_round(dirs[nranks], nranks, logs[nranks], recover=True, st=st, where=f"ranks={nranks} final")
    st.seconds = round(time.monotonic() - t0, 1)
    return st


def _split(total: int, parts: int) -> list[int]:
    """``total`` split over ``parts`` as evenly as integers allow, the larger first."""
    return [total // parts + (i < total % parts) for i in range(parts)]
