"""Shard paths that are not regular files, and cache directories that lead out of the cache.

A shard replaced by a FIFO (or a symlink to one) while an engine runs is damage at
once: the restore misses promptly, the node is marked damaged, no pin is left, the
node can be evicted and close() returns. A symlinked shard at rest is damage for
recovery, audit and repair, and repair returns the cache to a clean audit. A rank or
``lost+found`` directory that is a symlink is refused at open with nothing touched,
unless the rank directory is named explicitly. Every blocking call runs on a thread
joined with a timeout, so a regression fails instead of hanging.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_restores, make_layout, store_tokens, tokens_for

from prefixstore.base import errors as E
from prefixstore.base.keys import Prefix
from prefixstore.cli import main as cli_main
from prefixstore.engine.api import Engine
from prefixstore.gpu.fileio import OsFS
from prefixstore.gpu.ranks import LocalRank

CAP = 16 << 20
L = make_layout(ranks=2)
A, B = tokens_for(11, 3), tokens_for(12, 2)
PROMPT_S = 10.0  # far above what any of these calls takes; a hang fails the test


def on_thread(fn: Callable[[], Any], timeout: float = PROMPT_S) -> Any:
    """``fn()`` run on a daemon thread; fails the test if it is still running after ``timeout``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            box["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {timeout} s"
    if "exc" in box:
        raise box["exc"]
    return box.get("out")


@pytest.fixture
def fifos():
    """FIFOs a test makes; a reader still blocked opening one is released at teardown."""
    made: list[str] = []
    yield made
    for p in made:
        try:
            fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)  # succeeds only while a reader waits
        except OSError:
            continue
        os.close(fd)


def shard(root: str, toks: list[int], rank: int, gen: int = 1) -> str:
    key = Prefix.from_tokens(toks, L.block_tokens).keys[-1]
    return os.path.join(root, f"rank{rank}", f"{key.hex()}-g{gen}.st")


def build(root: str) -> None:
    with Engine.open(root, L, CAP) as eng:
        assert store_tokens(eng, A).status == "stored"
        assert store_tokens(eng, B).status == "stored"


def tree(top: Path) -> dict[str, str]:
    """Every entry under ``top``: file digests, link targets, kinds (to prove nothing changed)."""
    out = {}
    for d, dirs, files in os.walk(top):
        for name in dirs + files:
            p = os.path.join(d, name)
            mode = os.lstat(p).st_mode
            if stat.S_ISLNK(mode):
                out[p] = "link:" + os.readlink(p)
            elif stat.S_ISREG(mode):
                out[p] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
            else:
                out[p] = "dir" if stat.S_ISDIR(mode) else "special"
    return out


def audit_json(*argv: str, capsys) -> tuple[int, dict]:
    capsys.readouterr()
    rc = cli_main(["audit", *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------------- while an engine runs


@pytest.mark.parametrize("kind", ["fifo", "symlink-to-fifo"])
def test_a_shard_replaced_by_a_fifo_is_damage_at_once(tmp_path, kind, fifos):
    root = str(tmp_path / "cache")
    eng = Engine.open(root, L, CAP)
    try:
        assert store_tokens(eng, A).status == "stored"
        assert store_tokens(eng, B).status == "stored"
        m = eng.lookup(Prefix.from_tokens(A, L.block_tokens))
        assert m.hit
        nid = m.node_id
        path = shard(root, A, rank=1)
        os.unlink(path)
        target = path if kind == "fifo" else str(tmp_path / "outside.fifo")
        os.mkfifo(target)
        fifos.append(target)
        if kind == "symlink-to-fifo":
            os.symlink(target, path)

        assert on_thread(lambda: eng.restore(m)) is None
        assert eng.index.nodes[nid].state == "damaged"
        assert not eng.holds.pins, eng.holds.pins  # the restore's pins were all released
        assert not eng.lookup(Prefix.from_tokens(A, L.block_tokens)).hit
        assert_restores(eng, B)  # the other conversation is untouched

        freed = on_thread(lambda: eng.evict(prefix=Prefix.from_tokens(A, L.block_tokens)))
        assert freed > 0
        assert not os.path.lexists(path)  # the entry itself was unlinked...
        if kind == "symlink-to-fifo":
            assert stat.S_ISFIFO(os.lstat(target).st_mode)  # ...not what it pointed to
        assert eng.audit().ok
        assert store_tokens(eng, A).status == "stored"  # stored again, served again
        assert_restores(eng, A)
    finally:
        on_thread(eng.close)


def test_close_returns_promptly_after_a_fifo_restore(tmp_path, fifos):
    root = str(tmp_path / "cache")
    build(root)
    path = shard(root, A, rank=0)
    eng = Engine.open(root, L, CAP)
    try:
        m = eng.lookup(Prefix.from_tokens(A, L.block_tokens))
        os.unlink(path)
        os.mkfifo(path)
        fifos.append(path)
        assert on_thread(lambda: eng.restore(m)) is None
    finally:
        on_thread(eng.close)


# ---------------------------------------------------------------------- at rest


def test_a_symlinked_shard_at_rest_is_damage_for_recovery_audit_and_repair(tmp_path, capsys):
    """The link points at a byte-identical copy outside the cache: only the path check can tell."""
    roots = [str(tmp_path / "opened"), str(tmp_path / "repaired")]
    copies = []
    for root in roots:
        build(root)
        path = shard(root, A, rank=0)
        copy = tmp_path / f"{os.path.basename(root)}-copy.st"
        shutil.copyfile(path, copy)
        os.unlink(path)
        os.symlink(copy, path)
        copies.append((copy, copy.read_bytes()))

    rc, rep = audit_json(roots[1], capsys=capsys)
    assert rc == 1
    assert any(v["invariant"] == 1 and "not a regular file" in v["detail"] for v in rep["violations"]), rep

    # recovery (an engine opening it) marks the node damaged; the restore misses, B is served
    with Engine.open(roots[0], L, CAP) as eng:
        nid = eng.index.by_key[Prefix.from_tokens(A, L.block_tokens).keys[-1]]
        assert nid in eng.recovery_report.damaged
        assert eng.index.nodes[nid].state == "damaged"
        assert not eng.lookup(Prefix.from_tokens(A, L.block_tokens)).hit
        assert_restores(eng, B)

    # repair of the copy no engine touched, then of the other: a clean audit
    for root in roots[::-1]:
        rc, rep = audit_json(root, "--repair", capsys=capsys)
        assert rc == 0 and rep["ok"], rep
        rc, rep = audit_json(root, capsys=capsys)
        assert rc == 0, rep
        with Engine.open(root, L, CAP) as eng:
            assert_restores(eng, B)
            assert store_tokens(eng, A).status == "refilled"  # the refill serves it again
            assert_restores(eng, A)
            assert not os.path.lexists(shard(root, A, rank=0))  # the retired link is gone
            assert eng.audit().ok
    for copy, data in copies:
        assert copy.read_bytes() == data  # what the link pointed to was never written or unlinked


# ---------------------------------------------------------------------- the cache's own directories


@pytest.mark.parametrize("which", ["rank1", "lost+found"])
def test_a_symlinked_cache_directory_is_refused_at_open_and_nothing_changes(tmp_path, which, capsys):
    root = str(tmp_path / "cache")
    build(root)
    elsewhere = tmp_path / "elsewhere" / which
    elsewhere.parent.mkdir()
    if which == "lost+found":
        elsewhere.mkdir()
    else:
        os.rename(os.path.join(root, which), elsewhere)
    os.symlink(elsewhere, os.path.join(root, which))
    before = tree(tmp_path)

    with pytest.raises(E.UnsafeDirectoryError, match=re.escape(f"{which}/ is a symlink")):
        Engine.open(root, L, CAP)
    assert tree(tmp_path) == before

    rc, rep = audit_json(root, capsys=capsys)
    assert rc == 1 and any("is a symlink" in v["detail"] for v in rep["violations"]), rep
    rc, rep = audit_json(root, "--repair", capsys=capsys)
    assert rc == 2 and "is a symlink" in rep["error"], rep
    assert tree(tmp_path) == before


def test_a_rank_directory_named_explicitly_may_be_a_symlink(tmp_path, capsys):
    root = str(tmp_path / "cache")
    build(root)
    elsewhere = tmp_path / "disk2" / "rank1"
    elsewhere.parent.mkdir()
    os.rename(os.path.join(root, "rank1"), elsewhere)
    link = tmp_path / "rank1-link"
    os.symlink(elsewhere, link)
    dirs = [os.path.join(root, "rank0"), str(link)]

    rc, rep = audit_json(root, "--rank-dir", dirs[0], "--rank-dir", dirs[1], capsys=capsys)
    assert rc == 0, rep
    with Engine.open(root, L, CAP, ranks=[LocalRank(r, d) for r, d in enumerate(dirs)]) as eng:
        assert not eng.recovery_report.changed
        assert_restores(eng, A)
        assert_restores(eng, B)
        assert eng.audit().ok
    rc, rep = audit_json(root, "--repair", "--rank-dir", dirs[0], "--rank-dir", dirs[1], capsys=capsys)
    assert rc == 0 and not rep["repair"]["changed"], rep


# ---------------------------------------------------------------------- the primitive


def test_the_file_layer_never_follows_a_symlink_or_waits_on_a_fifo(tmp_path, fifos):
    fs = OsFS()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"keep me")
    d = tmp_path / "rank0"
    d.mkdir()
    os.symlink(outside / "secret", d / "link")
    os.mkfifo(d / "fifo")
    fifos.append(str(d / "fifo"))
    os.symlink(outside, tmp_path / "dirlink")
    via_dir = str(tmp_path / "dirlink" / "secret")

    for p in (str(d / "link"), str(d / "fifo"), via_dir):
        with pytest.raises(E.NotRegularFileError):
            on_thread(lambda p=p: fs.read(p))
        with pytest.raises(E.NotRegularFileError):
            on_thread(lambda p=p: fs.read_into(p, memoryview(bytearray(16))))
        with pytest.raises(E.NotRegularFileError):
            on_thread(lambda p=p: fs.fsync(p))
        assert fs.size(p) is None
    with pytest.raises(E.NotRegularFileError):
        fs.unlink(via_dir)
    with pytest.raises(E.NotRegularFileError):
        fs.write_new(str(tmp_path / "dirlink" / "new"), b"x")
    with pytest.raises(E.NotRegularFileError):
        fs.listdir(str(tmp_path / "dirlink"))
    assert (outside / "secret").read_bytes() == b"keep me" and sorted(os.listdir(outside)) == ["secret"]

    (d / "dir.st").mkdir()
    (d / "dir.st" / "inner").write_bytes(b"x")
    rank = LocalRank(0, str(d))
    assert rank.remove("link") and rank.remove("fifo")  # the entries go, their targets stay
    assert rank.remove("dir.st")  # a directory is moved aside whole
    assert os.listdir(d) == [] and (outside / "secret").read_bytes() == b"keep me"
    assert (tmp_path / "lost+found" / "rank0" / "dir.st" / "inner").read_bytes() == b"x"


def test_a_rank_process_reports_a_path_that_is_not_a_regular_file_as_such(tmp_path, fifos):
    """Over the wire the refusal keeps its type, so a remote rank's FIFO is damage too."""
    from prefixstore.gpu.distributed import RankGroup
    from prefixstore.gpu.rank_server import RankServer

    d = tmp_path / "host0" / "rank0"
    group = RankGroup(op_timeout=20, connect_timeout=20, gloo_host="127.0.0.1")
    server = RankServer(0, str(d), "127.0.0.1", group.port, connect_timeout=20, gloo_host="127.0.0.1")
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        (rr,) = group.connect([0], timeout=20)
        os.mkfifo(d / "a.st")
        fifos.append(str(d / "a.st"))
        (tmp_path / "secret").write_bytes(b"keep me")
        os.symlink(tmp_path / "secret", d / "b.st")
        for name in ("a.st", "b.st"):
            with pytest.raises(E.NotRegularFileError):
                on_thread(lambda name=name: rr.read_shard(name))
            assert rr.size(name) is None
            assert rr.remove(name)
        assert rr.listdir() == [] and (tmp_path / "secret").read_bytes() == b"keep me"
    finally:
        group.close()
    thread.join(PROMPT_S)
    assert not thread.is_alive()
