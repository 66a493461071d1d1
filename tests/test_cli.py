"""The command line as a new user meets it: a typed error is one line and exit status
2 (never a traceback), output into a closed pipe ends quietly, an interrupted fuzz
campaign still prints its summary, temporary work directories are named and removed
unless --keep, and a fuzz campaign saves one reproducer per kind of failure."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import make_layout

from prefixstore.base.errors import LayoutMismatchError
from prefixstore.cli import main
from prefixstore.cli.demo import demo_layout
from prefixstore.engine.api import Engine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*argv: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    kw.setdefault("stdout", subprocess.PIPE)
    return subprocess.run([sys.executable, "-m", "prefixstore.cli", *argv], cwd=REPO, env=env,
                          stderr=subprocess.PIPE, text=True, timeout=timeout, **kw)


def _one_error_line(capsys, argv: list[str], *, wants: str) -> None:
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"prefixstore {argv[0]}: ") and wants in lines[0], lines


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    """tempfile's default directory is this test's, so nothing a command leaves behind escapes."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def test_demo_on_a_non_empty_directory(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    _one_error_line(capsys, ["demo", str(tmp_path)], wants="is not empty")
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_demo_on_a_locked_directory(tmp_path, capsys):
    with Engine.open(str(tmp_path), demo_layout(2, 16), 64 << 20):
        _one_error_line(capsys, ["demo", str(tmp_path)], wants="open in another engine")


def test_demo_with_other_ranks_names_the_differing_field(tmp_path, capsys):
    Engine.open(str(tmp_path), demo_layout(2, 16), 64 << 20).close()
    _one_error_line(capsys, ["demo", str(tmp_path), "--ranks", "4"], wants="ranks 2 vs 4")
    with pytest.raises(LayoutMismatchError) as ei:
        Engine.open(str(tmp_path), demo_layout(2, 8), 64 << 20)
    assert "block_tokens 16 vs 8" in str(ei.value) and "{" not in str(ei.value)


def test_layout_mismatch_names_tensor_fields():
    a, b = make_layout(ranks=1), make_layout(ranks=1, dtype="float16", snapshot=False)
    assert a.differences(b) == ["segment k dtype bfloat16 vs float16", "segment v dtype bfloat16 vs float16",
                                "snapshot state only in the first"]
    assert a.differences(a) == []


def test_demo_with_zero_ranks(tmp_path, capsys):
    _one_error_line(capsys, ["demo", str(tmp_path / "c"), "--ranks", "0"], wants="ranks must be positive")


def test_seed_scenario_into_a_file(tmp_path, capsys):
    f = tmp_path / "trace.jsonl"
    f.write_text("{}\n")
    _one_error_line(capsys, ["replay", "--scenario", "seed", str(f)], wants="not a directory")
    assert f.read_text() == "{}\n"


def test_typed_error_in_a_real_process_is_one_line(tmp_path):
    (tmp_path / "x").write_text("x")
    p = _cli("demo", str(tmp_path))
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_audit_into_a_closed_pipe_exits_quietly(tmp_path):
    root = str(tmp_path / "c")
    Engine.open(root, demo_layout(2, 16), 64 << 20).close()
    r, w = os.pipe()
    os.close(r)  # the reader (think `| head -3`) is gone before the audit writes
    try:
        p = _cli("audit", root, stdout=w)
    finally:
        os.close(w)
    assert p.stderr == "" and p.returncode == 141, p.stderr


def test_rank_server_without_a_coordinator_says_one_line(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = _cli("rank-server", "--rank", "1", "--dir", str(tmp_path / "r1"),
             "--init-method", f"tcp://127.0.0.1:{port}", "--connect-timeout", "1")
    out = (p.stdout + p.stderr).strip().splitlines()
    assert p.returncode == 1 and len(out) == 1, out[:5]
    assert "cannot reach the coordinator" in out[0]


def test_interrupted_fuzz_prints_its_summary(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": REPO}
    p = subprocess.Popen(
        [sys.executable, "-m", "prefixstore.cli", "fuzz", "--steps", "1000000", "--json", "--quiet",
         "--workdir", str(work), "--out", str(tmp_path / "out")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # not ignored as in a background job
    try:
        deadline = time.monotonic() + 60
        while not glob.glob(str(work / "*" / "cache" / "rank*" / "*.st")) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the first run stored a shard: a step ran
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130, err[-2000:]
    d = json.loads(out)
    assert d["interrupted"] is True and d["steps"] > 0 and d["runs"] >= 1
    assert "Traceback" not in err
    assert os.listdir(work) == []  # the interrupted run's directory was removed


def test_fuzz_saves_one_reproducer_per_kind_unless_asked(tmp_path, capsys):
    # 100 steps fail about 40 times, all of one kind: plenty past the first of their kind
    argv = ["fuzz", "--plant", "skip-dir-fsync", "--steps", "100", "--shrink-seconds", "1", "--json", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "one")]) == 1
    d = json.loads(capsys.readouterr().out)
    kinds = {v["kind"] for v in d["violations"]}
    assert len(d["violations"]) > len(kinds)  # the plant failed more than once per kind
    assert len(os.listdir(tmp_path / "one")) == len(kinds)
    assert sum(1 for v in d["violations"] if "reproducer" in v) == len(kinds)
    assert main([*argv, "--out", str(tmp_path / "all"), "--all-reproducers"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert len(os.listdir(tmp_path / "all")) == len(d["violations"])


def _cache_line(out: str) -> str:
    """The cache directory the demo reports (its 'cache: DIR ...' line)."""
    return next(line.split()[1] for line in out.splitlines() if line.startswith("cache:"))


def test_demo_removes_its_temp_dir_unless_keep(own_tmp, capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    root = _cache_line(out)
    assert root.startswith(str(own_tmp)) and f"removed {root}" in out
    assert not os.path.exists(root)
    assert main(["demo", "--keep"]) == 0
    root = _cache_line(capsys.readouterr().out)
    assert os.path.isfile(os.path.join(root, "catalog.sqlite"))


def test_soak_removes_its_temp_dir_unless_keep(own_tmp, capsys):
    argv = ["soak", "--kills", "2", "--ranks", "1", "--json"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "working in" in err and os.listdir(own_tmp) == []
    assert main([*argv, "--keep"]) == 0
    kept = os.listdir(own_tmp)
    assert len(kept) == 1 and kept[0].startswith("prefixstore-soak-") and "kept" in capsys.readouterr().err


def test_seed_scenario_removes_its_temp_dir(own_tmp, capsys):
    assert main(["replay", "--scenario", "seed", "--json"]) == 0
    cap = capsys.readouterr()
    where = json.loads(cap.out)["directory"]
    assert where.startswith(str(own_tmp)) and f"removed {where}" in cap.err
    assert os.listdir(own_tmp) == []


def test_fuzz_creates_a_missing_workdir(tmp_path, capsys):
    work = tmp_path / "not" / "yet"
    assert main(["fuzz", "--steps", "3", "--json", "--quiet", "--workdir", str(work),
                 "--out", str(tmp_path / "out")]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 3
    assert work.is_dir() and os.listdir(work) == []  # created; its run directory removed


def test_fuzz_replay_creates_a_missing_workdir(tmp_path, capsys):
    repro = os.path.join(REPO, "tests", "fuzz_regressions", "damage-of-a-missing-shard.json")
    work = tmp_path / "w" / "x"
    assert main(["fuzz", "--replay", repro, "--quiet", "--workdir", str(work)]) == 0
    assert work.is_dir() and "no violation" in capsys.readouterr().out


TRACE = os.path.join(REPO, "..", "shared", "traces", "mooncake_conversation_trace.jsonl")


@pytest.mark.parametrize(("argv", "option"), [
    (["fuzz", "--steps", "3", "--quiet", "--workdir", "{f}"], "--workdir"),
    (["fuzz", "--steps", "3", "--quiet", "--workdir", "{f}/sub"], "--workdir"),
    (["fuzz", "--steps", "3", "--quiet", "--out", "{f}"], "--out"),
    (["soak", "--kills", "1", "--ranks", "1", "--dir", "{f}"], "--dir"),
    (["fiu", "--ops", "5", "--dir", "{f}"], "--dir"),
    (["demo", "{f}/sub"], "DIR"),
    (["replay", TRACE, "--limit", "5", "--quiet", "--plots", "{f}"], "--plots"),
], ids=["fuzz-workdir", "fuzz-workdir-below-a-file", "fuzz-out", "soak-dir", "fiu-dir", "demo-dir",
        "replay-plots"])
def test_a_path_option_naming_a_file_is_one_line_and_exit_2(tmp_path, capsys, argv, option):
    """A directory option given a regular file (or a path below one) is refused before
    any work, in one line naming the option; the file is untouched."""
    f = tmp_path / "a-file"
    f.write_text("mine")
    _one_error_line(capsys, [a.replace("{f}", str(f)) for a in argv], wants=f"{option} {f}")
    assert f.read_text() == "mine"
