"""The auditor: read-only (not one byte changes), per-invariant findings, journal and
recovery previews that match what recovery then does, exit codes, and --repair
(refused beside a running engine; crash-safe at every one of its effects)."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from pathlib import Path

import pytest
from conftest import Gate, assert_restores, make_layout, store_tokens, tokens_for

from prefixstore.base.errors import SimulatedCrash
from prefixstore.base.keys import Prefix
from prefixstore.cli import main as cli_main
from prefixstore.engine.api import Engine
from prefixstore.engine.audit import audit_dir, engine_running
from prefixstore.engine.repair import repair
from prefixstore.fuzz.faultfs import CountingHook, CrashAt, flip_bit

CAP = 16 << 20
A, B = tokens_for(21, 6), tokens_for(22, 3)


def files_hash(root: str, skip_shm: bool = False) -> dict[str, str]:
    """Every file under ``root`` (catalog, WAL, shm, LOCK, shards) -> sha256."""
    out = {}
    for d, _dirs, files in os.walk(root):
        for f in files:
            if skip_shm and f.endswith("-shm"):
                continue
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


def run_cli(capsys, *argv: str) -> tuple[int, dict]:
    capsys.readouterr()
    rc = cli_main(["audit", *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def build(root: str, ranks: int = 2) -> Engine:
    eng = Engine.open(root, make_layout(ranks=ranks), CAP)
    for t in (A[:8], A, B):
        assert store_tokens(eng, t).ok
    return eng


class _ExitAt:
    """A fault hook that ends the process (no cleanup at all) at the first ``op``."""

    def __init__(self, op: str, when: str = "before") -> None:
        self.op, self.when = op, when

    def before(self, op, target, rank):
        if self.when == "before" and op == self.op:
            os._exit(0)

    def after(self, op, target, rank):
        if self.when == "after" and op == self.op:
            os._exit(0)


class _CrashAfterCommit(CountingHook):
    """Model process death right after the catalog commit named ``label``."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label

    def after(self, op, target, rank):
        if op == "commit" and target == self.label:
            raise SimulatedCrash(self.label)


def _die_mid_store(root: str, ranks: int = 2) -> None:
    """In a forked child: open, store, then die as the next store renames its first shard."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            gate = Gate()
            eng = Engine.open(root, make_layout(ranks=ranks), CAP, hook=gate)
            for t in (A[:8], A, B):
                store_tokens(eng, t)
            gate.arm(_ExitAt("rename"))
            store_tokens(eng, tokens_for(23, 2))
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_the_auditor_probes_the_engines_own_lock_file():
    from prefixstore.engine import api, audit

    assert audit.LOCK_NAME == api.LOCK_NAME


def test_audit_of_a_closed_cache_changes_no_byte_and_creates_no_file(tmp_path, capsys):
    root = str(tmp_path / "c")
    build(root).close()
    before = files_hash(root)
    assert not any(f.endswith(("-wal", "-shm")) for f in before)
    rc, rep = run_cli(capsys, root)
    assert rc == 0 and rep["ok"], rep
    assert rep["source"].startswith("immutable")
    assert cli_main(["audit", root]) == 0  # human-readable too
    assert files_hash(root) == before


def test_audit_of_a_killed_engines_directory_changes_no_byte(tmp_path, capsys):
    root = str(tmp_path / "c")
    _die_mid_store(root)
    before = files_hash(root)
    assert os.path.getsize(os.path.join(root, "catalog.sqlite-wal")) > 0, "the kill must leave a WAL"
    rc, rep = run_cli(capsys, root)
    assert files_hash(root) == before  # catalog, WAL, shm, LOCK and shards alike
    assert rc == 1 and rep["source"].startswith("private copy")
    assert [v["invariant"] for v in rep["violations"]] == [7]
    (j,) = rep["journal"]
    assert (j["kind"], j["state"], j["recovery"]) == ("store", "INTENT", "roll back")
    assert len(j["files"]) == 2 and "undo store" in j["action"]
    assert rep["accounting"]["writing"] == j["bytes"] > 0
    with Engine.open(root, make_layout(ranks=2), CAP) as eng:
        assert eng.recovery_report.rolled_back == [j["txn"]]
        assert eng.audit().ok
        assert_restores(eng, A, blocks=6)


def test_audit_beside_a_running_engine_changes_no_byte_and_disturbs_nothing(tmp_path, capsys):
    root = str(tmp_path / "c")
    eng = build(root)
    try:
        assert engine_running(root)
        before = files_hash(root, skip_shm=True)
        assert "catalog.sqlite-wal" in before
        rc, rep = run_cli(capsys, root)
        assert rc == 0 and rep["ok"] and "running engine" in rep["source"], rep
        assert files_hash(root, skip_shm=True) == before
        # the engine goes on as if nothing happened
        assert store_tokens(eng, tokens_for(24, 2)).status == "stored"
        assert_restores(eng, A, blocks=6)
        live = eng.audit()
        assert live.ok and live.checked[6].startswith("0 pinned or fenced")
    finally:
        eng.close()
    assert not engine_running(root)


def test_every_unfinished_transaction_is_reported_with_what_recovery_does(tmp_path, capsys):
    """Crash at the commit that leaves each kind of unfinished transaction; compare the
    audit's prediction with what recovery then does."""
    L = make_layout(ranks=2)
    cases = [
        ("store.intent", "store", "INTENT", "roll back", "new"),
        ("store.publish", "store", "PUBLISHED", "roll forward", "refill"),
        ("evict.remove", "evict", "REMOVED", "roll forward", "evict"),
    ]
    for label, kind, state, direction, how in cases:
        root = str(tmp_path / label)
        gate = Gate()
        eng = Engine.open(root, L, CAP, hook=gate)
        for t in (A[:8], A, B):
            store_tokens(eng, t)
        target = tokens_for(25, 2)
        if how == "refill":
            b = eng.index.nodes[eng.index.by_key[Prefix.from_tokens(B, 4).keys[-1]]]
            flip_bit(os.path.join(root, "rank1", f"{b.key.hex()}-g1.st"), 100)
            assert eng.restore(eng.lookup(Prefix.from_tokens(B, 4))) is None  # now damaged
            target = B
        gate.arm(_CrashAfterCommit(label))
        with pytest.raises(SimulatedCrash):
            if how == "evict":
                eng.evict(prefix=Prefix.from_tokens(A, 4))
            else:
                store_tokens(eng, target)
        rc, rep = run_cli(capsys, root)
        assert rc == 1 and {v["invariant"] for v in rep["violations"]} == {7}, rep
        (j,) = rep["journal"]
        assert (j["kind"], j["state"], j["recovery"]) == (kind, state, direction), j
        assert j["files"] and j["bytes"] > 0
        with Engine.open(root, L, CAP) as e2:
            done = e2.recovery_report.rolled_back if direction == "roll back" else e2.recovery_report.rolled_forward
            assert done == [j["txn"]]
            assert e2.audit().ok
            if how == "refill":
                assert_restores(e2, B, blocks=3)


def test_recovery_preview_matches_recovery(tmp_path, capsys):
    root = str(tmp_path / "c")
    build(root).close()
    conn = sqlite3.connect(os.path.join(root, "catalog.sqlite"))
    name = conn.execute("SELECT name FROM files WHERE rank=1 ORDER BY name LIMIT 1").fetchone()[0]
    nid = conn.execute("SELECT node FROM files WHERE rank=1 AND name=?", (name,)).fetchone()[0]
    conn.close()
    os.truncate(os.path.join(root, "rank1", name), 10)
    Path(root, "rank0", "junk.txt").write_text("x")
    Path(root, "rank0", f"{'ef' * 16}-g3.st").write_bytes(b"orphan")
    rc, rep = run_cli(capsys, root)
    assert rc == 1
    inv = {v["invariant"] for v in rep["violations"]}
    assert inv == {1, 3}, rep["violations"]
    assert sorted(rep["unknown_files"]) == [f"rank0/{'ef' * 16}-g3.st", "rank0/junk.txt"]
    preview = "\n".join(rep["recovery"])
    assert "mark 1 nodes damaged" in preview and f"[{nid}]" in preview
    assert "remove 1 orphan shard files" in preview and "move 1 foreign entries" in preview
    with Engine.open(root, make_layout(ranks=2), CAP) as eng:
        r = eng.recovery_report
        assert r.damaged == [nid]
        assert r.orphans_removed == [f"rank0/{'ef' * 16}-g3.st"]
        assert r.quarantined == ["rank0/junk.txt"]
        assert eng.audit().ok
    assert os.path.exists(os.path.join(root, "lost+found", "rank0", "junk.txt"))


def test_exit_codes_and_json_shape(tmp_path, capsys):
    root = str(tmp_path / "c")
    build(root).close()
    rc, rep = run_cli(capsys, root)
    assert rc == 0
    assert {"ok", "violations", "invariants", "journal", "recovery", "accounting", "ranks"} <= set(rep)
    assert [i["invariant"] for i in rep["invariants"]] == list(range(1, 9))
    assert {i["status"] for i in rep["invariants"]} == {"ok", "not checked"}
    acct = rep["accounting"]
    assert acct["charged"] == acct["live"] == acct["on_disk"] > 0
    assert [r["files"] for r in rep["ranks"]] == [3, 3]
    # violations: exit 1
    conn = sqlite3.connect(os.path.join(root, "catalog.sqlite"))
    conn.execute("UPDATE files SET size=size+1 WHERE rank=0 AND name=(SELECT min(name) FROM files)")
    conn.commit()
    conn.close()
    rc, rep = run_cli(capsys, root)
    assert rc == 1 and rep["violations"] and all(set(v) == {"invariant", "detail"} for v in rep["violations"])
    assert run_cli(capsys, root, "--quick")[0] == 1
    # could not read: exit 2
    assert run_cli(capsys, str(tmp_path / "missing"))[0] == 2
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "catalog.sqlite").write_bytes(b"not a database at all" * 50)
    assert run_cli(capsys, str(junk))[0] == 2
    assert run_cli(capsys, str(tmp_path))[0] == 2


def test_acknowledged_and_dependency_invariants(tmp_path):
    root = str(tmp_path / "c")
    build(root).close()
    keys = [Prefix.from_tokens(t, 4).keys[-1] for t in (A[:8], A, B)]
    assert audit_dir(root, expected=keys).ok
    rep = audit_dir(root, expected=[*keys, b"\x01" * 16])
    assert [v.invariant for v in rep.violations] == [4]
    # invariant 8: the interior node loses its backing rows
    conn = sqlite3.connect(os.path.join(root, "catalog.sqlite"))
    nid = conn.execute("SELECT id FROM nodes WHERE key=?", (keys[0],)).fetchone()[0]
    conn.execute("DELETE FROM files WHERE node=?", (nid,))
    conn.commit()
    conn.close()
    rep = audit_dir(root)
    assert 8 in {v.invariant for v in rep.violations} and 1 in {v.invariant for v in rep.violations}


def test_repair_is_refused_while_an_engine_runs(tmp_path, capsys):
    root = str(tmp_path / "c")
    eng = build(root)
    try:
        before = files_hash(root, skip_shm=True)
        rc, rep = run_cli(capsys, root, "--repair")
        assert rc == 2 and "stop it" in rep["error"]
        assert files_hash(root, skip_shm=True) == before
    finally:
        eng.close()


def _damaged_dir(root: str) -> None:
    """A directory with one of everything repair handles, and an unfinished store."""
    _die_mid_store(root, ranks=1)
    conn = sqlite3.connect(os.path.join(root, "catalog.sqlite"))
    rows = dict(conn.execute("SELECT key, id FROM nodes").fetchall())
    ka, kb = (Prefix.from_tokens(t, 4).keys[-1] for t in (A, B))
    conn.execute("UPDATE nodes SET parent=999 WHERE id=?", (rows[ka],))  # relinkable
    conn.execute("INSERT INTO files VALUES(0, ?, NULL, 1, 64, NULL, 'garbage', NULL)", (f"{'01' * 16}-g1.st",))
    conn.commit()
    conn.close()
    flip_bit(os.path.join(root, "rank0", f"{kb.hex()}-g1.st"), 200)
    Path(root, "rank0", "stray.bin").write_bytes(b"x" * 10)
    Path(root, "rank0", f"{'01' * 16}-g1.st").write_bytes(b"g" * 64)


def test_repair_survives_a_crash_at_every_effect(tmp_path):
    """Crash repair at each of its effect points (catalog fix, recovery, invalidation,
    reclaim); a second repair always ends clean with every intact node restoring."""
    L = make_layout(ranks=1)
    counter = CountingHook()
    base = str(tmp_path / "count")
    _damaged_dir(base)
    fixed, rep = repair(base, hook=counter)
    assert rep.ok, rep.to_dict()
    lines = "\n".join(fixed.lines())
    assert "relinked node" in lines and "rolled back" in lines and "lost+found" in lines
    assert "checksum mismatch" in lines
    ops = {op for _, op, _, _ in counter.points}
    assert {"commit", "unlink", "read"} <= ops, ops
    for i in range(counter.count):
        root = str(tmp_path / f"r{i}")
        _damaged_dir(root)
        hook = CrashAt(i)
        with pytest.raises(SimulatedCrash):
            repair(root, hook=hook)
        assert hook.fired is not None
        assert not engine_running(root)
        _, rep = repair(root)
        assert rep.ok, (i, hook.fired, rep.to_dict())
        with Engine.open(root, L, CAP) as eng:
            assert_restores(eng, A, blocks=6)
            assert_restores(eng, A[:8], blocks=2)
            assert eng.lookup(Prefix.from_tokens(B, 4)).outcome in ("damaged", "miss")


@pytest.mark.parametrize("plant", ["generation", "state", "span", "files"])
def test_a_live_audit_compares_every_indexed_node_with_its_catalog_row(tmp_path, plant):
    """The in-memory index must be the catalog, node by node (a reload that left a stale
    Node object behind, or a wrong cached file row, is a violation of invariant 2)."""
    L = make_layout()
    with Engine.open(str(tmp_path / "c"), L, 1 << 20) as eng:
        toks = tokens_for(90, 4)
        assert store_tokens(eng, toks[:8]).ok and store_tokens(eng, toks).ok
        assert_restores(eng, toks)  # caches the nodes' live file rows
        assert eng.audit().ok
        node = eng.index.nodes[eng.index.by_key[Prefix.from_tokens(toks, 4).keys[-1]]]
        if plant == "generation":
            node.generation += 1
        elif plant == "state":
            node.state = "damaged"
        elif plant == "span":
            node.start -= 1
        else:
            gen, rows = node.files
            node.files = (gen, {r: (name, size + 1, ck) for r, (name, size, ck) in rows.items()})
        rep = eng.audit(checksums=False)
        assert not rep.ok and any(v.invariant == 2 and f"node {node.id}" in v.detail for v in rep.violations), rep.to_dict()
