"""`prefixstore audit DIR` beside a busy, healthy engine in another process: what is
in flight is reported as in flight, never as a violation; what is really wrong beside
a running engine (a shard deleted, an unknown file) is still reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from conftest import make_layout, store_tokens, tokens_for

from prefixstore.engine.api import Engine
from prefixstore.engine.audit import audit_dir

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
AUDITS = 100
THREADS = 32


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_100_audits_beside_32_busy_threads_report_nothing_false(tmp_path):
    root = str(tmp_path / "cache")
    busy = subprocess.Popen([sys.executable, os.path.join(HERE, "busy_engine.py"), root, str(THREADS)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert busy.stdout.readline().strip() == "READY"
        false, in_flight, explained = [], 0, 0
        for _ in range(AUDITS):
            rep = audit_dir(root)
            false += [f"invariant {v.invariant}: {v.detail}" for v in rep.violations]
            in_flight += sum(1 for j in rep.journal if j.get("in_flight"))
            explained += sum("explained by the running engine" in n for n in rep.notes)
            time.sleep(0.03)  # let the workload move between audits
        cli = subprocess.run([sys.executable, "-m", "prefixstore.cli", "audit", root, "--json"],
                             capture_output=True, text=True, env=_env(), cwd=REPO, timeout=120)
    finally:
        busy.stdin.close()
        tail = busy.stdout.read()
        busy.wait(timeout=120)
    assert false == [], false[:10]
    assert in_flight > 0, "the audits never overlapped a transaction: the test exercised nothing"
    assert cli.returncode == 0, cli.stdout[-2000:] + cli.stderr[-2000:]
    assert json.loads(cli.stdout)["ok"] is True
    ops, errors = tail.split("\n")[0].split()[1::2]
    assert int(ops) > THREADS and int(errors) == 0, tail
    print(f"{AUDITS} audits: {in_flight} transactions in flight seen, {explained} audits re-checked")


def test_beside_a_running_engine_a_deleted_shard_and_an_unknown_file_are_still_reported(tmp_path):
    root = str(tmp_path / "cache")
    with Engine.open(root, make_layout(ranks=2), 16 << 20) as eng:
        for seed in (1, 2):
            assert store_tokens(eng, tokens_for(seed, 3)).ok
        assert audit_dir(root).ok
        shard = sorted(os.listdir(os.path.join(root, "rank1")))[0]
        os.unlink(os.path.join(root, "rank1", shard))
        with open(os.path.join(root, "rank0", "0123456789abcdef0123456789abcdef-g9.st"), "wb") as f:
            f.write(b"not a shard")
        rep = audit_dir(root)
    found = [(v.invariant, v.detail) for v in rep.violations]
    assert any(inv == 1 and shard in d and "missing" in d for inv, d in found), found
    assert any(inv == 3 and "0123456789abcdef" in d for inv, d in found), found
