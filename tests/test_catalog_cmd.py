"""`prefixstore catalog DIR`: every row of a real cache, as text and as JSON, read
without changing a byte or creating a file: after a clean close, beside an open
engine, from a killed engine's leftovers (with and without its shared-memory index),
on a read-only file system; a directory that is not a cache is one line, exit 2."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Gate, make_layout, store_tokens, tokens_for

from prefixstore.base.errors import InvalidArgumentError
from prefixstore.cli import main as cli_main
from prefixstore.engine.api import Engine
from prefixstore.engine.catalog_reader import read_listing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAP = 16 << 20
A, B = tokens_for(31, 6), tokens_for(32, 3)


def run_catalog(*argv: str) -> subprocess.CompletedProcess:
    """The command in its own process, as a person runs it."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "prefixstore.cli", "catalog", *argv], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)


def catalog(capsys, *argv: str) -> subprocess.CompletedProcess:
    """The command in this process (an engine in this process shares SQLite's locks with it)."""
    capsys.readouterr()
    rc = cli_main(["catalog", *argv])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, rc, out.out, out.err)


def tree(root: str) -> dict[str, str]:
    """Every entry under ``root`` -> sha256 of its bytes ('dir' for a directory)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(d, name), root)] = "dir"
        for name in files:
            p = os.path.join(d, name)
            out[os.path.relpath(p, root)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


def build(root: str) -> Engine:
    """Two ranks; a conversation stored in two steps (a parent and a child) and one more."""
    eng = Engine.open(root, make_layout(ranks=2), CAP)
    for t in (A[: 2 * 4], A, B):
        assert store_tokens(eng, t).ok
    return eng


def rows_of(conn: sqlite3.Connection) -> dict[str, list[dict]]:
    """The four tables as the JSON output should give them (BLOBs as hex), in key order."""
    order = {"nodes": "id", "files": "rank, name", "journal": "id", "meta": "key"}
    out = {}
    for table, by in order.items():
        cur = conn.execute(f"SELECT * FROM {table} ORDER BY {by}")
        cols = [c[0] for c in cur.description]
        out[table] = [{c: v.hex() if isinstance(v, bytes) else v for c, v in zip(cols, r, strict=True)}
                      for r in cur]
    return out


def rows_in_copy(root: str, tmp: Path) -> dict[str, list[dict]]:
    """Ground truth for a directory no engine holds: a copy of its catalog files, opened normally."""
    copy = tmp / "truth"
    copy.mkdir()
    for name in os.listdir(root):
        if name.startswith("catalog.sqlite"):
            shutil.copyfile(os.path.join(root, name), copy / name)
    conn = sqlite3.connect(copy / "catalog.sqlite")
    try:
        return rows_of(conn)
    finally:
        conn.close()


def assert_json_matches(out: str, want: dict[str, list[dict]]) -> dict:
    got = json.loads(out)
    assert set(got["tables"]) == {"nodes", "files", "journal", "meta"}
    for table, rows in want.items():
        t = got["tables"][table]
        assert t["present"] and t["count"] == len(rows) and t["rows"] == rows, table
        if rows:
            assert t["columns"] == list(rows[0]), table
    live = [f for f in want["files"] if f["status"] == "live"]
    assert got["summary"]["files"]["live"] == {"rows": len(live), "bytes": sum(f["size"] for f in live)}
    assert got["summary"]["nodes"]["ready"] == sum(n["state"] == "ready" for n in want["nodes"])
    return got


def assert_text_matches(out: str, want: dict[str, list[dict]]) -> None:
    """Each row is one line of its table, its cells in column order (NULL as '-')."""
    lines = out.splitlines()
    for table in ("nodes", "files"):
        head = lines.index(f"{table}: {len(want[table])} row(s)")
        got = [line.split() for line in lines[head + 2 : head + 2 + len(want[table])]]
        expect = []
        for r in want[table]:
            cells = ["-" if v is None else str(v) for v in r.values()]
            if table == "nodes":
                digests = r["digests"]
                cells[5] = digests if len(digests) <= 32 else f"{digests[:16]}...({len(digests) // 2}"
                cells[6] = "yes" if r["has_snapshot"] else "no"
            expect.append(cells)
        if table == "nodes":  # the shortened digests are two words: '...(48' 'B)'
            got = [g[:6] + g[7:] if len(g) == len(e) + 1 else g for g, e in zip(got, expect, strict=True)]
        assert got == expect, table
    assert any(line.startswith("journal: ") for line in lines)
    meta = lines.index(f"meta: {len(want['meta'])} row(s)")
    for i, r in enumerate(want["meta"]):
        assert lines[meta + 2 + i].split(None, 1) == [r["key"], " ".join(r["value"].split())]


def before_no_shm(files: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in files.items() if not k.endswith("-shm")}


def _die_mid_store(root: str) -> None:
    """In a forked child: open, store, then end the process as the next store renames its first shard."""

    class ExitAt:
        def before(self, op, target, rank):
            if op == "rename":
                os._exit(0)

        def after(self, op, target, rank):
            pass

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            gate = Gate()
            eng = Engine.open(root, make_layout(ranks=2), CAP, hook=gate)
            for t in (A[:8], A, B):
                store_tokens(eng, t)
            gate.arm(ExitAt())
            store_tokens(eng, tokens_for(33, 2))
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_a_closed_cache_every_row_as_text_and_json_and_not_a_byte_changes(tmp_path, capsys):
    root = str(tmp_path / "c")
    build(root).close()
    before = tree(root)
    want = rows_in_copy(root, tmp_path)
    assert len(want["nodes"]) == 3 and len(want["files"]) == 6 and want["journal"] == []
    js = catalog(capsys, root, "--json")
    assert js.returncode == 0, js.stderr
    got = assert_json_matches(js.stdout, want)
    assert got["source"].startswith("immutable") and got["schema_version"] == 1
    assert got["summary"]["capacity"] == CAP
    text = catalog(capsys, root)
    assert text.returncode == 0 and text.stderr == "", text.stderr
    assert_text_matches(text.stdout, want)
    assert f"of capacity {CAP} bytes (16.0 MiB)" in text.stdout.splitlines()[1]
    assert tree(root) == before  # no -wal, -shm or LOCK created, not a byte changed


def test_table_and_limit_select_what_is_listed(tmp_path, capsys):
    root = str(tmp_path / "c")
    build(root).close()
    want = rows_in_copy(root, tmp_path)
    capsys.readouterr()
    assert cli_main(["catalog", root, "--json", "--table", "files", "--limit", "2"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert list(got["tables"]) == ["files"]
    assert got["tables"]["files"]["count"] == 6 and got["tables"]["files"]["rows"] == want["files"][:2]
    assert cli_main(["catalog", root, "--table", "journal", "--table", "nodes", "--limit", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "journal: 0 row(s)" in lines and "nodes: 3 row(s), first 0 shown" in lines
    assert not any(line.startswith(("files:", "meta:")) for line in lines)


def test_beside_an_open_engine_it_reads_the_log_and_disturbs_nothing(tmp_path, capsys):
    root = str(tmp_path / "c")
    eng = build(root)
    try:
        assert os.path.exists(os.path.join(root, "catalog.sqlite-wal"))
        before = tree(root)
        js = run_catalog(root, "--json")  # another process: the engine's index is opened read-only
        assert js.returncode == 0, js.stderr
        assert tree(root) == before  # the shared-memory index included
        text = catalog(capsys, root)
        assert text.returncode == 0, text.stderr
        assert {k: v for k, v in tree(root).items() if not k.endswith("-shm")} == before_no_shm(before)
        conn = sqlite3.connect(f"file:{root}/catalog.sqlite?mode=ro", uri=True)
        try:
            want = rows_of(conn)
        finally:
            conn.close()
        assert len(want["nodes"]) == 3
        got = assert_json_matches(js.stdout, want)
        assert got["source"].startswith("read-only")
        assert_text_matches(text.stdout, want)
        # the engine goes on, and the next listing sees its newest commit
        assert store_tokens(eng, tokens_for(34, 2)).status == "stored"
        again = json.loads(catalog(capsys, root, "--json", "--table", "nodes").stdout)
        assert again["tables"]["nodes"]["count"] == 4
    finally:
        eng.close()


def test_a_killed_engines_leftovers_are_read_without_changing_a_byte(tmp_path, capsys):
    root = str(tmp_path / "c")
    _die_mid_store(root)
    assert os.path.getsize(os.path.join(root, "catalog.sqlite-wal")) > 0, "the kill must leave a WAL"
    assert os.path.exists(os.path.join(root, "catalog.sqlite-shm"))
    before = tree(root)
    want = rows_in_copy(root, tmp_path)
    (j,) = want["journal"]
    assert (j["kind"], j["state"]) == ("store", "INTENT")
    js = catalog(capsys, root, "--json")
    assert js.returncode == 0, js.stderr
    assert tree(root) == before  # the -shm index too: a read-only one is not rebuilt
    assert assert_json_matches(js.stdout, want)["source"].startswith("read-only")
    assert sorted(f["status"] for f in want["files"]).count("writing") == 2
    # without its index, the log is read from a private copy; still nothing is created
    os.unlink(os.path.join(root, "catalog.sqlite-shm"))
    before = tree(root)
    js = catalog(capsys, root, "--json")
    assert js.returncode == 0, js.stderr
    assert tree(root) == before
    assert assert_json_matches(js.stdout, want)["source"].startswith("from a private copy")


def _remount(mnt: str, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", mnt], check=True, capture_output=True)


def test_on_a_read_only_file_system_every_way_of_opening_works(small_fs, tmp_path, capsys):
    root = os.path.join(small_fs, "c")
    _die_mid_store(root)
    want = rows_in_copy(root, tmp_path)
    cases = [("read-only", None), ("from a private copy", "catalog.sqlite-shm")]
    for source, remove in cases:
        if remove:
            os.unlink(os.path.join(root, remove))
        _remount(small_fs, "ro")
        try:
            js = catalog(capsys, root, "--json")
        finally:
            _remount(small_fs, "rw")
        assert js.returncode == 0, js.stderr
        assert assert_json_matches(js.stdout, want)["source"].startswith(source)
    Engine.open(root, make_layout(ranks=2), CAP).close()  # recovery rolls the store back
    _remount(small_fs, "ro")
    try:
        js = catalog(capsys, root, "--json")
        text = catalog(capsys, root)
    finally:
        _remount(small_fs, "rw")
    assert js.returncode == 0 and text.returncode == 0, js.stderr + text.stderr
    got = json.loads(js.stdout)
    assert got["source"].startswith("immutable") and got["tables"]["journal"]["rows"] == []
    assert "journal: 0 row(s)" in text.stdout.splitlines()


def _one_line_exit_2(capsys, argv: list[str], wants: str) -> None:
    done = catalog(capsys, *argv)
    assert done.returncode == 2 and done.stdout == "", done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("prefixstore catalog: ") and wants in lines[0], lines


def test_what_is_not_a_cache_is_one_line_and_exit_2(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    done = run_catalog(str(empty))  # the real process: its exit status and its one line
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr == f"prefixstore catalog: {empty}: no catalog.sqlite (not a prefixstore cache)\n"
    _one_line_exit_2(capsys, [str(tmp_path / "missing")], "no catalog.sqlite")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    conn = sqlite3.connect(foreign / "catalog.sqlite")
    conn.execute("CREATE TABLE notes(text TEXT)")
    conn.commit()
    conn.close()
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "catalog.sqlite").write_bytes(b"not a database at all" * 100)
    before = tree(str(tmp_path))
    _one_line_exit_2(capsys, [str(foreign)], "no prefixstore format marker")
    _one_line_exit_2(capsys, [str(tmp_path / "garbage"), "--json"], "not a readable prefixstore catalog")
    newer = tmp_path / "newer"
    build(str(newer)).close()
    conn = sqlite3.connect(newer / "catalog.sqlite")
    conn.execute("PRAGMA user_version=99")
    conn.close()
    _one_line_exit_2(capsys, [str(newer)], "schema version 99 is newer")
    _one_line_exit_2(capsys, [str(newer), "--limit", "-1"], "--limit: must be a whole number >= 0")
    assert {k: v for k, v in tree(str(tmp_path)).items() if not k.startswith("newer")} == before


def test_read_listing_names_a_bad_argument(tmp_path):
    root = str(tmp_path / "c")
    build(root).close()
    before = tree(root)
    for kwargs, argument in (({"tables": ["nodes", "bogus"]}, "tables"), ({"limit": -1}, "limit"),
                             ({"limit": True}, "limit"), ({"limit": "3"}, "limit")):
        with pytest.raises(InvalidArgumentError) as ei:
            read_listing(root, **kwargs)
        assert ei.value.argument == argument
    assert [t.name for t in read_listing(root, ["meta"], limit=1).tables] == ["meta"]
    assert tree(root) == before


def test_listings_beside_a_busy_engine_in_another_process_are_snapshots(tmp_path):
    """50 listings while 4 threads store, evict and compact: each one consistent, the
    engine undisturbed (no error seen by its callers), its journal seen in flight."""
    root = str(tmp_path / "c")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    busy = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "busy_engine.py"), root, "4"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert busy.stdout.readline().strip() == "READY"
        in_flight = listings = 0
        deadline = time.monotonic() + 120  # a loaded machine may need more listings to see one
        while listings < 50 or (not in_flight and time.monotonic() < deadline):
            listings += 1
            got = read_listing(root).to_dict()
            assert got["source"].startswith("read-only")
            t = got["tables"]
            nodes = {n["id"]: n for n in t["nodes"]["rows"]}
            assert len(nodes) == t["nodes"]["count"] == sum(got["summary"]["nodes"].values())
            assert all(n["parent"] is None or n["parent"] in nodes for n in nodes.values())
            live = [f for f in t["files"]["rows"] if f["status"] == "live"]
            assert all(nodes[f["node"]]["generation"] == f["generation"] for f in live)
            assert sum(f["size"] for f in t["files"]["rows"]) == sum(
                s["bytes"] for s in got["summary"]["files"].values())
            in_flight += len(t["journal"]["rows"])
    finally:
        busy.stdin.close()
        tail = busy.stdout.read()
        busy.wait(timeout=120)
    ops, errors = tail.split("\n")[0].split()[1::2]
    assert int(ops) > 4 and int(errors) == 0, tail
    assert in_flight > 0, "no listing overlapped a transaction: the test exercised nothing"
