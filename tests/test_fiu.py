"""Real I/O faults from libc through libfiu (``fiu-run -x``), then a fault-free audit.

ENOSPC and EIO on the real open, write, fsync, rename, unlink and read calls of the
shard files, and on SQLite's pwrite, pread and fdatasync (the catalog). The engine
must only report typed errors or failed/missed results, serve nothing wrong, lose no
acknowledged store, and leave a directory that recovers to a clean audit. A planted
bug (a rank that ignores its write errors) must be caught. Skipped only when
``fiu-run`` (Debian ``fiu-utils``, installed by ``.ci/run``) is absent.
"""

from __future__ import annotations

import pytest

from prefixstore.fuzz.fiu import fiu_available, run_under_fiu, summary

pytestmark = pytest.mark.skipif(not fiu_available(), reason="fiu-run (package fiu-utils) is not installed")


@pytest.mark.parametrize(("target", "p"), [("files", 0.1), ("catalog", 0.01), ("all", 0.02)])
def test_workload_under_real_io_faults_recovers_to_a_clean_audit(tmp_path, capsys, target, p):
    res = run_under_fiu(str(tmp_path / "cache"), target=target, ops=300, probability=p, seed=7)
    with capsys.disabled():
        print("\n" + "\n".join(summary(res)))
    c = res.child
    assert c["injected"] > 0
    hit = {k.split()[0] for k in c["faults"]}
    errnos = {k.split()[1] for k in c["faults"]}
    assert errnos == {"ENOSPC", "EIO"}
    if target == "files":
        want = {"posix/io/rw/write", "posix/io/sync/fsync", "posix/io/dir/rename", "posix/io/dir/unlink",
                "posix/io/rw/read"}
        assert want <= hit, hit
        assert c["outcomes"].get("store failed", 0) > 0  # reported as a result, not raised
    if target == "catalog":
        assert {"posix/io/rw/pwrite", "posix/io/rw/pread"} <= hit, hit
        assert c["outcomes"].get("typed error CatalogIOError", 0) > 0
    untyped = {k: v for k, v in c["outcomes"].items() if k.startswith("untyped")}
    assert not untyped, (untyped, c["errors"])
    assert c["outcomes"].get("restore served", 0) > 0  # it keeps serving what it can
    assert not c["wrong_bytes"], c["wrong_bytes"]
    assert res.audit_ok, res.violations
    assert res.journal_after_recovery == 0
    assert res.acked_checked > 0 and not res.lost, res.lost
    assert res.ok


def test_a_rank_that_ignores_write_errors_is_caught(tmp_path, capsys):
    res = run_under_fiu(str(tmp_path / "cache"), target="files", ops=300, probability=0.1, seed=7,
                        plant="swallow-write-errors")
    with capsys.disabled():
        print("\n[planted bug] " + "\n".join(summary(res)))
    assert res.child["injected"] > 0
    assert not res.ok
    assert res.lost or not res.audit_ok
