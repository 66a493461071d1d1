"""The fault-injecting file layer: power-loss rules, error injection, damage, crash hooks."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from prefixstore.base.errors import SimulatedCrash
from prefixstore.fuzz.faultfs import (
    ChainHook,
    CountingHook,
    CrashAt,
    FaultFS,
    FaultPlan,
    FaultRule,
    count_crash_points,
    enumerate_crash_points,
    rank_of,
    run_to_crash,
)
from prefixstore.gpu.fileio import FileSystem, HookedFS, OsFS

DATA = b"0123456789abcdef" * 4


@pytest.fixture
def root(tmp_path: Path) -> str:
    for r in (0, 1):
        (tmp_path / f"rank{r}").mkdir()
    return str(tmp_path)


def p(root: str, *parts: str) -> str:
    return os.path.join(root, *parts)


def content(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def durable_write(fs: FaultFS, path: str, data: bytes = DATA) -> None:
    fs.write_new(path, data)
    fs.fsync(path)
    fs.fsync_dir(os.path.dirname(path))


# --- the FileSystem protocol ----------------------------------------------------------


def test_protocol_semantics(root: str) -> None:
    fs: FileSystem = FaultFS()
    a, b = p(root, "rank0", "a"), p(root, "rank0", "b")
    fs.write_new(a, DATA)
    with pytest.raises(FileExistsError):
        fs.write_new(a, b"x")
    fs.write_new(b, b"other")
    with pytest.raises(FileExistsError):
        fs.rename_new(a, b)
    assert fs.read(a) == DATA and fs.read(b) == b"other"
    assert fs.size(a) == len(DATA) and fs.size(p(root, "nope")) is None
    assert fs.listdir(p(root, "rank0")) == ["a", "b"]
    assert fs.listdir(p(root, "missing")) == []
    with pytest.raises(FileNotFoundError):
        fs.unlink(p(root, "rank0", "nope"))
    with pytest.raises(FileNotFoundError):
        fs.rename_new(p(root, "rank0", "nope"), p(root, "rank0", "c"))
    fs.makedirs(p(root, "x", "y"))
    assert os.path.isdir(p(root, "x", "y"))


def test_rank_of() -> None:
    assert rank_of("/cache/rank0/abc-g1.st") == 0
    assert rank_of("/cache/rank12/x") == 12
    assert rank_of("/cache/rank3") == 3
    assert rank_of("/cache/catalog.db") is None
    assert rank_of("/tmp/test_rank0_0/x") is None
    assert rank_of("/a/rank1/b/rank2/f") == 2


# --- power loss: data ------------------------------------------------------------------


def test_fully_durable_file_survives_both_modes(root: str) -> None:
    for mode in ("drop", "garble"):
        fs = FaultFS(seed=1)
        path = p(root, "rank0", f"f-{mode}")
        durable_write(fs, path)
        assert fs.is_durable(path) and fs.unsynced() == [] and fs.pending() == []
        report = fs.crash(mode)
        assert content(path) == DATA
        assert not report.changed


def test_unsynced_data_dropped_under_durable_entry(root: str) -> None:
    fs = FaultFS()
    path = p(root, "rank0", "f")
    fs.write_new(path, DATA)
    fs.fsync_dir(p(root, "rank0"))  # the entry is durable, the data never synced
    assert fs.unsynced() == [path] and not fs.is_durable(path)
    report = fs.crash("drop")
    assert content(path) == b""
    assert report.rewritten == (path,)


def test_unsynced_data_garbled_under_durable_entry(root: str) -> None:
    fs = FaultFS(seed=3)
    path = p(root, "rank0", "f")
    fs.write_new(path, DATA)
    fs.fsync_dir(p(root, "rank0"))
    fs.crash("garble")
    got = content(path)
    assert got is not None and len(got) == len(DATA) and got != DATA


def test_garble_is_deterministic_per_seed(tmp_path: Path) -> None:
    def run(seed: int, sub: str) -> bytes | None:
        d = tmp_path / sub / "rank0"
        d.mkdir(parents=True)
        fs = FaultFS(seed=seed)
        fs.write_new(str(d / "f"), DATA)
        fs.fsync_dir(str(d))
        fs.crash("garble")
        return content(str(d / "f"))

    assert run(7, "a") == run(7, "b")
    assert run(7, "c") != run(8, "d")


def test_failed_fsync_poisons_the_file(root: str) -> None:
    plan = FaultPlan()
    plan.fail_nth("fsync", 1)
    fs = FaultFS(plan)
    path = p(root, "rank0", "f")
    fs.write_new(path, DATA)
    with pytest.raises(OSError) as ei:
        fs.fsync(path)
    assert ei.value.errno == errno.EIO
    fs.fsync(path)  # "succeeds", but the dirty pages were dropped
    fs.fsync_dir(p(root, "rank0"))
    assert fs.unsynced() == [path]
    fs.crash("drop")
    assert content(path) == b""


# --- power loss: directory entries -----------------------------------------------------


def test_undurable_create_disappears(root: str) -> None:
    fs = FaultFS()
    path = p(root, "rank0", "f")
    fs.write_new(path, DATA)
    fs.fsync(path)  # data durable, entry not
    assert fs.pending() == [f"create {path}"]
    report = fs.crash("drop")
    assert content(path) is None
    assert report.removed == (path,)


def test_fsync_dir_of_another_directory_does_not_help(root: str) -> None:
    fs = FaultFS()
    path = p(root, "rank0", "f")
    fs.write_new(path, DATA)
    fs.fsync(path)
    fs.fsync_dir(p(root, "rank1"))
    fs.fsync_dir(root)
    fs.crash()
    assert content(path) is None


def test_undurable_rename_is_undone(root: str) -> None:
    fs = FaultFS()
    tmp, final = p(root, "rank0", "f.tmp"), p(root, "rank0", "f")
    durable_write(fs, tmp)
    fs.rename_new(tmp, final)
    assert content(final) == DATA and content(tmp) is None
    report = fs.crash()
    assert content(tmp) == DATA and content(final) is None
    assert report.removed == (final,) and report.restored == (tmp,)


def test_rename_of_undurable_create_vanishes_entirely(root: str) -> None:
    fs = FaultFS()
    tmp, final = p(root, "rank0", "f.tmp"), p(root, "rank0", "f")
    fs.write_new(tmp, DATA)
    fs.fsync(tmp)
    fs.rename_new(tmp, final)
    fs.crash()
    assert content(tmp) is None and content(final) is None


def test_durable_rename_is_kept(root: str) -> None:
    """The engine's publish sequence: write, fsync, rename, fsync_dir."""
    fs = FaultFS()
    tmp, final = p(root, "rank0", "f.tmp"), p(root, "rank0", "f")
    fs.write_new(tmp, DATA)
    fs.fsync(tmp)
    fs.rename_new(tmp, final)
    fs.fsync_dir(p(root, "rank0"))
    assert fs.pending() == [] and fs.is_durable(final)
    fs.crash("garble")
    assert content(final) == DATA and content(tmp) is None


def test_rename_before_data_sync_keeps_name_but_not_data(root: str) -> None:
    fs = FaultFS()
    tmp, final = p(root, "rank0", "f.tmp"), p(root, "rank0", "f")
    fs.write_new(tmp, DATA)
    fs.rename_new(tmp, final)  # forgot the fsync
    fs.fsync_dir(p(root, "rank0"))
    fs.crash("drop")
    assert content(final) == b"" and content(tmp) is None


def test_fsync_dir_before_rename_does_not_count(root: str) -> None:
    fs = FaultFS()
    a, b = p(root, "rank0", "a"), p(root, "rank0", "b")
    durable_write(fs, a)
    fs.fsync_dir(p(root, "rank0"))
    fs.rename_new(a, b)
    fs.crash()
    assert content(a) == DATA and content(b) is None


def test_cross_directory_rename_needs_the_destination_dir(root: str) -> None:
    fs = FaultFS()
    src, dst = p(root, "rank0", "f"), p(root, "rank1", "f")
    durable_write(fs, src)
    fs.rename_new(src, dst)
    fs.fsync_dir(p(root, "rank0"))  # the source directory is not enough
    fs.crash()
    assert content(src) == DATA and content(dst) is None

    fs.rename_new(src, dst)
    fs.fsync_dir(p(root, "rank1"))
    fs.crash()
    assert content(src) is None and content(dst) == DATA


def test_undurable_unlink_reappears_with_durable_content(root: str) -> None:
    fs = FaultFS()
    path = p(root, "rank0", "f")
    durable_write(fs, path)
    fs.unlink(path)
    assert content(path) is None and fs.pending() == [f"unlink {path}"]
    report = fs.crash()
    assert content(path) == DATA
    assert report.restored == (path,)


def test_undurable_unlink_of_unsynced_file_reappears_per_mode(root: str) -> None:
    fs = FaultFS(seed=5)
    path = p(root, "rank0", "f")
    fs.write_new(path, DATA)
    fs.fsync_dir(p(root, "rank0"))  # durable entry, data never synced
    fs.unlink(path)
    fs.crash("garble")
    got = content(path)
    assert got is not None and len(got) == len(DATA) and got != DATA


def test_durable_unlink_stays_gone(root: str) -> None:
    fs = FaultFS()
    path = p(root, "rank0", "f")
    durable_write(fs, path)
    fs.unlink(path)
    fs.fsync_dir(p(root, "rank0"))
    fs.crash()
    assert content(path) is None


def test_unlink_of_preexisting_file_is_undone(root: str) -> None:
    path = p(root, "rank1", "old")
    with open(path, "wb") as f:
        f.write(b"from before")
    fs = FaultFS()
    assert fs.is_durable(path)
    fs.unlink(path)
    fs.crash()
    assert content(path) == b"from before"


def test_unlink_then_recreate_same_name(root: str) -> None:
    fs = FaultFS()
    path = p(root, "rank0", "f")
    durable_write(fs, path, b"old")
    fs.unlink(path)
    fs.write_new(path, b"new")
    fs.fsync(path)
    fs.crash()
    assert content(path) == b"old"

    fs.unlink(path)
    durable_write(fs, path, b"new")
    fs.crash()
    assert content(path) == b"new"


def test_untracked_files_are_left_alone(root: str) -> None:
    other = p(root, "rank0", "untouched")
    with open(other, "wb") as f:
        f.write(b"keep me")
    fs = FaultFS()
    fs.write_new(p(root, "rank0", "f"), DATA)
    fs.crash()
    assert content(other) == b"keep me"
    assert os.listdir(p(root, "rank0")) == ["untouched"]


def test_tracking_restarts_clean_after_crash(root: str) -> None:
    fs = FaultFS()
    path = p(root, "rank0", "f")
    fs.write_new(path, DATA)
    fs.fsync_dir(p(root, "rank0"))
    fs.crash()  # leaves an empty file, now durable
    assert fs.pending() == [] and fs.unsynced() == [] and fs.acknowledged == []
    assert not fs.crash().changed
    assert content(path) == b""
    fs.unlink(path)  # adopted as durable: the unlink is undone
    fs.crash()
    assert content(path) == b""
    assert fs.crashes == 3


def test_sync_all_makes_everything_durable(root: str) -> None:
    fs = FaultFS()
    a, b = p(root, "rank0", "a"), p(root, "rank1", "b")
    fs.write_new(a, DATA)
    fs.write_new(b, b"bb")
    fs.sync_all()
    assert fs.pending() == [] and fs.unsynced() == []
    fs.crash()
    assert content(a) == DATA and content(b) == b"bb"


def test_acknowledged_lists_completed_ops(root: str) -> None:
    plan = FaultPlan()
    plan.fail_nth("fsync", 1)
    fs = FaultFS(plan)
    path = p(root, "rank0", "f")
    fs.write_new(path, DATA)
    with pytest.raises(OSError):
        fs.fsync(path)
    fs.fsync_dir(p(root, "rank0"))
    assert fs.acknowledged == [("write", path), ("fsync_dir", p(root, "rank0"))]


# --- error injection -------------------------------------------------------------------


def test_nth_call_one_off(root: str) -> None:
    plan = FaultPlan()
    plan.fail_nth("write", 2, "ENOSPC")
    fs = FaultFS(plan)
    fs.write_new(p(root, "rank0", "a"), DATA)
    with pytest.raises(OSError) as ei:
        fs.write_new(p(root, "rank0", "b"), DATA)
    assert ei.value.errno == errno.ENOSPC
    fs.write_new(p(root, "rank0", "c"), DATA)
    assert plan.calls["write"] == 3
    assert plan.injected == {"write:ENOSPC": 1}
    assert [(i.op, i.call, i.err) for i in plan.log] == [("write", 2, "ENOSPC")]


def test_nth_call_persistent(root: str) -> None:
    plan = FaultPlan()
    rule = plan.fail_nth("fsync", 2, persistent=True)
    fs = FaultFS(plan)
    results = []
    for i in range(5):
        path = p(root, "rank0", f"f{i}")
        fs.write_new(path, DATA)
        try:
            fs.fsync(path)
            results.append("ok")
        except OSError as exc:
            results.append(errno.errorcode[exc.errno])
    assert results == ["ok", "EIO", "EIO", "EIO", "EIO"]
    assert plan.injected["fsync:EIO"] == 4 and rule.fired == 4 and rule.seen == 5


def test_per_rank_counts_only_that_rank(root: str) -> None:
    plan = FaultPlan()
    plan.fail_nth("write", 2, "EIO", rank=1)
    fs = FaultFS(plan)
    fs.write_new(p(root, "rank1", "a"), DATA)  # rank 1, call 1
    fs.write_new(p(root, "rank0", "b"), DATA)  # rank 0: not counted
    fs.write_new(p(root, "rank0", "c"), DATA)
    with pytest.raises(OSError):
        fs.write_new(p(root, "rank1", "d"), DATA)  # rank 1, call 2
    fs.write_new(p(root, "rank1", "e"), DATA)
    assert plan.calls["write"] == 5
    assert plan.calls_by_rank[("write", 1)] == 3 and plan.calls_by_rank[("write", 0)] == 2
    assert plan.log[0].rank == 1 and plan.log[0].target.endswith("rank1/d")


@pytest.mark.parametrize("err", ["EIO", "ENOSPC"])
def test_each_op_fails_without_effect(root: str, err: str) -> None:
    plan = FaultPlan()
    for op in ("fsync", "rename", "unlink", "read", "fsync_dir"):
        plan.add(op, err, at=1)
    fs = FaultFS(plan)
    a, b = p(root, "rank0", "a"), p(root, "rank0", "b")
    fs.write_new(a, DATA)
    code = getattr(errno, err)

    with pytest.raises(OSError) as ei:
        fs.fsync(a)
    assert ei.value.errno == code
    with pytest.raises(OSError) as ei:
        fs.rename_new(a, b)
    assert ei.value.errno == code and content(a) == DATA and content(b) is None
    with pytest.raises(OSError) as ei:
        fs.unlink(a)
    assert ei.value.errno == code and content(a) == DATA
    with pytest.raises(OSError) as ei:
        fs.read(a)
    assert ei.value.errno == code
    with pytest.raises(OSError) as ei:
        fs.fsync_dir(p(root, "rank0"))
    assert ei.value.errno == code and fs.pending() == [f"create {a}"]

    assert fs.read(a) == DATA  # one-off: the second call succeeds
    fs.rename_new(a, b)
    assert dict(plan.injected) == {
        f"{op}:{err}": 1 for op in ("fsync", "rename", "unlink", "read", "fsync_dir")
    }


def test_failed_write_leaves_a_short_file(root: str) -> None:
    plan = FaultPlan(seed=2)
    plan.fail_nth("write", 1, "ENOSPC")
    fs = FaultFS(plan, seed=2)
    path = p(root, "rank0", "f")
    with pytest.raises(OSError):
        fs.write_new(path, DATA)
    got = content(path)
    assert got is not None and len(got) < len(DATA) and DATA.startswith(got)
    assert fs.pending() == [f"create {path}"]
    fs.crash()  # the partial file was never made durable
    assert content(path) is None


def test_failed_write_without_partial_leaves_nothing(root: str) -> None:
    plan = FaultPlan()
    plan.add("write", "ENOSPC", at=1, partial=False)
    fs = FaultFS(plan)
    path = p(root, "rank0", "f")
    with pytest.raises(OSError):
        fs.write_new(path, DATA)
    assert content(path) is None and fs.pending() == []


def test_match_restricts_by_path(root: str) -> None:
    plan = FaultPlan()
    plan.add("write", at=1, persistent=True, match=".tmp")
    fs = FaultFS(plan)
    fs.write_new(p(root, "rank0", "a"), DATA)
    with pytest.raises(OSError):
        fs.write_new(p(root, "rank0", "b.tmp"), DATA)
    assert plan.injected["write:EIO"] == 1


def _probabilistic_run(tmp_path: Path, seed: int, sub: str) -> list[int]:
    d = tmp_path / sub / "rank0"
    d.mkdir(parents=True)
    plan = FaultPlan(seed=seed)
    plan.fail_randomly("write", 0.25, "ENOSPC")
    fs = FaultFS(plan, seed=seed)
    failed = []
    for i in range(200):
        try:
            fs.write_new(str(d / f"f{i}"), b"x")
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
            failed.append(i)
    assert plan.injected["write:ENOSPC"] == len(failed)
    assert plan.calls["write"] == 200
    return failed


def test_probabilistic_faults_are_seeded(tmp_path: Path) -> None:
    a = _probabilistic_run(tmp_path, 11, "a")
    assert 25 <= len(a) <= 75
    assert _probabilistic_run(tmp_path, 11, "b") == a
    assert _probabilistic_run(tmp_path, 12, "c") != a


def test_probabilistic_faults_do_not_depend_on_rank_interleaving(tmp_path: Path) -> None:
    """Ranks call concurrently in the engine: each rank draws from its own stream."""

    def run(order: list[int], sub: str) -> set[tuple[int, int]]:
        for r in (0, 1):
            (tmp_path / sub / f"rank{r}").mkdir(parents=True)
        plan = FaultPlan(seed=5)
        plan.fail_randomly("write", 0.3)
        plan.add("write", "ENOSPC", rank=None)  # a rule that never fires, drawn first
        fs = FaultFS(plan, seed=5)
        seq = {0: 0, 1: 0}
        failed = set()
        for r in order:
            i = seq[r]
            seq[r] += 1
            path = str(tmp_path / sub / f"rank{r}" / f"f{i}")
            try:
                fs.write_new(path, DATA)
            except OSError:
                failed.add((r, i))
                assert len(content(path) or b"") < len(DATA)
        return failed

    interleaved = run([0, 1] * 40, "a")
    rank_by_rank = run([0] * 40 + [1] * 40, "b")
    assert interleaved == rank_by_rank
    assert {r for r, _ in interleaved} == {0, 1}


def test_garble_does_not_depend_on_creation_order(tmp_path: Path) -> None:
    def run(names: list[str], sub: str) -> dict[str, bytes | None]:
        d = tmp_path / sub / "rank0"
        d.mkdir(parents=True)
        fs = FaultFS(seed=13)
        for n in names:
            fs.write_new(str(d / n), DATA)
        fs.fsync_dir(str(d))
        fs.crash("garble")
        return {n: content(str(d / n)) for n in names}

    assert run(["a", "b", "c"], "x") == run(["c", "a", "b"], "y")


def test_paused_plan_injects_nothing(root: str) -> None:
    plan = FaultPlan()
    plan.fail_nth("write", 1, persistent=True)
    fs = FaultFS(plan)
    with plan.paused():
        fs.write_new(p(root, "rank0", "a"), DATA)
    with pytest.raises(OSError):
        fs.write_new(p(root, "rank0", "b"), DATA)
    assert plan.calls["write"] == 2 and plan.total_injected == 1


def test_first_firing_rule_wins_but_all_count(root: str) -> None:
    plan = FaultPlan()
    r1 = plan.add("read", "EIO", at=1)
    r2 = plan.add("read", "ENOSPC", at=1, persistent=True)
    fs = FaultFS(plan)
    fs.write_new(p(root, "rank0", "a"), DATA)
    for expect in (errno.EIO, errno.ENOSPC):
        with pytest.raises(OSError) as ei:
            fs.read(p(root, "rank0", "a"))
        assert ei.value.errno == expect
    assert (r1.seen, r1.fired, r2.seen, r2.fired) == (2, 1, 2, 1)


def test_bad_rules_are_rejected() -> None:
    with pytest.raises(ValueError):
        FaultRule("commit")
    with pytest.raises(ValueError):
        FaultRule("write", "ENOTANERRNO")
    with pytest.raises(ValueError):
        FaultRule("write", at=0)
    with pytest.raises(ValueError):
        FaultRule("write", persistent=True)
    with pytest.raises(ValueError):
        FaultRule("write", probability=1.5)


def test_works_under_hookedfs(root: str) -> None:
    plan = FaultPlan()
    plan.fail_nth("rename", 1, rank=0)
    hook = CountingHook()
    fs = HookedFS(FaultFS(plan), hook, 0)
    tmp, final = p(root, "rank0", "f.tmp"), p(root, "rank0", "f")
    fs.write_new(tmp, DATA)
    fs.fsync(tmp)
    with pytest.raises(OSError):
        fs.rename_new(tmp, final)
    assert [(w, op) for w, op, _, _ in hook.points] == [
        ("before", "write"),
        ("after", "write"),
        ("before", "fsync"),
        ("after", "fsync"),
        ("before", "rename"),
    ]


# --- damage at rest --------------------------------------------------------------------


def test_damage_helpers(root: str) -> None:
    fs = FaultFS(seed=9)
    names = ["a", "b", "c", "d", "e", "f"]
    paths = {n: p(root, "rank0", n) for n in names}
    for n in names:
        durable_write(fs, paths[n], n.encode() * 8)

    fs.flip_bit(paths["a"], 3, bit=2)
    got = content(paths["a"])
    assert got is not None and got[3] == ord("a") ^ 4 and got[:3] + got[4:] == b"a" * 7
    fs.truncate(paths["b"], 5)
    fs.zero_length(paths["c"])
    fs.delete(paths["d"])
    fs.swap(paths["e"], paths["f"])
    offset, bit = fs.flip_random_bit(paths["a"])  # flips some bit of "a" again
    assert 0 <= offset < 8 and 0 <= bit < 8
    after_a = content(paths["a"])

    expected = {
        "a": after_a,
        "b": b"bbbbb",
        "c": b"",
        "d": None,
        "e": b"f" * 8,
        "f": b"e" * 8,
    }
    assert {n: content(paths[n]) for n in names} == expected
    fs.crash("garble")  # damage at rest is durable: a crash does not undo it
    assert {n: content(paths[n]) for n in names} == expected


def test_flip_random_bit_is_seeded(tmp_path: Path) -> None:
    def run(seed: int, sub: str) -> tuple[int, int]:
        d = tmp_path / sub
        d.mkdir()
        (d / "f").write_bytes(DATA)
        return FaultFS(seed=seed).flip_random_bit(str(d / "f"))

    assert run(4, "a") == run(4, "b")


def test_damage_of_pending_file_makes_it_durable(root: str) -> None:
    fs = FaultFS()
    path = p(root, "rank0", "f")
    fs.write_new(path, DATA)  # neither data nor entry durable
    fs.truncate(path, 4)
    fs.crash()
    assert content(path) == DATA[:4]


# --- in-process crashes ----------------------------------------------------------------


def _publish(root: str, hook) -> None:
    fs = HookedFS(OsFS(), hook, 0)
    tmp, final = p(root, "rank0", "f.tmp"), p(root, "rank0", "f")
    fs.write_new(tmp, DATA)
    fs.fsync(tmp)
    fs.rename_new(tmp, final)
    fs.fsync_dir(p(root, "rank0"))
    hook.before("commit", "catalog", None)
    hook.after("commit", "catalog", None)


def test_simulated_crash_is_not_an_exception() -> None:
    assert issubclass(SimulatedCrash, BaseException)
    assert not issubclass(SimulatedCrash, Exception)


def test_counting_hook_counts_every_point(root: str) -> None:
    hook = CountingHook()
    _publish(root, hook)
    assert hook.count == 10
    assert [op for _, op, _, _ in hook.points[::2]] == [
        "write",
        "fsync",
        "rename",
        "fsync_dir",
        "commit",
    ]
    filtered = CountingHook(ops={"commit"})
    os.makedirs(p(root, "x", "rank0"))
    _publish(p(root, "x"), filtered)
    assert filtered.count == 2


def test_crash_at_before_and_after(root: str) -> None:
    hook = CrashAt(4)  # before rename
    with pytest.raises(SimulatedCrash):
        _publish(root, hook)
    assert hook.fired is not None and hook.fired[:2] == ("before", "rename")
    assert content(p(root, "rank0", "f.tmp")) == DATA and content(p(root, "rank0", "f")) is None
    hook.before("commit", "catalog", None)  # stays quiet once it fired


def test_crash_at_after_point_means_effect_happened(root: str) -> None:
    hook = CrashAt(5)  # after rename
    try:
        _publish(root, hook)
    except Exception:  # pragma: no cover - must not be caught here
        pytest.fail("SimulatedCrash was caught as an Exception")
    except SimulatedCrash:
        pass
    assert hook.fired is not None and hook.fired[:2] == ("after", "rename")
    assert content(p(root, "rank0", "f")) == DATA


def test_crash_at_rank_filter(root: str) -> None:
    hook = CrashAt(0, rank=1)
    _publish(root, hook)  # everything is rank 0 or None: never fires
    assert hook.fired is None and hook.count == 0


def test_enumerate_crash_points(tmp_path: Path) -> None:
    runs = []

    def run(hook) -> None:
        d = tmp_path / f"run{len(runs)}"
        (d / "rank0").mkdir(parents=True)
        runs.append(str(d))
        _publish(str(d), hook)

    assert count_crash_points(run) == 10
    seen = []
    for hook in enumerate_crash_points(run):
        assert hook.fired is not None
        seen.append(hook.fired[:2])
        final = content(os.path.join(runs[-1], "rank0", "f"))
        assert (final == DATA) == (hook.n >= 5)  # published once the rename ran
    assert len(seen) == 10 and seen[0] == ("before", "write") and seen[-1] == ("after", "commit")
    assert run_to_crash(run, 99).fired is None


def test_enumerate_detects_nondeterminism(tmp_path: Path) -> None:
    calls = []

    def run(hook) -> None:
        calls.append(1)
        for _ in range(3 if len(calls) == 1 else 1):
            hook.before("commit", "catalog", None)

    with pytest.raises(RuntimeError, match="not deterministic"):
        list(enumerate_crash_points(run))


def test_chain_hook(root: str) -> None:
    counter = CountingHook()
    with pytest.raises(SimulatedCrash):
        _publish(root, ChainHook(counter, CrashAt(2)))
    assert counter.count == 3


def test_crash_then_power_loss(root: str) -> None:
    """A process death mid-publish, then power loss: only durable effects remain."""
    fs = FaultFS()
    hook = CrashAt(5)  # after the rename, before fsync_dir
    hooked = HookedFS(fs, hook, 0)
    tmp, final = p(root, "rank0", "f.tmp"), p(root, "rank0", "f")
    with pytest.raises(SimulatedCrash):
        hooked.write_new(tmp, DATA)
        hooked.fsync(tmp)
        hooked.rename_new(tmp, final)
    fs.crash()
    assert content(tmp) is None and content(final) is None
