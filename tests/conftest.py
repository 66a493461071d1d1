"""Shared fixtures and helpers: small layouts, deterministic tensors, node look-ups, fault hooks,
and the SIGKILL harness of the crash tests through loopback rank servers."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from ci_mode import CI, pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 (hooks)
from hypothesis import HealthCheck, settings

from prefixstore.base.errors import SimulatedCrash
from prefixstore.base.keys import Prefix
from prefixstore.base.layout import Layout, TensorSpec
from prefixstore.engine.api import Engine
from prefixstore.engine.driver import DEBUG_ENV
from prefixstore.engine.index import Node
from prefixstore.fuzz.faultfs import CountingHook
from prefixstore.gpu.fileio import FaultHook
from prefixstore.gpu.rank_server import RankServer
from prefixstore.gpu.ranks import LocalRank

settings.register_profile("dev", max_examples=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("campaign", max_examples=5000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
# PREFIXSTORE_HYPOTHESIS_PROFILE picks one; by default CI runs "ci", anything else "dev".
HYPOTHESIS_PROFILE = os.environ.get("PREFIXSTORE_HYPOTHESIS_PROFILE") or ("ci" if CI else "dev")
settings.load_profile(HYPOTHESIS_PROFILE)
# The driver's per-state invariant checks are on for the whole suite (and in the rank
# processes and CLI subprocesses it starts, which inherit the environment).
os.environ.setdefault(DEBUG_ENV, "1")

BT = 4  # tokens per block in tests


def make_layout(ranks: int = 1, snapshot: bool = True, dtype: str = "bfloat16", bt: int = BT) -> Layout:
    return Layout(
        segments=[TensorSpec("k", dtype, (2, 3)), TensorSpec("v", dtype, (2, 3))],
        snapshots=[TensorSpec("state", "float32", (2, 2))] if snapshot else [],
        block_tokens=bt,
        ranks=ranks,
    )


def tokens_for(seed: int, blocks: int, bt: int = BT) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (blocks * bt,), generator=g).tolist()


def seg_tensors(layout: Layout, tokens: list[int], salt: int = 0) -> list[dict[str, torch.Tensor]]:
    """Deterministic per-token rows: a token's rows depend only on its position and id."""
    out = []
    t = torch.tensor(tokens, dtype=torch.float64)
    pos = torch.arange(len(tokens), dtype=torch.float64)
    for r in range(layout.ranks):
        d = {}
        for i, spec in enumerate(layout.segments):
            base = (t * 0.001 + pos * 0.01 + r * 0.5 + i + salt)[:, None, None]
            val = base + torch.arange(6, dtype=torch.float64).reshape(1, 2, 3) * 0.125
            if spec.torch_dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
                val = (t[:, None, None] + pos[:, None, None] * 3 + r + i
                       + torch.arange(6).reshape(1, 2, 3)) % 100
            d[spec.name] = val.to(spec.torch_dtype)
        out.append(d)
    return out


def snap_tensors(layout: Layout, tokens: list[int], salt: int = 0) -> list[dict[str, torch.Tensor]] | None:
    if not layout.has_snapshot:
        return None
    s = float(sum(tokens) % 10007 + len(tokens) + salt)
    return [{spec.name: torch.full(spec.shape, s + r, dtype=spec.torch_dtype) for spec in layout.snapshots}
            for r in range(layout.ranks)]


def store_tokens(eng: Engine, tokens: list[int], salt: int = 0, **kw):
    L = eng.layout
    return eng.store(Prefix.from_tokens(tokens, L.block_tokens), seg_tensors(L, tokens, salt),
                     snap_tensors(L, tokens, salt), **kw)


def key_at(tokens: list[int], bt: int = BT) -> bytes:
    """The chained key of the last block of ``tokens``."""
    return Prefix.from_tokens(tokens, bt).keys[-1]


def node_at(eng: Engine, tokens: list[int]) -> Node | None:
    """The node whose checkpoint ends at the last block of ``tokens``, or None."""
    nid = eng.index.by_key.get(key_at(tokens, eng.layout.block_tokens))
    return eng.index.get(nid) if nid is not None else None


def assert_restores(eng: Engine, tokens: list[int], salt: int = 0, blocks: int | None = None) -> None:
    """The deepest match of ``tokens`` restores bit-identically (at ``blocks`` if given)."""
    L = eng.layout
    m = eng.lookup(Prefix.from_tokens(tokens, L.block_tokens))
    assert m.hit, m
    if blocks is not None:
        assert m.blocks == blocks, m
    r = eng.restore(m)
    assert r is not None
    want = seg_tensors(L, tokens[: m.tokens], salt)
    for rank in range(L.ranks):
        for name, t in r.segments[rank].items():
            assert torch.equal(t, want[rank][name]), (rank, name)
    if L.has_snapshot:
        ws = snap_tensors(L, tokens[: m.tokens], salt)
        for rank in range(L.ranks):
            for name, t in r.snapshot[rank].items():
                assert torch.equal(t, ws[rank][name]), (rank, name)


@pytest.fixture
def layout() -> Layout:
    return make_layout()


@pytest.fixture
def cache_dir(tmp_path) -> str:
    return str(tmp_path / "cache")


class Gate:
    """A FaultHook that forwards to ``inner`` only while armed (setup runs unhooked);
    ``points`` counts the effect points it forwarded (each ``before`` and ``after``)."""

    def __init__(self) -> None:
        self.inner = None
        self.points = 0
        self.acked_at: int | None = None  # set by store_until_crash

    def arm(self, inner) -> None:
        self.inner = inner

    def disarm(self) -> None:
        self.inner = None

    def before(self, op, target, rank):
        if self.inner is not None:
            self.points += 1
            self.inner.before(op, target, rank)

    def after(self, op, target, rank):
        if self.inner is not None:
            self.points += 1
            self.inner.after(op, target, rank)


# A store that follows the store under test, with the crash hook still armed: its
# effect points are crash points that lie after the acknowledgement.
FOLLOW_UP = tokens_for(99, 1)


def store_until_crash(eng: Engine, gate: Gate, hook, tokens: list[int]):
    """Store ``tokens``, then ``FOLLOW_UP``, with ``hook`` armed on ``gate``; close ``eng``.

    Returns the result of the store of ``tokens``, or None when the hook crashed it
    (SimulatedCrash); a crash in the follow-up store comes after that result.
    ``gate.acked_at`` is the number of effect points the hook saw until the result.
    """
    gate.arm(hook)
    result = None
    gate.acked_at = None
    with contextlib.suppress(SimulatedCrash):
        result = store_tokens(eng, tokens)
        gate.acked_at = gate.points
        store_tokens(eng, FOLLOW_UP)
    gate.disarm()
    if not eng.guard.closed:
        eng.close()
    return result


def crash_points(total: int, acked_at: int) -> list[int]:
    """Every effect point of the store under test (``0 .. acked_at - 1``) and three of
    the follow-up store's (its first, middle and last): crashes after the acknowledgement."""
    after = range(acked_at, total)
    return [*range(acked_at), *sorted({after[0], after[len(after) // 2], after[-1]})]


class BugAtFirstUnlink(FaultHook):
    """Raises a non-OSError (a bug, not an I/O error) at the first unlink only."""

    def __init__(self) -> None:
        self.fired = False

    def before(self, op, target, rank):
        if op == "unlink" and not self.fired:
            self.fired = True
            raise RuntimeError("a rank agent bug, not an I/O error")


class FailUnlinks(FaultHook):
    """Every unlink fails with EIO."""

    def before(self, op, target, rank):
        if op == "unlink":
            raise OSError(errno.EIO, "injected EIO on unlink", target)


@contextlib.contextmanager
def mounted_tmpfs(path, size: str = "16m") -> Iterator[str]:
    """A real tmpfs of ``size`` mounted at ``path`` (an existing empty directory) for the
    block, unmounted after it, also on failure; skips the test where mounting needs root."""
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield str(path)
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=False)  # a leaked descriptor: detach


@pytest.fixture
def small_fs(tmp_path) -> Iterator[str]:
    """A tmpfs of 16 MiB mounted for this test (unmounted after it, also on failure)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    with mounted_tmpfs(mnt) as path:
        yield path


# SIGKILL at an effect point, through loopback rank servers (tests/test_crash_revive.py,
# tests/test_crash_rebuild_remote.py): a forked child runs the coordinator and every rank
# server (threads), one ``KillAt`` hook on all of them.
RANK_EFFECTS = frozenset({"write", "fsync", "rename", "fsync_dir", "unlink", "commit", "sync"})


def host_rank_dir(base: str, r: int) -> str:
    """Rank ``r``'s directory on its own "host" below ``base`` (``lost+found/`` beside it)."""
    return os.path.join(base, f"host{r}", f"rank{r}")


class KillAt(CountingHook):
    """Records effect points (named ``[when, op, entry, rank, k]``: the k-th such point,
    the entry without its directory) while ``armed``; SIGKILLs this process at ``spec``."""

    def __init__(self, spec: list | None) -> None:
        super().__init__(ops=RANK_EFFECTS)
        self.spec = spec
        self.armed = False
        self._lock = threading.Lock()

    def _point(self, when: str, op: str, target: str, rank: int | None) -> None:
        if not self.armed or not self._counts(op, rank):
            return
        with self._lock:
            point = (when, op, os.path.basename(target), rank)
            if self.spec is not None and list(point) + [self.points.count(point)] == self.spec:
                os.kill(os.getpid(), signal.SIGKILL)
            super()._point(*point)


def report_quarantines(hook: FaultHook) -> None:
    """Report each quarantine rename of a ``LocalRank`` to ``hook`` (op ``rename``):
    ``LocalRank.quarantine`` renames by directory descriptors, not through its file system.
    For a forked child only: it patches the class."""
    real = LocalRank.quarantine

    @functools.wraps(real)
    def quarantine(self, entry: str) -> str:
        hook.before("rename", entry, self.rank)
        out = real(self, entry)
        hook.after("rename", entry, self.rank)
        return out

    LocalRank.quarantine = quarantine


def serve_rank(base: str, r: int, port: int, hook: FaultHook) -> None:
    """A rank server (a daemon thread) for ``host_rank_dir(base, r)``, for the coordinator's store at ``port``."""
    server = RankServer(r, host_rank_dir(base, r), "127.0.0.1", port, connect_timeout=20, gloo_host="127.0.0.1",
                        hook=hook)
    threading.Thread(target=server.serve, daemon=True, name=f"rank-server-{r}").start()


def report_points(out: int, hook: CountingHook) -> None:
    """The child's last word: the points ``hook`` saw, for ``killed_points``."""
    os.write(out, ("POINTS " + json.dumps(hook.points) + "\n").encode())


def run_killed(child: Callable[[int], None], spec: list | None) -> str:
    """Fork and run ``child(out)`` (``out``: a pipe to write to); its output once it ended:
    SIGKILLed when ``spec`` names a point, else exited 0."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing of the parent's runs past this
        code = 1
        try:
            os.close(r)
            child(w)
            code = 0
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit
            os.write(w, f"CHILD FAILED {exc!r}\n".encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    if spec is None:
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, out
    else:
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (spec, out)
    return out


def killed_points(out: str) -> list[list]:
    """The points a child reported (``report_points``), each named ``[when, op, entry, rank, k]``."""
    points = [tuple(p) for p in json.loads(out.split("POINTS ")[1].splitlines()[0])]
    return [[*p, points[:i].count(p)] for i, p in enumerate(points)]
